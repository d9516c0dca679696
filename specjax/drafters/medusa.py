"""Medusa-1 heads: K residual heads on the frozen target's last hidden state, drafting a
static token tree from their top choices; no draft model, no extra target pass.

Heads. With h = the target's final-norm output at position t (what its LM head reads),

    h_j = h + SiLU(W_j h + b_j),    logits_j = LMHead(h_j),    j = 0 .. K-1,

where LMHead is the target's own (tied embedding or lm_head; shared, not copied). The root
of a cycle is x_L, the target's own token sampled from h at L - 1; head j guesses token
L + 1 + j. W_j, b_j start at zero, so an untrained head is the target's LM head itself.

The published Medusa-1 head (FasterDecoding/Medusa, `checkpoints.published.medusa`) may
stack R residual blocks per head (w [K, R, D, D], b [K, R, D]: h <- h + SiLU(W_r h + b_r),
r = 0..R-1) and carries its own LM projection per head (lm [K, D, V], initialised from the
target's and trained): `params` then holds those, and `head_logits` reads `lm` instead of
the target's LM head. Without them (our trained heads) nothing changes.

Training: the `MedusaHeads` kind (`specjax.training.medusa`) fits head j to the target's own
distribution for token t + 2 + j.

Drafting (`MedusaDrafter`). The loop hands the drafter the target's final-norm output of
every prompt position (`init`) and of every verified node (`commit`); it keeps, per row,
h at L - 1 (after a cycle that emitted m tokens, L' − 1 is path node m − 1). `propose`
computes the K heads' logits at h, takes each head's top-W tokens (W = the tree's widest
node) and fills the tree: a node at depth d and sibling rank r gets head d−1's rank-r
token. Siblings are distinct (different ranks of one head), the candidates are a
deterministic function of the committed context, and Proposal.q = None: the point-mass
rule verifies them exactly at any temperature / top-k / top-p. Any static tree of depth
≤ K whose nodes have at most V children works (chains, `trees.branching`, `from_paths` in
the Medusa "choices" format, or `trees.optimal` from measured acceptance); dynamic trees are
refused (Medusa's candidates do not depend on the path).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.models.lm import LM
from specjax.drafters.base import Context, Drafter, Proposal, finite_rows
from specjax.verify.trees import DynamicTree, TreeSpec

Array = jax.Array


def head_states(params: dict, hidden_XD: Array) -> Array:
  """[..., K, D] residual head states h + SiLU(W_j h + b_j) for every head j (R blocks in
  turn when w is [K, R, D, D])."""
  h = hidden_XD.astype(jnp.float32)
  if params["w"].ndim == 4:  # R residual blocks per head (the published format)
    x = jnp.broadcast_to(jnp.expand_dims(h, -2), h.shape[:-1] + params["w"].shape[:1]
                         + h.shape[-1:])
    for r in range(params["w"].shape[1]):
      z = jnp.einsum("...kd,kde->...ke", x, params["w"][:, r])
      x = x + jax.nn.silu(z + params["b"][:, r].reshape((1,) * (z.ndim - 2)
                                                        + params["b"].shape[:1] + z.shape[-1:]))
    return x
  z = jnp.einsum("...d,kde->...ke", h, params["w"])
  b = params["b"].reshape((1,) * (z.ndim - 2) + params["b"].shape)  # [..., K, D]
  return jnp.expand_dims(h, -2) + jax.nn.silu(z + b)


def head_logits(params: dict, target: LM, hidden_XD: Array) -> Array:
  """[..., K, V] float32 logits of every head through the target's own LM head (or each
  head's own projection, params["lm"] [K, D, V], where the heads carry one)."""
  states = head_states(params, hidden_XD)
  if "lm" in params:
    return jnp.einsum("...kd,kdv->...kv", states, params["lm"],
                      preferred_element_type=jnp.float32)
  lead = states.shape[:-1]
  flat = states.reshape((1, -1, states.shape[-1]))
  return target.module().logits(flat).astype(jnp.float32).reshape(lead + (-1,))


# ----------------------------------------------------------------------------- drafter


@functools.lru_cache(maxsize=64)
def _node_table(tree: TreeSpec) -> tuple[np.ndarray, np.ndarray]:
  """(head index, rank) of the drafted nodes 1..N: depth − 1 and sibling rank."""
  return (np.asarray(tree.depth[1:] - 1, np.int32), np.asarray(tree.ranks[1:], np.int32))


@struct.dataclass
class MedusaState:
  hidden: Array  # float32 [B, D] the target's final-norm output at L - 1
  length: Array  # int32 [B] L when `hidden` was taken


