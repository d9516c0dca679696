"""The verify layout (`VerifyLayout`): how one verify pass lays out [root, drafted nodes].

Each node's depth (its position is L + depth), the attention mask, the children table and
the depth bound. `tree.layout(proposal)` gives it for either kind of tree
(`trees.TreeSpec`: a numpy constant, the proposal not read; `trees.DynamicTree`: built
in-graph from the proposal's `parents` / `depth`). The target pass and the acceptance rule
read only the layout, never the tree type.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class VerifyLayout:
  """How one verify pass lays out the T = N + 1 nodes [root, drafted nodes].

  depth: int32 [T] (the same for every row) or [B, T] (per row): node i is scored at
    position L + depth[i] (depth[root] = 0).
  mask: bool [T, T] or [B, T, T], mask[i, j]: node j is node i or one of its ancestors (what
    node i attends to besides the committed prefix); None for a chain (a causal block).
  children: int32 [T, W] or [B, T, W], the children of each node in rank order, -1 padded
    (the order the acceptance rule tries them in).
  max_depth: D, static: the deepest node (the acceptance rule's number of levels).
  is_chain: static. A chain's nodes are verified by the vectorised chain rule, and its
    accepted path already sits in contiguous cache slots (no compaction).

  The arrays are numpy constants for a static `TreeSpec` (`TreeSpec.layout`) and traced
  values for a `DynamicTree` (built from the drafter's proposal inside the loop).
  """

  depth: Any
  mask: Any
  children: Any
  max_depth: int = struct.field(pytree_node=False)
  is_chain: bool = struct.field(pytree_node=False, default=False)

  @property
  def n_nodes(self) -> int:
    """T: verified nodes including the root."""
    return self.children.shape[-2]

  @property
  def max_width(self) -> int:
    """W: the most children of one node."""
    return self.children.shape[-1]

  def positions(self, length_B) -> jax.Array:
    """int32 [B, T] positions of the verified nodes: L + depth."""
    depth = self.depth if self.depth.ndim == 2 else jnp.asarray(self.depth)[None]
    return length_B[:, None] + depth

  def block_mask(self) -> jax.Array | None:
    """The mask as the model's forward takes it (`block_mask`): None for a causal block."""
    return None if self.mask is None else jnp.asarray(self.mask)

  def children_for(self, batch: int) -> jax.Array:
    """The children table per row, int32 [B, T, W]."""
    c = jnp.asarray(self.children)
    return c if c.ndim == 3 else jnp.broadcast_to(c, (batch,) + c.shape)
