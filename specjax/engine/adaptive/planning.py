"""Host-side planning with an adaptive policy: what the loop would choose, and what it gains.

`AdaptivePlanning` is mixed into `adaptive.AdaptivePolicy`: the answers `specjax theory`
prints and the experiments predict, for rows that all accept alike (at α, or at given
per-rank and per-depth rates), with no forced schedule. They run the loop's own formula
(`AdaptivePolicy.scores` in numpy, `xp=np`), so the host and the compiled loop agree; the
in-loop policy (estimate, costs, choice) stays in `specjax/engine/adaptive/policy.py`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class AdaptivePlanning:
  """Host answers of an `adaptive.AdaptivePolicy` (its `scores`, `expected_tokens`,
  `cycle_seconds`, `_host_rates`, `names`, `batches` and `plain`): choices by batch, tables
  of choices and predicted speedups, the batch sizes where the choice changes."""

  def choose_batches(self, alpha, batches, rank_rates=None, depth_rates=None) -> np.ndarray:
    """Host (numpy, the loop's formula): the entry index the loop would pick at each batch
    size in `batches` for rows that all accept at α (or at per-rank rates `rank_rates` and
    the first candidate's per-depth rates `depth_rates`), no forcing."""
    b = np.asarray(batches)
    if b.ndim != 1 or b.size == 0 or not np.issubdtype(b.dtype, np.integer) or np.any(b < 1):
      raise ValueError(f"batches must be ints >= 1, got {batches!r}")
    s = self.scores(self._host_rates(alpha, rank_rates, depth_rates), np.ones(1, bool), b, np)
    return np.argmax(s, axis=-1)

  def choose(self, alpha, batch: int, rank_rates: Sequence[float] | None = None,
             depth_rates: Sequence[float] | None = None) -> int:
    """Host: the entry the loop would pick for `batch` rows that all accept at α (or at
    per-rank rates `rank_rates` and per-depth first-candidate rates `depth_rates`), with no
    forced schedule."""
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
      raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    return int(self.choose_batches(alpha, [int(batch)], rank_rates, depth_rates)[0])

  def predicted_speedup(self, alpha: float, batch: int, entry: int) -> float:
    """Predicted speedup of `entry` over plain decoding at `batch` (`plain_seconds`)."""
    tau = float(self.expected_tokens(self._host_rates(alpha), np)[0, entry])
    sec = self.cycle_seconds(batch, np)
    return tau / float(sec[entry]) * self.plain_seconds(batch)

  def plain_seconds(self, batch: int) -> float:
    """Seconds of a plain decoding step at `batch` (linear in log batch, clamped)."""
    return float(np.interp(np.log(batch), np.log(np.asarray(self.batches)),
                           np.asarray(self.plain)))

  def table(self, alphas: Sequence[float], batches: Sequence[int]) -> list[dict]:
    """[{alpha, batch, choice, speedup}]: what the engine would choose."""
    out = []
    for a in alphas:
      for b, i in zip(batches, self.choose_batches(a, list(batches))):
        out.append({"alpha": float(a), "batch": int(b), "choice": self.names[int(i)],
                    "speedup": self.predicted_speedup(float(a), int(b), int(i))})
    return out

  def breakpoints(self, alpha: float, max_batch: int) -> list[tuple[int, str]]:
    """[(first batch, choice)] where the choice at α changes over batches 1..max_batch."""
    out: list[tuple[int, str]] = []
    for b, i in enumerate(self.choose_batches(alpha, np.arange(1, int(max_batch) + 1)), 1):
      name = self.names[int(i)]
      if not out or out[-1][1] != name:
        out.append((b, name))
    return out
