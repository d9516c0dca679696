"""Closed forms for chain and tree speculation, and a Monte Carlo check of them.

Conventions (docs/cost_model.md and docs/conventions.md):
- α: probability that a drafted token is accepted given that every earlier draft of the
  cycle was accepted (independent Bernoulli trials in the basic model).
- τ: tokens emitted per target verification, *including* the target's own token (the
  correction after a rejection, or the bonus token after k accepts). τ = 1 means no gain.
- c: cost of one drafted token, in target decode steps. A cycle costs 1 + k·c target steps
  while the step is memory-bound.

    E[τ](α, k)       = Σ_{i=0..k} α^i = (1 − α^(k+1)) / (1 − α)
    speedup(α, k, c) = E[τ] / (1 + k·c)

Everything here is plain numpy (no JAX), so the analytic model imports in milliseconds.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "expected_tokens", "speedup", "optimal_k", "speedup_table", "alpha_sample_size",
    "effective_sample_size", "sibling_ranks", "node_depths", "tree_node_probs",
    "tree_expected_tokens", "chain_expected_tokens", "bursty_expected_tokens",
    "SimulationResult", "simulate_chain", "simulate_tree", "MAX_K", "MAX_TABLE_CELLS",
    "MAX_DRAWS", "MIN_HALF_WIDTH", "check_size", "chain_draws",
]

# ----------------------------------------------------------------------------- size limits
# Work sizes are refused before anything is allocated, naming the value and the limit: the
# closed forms and the Monte Carlo below allocate float64 arrays of these sizes.

MAX_K = 1_000_000  # chain lengths searched or priced: a few float64 arrays of k (8 MB each)
MAX_TABLE_CELLS = 10_000_000  # speedup-table (α × k) entries: 80 MB of float64
# Monte Carlo: uniforms drawn by one simulation (chains: cycles × k, held at once as
# [cycles, k] draws, accept flags and run counts, ~17 B each; trees: samples × depth, with
# ~60 B per sample live). 10^7 draws: at most ~0.6 GB and seconds, with a standard error of
# τ already below 10^-3.
MAX_DRAWS = 10_000_000
# alpha_sample_size: n ~ z²/(4h²) drafted tokens; at h = 1e-9 that is ~10^18 (z = 1.96),
# beyond it h² underflows and the Wilson search overflows floats.
MIN_HALF_WIDTH = 1e-9


def chain_draws(cycles: int, k: int, rho: float = 0.0, streams: int = 1000) -> int:
  """Uniforms `simulate_chain` draws (its MAX_DRAWS check): cycles × k independent, or
  streams × (cycles per stream + 20 burn-in cycles) × (k + 1) for bursty acceptance; a k of
  0 counts as 1 (the per-cycle arrays remain)."""
  if rho == 0.0:
    return cycles * max(k, 1)
  return streams * (20 + max(cycles // streams, 2)) * (k + 1)


def check_size(name: str, value: int, limit: int, what: str) -> int:
  """`value` if it is at most `limit`, else ValueError naming both and what they size."""
  if value > limit:
    raise ValueError(f"{name} = {value:,} exceeds the limit of {limit:,} ({what})")
  return value


# ----------------------------------------------------------------------------- validation


def _finite_array(name: str, value: Any) -> np.ndarray:
  try:
    arr = np.asarray(value, dtype=np.float64)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be a number, got {value!r}") from None
  if not np.all(np.isfinite(arr)):
    raise ValueError(f"{name} must be finite, got {value!r}")
  return arr


def _check_unit(name: str, value: Any) -> np.ndarray:
  """A probability: finite and in [0, 1]."""
  arr = _finite_array(name, value)
  if np.any((arr < 0) | (arr > 1)):
    raise ValueError(f"{name} must be in [0, 1], got {value!r}")
  return arr


def _check_nonneg(name: str, value: Any) -> np.ndarray:
  arr = _finite_array(name, value)
  if np.any(arr < 0):
    raise ValueError(f"{name} must be >= 0, got {value!r}")
  return arr


def _check_int(name: str, value: Any, minimum: int) -> np.ndarray:
  """An integer count (ints or integer-valued floats) >= minimum."""
  if isinstance(value, bool) or (isinstance(value, np.ndarray) and value.dtype == bool):
    raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
  arr = _finite_array(name, value)
  if np.any(arr != np.round(arr)) or np.any(arr < minimum):
    raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
  return arr.astype(np.int64)


def _check_rho(name: str, value: Any) -> float:
  rho = float(_finite_array(name, value))
  if not -1.0 < rho < 1.0:
    raise ValueError(f"{name} must be in (-1, 1), got {value!r}")
  return rho


def _out(arr: np.ndarray) -> float | np.ndarray:
  """A Python float for scalar results, the array otherwise."""
  return float(arr) if arr.ndim == 0 else arr


# ----------------------------------------------------------------------------- chains


def expected_tokens(alpha: Any, k: Any) -> float | np.ndarray:
  """E[τ] = Σ_{i=0..k} α^i = (1 − α^(k+1)) / (1 − α): tokens per verification, bonus included.

  Limits: α → 0 gives 1, α = 1 gives k + 1, k → ∞ gives 1/(1 − α). Broadcasts over arrays.
  Computed as −expm1((k+1)·ln α)/(1 − α), accurate right up to α = 1.
  """
  a = _check_unit("alpha", alpha)
  kk = _check_int("k", k, 0).astype(np.float64)
  with np.errstate(divide="ignore", invalid="ignore"):
    closed = -np.expm1((kk + 1.0) * np.log(a)) / (1.0 - a)
  return _out(np.where(a >= 1.0, kk + 1.0, closed))


def speedup(alpha: Any, k: Any, c: Any) -> float | np.ndarray:
  """Memory-bound speedup E[τ] / (1 + k·c); k = 0 (no speculation) gives exactly 1."""
  cc = _check_nonneg("c", c)
  kk = _check_int("k", k, 0)
  return _out(np.asarray(expected_tokens(alpha, kk)) / (1.0 + kk * cc))


def optimal_k(alpha: float, c: float, k_max: int = 16) -> tuple[int, float]:
  """The k in 1..k_max with the highest speedup (smallest k on ties), and that speedup.

  Every k in the range is evaluated; nothing assumes a unimodal curve. The speedup can be
  below 1 (α = 0, for instance): use `roofline.best_k` for a search that may answer k = 0.
  """
  a = float(_check_unit("alpha", alpha))
  cc = float(_check_nonneg("c", c))
  km = check_size("k_max", int(_check_int("k_max", k_max, 1)), MAX_K,
                  "k = 1..k_max are all evaluated")
  s = np.asarray(speedup(a, np.arange(1, km + 1), cc))
  i = int(np.argmax(s))  # first maximum: the smallest k among ties
  return i + 1, float(s[i])


def speedup_table(alphas: Sequence[float], c: float, k_max: int) -> np.ndarray:
  """speedup[i, j] for alphas[i] and k = j + 1, j < k_max: the lecture's α × k table."""
  a = _check_unit("alphas", alphas).reshape(-1, 1)
  km = check_size("k_max", int(_check_int("k_max", k_max, 1)), MAX_K, "columns k = 1..k_max")
  check_size("len(alphas) × k_max", a.size * km, MAX_TABLE_CELLS, "table entries")
  kk = np.arange(1, km + 1).reshape(1, -1)
  return np.asarray(speedup(a, kk, c))


