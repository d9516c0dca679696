"""Host-side speculative-decoding statistics (numpy + scipy; never jitted): chain statistics
(`summarize` -> `SpecStats`) and tree statistics (`summarize_tree` -> `TreeSummary`,
`rank_probs_from_counts` for `trees.optimal`). The host API's result type
(`decoding.Generation.summary` / `.tree_summary`) calls them; the jitted loop only counts.

Conventions (the names are defined in docs/conventions.md):
- α (alpha) = accepted drafted tokens / drafted tokens. Every cycle drafts k tokens and all
  k count as drafted, including those after the first rejection that the rule never tried.
  This is what `alpha_interval(accepted, drafted)` is fed by default.
- Trials. The rule tries positions left to right and stops at the first rejection, so a
  cycle with n accepted tokens is n successes followed by one failure if n < k, and the
  positions after the failure are no trial at all. Under the i.i.d. acceptance model of the
  cost model (docs/cost_model.md: each tried token accepted with probability a) the
  maximum-likelihood estimate of a is accepted / trials (`alpha_trial`), and that a is what
  E[τ] = (1 - a^(k+1)) / (1 - a) expects. accepted / drafted is smaller whenever rejections
  happen (it estimates E[n] / k = (a + a^2 + ... + a^k) / k), so do not feed it into the
  E[τ] formula.
- Autocorrelation is measured on the trial sequence (no untried positions), per row: the
  last trial of one row and the first of the next are not a pair.
- τ (tau) = tokens emitted / target verifications, the correction or bonus token included
  (1.0 = no gain).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np
import scipy.stats


def _check_count(name: str, value: Any) -> int:
  try:
    ok = not isinstance(value, bool) and float(value).is_integer() and value >= 0
  except (TypeError, ValueError, OverflowError):
    ok = False
  if not ok:
    raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
  return int(value)


def alpha_interval(accepted: int, drafted: int, confidence: float = 0.95,
                   rho: float = 0.0) -> tuple[float, float, float]:
  """Point estimate and Wilson score interval for a binomial proportion: (alpha, lo, hi).

  Wilson (not Wald, not Clopper-Pearson): closed form, stays inside [0, 1], near-nominal
  coverage even for small n or alpha near 0 / 1, and, unlike Clopper-Pearson, it is defined
  for the non-integer effective sample sizes below. With z = Φ^-1((1 + confidence) / 2),
  n trials and a = accepted / n:

    centre = (a + z²/2n) / (1 + z²/n),  half = z / (1 + z²/n) * sqrt(a(1-a)/n + z²/4n²).

  rho: lag-1 autocorrelation of the accept flags (see lag1_autocorrelation). Acceptance is
  bursty (docs/cost_model.md), so n correlated trials carry less information than n
  independent ones. For an AR(1)-like sequence the variance of the mean is inflated by
  (1 + rho) / (1 - rho), so the interval is computed at the effective sample size
  n_eff = n (1 - rho) / (1 + rho) with the same a. Only positive rho is applied (the
  correction only ever widens the interval; a negative rho, which would narrow it, is
  treated as 0).

  drafted == 0 gives (nan, 0.0, 1.0): no information.
  """
  accepted = _check_count("accepted", accepted)
  drafted = _check_count("drafted", drafted)
  if accepted > drafted:
    raise ValueError(f"accepted must be <= drafted, got accepted={accepted}, drafted={drafted}")
  if not (0.0 < confidence < 1.0):
    raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
  if not (-1.0 < rho < 1.0):  # also rejects NaN
    raise ValueError(f"rho must be in (-1, 1), got {rho!r}")
  if drafted == 0:
    return float("nan"), 0.0, 1.0
  a = accepted / drafted
  r = max(float(rho), 0.0)
  n = drafted * (1.0 - r) / (1.0 + r)
  z = _z(float(confidence))
  denom = 1.0 + z * z / n
  centre = (a + z * z / (2.0 * n)) / denom
  half = z / denom * math.sqrt(a * (1.0 - a) / n + z * z / (4.0 * n * n))
  # Exactly, lo = 0 at a = 0 and hi = 1 at a = 1; clamp the rounding so lo <= a <= hi.
  return a, min(max(0.0, centre - half), a), max(min(1.0, centre + half), a)


@functools.lru_cache(maxsize=64)
def _z(confidence: float) -> float:
  """Two-sided normal quantile Φ^-1((1 + confidence) / 2)."""
  return float(scipy.stats.norm.ppf(0.5 + confidence / 2.0))


def tau(emitted_tokens: Any, verifications: Any) -> float:
  """Mean tokens emitted per target verification, bonus/correction included.

  Arguments are counts or arrays of per-row counts (summed). 0 verifications -> nan.
  """
  e = np.asarray(emitted_tokens, dtype=np.int64)
  v = np.asarray(verifications, dtype=np.int64)
  if np.any(e < 0) or np.any(v < 0):
    raise ValueError(f"emitted_tokens and verifications must be >= 0, got {emitted_tokens!r}, "
                     f"{verifications!r}")
  total_v = int(v.sum())
  return float("nan") if total_v == 0 else float(e.sum()) / total_v


def _cycle_counts(n_accepted_per_cycle: Any, k: int) -> np.ndarray:
  """Flattened valid per-cycle counts (entries -1 mark unused log slots and are dropped)."""
  k = _check_count("k", k)
  n = np.asarray(n_accepted_per_cycle, dtype=np.int64)
  if np.any((n < -1) | (n > k)):
    bad = n[(n < -1) | (n > k)][0]
    raise ValueError(f"n_accepted_per_cycle entries must be in [0, k={k}] (or -1 for unused), "
                     f"got {bad}")
  return n[n >= 0]


def run_length_histogram(n_accepted_per_cycle: Any, k: int) -> np.ndarray:
  """Counts of cycles that accepted 0, 1, ..., k drafted tokens: int64 [k + 1].

  Any shape is accepted; -1 entries (unused log slots) are ignored.
  """
  return np.bincount(_cycle_counts(n_accepted_per_cycle, k), minlength=k + 1).astype(np.int64)


def accept_flags_from_cycles(n_accepted_per_cycle: Any, k: int) -> np.ndarray:
  """The Bernoulli trials implied by one row's per-cycle accepted counts: bool [trials].

  A cycle with n accepted contributes n True then one False if n < k (the rejection); the
  positions after a rejection were never tried and contribute nothing. So
  trials = accepted + #(cycles with n < k), not k * cycles (which is what α = accepted /
  drafted divides by). Input: 1-D counts of one row, in cycle order; -1 entries are skipped.
  """
  n = np.asarray(n_accepted_per_cycle)
  if n.ndim != 1:
    raise ValueError(f"n_accepted_per_cycle must be 1-D (one row), got shape {n.shape}")
  n = _cycle_counts(n, k)
  pieces = [np.concatenate([np.ones(c, bool), np.zeros(int(c < k), bool)]) for c in n]
  return np.concatenate(pieces) if pieces else np.zeros(0, bool)


def lag1_autocorrelation(flags: Any) -> float:
  """Lag-1 autocorrelation of accept flags, pooled over rows without crossing row borders.

  flags: one 1-D sequence, or a sequence of 1-D sequences (one per row, ragged allowed; a 2-D
  array is read as rows). With μ the mean over all flags,

    rho = mean over within-row pairs (x_t - μ)(x_{t+1} - μ) / mean over flags (x_t - μ)².

  An alternating sequence gives -1; long runs give values near +1; i.i.d. flags give ~0.
  Defined as 0.0 when there is no variation (all flags equal) or no within-row pair: such
  data carries no evidence of burstiness, and 0 makes the effective-sample-size correction
  in alpha_interval a no-op instead of propagating NaN.
  """
  if isinstance(flags, np.ndarray) and flags.ndim == 1:
    rows = [flags]
  elif isinstance(flags, np.ndarray) and flags.ndim == 2:
    rows = list(flags)
  elif isinstance(flags, np.ndarray):
    raise ValueError(f"flags must be 1-D or 2-D (rows), got shape {flags.shape}")
  else:
    seq = list(flags)
    rows = [np.asarray(r) for r in seq] if seq and np.ndim(seq[0]) == 1 else [np.asarray(seq)]
  rows = [np.asarray(r, dtype=np.float64).ravel() for r in rows]
  total = np.concatenate(rows) if rows else np.zeros(0)
  pairs = sum(max(len(r) - 1, 0) for r in rows)
  if total.size == 0 or pairs == 0:
    return 0.0
  mu = total.mean()
  var = float(np.mean((total - mu) ** 2))
  if var <= 1e-15:
    return 0.0
  cov = sum(float(np.sum((r[:-1] - mu) * (r[1:] - mu))) for r in rows if len(r) > 1) / pairs
  return float(np.clip(cov / var, -1.0, 1.0))


@dataclasses.dataclass(frozen=True)
class SpecStats:
  """Summary of a speculative run (see module doc for the α / trial / τ conventions).

  alpha_ci: Wilson interval for alpha treating each drafted token as a trial;
  alpha_ci_ess: the same widened by the effective-sample-size correction with rho.
  alpha_trial(_ci, _ci_ess): per-tried-token acceptance (the i.i.d. model's a) and intervals.
  histogram[n]: cycles that accepted n drafts. log_complete: the cycle log held every cycle
  (otherwise histogram and rho cover only the logged cycles).
  """

  k: int
  rows: int
  cycles: int
  drafted: int
  accepted: int
  emitted: int
  trials: int
  confidence: float
  alpha: float
  alpha_ci: tuple[float, float]
  alpha_ci_ess: tuple[float, float]
  alpha_trial: float
  alpha_trial_ci: tuple[float, float]
  alpha_trial_ci_ess: tuple[float, float]
  rho: float
  tau: float
  mean_accepted: float
  histogram: tuple[int, ...]
  alpha_rows: tuple[float, ...]
  log_complete: bool

  def to_dict(self) -> dict[str, Any]:
    """Plain JSON types only: NaN becomes None, tuples become lists."""

    def clean(v):
      if isinstance(v, (tuple, list)):
        return [clean(x) for x in v]
      if isinstance(v, float):
        return None if math.isnan(v) else v
      return v

    return {f.name: clean(getattr(self, f.name)) for f in dataclasses.fields(self)}


def summarize(cycles: Any, drafted: Any, accepted: Any, emitted: Any, cycle_log: Any, k: int,
              confidence: float = 0.95) -> SpecStats:
  """Builds SpecStats from per-row counters of a speculative run.

  cycles[B]: verifications per row; drafted[B], accepted[B]: drafted / accepted tokens;
  emitted[B]: tokens emitted by verification cycles (accepted + one per cycle, unless the
  decoder truncated at a budget or EOS); cycle_log[B, C]: accepted count of each cycle in
  order, -1 in unused slots.
  """
  k = _check_count("k", k)
  arrs = {}
  for name, v in (("cycles", cycles), ("drafted", drafted), ("accepted", accepted),
                  ("emitted", emitted)):
    a = np.asarray(v, dtype=np.int64)
    if a.ndim != 1:
      raise ValueError(f"{name} must be 1-D [B], got shape {a.shape}")
    if np.any(a < 0):
      raise ValueError(f"{name} must be >= 0, got {a.min()}")
    arrs[name] = a
  B = arrs["cycles"].shape[0]
  for name, a in arrs.items():
    if a.shape != (B,):
      raise ValueError(f"{name} must have shape [{B}] like cycles, got {a.shape}")
  log = np.asarray(cycle_log, dtype=np.int64)
  if log.ndim != 2 or log.shape[0] != B:
    raise ValueError(f"cycle_log must be [B={B}, C], got shape {log.shape}")
  if np.any(arrs["accepted"] > arrs["drafted"]):
    raise ValueError("accepted must be <= drafted in every row")
  logged = (log >= 0).sum(axis=1)
  if np.any(logged > arrs["cycles"]):
    raise ValueError("cycle_log holds more cycles than cycles[] counts in some row")

  hist = run_length_histogram(log, k)
  rows_flags = [accept_flags_from_cycles(row, k) for row in log]
  rho = lag1_autocorrelation(rows_flags)
  n_acc, n_drafted = int(arrs["accepted"].sum()), int(arrs["drafted"].sum())
  log_complete = bool(np.all(logged == arrs["cycles"]))
  if log_complete:
    trials = n_acc + int(np.sum((log >= 0) & (log < k)))
  else:  # Fall back to the logged cycles for both numerator and denominator.
    trials = sum(len(f) for f in rows_flags)
  trial_acc = n_acc if log_complete else int(sum(f.sum() for f in rows_flags))
  rho_ess = min(max(rho, 0.0), 0.999)  # only positive rho widens; -1 (alternating) is valid
  a, lo, hi = alpha_interval(n_acc, n_drafted, confidence)
  _, lo_e, hi_e = alpha_interval(n_acc, n_drafted, confidence, rho=rho_ess)
  at, lo_t, hi_t = alpha_interval(trial_acc, trials, confidence)
  _, lo_te, hi_te = alpha_interval(trial_acc, trials, confidence, rho=rho_ess)
  with np.errstate(invalid="ignore", divide="ignore"):
    alpha_rows = np.where(arrs["drafted"] > 0, arrs["accepted"] / np.maximum(arrs["drafted"], 1),
                          np.nan)
  n_cycles = int(arrs["cycles"].sum())
  return SpecStats(
      k=k, rows=B, cycles=n_cycles, drafted=n_drafted, accepted=n_acc,
      emitted=int(arrs["emitted"].sum()), trials=trials, confidence=float(confidence),
      alpha=a, alpha_ci=(lo, hi), alpha_ci_ess=(lo_e, hi_e),
      alpha_trial=at, alpha_trial_ci=(lo_t, hi_t), alpha_trial_ci_ess=(lo_te, hi_te),
      rho=rho, tau=tau(arrs["emitted"], arrs["cycles"]),
      mean_accepted=float(n_acc / n_cycles) if n_cycles else float("nan"),
      histogram=tuple(int(c) for c in hist), alpha_rows=tuple(float(x) for x in alpha_rows),
      log_complete=log_complete)


# ----------------------------------------------------------------------------- trees


def rank_probs_from_counts(rank_tried: Any, rank_accepted: Any) -> np.ndarray:
  """Sequoia's rank_probs from measured counters: p_r = a_r Π_{s<r} (1 − a_s).

  a_r = accepted / tried of rank-r candidates (conditional acceptance once tried); the
  rank-r child is the accepted one iff ranks < r were rejected and r passed. Untried ranks
  get a_r = 0. Feed the result to `trees.optimal`.
  """
  tried = np.asarray(rank_tried, np.float64)
  acc = np.asarray(rank_accepted, np.float64)
  if tried.shape != acc.shape or tried.ndim != 1:
    raise ValueError(f"rank_tried and rank_accepted must be 1-D of one shape, got {tried.shape} "
                     f"and {acc.shape}")
  a = np.where(tried > 0, acc / np.maximum(tried, 1), 0.0)
  survive = np.concatenate([[1.0], np.cumprod(1.0 - a)[:-1]])
  return a * survive


@dataclasses.dataclass(frozen=True)
class TreeSummary:
  """Tree statistics of a speculative run (all rows pooled).

  tau: tokens emitted per verification (bonus/correction included).
  utilisation: accepted nodes / verified nodes.
  depth_acceptance[d-1]: P(a depth-d node is accepted | its parent was accepted and has
    children); depth_reach[d-1]: fraction of cycles whose accepted path reached depth d.
  rank_acceptance[r]: P(rank-r candidate accepted | it was tried); rank_probs: Sequoia's
    P(rank-r child is the accepted one | parent accepted), for `trees.optimal`.
  """

  cycles: int
  verified: int
  accepted: int
  emitted: int
  tau: float
  utilisation: float
  mean_accepted: float
  depth_tried: tuple[int, ...]
  depth_accepted: tuple[int, ...]
  depth_acceptance: tuple[float, ...]
  depth_reach: tuple[float, ...]
  rank_tried: tuple[int, ...]
  rank_accepted: tuple[int, ...]
  rank_acceptance: tuple[float, ...]
  rank_probs: tuple[float, ...]
  histogram: tuple[int, ...]

  def to_dict(self) -> dict[str, Any]:
    def clean(v):
      if isinstance(v, (tuple, list)):
        return [clean(x) for x in v]
      if isinstance(v, float) and v != v:
        return None
      return v
    return {f.name: clean(getattr(self, f.name)) for f in dataclasses.fields(self)}


def summarize_tree(stats: dict[str, Any], emitted: Any) -> TreeSummary:
  """TreeSummary from a Generation's per-row counters (`Generation.stats`) and the tokens
  each row emitted through verification cycles."""
  s = {k: np.asarray(v, np.int64) for k, v in stats.items()}
  need = ("cycles", "verified", "accepted", "hist", "depth_tried", "depth_accepted",
          "rank_tried", "rank_accepted")
  missing = [k for k in need if k not in s]
  if missing:
    raise ValueError(f"stats lacks {missing}: pass Generation.stats of a speculative run")
  cycles = int(s["cycles"].sum())
  verified = int(s["verified"].sum())
  acc = int(s["accepted"].sum())
  em = int(np.asarray(emitted, np.int64).sum())

  def ratio(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return tuple(float(x / y) if y > 0 else float("nan") for x, y in zip(a, b))

  dt, da = s["depth_tried"].sum(0), s["depth_accepted"].sum(0)
  rt, ra = s["rank_tried"].sum(0), s["rank_accepted"].sum(0)
  nan = float("nan")
  return TreeSummary(
      cycles=cycles, verified=verified, accepted=acc, emitted=em,
      tau=em / cycles if cycles else nan, utilisation=acc / verified if verified else nan,
      mean_accepted=acc / cycles if cycles else nan,
      depth_tried=tuple(int(x) for x in dt), depth_accepted=tuple(int(x) for x in da),
      depth_acceptance=ratio(da, dt), depth_reach=ratio(da, np.full(da.shape, cycles)),
      rank_tried=tuple(int(x) for x in rt), rank_accepted=tuple(int(x) for x in ra),
      rank_acceptance=ratio(ra, rt),
      rank_probs=tuple(float(x) for x in rank_probs_from_counts(rt, ra)),
      histogram=tuple(int(x) for x in s["hist"].sum(0)))


# ----------------------------------------------------------------------------- repetition loops
#
# A weak model at T = 0 falls into loops ("S_S_S_S…") that any drafter predicts, inflating α,
# τ and speedups; these measure how much of an output is such a loop, so reports can say so.

MAX_LOOP_PERIOD = 8


def loop_flags(tokens: Any, max_period: int = MAX_LOOP_PERIOD, repeats: int = 3) -> np.ndarray:
  """bool [n]: token i continues a loop when, for some period p <= max_period, the `repeats`
  * p tokens ending at i are one p-gram repeated `repeats` times (x[j] = x[j - p] for the last
  (repeats - 1) * p positions up to i)."""
  x = np.asarray(tokens, np.int64).reshape(-1)
  n = len(x)
  flags = np.zeros(n, bool)
  for p in range(1, max_period + 1):
    if n <= p:
      break
    same = np.zeros(n, bool)
    same[p:] = x[p:] == x[:-p]
    need = (repeats - 1) * p  # consecutive matches ending at i
    run = np.zeros(n, np.int64)
    for i in range(p, n):  # run length of consecutive matches ending at i
      run[i] = run[i - 1] + 1 if same[i] else 0
    flags |= run >= need
  return flags


def loop_fraction(rows: Any, max_period: int = MAX_LOOP_PERIOD) -> float:
  """The share of tokens, over all `rows` (sequences of emitted ids), that continue a repeated
  n-gram cycle of period <= max_period repeated >= 3 times (`loop_flags`)."""
  total = hits = 0
  for row in rows:
    f = loop_flags(row, max_period)
    total, hits = total + len(f), hits + int(f.sum())
  return hits / total if total else 0.0


def ends_in_loop(tokens: Any, window: int = 32, max_period: int = MAX_LOOP_PERIOD) -> bool:
  """Whether the last `window` tokens are periodic with some period <= max_period (a repeated
  n-gram covering them): an output that ended in a loop."""
  x = np.asarray(tokens, np.int64).reshape(-1)
  if len(x) < window:
    return False
  tail = x[-window:]
  return any(bool(np.all(tail[p:] == tail[:-p])) for p in range(1, max_period + 1))
