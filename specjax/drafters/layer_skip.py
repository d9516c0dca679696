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

KV cache. The draft keeps its own cache of m layers (`config.n_layers = m`, sized and
checked by the host API like any draft cache), with the separate-model bookkeeping
(committed to L - 1, catch-up by feeding tokens L - 1 and L).

Why not the target's own cache. For the committed prefix [0, L) the target's entries of
layers 0..m-1 are exactly what the draft computes there (same weights, same inputs, same
positions; a block's keys and values depend only on the blocks below it), so sharing them
would be exact and would save the draft's cache and its catch-up pass. The current protocol
does not allow it: `propose` / `commit` see the committed context (tokens and L), never the
target's cache, and the loop owns that cache. It would need the loop to hand the target
cache to `propose` and take it back: the draft writes its layers' entries for the tree at
slots >= L, which the verify pass rewrites before reading (it attends to the committed
prefix and to its own block), so verification would stay exact; after verification and
compaction the accepted path's low-layer entries are again the draft's. (The target's cache
layout stores all layers in one structure, so the draft would also need a per-layer view.)
"""

from __future__ import annotations

import numpy as np
from flax import nnx, struct

from specjax.drafters.base import LM
from specjax.drafters.model import ModelDrafter
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
  candidates, as for `ModelDrafter`.
  """

  @classmethod
  def of(cls, target, layers: int, deterministic: bool = False) -> "LayerSkipDrafter":  # noqa: D102
    return cls(lm=truncated_lm(target, layers), deterministic=deterministic)

  @property
  def layers(self) -> int:
    """m: the target blocks the draft runs."""
    return self.lm.config.n_layers
