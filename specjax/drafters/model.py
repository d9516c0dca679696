"""A separate (small, ideally distilled) draft model with its own KV cache, drafting chains,
static token trees and dynamic (EAGLE-2 style) trees through the level-by-level machinery of
`levels.py` (`LevelDrafter`).

Cache bookkeeping. With L the index of the pending token (the tree's root), the draft's
cache is kept committed to L - 1 entries between cycles. Every proposal starts by feeding
token L - 1 and the root L together (positions L-1, L): that single rule covers both
catch-up cases. After a rejection the correction token is the new root; after the deepest
node of the accepted path was accepted (a leaf never fed to the draft: d_k of a chain after
a full accept), that node is token L - 1 of the next cycle. Re-feeding token L - 1 rewrites
a slot that may already hold it, with the same values. The nodes the draft needs to keep
after a cycle (the root and the accepted path except its deepest node) always have a child
on the path, so they were fed.

The tree occupies the draft cache from slot L (the root) in breadth-first order
(`levels.py`). After the cycle `commit` moves the accepted path to slots [L, L + n]
(`cache.gather_block`, through the tree's plan) and sets the committed length to L' - 1
(the new root is L').

Padded vocabularies (`padded_to`). A draft whose vocabulary V_d is a prefix of the target's
V_t (a target with extra padded or reserved rows) drafts over V_t: its logits get -inf on
ids >= V_d at the one place they leave the draft model (`_lm`), so q = 0 there, those ids
are never proposed (argmax, top-k, samples), and the acceptance rule stays exact: the
target's own mass on them is emitted through the residual (docs/exactness.md). Ids >= V_d in
the context (the target may emit them) are fed to the draft as V_d - 1. The padding is a
static shape decision (V_t a static field): one compiled program, no per-token work.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.models.lm import LM
from specjax.drafters.base import Context, Proposal, finite_rows
from specjax.drafters.levels import LevelDrafter, _plan
from specjax.models import cache as kv

Array = jax.Array


@struct.dataclass
class ModelDraftState:
  cache: kv.KVCache
  node_slots: Array | None = None  # int32 [B, T] draft-cache slot (from L) of each node (dynamic)


@struct.dataclass
class ModelDrafter(LevelDrafter):
  """Proposes chains and trees from its own model.

  deterministic=False: children are i.i.d. samples of the warped draft law q, returned as
  `Proposal.q` (rule min(1, r/q), residual updates between siblings).
  deterministic=True: children are the top-k of the draft's logits (the argmax for a chain)
  and q = None (point-mass rule). Dynamic trees are always deterministic.
  """

  lm: LM
  deterministic: bool = struct.field(pytree_node=False, default=False)
  stop_below: Array | None = None  # dynamic draft stopping threshold (`with_stopping`)
  vocab_size: int | None = struct.field(pytree_node=False, default=None)  # V_t if padded

  def padded_to(self, vocab_size: int) -> "ModelDrafter":
    """This drafter drafting over a target vocabulary of `vocab_size` >= the draft's own V_d
    ids (module doc); the same drafter when they are equal."""
    v = self.lm.config.vocab_size
    if vocab_size < v:
      raise ValueError(f"draft vocabulary ({v}) must match the target's ({vocab_size}) or "
                       f"be smaller by padding rows only: the draft would propose ids the "
                       f"target does not have")
    return self.replace(vocab_size=None if vocab_size == v else int(vocab_size))

  def _lm(self, tokens_BT, positions_BT, cache, mask=None):
    """The draft model's (logits [B, T, V_t], hidden, cache): padded with -inf past V_d when
    the target's vocabulary is larger (module doc)."""
    v = self.lm.config.vocab_size
    if self.vocab_size is None:
      return self.lm(tokens_BT, positions_BT, cache, mask)
    logits, h, cache = self.lm(jnp.minimum(tokens_BT, v - 1), positions_BT, cache, mask)
    pad = [(0, 0)] * (logits.ndim - 1) + [(0, self.vocab_size - v)]
    return jnp.pad(logits, pad, constant_values=-jnp.inf), h, cache

  def validate(self, tree, batch: int) -> None:
    """Padded: a top-k (deterministic) node's candidates must fit in the draft's V_d ids."""
    del batch
    v = self.lm.config.vocab_size
    if (self.vocab_size is not None and (self.deterministic or tree.deterministic_candidates)
        and tree.max_width > v):
      raise ValueError(f"tree has a node with {tree.max_width} top-k candidates but the "
                       f"draft vocabulary has only {v} tokens")

  @classmethod
  def of(cls, model, deterministic: bool = False) -> "ModelDrafter":
    return cls(lm=LM.of(model), deterministic=deterministic)

  @property
  def config(self):
    return self.lm.config

  def slots_needed(self, tree) -> int:
    """Cache slots written from L (the root) in one cycle (the drafting extent)."""
    return _plan(tree).extent

  def init(self, prompt_BP, prompt_len_B, cache_len: int, tree=None) -> ModelDraftState:
    cache = kv.init(self.lm.config, prompt_BP.shape[0], cache_len)
    if self.vocab_size is not None:  # ids the draft lacks (module doc)
      prompt_BP = jnp.minimum(prompt_BP, self.lm.config.vocab_size - 1)
    _, cache = self.lm.prefill(cache, prompt_BP, prompt_len_B)
    slots = None if tree is None else _plan(tree).node_slots(prompt_BP.shape[0])
    return ModelDraftState(cache=kv.set_lengths(cache, prompt_len_B - 1), node_slots=slots)

  # -- the shared first step: [x_{L-1}, x_L] at positions [L-1, L]
  def _root(self, state: ModelDraftState, ctx: Context):
    length = ctx.length  # [B]
    prev = jnp.take_along_axis(ctx.tokens, (length - 1)[:, None], axis=1)
    cur = jnp.take_along_axis(ctx.tokens, length[:, None], axis=1)
    cache = kv.set_lengths(state.cache, length - 1)
    pos = (length - 1)[:, None] + jnp.arange(2, dtype=jnp.int32)[None]
    logits, _, cache = self._lm(jnp.concatenate([prev, cur], axis=1), pos, cache)
    nothing = jnp.zeros((length.shape[0], 0), jnp.float32)  # a separate model carries no state
    return logits[:, -1], nothing, kv.set_lengths(cache, length)  # the root is at slot L

  def _step(self, tokens_BW, parent_h_BWH, positions_BW, cache, mask):
    logits_BWV, _, cache = self._lm(tokens_BW, positions_BW, cache, mask)
    return logits_BWV, parent_h_BWH, cache

  @property
  def lazy_catch_up(self) -> bool:
    """True unless a subclass reads target features: this catch-up replays tokens only, so
    such a subclass catches up eagerly."""
    return not self.feature_layers

  def catch_up(self, state: ModelDraftState, ctx: Context, behind_B, width: int, sampler):
    """Lazy catch-up (`base` module doc): the cache is committed to L - behind - 1 (synced at
    L - behind); one forward pass over the tokens from there to L - 1 brings it to L - 1.

    Static shapes: the block has width + 1 tokens starting at s = L - behind - 1 (slots past
    L - 1 get padding, beyond the committed length, overwritten later); where the cache
    ends earlier than s + width + 1 the block starts earlier, re-writing committed entries
    with the values they already hold. The logits at position L - behind + j are the
    guess for token L - behind + 1 + j (row j of `guess`)."""
    size = ctx.tokens.shape[1]
    w = min(width + 1, size)
    length = ctx.length
    start = jnp.clip(length - behind_B - 1, 0, size - w).astype(jnp.int32)
    pos_BW = start[:, None] + jnp.arange(w, dtype=jnp.int32)[None]
    feed_BW = jnp.take_along_axis(ctx.tokens, pos_BW, axis=1)
    logits_BWV, _, cache = self._lm(feed_BW, pos_BW, kv.set_lengths(state.cache, start))
    rows = (length - behind_B - start)[:, None] + jnp.arange(width, dtype=jnp.int32)[None]
    logits_BPV = jnp.take_along_axis(logits_BWV, jnp.clip(rows, 0, w - 1)[:, :, None], axis=1)
    valid = jnp.arange(width)[None, :, None] < behind_B[:, None, None]  # rows j < behind
    guess = Proposal(tokens=jnp.argmax(logits_BPV, axis=-1).astype(jnp.int32),
                     q=None if self.deterministic else self.draft_law(logits_BPV, sampler),
                     finite=finite_rows(jnp.where(valid, logits_BPV, 0.0)))
    return state.replace(cache=kv.set_lengths(cache, length - 1)), guess

  def commit(self, state: ModelDraftState, ctx: Context, tree, path_BP, n_accepted_B
             ) -> ModelDraftState:
    """Moves the accepted path to slots [L, L + n] and commits L' - 1 entries (module doc).

    Only the path's fed nodes matter (all but possibly its deepest node); the rest of the
    moved window lies beyond the committed length.
    """
    del n_accepted_B  # the context length says it all
    cache = _plan(tree).compact(state, path_BP)  # lengths = L, the old root's slot
    return state.replace(cache=kv.set_lengths(cache, ctx.length - 1))
