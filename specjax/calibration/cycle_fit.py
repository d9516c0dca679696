"""The fitted cycle cost: cycle(N, D) = t_fixed + t_verify·(N + 1) + D·t_draft (seconds, all
≥ 0), N drafted nodes, D draft passes, fitted by non-negative least squares to the cycle
times of the calibrated shapes (`calibration.LoopCosts.fitted`; docs/cost_model.md,
"Calibrated loop costs"). Chains alone cannot separate the three costs (N = D): the fit
needs a tree among the shapes (`identifiable`). Pure numpy.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class CycleFit:
  """cycle(N, D) = t_fixed + t_verify·(N + 1) + D·t_draft, seconds; rms = root-mean-square
  residual of the fit (seconds), rel_rms = rms ÷ mean cycle time."""

  t_fixed: float
  t_verify: float
  t_draft: float
  rms: float
  rel_rms: float

  def seconds(self, nodes: int, passes: int) -> float:
    return self.t_fixed + self.t_verify * (nodes + 1) + passes * self.t_draft


def _design(points: Sequence[tuple[int, int]]) -> np.ndarray:
  return np.asarray([[1.0, n + 1.0, float(d)] for n, d in points])


def identifiable(points: Sequence[tuple[int, int]]) -> bool:
  """Whether (N, D) shapes determine all three costs (the design has rank 3: at least three
  distinct shapes, not all with N = D, i.e. not chains only)."""
  return len(points) >= 3 and np.linalg.matrix_rank(_design(points)) == 3


def fit(samples: Sequence[tuple[int, int, float]]) -> CycleFit:
  """Non-negative least squares of cycle seconds on (1, N + 1, D).

  samples: (N, D, seconds per cycle) per calibrated shape. Exact for three unknowns: every
  subset of the coefficients is solved by ordinary least squares with the others held at
  0, and the feasible (all ≥ 0) solution with the smallest residual wins (the NNLS
  optimum is one of them). Raises ValueError when the shapes do not identify the costs
  (`identifiable`).
  """
  if len(samples) == 0:
    raise ValueError("samples must hold (nodes, passes, seconds) per shape, got none")
  pts, y = [], []
  for i, s in enumerate(samples):
    if len(s) != 3:
      raise ValueError(f"samples[{i}] must be (nodes, passes, seconds), got {s!r}")
    n, d, sec = s
    if not (isinstance(sec, (int, float, np.floating)) and math.isfinite(sec) and sec > 0):
      raise ValueError(f"samples[{i}] seconds must be a finite number > 0, got {sec!r}")
    pts.append((int(n), int(d)))
    y.append(float(sec))
  if not identifiable(pts):
    raise ValueError(f"samples: shapes (N, D) = {sorted(set(pts))} cannot separate t_fixed, "
                     f"t_verify and t_draft: need >= 3 distinct shapes including one with "
                     f"N != D (a tree; chains alone have N = D)")
  a, y = _design(pts), np.asarray(y)
  best, best_res = np.zeros(3), math.inf
  for r in range(1, 4):
    for cols in itertools.combinations(range(3), r):
      sol, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
      if np.any(sol < 0):
        continue
      coef = np.zeros(3)
      coef[list(cols)] = sol
      res = float(np.sum((a @ coef - y) ** 2))
      if res < best_res - 1e-30:
        best, best_res = coef, res
  rms = math.sqrt(best_res / len(y))
  return CycleFit(t_fixed=float(best[0]), t_verify=float(best[1]), t_draft=float(best[2]),
                  rms=rms, rel_rms=rms / float(np.mean(y)))