# ----------------------------------------------------------------------------- measuring α


def effective_sample_size(n: Any, rho: float = 0.0) -> float:
  """n_eff = n (1 − ρ) / (1 + ρ): Bernoulli trials with lag-1 autocorrelation ρ (AR(1)-like).

  Positively correlated acceptance (bursts) carries less information per drafted token.
  """
  nn = float(_check_nonneg("n", n))
  r = _check_rho("rho", rho)
  return nn * (1.0 - r) / (1.0 + r)


def _z(confidence: float) -> float:
  conf = float(_finite_array("confidence", confidence))
  if not 0.0 < conf < 1.0:
    raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
  return statistics.NormalDist().inv_cdf(0.5 + conf / 2.0)


def alpha_sample_size(alpha: float, half_width: float, confidence: float = 0.95,
                      rho: float = 0.0, method: str = "wald") -> int:
  """Drafted tokens needed to estimate α to ± half_width at the given confidence.

  - "wald": n_eff = z² α(1 − α) / h² (the textbook binomial interval; 0 at α ∈ {0, 1}).
  - "wilson": the smallest n_eff whose Wilson score interval at p̂ = α has half-width ≤ h
    (stays positive at α ∈ {0, 1}).
  Autocorrelated acceptance: the raw count is n = n_eff (1 + ρ) / (1 − ρ), the inverse of
  `effective_sample_size`. ρ is the lag-1 autocorrelation of the accept indicators.
  """
  a = float(_check_unit("alpha", alpha))
  h = float(_finite_array("half_width", half_width))
  if not MIN_HALF_WIDTH <= h <= 0.5:
    raise ValueError(f"half_width must be in [{MIN_HALF_WIDTH:g}, 0.5] (narrower needs over "
                     f"10^17 drafted tokens and overflows floats), got {half_width!r}")
  z = _z(confidence)
  r = _check_rho("rho", rho)
  if method == "wald":
    n_eff = z * z * a * (1.0 - a) / (h * h)
  elif method == "wilson":
    def wilson_half(n: float) -> float:
      return z / (1.0 + z * z / n) * math.sqrt(a * (1.0 - a) / n + z * z / (4.0 * n * n))
    lo, hi = 1, 2
    while wilson_half(hi) > h:
      lo, hi = hi, hi * 2
    while lo < hi:  # smallest n with half-width <= h (the half-width falls with n)
      mid = (lo + hi) // 2
      if wilson_half(mid) <= h:
        hi = mid
      else:
        lo = mid + 1
    n_eff = float(lo)
  else:
    raise ValueError(f"method must be 'wald' or 'wilson', got {method!r}")
  # Round before ceil so that 384.00000000001 does not become 385.
  return int(math.ceil(round(n_eff * (1.0 + r) / (1.0 - r), 9)))