@struct.dataclass
class MedusaDrafter(Drafter):
  """Drafts static trees from Medusa heads (module doc). `target`: the target's LM (its LM
  head is used, shared); `params`: {"w": [K, D, D], "b": [K, D]}, or the published
  structure's {"w": [K, R, D, D], "b": [K, R, D]} and optionally "lm": [K, D, V]."""

  target: LM
  params: dict

  @classmethod
  def of(cls, target, params) -> "MedusaDrafter":
    """A drafter for `target` (Transformer or LM) from trained head params (validated)."""
    lm = LM.of(target)
    d = lm.config.d_model
    w, b, own = params.get("w"), params.get("b"), params.get("lm")
    mid = tuple(np.shape(w))[1:-2] if w is not None else ()
    if w is None or b is None or np.ndim(w) not in (3, 4) or tuple(np.shape(w))[-2:] != (d, d) \
        or tuple(np.shape(b)) != tuple(np.shape(w))[:1] + mid + (d,):
      raise ValueError(f"params must be Medusa heads for d_model {d}: w [K, {d}, {d}] and "
                       f"b [K, {d}] (or w [K, R, {d}, {d}] and b [K, R, {d}]), got shapes "
                       f"{np.shape(w)} and {np.shape(b)}")
    v = lm.config.vocab_size
    if own is not None and tuple(np.shape(own)) != (np.shape(w)[0], d, v):
      raise ValueError(f"params['lm'] must be the heads' own LM projections [K, {d}, {v}], got "
                       f"shape {np.shape(own)}")
    out = {"w": jnp.asarray(w, jnp.float32), "b": jnp.asarray(b, jnp.float32)}
    if own is not None:
      out["lm"] = jnp.asarray(own, jnp.float32)
    return cls(target=lm, params=out)

  @property
  def heads(self) -> int:
    return int(self.params["w"].shape[0])

  @property
  def feature_layers(self) -> tuple[int, ...]:
    return (self.target.config.n_layers,)

  def validate(self, tree, batch: int) -> None:
    """Static trees only, depth <= K (one head per level), at most V children a node."""
    del batch
    if isinstance(tree, DynamicTree) or not isinstance(tree, TreeSpec):
      raise ValueError(f"Medusa heads draft static trees (a chain or a trees.TreeSpec); got "
                       f"{tree!r}: its candidates do not depend on the path, so a dynamic "
                       "tree has nothing to choose from")
    if tree.max_depth > self.heads:
      raise ValueError(f"tree depth {tree.max_depth} exceeds the {self.heads} Medusa heads "
                       f"(one head per level): use a tree of depth <= {self.heads}")
    v = self.target.config.vocab_size
    if tree.max_width > v:
      raise ValueError(f"tree has a node with {tree.max_width} children but a Medusa head "
                       f"ranks only {v} tokens: width must be <= {v}")

  def init(self, prompt_BP, prompt_len_B, cache_len: int, tree=None,
           features=None) -> MedusaState:
    del cache_len, tree
    last = jnp.take_along_axis(features[:, :, 0], (prompt_len_B - 1)[:, None, None], axis=1)
    return MedusaState(hidden=last[:, 0].astype(jnp.float32),
                       length=prompt_len_B.astype(jnp.int32))

  def propose(self, state: MedusaState, ctx: Context, tree, sampler, key):
    del ctx, sampler, key  # deterministic candidates from the kept hidden state
    head_idx, rank = _node_table(tree)
    logits_BKV = head_logits(self.params, self.target, state.hidden)
    width = tree.max_width
    if width == 1:
      top_BKW = jnp.argmax(logits_BKV, axis=-1)[..., None]
    else:
      top_BKW = jax.lax.top_k(logits_BKV, width)[1]
    tokens_BN = top_BKW[:, head_idx, rank].astype(jnp.int32)
    return Proposal(tokens=tokens_BN, q=None, finite=finite_rows(logits_BKV)), state

  lazy_catch_up = True  # the loop keeps the skipped plain steps' features for `catch_up`

  def catch_up(self, state: MedusaState, ctx: Context, behind_B, width: int, sampler,
               features=None):
    """Lazy catch-up (`base` module doc): `features` row j is position L0 + j's final-norm
    output (L0 = L - behind); the kept state becomes position L - 1's (row behind - 1; rows
    not behind keep theirs). Guess j, for token L0 + 1 + j, is head 0's top token from
    position L0 - 1 + j's state (the kept one for j = 0): what a plain step's one-token
    draft would have proposed, from one product of head 0 over the P rows."""
    del sampler
    f = features[:, :, 0].astype(jnp.float32)  # [B, P, D]
    before = jnp.concatenate([state.hidden[:, None], f[:, :-1]], axis=1)
    logits = head_logits({k: v[:1] for k, v in self.params.items()}, self.target,
                         before)[:, :, 0]
    valid = jnp.arange(width)[None, :, None] < behind_B[:, None, None]
    guess = Proposal(tokens=jnp.argmax(logits, axis=-1).astype(jnp.int32), q=None,
                     finite=finite_rows(jnp.where(valid, logits, 0.0)))
    last = jnp.take_along_axis(f, jnp.maximum(behind_B - 1, 0)[:, None, None], axis=1)[:, 0]
    return MedusaState(hidden=jnp.where((behind_B > 0)[:, None], last, state.hidden),
                       length=ctx.length), guess

  def commit(self, state: MedusaState, ctx: Context, tree, path_BP, n_accepted_B,
             features=None) -> MedusaState:
    del tree, n_accepted_B
    m = ctx.length - state.length  # tokens emitted this cycle (0 for a finished row)
    node = jnp.take_along_axis(path_BP, jnp.maximum(m - 1, 0)[:, None], axis=1)
    last = jnp.take_along_axis(features[:, :, 0], node[:, :, None], axis=1)[:, 0]
    return MedusaState(hidden=jnp.where((m > 0)[:, None], last, state.hidden),
                       length=ctx.length)
