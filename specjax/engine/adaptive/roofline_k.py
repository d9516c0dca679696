"""The roofline's k per batch size (`AdaptiveKPolicy`): deep drafts when the engine is
quiet, none when it is full.

The roofline (`specjax/analysis/roofline.py`) prices each chain length k at each batch size; the
engine's one policy (`adaptive.AdaptivePolicy`) chooses among them; this module tabulates
the choice over batch sizes, made monotone (what `specjax theory roofline` prints). Pure
numpy until built: building imports JAX (the policy's module).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np

from specjax.analysis import roofline, theory


@dataclasses.dataclass(frozen=True)
class AdaptiveKPolicy:
  """The k to draft at each batch size: deep when the engine is quiet, 0 (off) when full.

  The roofline's prices for the engine's one policy (`policy.AdaptivePolicy`,
  exposed as `.policy`): the menu is k = 0..k_max, the cost of entry k at batch b is
  `cycle_time(b, k)` (k = 0: the plain step t(b, 1)), and the raw choice at batch b is the
  policy's at acceptance α. k_for_batch(B) = min over b <= B of that choice: made monotone
  non-increasing in B (the running minimum only matters where the raw optimum wiggles).
  Precomputed for B = 1..max_batch; larger batches use the max_batch value. Hashable, so it
  can be a static argument. Building it imports JAX (the policy's module). Sizes are
  refused before anything is built: max_batch × (k_max + 1) and (k_max + 1) × k_max² at
  most `theory.MAX_TABLE_CELLS` (k_max <= 215).
  """

  hardware: roofline.Hardware
  workload: roofline.Workload
  alpha: float
  c: float
  k_max: int = 8
  max_batch: int = 4096
  draft_cost: str = "full"
  ks: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)
  policy: Any = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self):
    from specjax.engine.adaptive import policy as adaptive  # lazy: the policy module imports JAX

    a, _, cc, dc = roofline._spec_args(self.alpha, 0, self.c, self.draft_cost)
    k_max = theory.check_size("k_max", roofline._int("k_max", self.k_max, 0), theory.MAX_K,
                              "menu k = 0..k_max")
    n = roofline._int("max_batch", self.max_batch, 1)
    theory.check_size("max_batch × (k_max + 1)", n * (k_max + 1), theory.MAX_TABLE_CELLS,
                      "cycle times tabulated for every batch 1..max_batch and k")
    theory.check_size("(k_max + 1) × k_max²", (k_max + 1) * k_max**2, theory.MAX_TABLE_CELLS,
                      "the policy's per-entry node tables")
    b_B = np.arange(1, n + 1)
    b_B1 = b_B.astype(np.float64)[:, None]
    L = self.workload.context_len
    t_plain_B1 = np.maximum(roofline._t_mem(self.hardware, self.workload, b_B1, L),
                            roofline._t_comp(self.hardware, self.workload, b_B1, 1, L))
    k_1K = np.arange(1, k_max + 1)[None, :]
    cycle_BK = roofline._cycle_arr(self.hardware, self.workload, b_B1, k_1K, cc, L, dc)
    policy = adaptive.AdaptivePolicy.create(tuple(range(k_max + 1)),
                                            np.concatenate([t_plain_B1, cycle_BK], axis=1),
                                            tuple(b_B.tolist()))
    raw_B = policy.choose_batches(a, b_B)  # smallest k among ties
    object.__setattr__(self, "policy", policy)
    object.__setattr__(self, "ks", tuple(int(x) for x in np.minimum.accumulate(raw_B)))

  def k_for_batch(self, batch: int) -> int:
    b = roofline._int("batch", batch, 1)
    return self.ks[min(b, self.max_batch) - 1]

  def table(self, batches: Iterable[int]) -> list[tuple[int, int]]:
    """[(batch, k)] for the given batch sizes."""
    return [(int(b), self.k_for_batch(b)) for b in batches]

  def breakpoints(self) -> list[tuple[int, int]]:
    """[(first batch, k)] where k changes: a compact description of the policy."""
    out = []
    for b, k in enumerate(self.ks, start=1):
      if not out or out[-1][1] != k:
        out.append((b, k))
    return out