# ----------------------------------------------------------------------------- trees


def _check_parents(parents: Sequence[int]) -> np.ndarray:
  p = np.asarray(parents)
  if p.ndim != 1 or p.size == 0 or not np.issubdtype(p.dtype, np.integer):
    raise ValueError(f"parents must be a non-empty 1-D sequence of ints, got {parents!r}")
  idx = np.arange(p.size)
  if np.any(p < -1) or np.any(p >= idx):
    raise ValueError("parents must be in topological order: -1 <= parents[i] < i, "
                     f"got {parents!r}")
  return p.astype(np.int64)


def sibling_ranks(parents: Sequence[int]) -> np.ndarray:
  """rank[i] = how many earlier nodes share node i's parent (0 = first candidate)."""
  p = _check_parents(parents)
  order = np.argsort(p, kind="stable")  # grouped by parent, index order inside a group
  sorted_p = p[order]
  start = np.r_[0, np.flatnonzero(sorted_p[1:] != sorted_p[:-1]) + 1]
  group_start = np.repeat(start, np.diff(np.r_[start, p.size]))
  ranks = np.empty_like(p)
  ranks[order] = np.arange(p.size) - group_start
  return ranks


def node_depths(parents: Sequence[int]) -> np.ndarray:
  """depth[i] = 1 for a child of the (implicit) root, parent's depth + 1 otherwise."""
  p = _check_parents(parents)
  depth = np.zeros(p.size, dtype=np.int64)
  for i, q in enumerate(p.tolist()):  # one pass: parents come first
    depth[i] = 1 if q < 0 else depth[q] + 1
  return depth


def tree_node_probs(parents: Sequence[int], rank_probs: Any) -> np.ndarray:
  """P(node i is on the accepted path) under Sequoia's positional acceptance model.

  rank_probs[r] (shape [R]) or rank_probs[d-1, r] (shape [D, R], per depth) is the
  probability that, once a node is accepted, its r-th ranked child (rank from
  `sibling_ranks`) is the one accepted next. Siblings are tried in rank order and at most
  one is accepted, so the events are disjoint and Σ_r p_r <= 1 (the rest is "no child
  accepted": the target's correction token ends the cycle). A node's probability is the
  product of p over the ranks along its root path. With R = 1 per depth this is the
  per-depth chain model, and with p = α it is the i.i.d. chain.
  """
  p = _check_parents(parents)
  probs = _check_unit("rank_probs", rank_probs)
  if probs.ndim not in (1, 2) or probs.shape[-1] == 0:
    raise ValueError(f"rank_probs must have shape [R] or [D, R], got shape {probs.shape}")
  if np.any(probs.sum(axis=-1) > 1.0 + 1e-9):
    raise ValueError("rank_probs must sum to at most 1 over ranks (at most one sibling is "
                     f"accepted), got sums {probs.sum(axis=-1)}")
  ranks = sibling_ranks(p)
  depth = node_depths(p)
  if ranks.max() >= probs.shape[-1]:
    raise ValueError(f"the tree has {ranks.max() + 1} siblings under one node but rank_probs "
                     f"gives only {probs.shape[-1]} ranks")
  if probs.ndim == 1:
    edge = probs[ranks]
  else:
    if depth.max() > probs.shape[0]:
      raise ValueError(f"the tree is {depth.max()} deep but rank_probs gives only "
                       f"{probs.shape[0]} depths")
    edge = probs[depth - 1, ranks]
  node = np.empty(p.size)
  for i, q in enumerate(p.tolist()):  # O(N): a parent's probability is known before its child
    node[i] = edge[i] if q < 0 else node[q] * edge[i]
  return node


