"""Layer-skip self-speculation: the target's first m blocks, its final norm and its LM head
are the draft (LayerSkip-style early exit, without training).

Shared weights, no copy. `truncated_lm(target, m)` is an `LM` whose graph is a Transformer
of the target's config with `n_layers = m` and whose weights are the target's own arrays
(embedding, position table, blocks 0..m-1, final norm, head): the same buffers, not copies.
Its forward is therefore the target's own code (embedding, `blocks[:m]`, `final_norm`,
`logits`) stopped after block m - 1, and everything the separate-model drafter does (chains,
static trees, EAGLE-2 dynamic trees; sampled candidates with q = the warped draft law, or
top-k candidates with the point-mass rule) applies unchanged: `LayerSkipDrafter` is a
`ModelDrafter` over that view.

KV cache: the target's own (the default, `share_cache=True`). For the committed prefix
[0, L) the target's entries of layers 0..m-1 are exactly what the draft computes there (same
weights, same inputs, same positions; a block's keys and values depend only on the blocks
below it), so the draft keeps no cache: the loop lends it a view of the target's cache
(its first m layers: the same buffers) around each proposal (`Drafter.borrow_cache` /
`return_cache`). A cycle opens by feeding the pending token alone at slot L (the
separate-model rule feeds L - 1 and L: here L - 1 is already the target's) and drafts the
tree's levels at slots > L, as a `ModelDrafter` does in its own cache. The verify pass
rewrites slots L..L + N for every layer before reading them and reads the committed prefix,
which the draft never writes, so the target computes exactly what it computes without a
draft; after verification (and compaction for trees) the accepted path's low-layer entries
are the target's, which is what the next proposal reads. No draft cache, no catch-up pass
(one fed row instead of two) and nothing to commit. In the adaptive loop such a drafter
catches up eagerly (each plain step drafts one token at slot L, then the target's step
rewrites it): a lazy catch-up over skipped tokens would have to rewrite committed entries.

`share_cache=False` keeps the first wave's behaviour: an m-layer cache of its own with the
separate-model bookkeeping (committed to L - 1, catch-up by feeding tokens L - 1 and L) and
lazy catch-up in the adaptive loop.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from specjax.models.lm import LM
from specjax.drafters.base import Context
from specjax.drafters.levels import _plan
from specjax.drafters.model import ModelDrafter, ModelDraftState
from specjax.models import cache as kv
from specjax.models.transformer import graphdef_for


def check_layers(layers, n_layers: int) -> int:
  """Validates the draft depth m against the target's layer count (host side)."""
  if isinstance(layers, (bool, np.bool_)) or not isinstance(layers, (int, np.integer)) \
      or not 1 <= layers < n_layers:
    hint = ("" if n_layers > 1 else ": a 1-layer target has no proper prefix to draft with")
    raise ValueError(f"layers must be an int in [1, {n_layers - 1}] (the draft is the target's "
                     f"first `layers` blocks, fewer than its {n_layers}), got {layers!r}{hint}")
  return int(layers)


def truncated_lm(target, layers: int) -> LM:
  """The target's first `layers` blocks + final norm + head as an `LM`, sharing its arrays."""
  target = LM.of(target)
  m = check_layers(layers, target.config.n_layers)
  config = target.config.replace(n_layers=m)
  params = target.params
  kept = {k: v for k, v in params.items() if k != "blocks"}
  kept["blocks"] = nnx.State({i: params["blocks"][i] for i in range(m)})
  # merge + split gives the view's canonical pytree structure; the leaves stay the same arrays.
  return LM.of(nnx.merge(graphdef_for(config), nnx.State(kept)))


@struct.dataclass
class LayerSkipDrafter(ModelDrafter):
  """Self-speculation from the target's first m layers (module doc).

  deterministic=False: children sampled from the warped draft law q (stochastic rule);
  deterministic=True: top-k children, q = None (point-mass rule). Dynamic trees use top-k
  candidates, as for `ModelDrafter`. share_cache=True (default): drafts in the target's own
  cache; False: keeps an m-layer cache of its own (module doc).
  """

  share_cache: bool = struct.field(pytree_node=False, default=True)

  @classmethod
  def of(cls, target, layers: int, deterministic: bool = False,  # noqa: D102
         share_cache: bool = True) -> "LayerSkipDrafter":
    return cls(lm=truncated_lm(target, layers), deterministic=deterministic,
               share_cache=bool(share_cache))

  @property
  def layers(self) -> int:
    """m: the target blocks the draft runs."""
    return self.lm.config.n_layers

  @property
  def shares_target_cache(self) -> bool:
    return self.share_cache

  @property
  def lazy_catch_up(self) -> bool:
    """Lazy only with a cache of its own (module doc)."""
    return not self.share_cache

  def init(self, prompt_BP, prompt_len_B, cache_len: int, tree=None) -> ModelDraftState:
    if not self.share_cache:
      return super().init(prompt_BP, prompt_len_B, cache_len, tree)
    slots = None if tree is None else _plan(tree).node_slots(prompt_BP.shape[0])
    return ModelDraftState(cache=None, node_slots=slots)  # the target's prefill fills it

  def borrow_cache(self, state: ModelDraftState, target_cache: kv.KVCache) -> ModelDraftState:
    """The target's first m layers as the draft's cache (the same buffers)."""
    m = self.layers
    return state.replace(cache=target_cache.replace(k=target_cache.k[:m], v=target_cache.v[:m]))

  def return_cache(self, state: ModelDraftState, target_cache: kv.KVCache):
    """The target's cache with the draft's writes (slots >= L of its first m layers), its
    lengths unchanged."""
    m = self.layers
    merged = target_cache.replace(k=state.cache.k + target_cache.k[m:],
                                  v=state.cache.v + target_cache.v[m:])
    return state.replace(cache=None), merged

  def _root(self, state: ModelDraftState, ctx: Context):
    if not self.share_cache:
      return super()._root(state, ctx)
    length = ctx.length  # the pending token alone, at slot and position L
    cur = jnp.take_along_axis(ctx.tokens, length[:, None], axis=1)
    logits, _, cache = self.lm(cur, length[:, None], kv.set_lengths(state.cache, length))
    nothing = jnp.zeros((length.shape[0], 0), jnp.float32)
    return logits[:, -1], nothing, kv.set_lengths(cache, length)

  def commit(self, state: ModelDraftState, ctx: Context, tree, path_BP, n_accepted_B
             ) -> ModelDraftState:
    """Nothing to commit with the target's cache: its verify pass and compaction did it."""
    if not self.share_cache:
      return super().commit(state, ctx, tree, path_BP, n_accepted_B)
    return state
