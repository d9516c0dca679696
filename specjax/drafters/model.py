"""A separate (small, ideally distilled) draft model with its own KV cache.

Cache bookkeeping. With L the index of the pending token, the draft's cache is kept
committed to L - 1 entries: token L - 1 and the pending token L are fed together as the
first step of every proposal. That single rule covers both catch-up cases of the chain
loop: after a rejection the bonus/correction token is the new pending token, and after a
full accept the last draft token d_k (never fed to the draft) is token L - 1. Re-feeding
token L - 1 rewrites a slot that may already hold it, with the same values.

Every draft step therefore feeds two tokens `[x_{j-1}, x_j]` at positions `[j-1, j]`;
on XLA:CPU a 2-row step costs the same as a 1-row one (PERF_NOTES trap 3), and one shape
means one compiled step inside the `lax.scan`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax import sampling
from specjax.drafters.base import LM, Context
from specjax.models import cache as kv


@struct.dataclass
class ModelDraftState:
  cache: kv.KVCache


@struct.dataclass
class ModelDrafter:
  """Proposes k tokens autoregressively from its own model.

  deterministic=False: samples from the warped draft distribution q and returns q (exact
  rule min(1, p/q)). deterministic=True: proposes the draft's argmax and returns q=None
  (point-mass rule).
  """

  lm: LM
  deterministic: bool = struct.field(pytree_node=False, default=False)

  @classmethod
  def of(cls, model, deterministic: bool = False) -> "ModelDrafter":
    return cls(lm=LM.of(model), deterministic=deterministic)

  @property
  def config(self):
    return self.lm.config

  def init(self, prompt_BP, prompt_len_B, cache_len: int) -> ModelDraftState:
    cache = kv.init(self.lm.config, prompt_BP.shape[0], cache_len)
    _, cache = self.lm.prefill(cache, prompt_BP, prompt_len_B)
    return ModelDraftState(cache=kv.set_lengths(cache, prompt_len_B - 1))

  def propose(self, state: ModelDraftState, ctx: Context, k: int, sampler, key):
    length = ctx.length  # [B]
    prev = jnp.take_along_axis(ctx.tokens, (length - 1)[:, None], axis=1)[:, 0]
    cur = jnp.take_along_axis(ctx.tokens, length[:, None], axis=1)[:, 0]

    def step(carry, step_key):
      cache, prev, cur = carry
      pos = cache.lengths[:, None] + jnp.arange(2, dtype=jnp.int32)[None]  # [B, 2]
      logits, _, cache = self.lm(jnp.stack([prev, cur], axis=1), pos, cache)
      logits = logits[:, -1]
      if self.deterministic:
        q = None
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
      else:
        q = sampling.warp(logits, sampler)
        token = sampling.sample(step_key, q)
      cache = kv.commit(cache, jnp.ones_like(cache.lengths))  # token `prev` is now in
      return (cache, cur, token), (token, q)

    keys = jax.random.split(key, k)
    (cache, _, _), (tokens_KB, q_KBV) = jax.lax.scan(step, (state.cache, prev, cur), keys)
    q = None if q_KBV is None else q_KBV.transpose(1, 0, 2)
    return tokens_KB.T, q, state.replace(cache=cache)

  def commit(self, state: ModelDraftState, ctx: Context, n_accepted_B) -> ModelDraftState:
    del n_accepted_B  # the context length says it all
    return state.replace(cache=kv.set_lengths(state.cache, ctx.length - 1))