def tree_expected_tokens(parents: Sequence[int], rank_probs: Any) -> float:
  """E[τ] for one tree verification = 1 + Σ_nodes P(node on the accepted path).

  parents: node i's parent index (-1 = child of the last committed token), topological
  order, as in `TreeSpec`. See `tree_node_probs` for rank_probs. The 1 is the target's
  token after the accepted path (correction or bonus), as in `expected_tokens`.
  """
  return 1.0 + float(tree_node_probs(parents, rank_probs).sum())


def chain_expected_tokens(depth_probs: Any) -> float:
  """Per-depth chain model: E[τ] = 1 + Σ_d Π_{j<=d} a_j, a_j = P(accept depth j | j−1 accepted)."""
  a = _check_unit("depth_probs", depth_probs)
  if a.ndim != 1:
    raise ValueError(f"depth_probs must be 1-D, got shape {a.shape}")
  return 1.0 + float(np.cumprod(a).sum())


# ----------------------------------------------------------------------------- bursty acceptance


def _markov(alpha: float, rho: float) -> tuple[float, float]:
  """The two-state accept process with mean α and lag-1 autocorrelation ρ >= 0.

  P(accept | previous accepted) = α + ρ(1 − α), P(accept | previous rejected) = α(1 − ρ).
  Its stationary mean is α; ρ = 0 is the independent model.
  """
  return alpha + rho * (1.0 - alpha), alpha * (1.0 - rho)


def _check_burst(rho: Any) -> float:
  r = float(_finite_array("rho", rho))
  if not 0.0 <= r < 1.0:
    raise ValueError(f"rho must be in [0, 1), got {rho!r}")
  return r


def bursty_expected_tokens(alpha: float, k: int, rho: float) -> float:
  """Long-run tokens per verification when acceptance is a two-state Markov process.

  The latent accept indicator X_t runs over the response's positions with mean α and lag-1
  autocorrelation ρ (`_markov`). A cycle drafts the next k positions and accepts the prefix
  of X = 1; the target's token takes the next position (X = 0 there after a rejection; a
  fresh draw after k accepts), and the next cycle starts after it. The state carried from
  one cycle to the next is a two-state Markov chain; τ is averaged over its stationary law.
  ρ = 0 recovers `expected_tokens(α, k)`; ρ > 0 lowers τ at the same α, because a rejection
  predicts more rejections (the next cycle starts in a bad spell).
  """
  a = float(_check_unit("alpha", alpha))
  kk = check_size("k", int(_check_int("k", k, 0)), MAX_K, "chain length")
  r = _check_burst(rho)
  p11, p01 = _markov(a, r)
  tau, to_one = np.zeros(2), np.zeros(2)  # per previous state s: E[τ | s], P(next s = 1 | s)
  for s in (0, 1):
    first = p11 if s else p01
    run = np.r_[1.0, first * p11 ** np.arange(kk)]  # run[j] = P(first j drafts accepted)
    tau[s] = run.sum()  # τ = 1 + #accepted; E = Σ_{j=0..k} P(>= j accepted)
    to_one[s] = run[kk] * p11  # only a full run ends on a fresh draw, X ~ P(. | 1)
  # Stationary law of the carried state: π1 = π0·P(0→1) + π1·P(1→1).
  pi1 = to_one[0] / (1.0 - to_one[1] + to_one[0]) if (1.0 - to_one[1] + to_one[0]) > 0 else 1.0
  return float((1.0 - pi1) * tau[0] + pi1 * tau[1])


