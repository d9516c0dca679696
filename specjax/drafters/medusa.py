"""Medusa-1 heads: K residual heads on the frozen target's last hidden state, drafting a
static token tree from their top choices; no draft model, no extra target pass.

Heads. With h = the target's final-norm output at position t (what its LM head reads),

    h_j = h + SiLU(W_j h + b_j),    logits_j = LMHead(h_j),    j = 0 .. K-1,

where LMHead is the target's own (tied embedding or lm_head; shared, not copied). The root
of a cycle is x_L, the target's own token sampled from h at L - 1; head j guesses token
L + 1 + j. W_j, b_j start at zero, so an untrained head is the target's LM head itself.

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

from specjax.drafters.base import LM, Context, Drafter, Proposal
from specjax.trees import DynamicTree, TreeSpec

Array = jax.Array


def head_states(params: dict, hidden_XD: Array) -> Array:
  """[..., K, D] residual head states h + SiLU(W_j h + b_j) for every head j."""
  h = hidden_XD.astype(jnp.float32)
  z = jnp.einsum("...d,kde->...ke", h, params["w"])
  b = params["b"].reshape((1,) * (z.ndim - 2) + params["b"].shape)  # [..., K, D]
  return jnp.expand_dims(h, -2) + jax.nn.silu(z + b)


def head_logits(params: dict, target: LM, hidden_XD: Array) -> Array:
  """[..., K, V] float32 logits of every head through the target's own LM head."""
  states = head_states(params, hidden_XD)
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
  head is used, shared); `params`: {"w": [K, D, D], "b": [K, D]}."""

  target: LM
  params: dict

  @classmethod
  def of(cls, target, params) -> "MedusaDrafter":
    """A drafter for `target` (Transformer or LM) from trained head params (validated)."""
    lm = LM.of(target)
    d = lm.config.d_model
    w, b = params.get("w"), params.get("b")
    if w is None or b is None or np.ndim(w) != 3 or tuple(np.shape(w))[1:] != (d, d) or \
        tuple(np.shape(b)) != (np.shape(w)[0], d):
      raise ValueError(f"params must be Medusa heads for d_model {d}: w [K, {d}, {d}] and "
                       f"b [K, {d}], got shapes {np.shape(w)} and {np.shape(b)}")
    return cls(target=lm, params={"w": jnp.asarray(w, jnp.float32),
                                  "b": jnp.asarray(b, jnp.float32)})

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
    return Proposal(tokens=tokens_BN, q=None), state

  def commit(self, state: MedusaState, ctx: Context, tree, path_BP, n_accepted_B,
             features=None) -> MedusaState:
    del tree, n_accepted_B
    m = ctx.length - state.length  # tokens emitted this cycle (0 for a finished row)
    node = jnp.take_along_axis(path_BP, jnp.maximum(m - 1, 0)[:, None], axis=1)
    last = jnp.take_along_axis(features[:, :, 0], node[:, :, None], axis=1)[:, 0]
    return MedusaState(hidden=jnp.where((m > 0)[:, None], last, state.hidden),
                       length=ctx.length)