@dataclasses.dataclass(frozen=True)
class SimulationResult:
  """Monte Carlo estimate of τ with its standard error, and the measured acceptance rate."""

  tau: float  # mean tokens per verification (bonus included)
  tau_se: float  # standard error of tau (over independent streams/cycles)
  alpha_hat: float  # accepted drafts / drafted tokens, as metrics.py would measure it
  cycles: int

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def simulate_chain(alpha: float, k: int, *, cycles: int = 100_000, seed: int = 0,
                   rho: float = 0.0, streams: int = 1000) -> SimulationResult:
  """Simulate chain speculation and measure τ.

  rho = 0: every draft accepted independently with probability α (`cycles` i.i.d. cycles).
  rho > 0: the bursty process of `bursty_expected_tokens`, simulated as `streams`
  independent responses of cycles // streams cycles each (after a short burn-in); the
  standard error is taken over per-stream means, which are independent.
  """
  a = float(_check_unit("alpha", alpha))
  kk = int(_check_int("k", k, 0))
  n = int(_check_int("cycles", cycles, 1))
  r = _check_burst(rho)
  rng = np.random.default_rng(int(_check_int("seed", seed, 0)))
  if r == 0.0:
    check_size("cycles × k", chain_draws(n, kk), MAX_DRAWS, "uniforms one simulation draws")
    accept_NK = rng.random((n, kk)) < a
    n_acc_N = np.cumprod(accept_NK, axis=1).sum(axis=1)
    tau_N = 1.0 + n_acc_N
    drafted = int(np.minimum(n_acc_N + 1, kk).sum())  # tested: up to the first rejection
    alpha_hat = float(n_acc_N.sum() / drafted) if drafted else float("nan")
    return SimulationResult(float(tau_N.mean()), float(tau_N.std(ddof=1) / math.sqrt(n)),
                            alpha_hat, n)
  s = int(_check_int("streams", streams, 2))
  per_stream = max(n // s, 2)
  burn = 20
  check_size("streams × (cycles per stream + 20 burn-in) × (k + 1)",
             chain_draws(n, kk, r, s), MAX_DRAWS, "uniforms one simulation draws")
  p11, p01 = _markov(a, r)
  state_S = rng.random(s) < a  # latent state of the previous position, stationary start
  tau_sum_S = np.zeros(s)
  acc_total = drafted = 0
  for cycle in range(burn + per_stream):
    alive_S = np.ones(s, dtype=bool)  # every draft of this cycle accepted so far
    n_acc_S = np.zeros(s, dtype=np.int64)
    for _ in range(kk):
      drawn_S = rng.random(s) < np.where(state_S, p11, p01)
      state_S = np.where(alive_S, drawn_S, state_S)  # the chain stops at a rejection (X = 0)
      alive_S &= state_S
      n_acc_S += alive_S
    # Carried state: 0 at a rejected position (the correction sits there); after k
    # accepts the bonus token's position gets a fresh draw from P(. | accepted).
    state_S = np.where(alive_S, rng.random(s) < p11, False)
    if cycle >= burn:
      tau_sum_S += 1.0 + n_acc_S
      acc_total += int(n_acc_S.sum())
      drafted += int(np.minimum(n_acc_S + 1, kk).sum())
  tau_S = tau_sum_S / per_stream
  alpha_hat = acc_total / drafted if drafted else float("nan")
  return SimulationResult(float(tau_S.mean()), float(tau_S.std(ddof=1) / math.sqrt(s)),
                          float(alpha_hat), s * per_stream)


def simulate_tree(parents: Sequence[int], rank_probs: Any, *, samples: int = 100_000,
                  seed: int = 0) -> SimulationResult:
  """Simulate Sequoia's acceptance process on a tree: from each accepted node pick child
  rank r with probability p_r (or stop with 1 − Σ p_r); stop when that rank is not in the
  tree. τ = accepted path length + 1. Checks `tree_expected_tokens`.
  """
  p = _check_parents(parents)
  tree_node_probs(p, rank_probs)  # validates rank_probs against the tree
  probs = np.atleast_2d(_check_unit("rank_probs", rank_probs))
  n = int(_check_int("samples", samples, 2))
  ranks, depth = sibling_ranks(p), node_depths(p)
  check_size("samples × depth", n * int(depth.max()), MAX_DRAWS,
             f"uniforms one simulation draws; the tree is {int(depth.max())} deep")
  rng = np.random.default_rng(int(_check_int("seed", seed, 0)))
  max_depth, max_rank = int(depth.max()), probs.shape[-1]
  # child[v + 1, r] = index of the rank-r child of node v (v = -1: the root), or -1.
  child = np.full((p.size + 1, max_rank), -1, dtype=np.int64)
  child[p + 1, ranks] = np.arange(p.size)
  at_N = np.full(n, -1, dtype=np.int64)  # current accepted node (-1 = root)
  live_N = np.ones(n, dtype=bool)
  tau_N = np.ones(n)
  for d in range(max_depth):
    row = probs[min(d, probs.shape[0] - 1)]  # per-depth rows; a 1-D input repeats
    cdf = np.cumsum(row)
    pick_N = np.searchsorted(cdf, rng.random(n), side="right")  # == max_rank: no child
    nxt_N = np.where(pick_N < max_rank, child[at_N + 1, np.minimum(pick_N, max_rank - 1)], -1)
    live_N &= nxt_N >= 0
    at_N = np.where(live_N, nxt_N, at_N)
    tau_N += live_N
  return SimulationResult(float(tau_N.mean()), float(tau_N.std(ddof=1) / math.sqrt(n)),
                          float("nan"), n)
