"""The adaptive policy's menu and its prices, validated: what `policy.AdaptivePolicy` is built
from, on the host (numpy).

A menu is a tuple of static entries (`menu`: None = a plain step, else a `trees.TreeSpec`;
`entry_name` labels them). `policy_fields` validates everything a policy holds and returns its
arrays; `calibrated_prices` prices each entry from calibrations (`calibration.LoopCosts`:
the fitted cycle or the shape's own measurement, a k = 0 entry a plain step plus the
drafter's catch-up share) and takes the priors α₀ and α₀_d from what the calibrations
measured; `model_prices` prices them from the uncalibrated model cycle(N, D) =
1 + fixed + v·N + c·D in target steps. The estimate and the choice that run inside the
compiled loop stay in `policy.py` (its module doc: why each default).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from specjax.verify import trees
from specjax.verify.trees import TreeSpec

DEFAULT_CHAINS = (0, 1, 2, 4, 6)
OBJECTIVES = ("batch", "tokens")  # AdaptivePolicy.objective (module doc)
CYCLES = ("fit", "measured")  # AdaptivePolicy.from_costs: where an entry's cycle cost comes from
# The prior's weight w in trials (module doc). With w = 1 one rejected first draft took a
# row's estimate from α₀ ≈ 0.8 to ≈ 0.4, often pricing speculation below plain decoding
# (a run of up to P plain steps) or a shorter chain for the next cycles; with w = 8 the
# same side-by-side sweep (batch 1-8, T 0 and 1, code and prose, the embedded pair) came
# closer to the best fixed shape at 12 of 16 points (median 0.92 vs 0.88; BUILD_NOTES.md).
DEFAULT_PRIOR_WEIGHT = 8.0
# The estimate's memory λ per cycle (module doc). Evidence weighted by λ^age sums to at most
# 1 / (1 − λ) trials, so the prior keeps a share of at least w ÷ (w + 1 / (1 − λ)): 44% at
# λ = 0.9 and w = 8, which held a row whose second draft never matched (a period-2 loop at
# T = 0) at a second-draft rate of 0.30 instead of ~0 and kept it on chains of 6 where a
# chain of 1 measured best (batch 2, T = 0, code: adaptive at 0.75-0.76 of the best fixed
# shape in two runs). At λ = 0.97 the share is 19%: 0.82 there, the other seven points
# tried unchanged within this machine's noise (BUILD_NOTES.md).
DEFAULT_DECAY = 0.97


def menu(entries: Sequence[Any] = DEFAULT_CHAINS) -> tuple[TreeSpec | None, ...]:
  """A validated menu: ints k >= 0 (0 = plain step, k = trees.chain(k)) and static TreeSpecs.

  Raises ValueError for an empty menu, a negative k, a dynamic tree or anything else."""
  if isinstance(entries, (str, bytes)) or not isinstance(entries, (Sequence, np.ndarray)):
    raise ValueError(f"menu must be a sequence of chain lengths k >= 0 and trees.TreeSpec "
                     f"shapes, got {entries!r}")
  if len(entries) == 0:
    raise ValueError("menu must hold at least one shape (e.g. (0, 1, 2, 4, 6)), got an "
                     "empty menu")
  out: list[TreeSpec | None] = []
  for i, e in enumerate(entries):
    if e is None:
      out.append(None)
    elif isinstance(e, (int, np.integer)) and not isinstance(e, bool):
      if e < 0:
        raise ValueError(f"menu[{i}] must be a chain length k >= 0 (0 = plain step), got {e}")
      out.append(None if e == 0 else trees.chain(int(e)))
    elif isinstance(e, TreeSpec):
      out.append(e)
    else:
      raise ValueError(f"menu[{i}] must be an int k >= 0 or a static trees.TreeSpec (dynamic "
                       f"trees are not menu shapes), got {e!r}")
  keys = [entry_name(e) for e in out]
  if len(set(keys)) != len(keys):
    raise ValueError(f"menu has duplicate shapes: {keys}")
  return tuple(out)


def entry_name(entry: TreeSpec | None) -> str:
  """'k=0' (plain), 'k=K' (a chain) or 'tree(N nodes, depth D)': the policy label."""
  if entry is None:
    return "k=0"
  if entry.is_chain:
    return f"k={entry.size}"
  return f"tree{entry.parents}"


def check_float(name: str, value, lo: float, hi: float = math.inf,
                lo_open: bool = False) -> float:
  """value as a float in [lo, hi] ((lo, hi] when lo_open); ValueError naming `name`."""
  ok = isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)
  if ok:
    value = float(value)
    ok = math.isfinite(value) and (value > lo if lo_open else value >= lo) and value <= hi
  if not ok:
    rng = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g}]"
    raise ValueError(f"{name} must be a finite number in {rng}, got {value!r}")
  return value


def lazy_share(lazy_slots) -> int:
  """P >= 1 plain steps per catch-up pass (0 = eager catch-up: one pass per step)."""
  if isinstance(lazy_slots, bool) or not isinstance(lazy_slots, (int, np.integer)) or \
      lazy_slots < 0:
    raise ValueError(f"lazy_slots must be an int >= 0 (0: the drafter catches up every plain "
                     f"step; P > 0: once every P plain steps), got {lazy_slots!r}")
  return max(int(lazy_slots), 1)


def check_threshold(threshold) -> float:
  """The draft-stopping threshold: a finite number in [0, 1] (0 = never stop)."""
  return check_float("threshold", threshold, 0.0, 1.0)


def prior_by_depth(prior, depths: int) -> np.ndarray:
  """The depth prior as [depths] probabilities: a number for every depth, or a list (its last
  value repeated past its end, cut at `depths`)."""
  if isinstance(prior, (int, float, np.floating, np.integer)) and not isinstance(prior, bool):
    values = np.asarray([float(prior)])
  else:
    try:
      values = np.asarray(prior, np.float64).ravel()
    except (TypeError, ValueError):
      values = np.asarray([np.nan])
  if values.size == 0 or np.any(~np.isfinite(values)) or np.any(values < 0) or np.any(
      values > 1):
    raise ValueError(f"prior_depth must be probabilities in [0, 1] (the first candidate's "
                     f"acceptance at depths 1, 2, ...), got {prior!r}")
  out = np.full(depths, values[-1])
  out[:min(values.size, depths)] = values[:depths]
  return out


def depth_profile(value) -> np.ndarray | None:
  """A calibration's meta["depth_alpha"] when usable (`prior_by_depth`'s rules), else None."""
  try:
    return prior_by_depth(value, max(1, int(np.size(value))))
  except ValueError:
    return None


def entry_seconds(costs, entry: TreeSpec, cycles: str) -> float:
  """Seconds per cycle of a speculative entry from a calibration (`from_costs`)."""
  if cycles == "fit" and costs.fitted is not None:
    return costs.fitted.seconds(entry.size, entry.max_depth)
  return costs.cycle_seconds(entry)



def policy_fields(entries: Sequence[Any], seconds, batches: Sequence[int] = (1,), *,
                  plain=None, decay: float = DEFAULT_DECAY, prior_alpha: float = 0.5,
                  prior_depth: Sequence[float] | None = None,
                  prior_weight: float = DEFAULT_PRIOR_WEIGHT, threshold: float = 0.0,
                  forced: Sequence[int] | None = None, objective: str = "batch") -> dict:
  """The validated fields of an `AdaptivePolicy` (`AdaptivePolicy.create`'s arguments, its
  doc): ValueError naming the argument, the value and what is allowed."""
  m = menu(entries)
  b = np.asarray(batches, np.float64)
  if b.ndim != 1 or b.size == 0 or np.any(~np.isfinite(b)) or np.any(b < 1) or np.any(
      np.diff(b) <= 0):
    raise ValueError(f"batches must be increasing batch sizes >= 1, got {batches!r}")
  s = np.asarray(seconds, np.float64)
  if s.ndim == 1:
    s = s[None]
  if s.shape != (b.size, len(m)) or np.any(~np.isfinite(s)) or np.any(s <= 0):
    raise ValueError(f"seconds must be finite cycle costs > 0 of shape [{b.size} batches, "
                     f"{len(m)} menu entries], got {np.asarray(seconds).tolist()!r}")
  if plain is None:
    idx = [i for i, e in enumerate(m) if e is None]
    pl = s[:, idx[0]] if idx else s.min(axis=1)
  else:
    pl = np.asarray(plain, np.float64).reshape(-1)
    if pl.shape != (b.size,) or np.any(~np.isfinite(pl)) or np.any(pl <= 0):
      raise ValueError(f"plain must be finite step costs > 0, one per batch ({b.size}), got "
                       f"{plain!r}")
  check_float("decay", decay, 0.0, 1.0)
  if decay >= 1.0:
    raise ValueError(f"decay must be in [0, 1), got {decay!r}")
  check_float("prior_alpha", prior_alpha, 0.0, 1.0)
  depths = max([1] + [e.max_depth for e in m if e is not None])
  pd = prior_by_depth(prior_alpha if prior_depth is None else prior_depth, depths)
  check_float("prior_weight", prior_weight, 0.0, lo_open=True)
  check_threshold(threshold)
  if objective not in OBJECTIVES:
    raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
  if forced is None:
    f = np.asarray([-1], np.int32)
  else:
    f = np.asarray(forced)
    if f.ndim != 1 or f.size == 0 or not np.issubdtype(f.dtype, np.integer) or np.any(
        f < -1) or np.any(f >= len(m)):
      raise ValueError(f"forced must be a non-empty list of menu indices in [0, {len(m)}) or "
                       f"-1 (free), got {forced!r}")
  return dict(menu=m, batches=jnp.asarray(b, jnp.float32), seconds=jnp.asarray(s, jnp.float32),
              plain=jnp.asarray(pl, jnp.float32), decay=jnp.asarray(decay, jnp.float32),
              prior_alpha=jnp.asarray(prior_alpha, jnp.float32),
              prior_depth=jnp.asarray(pd, jnp.float32),
              prior_weight=jnp.asarray(prior_weight, jnp.float32),
              threshold=jnp.asarray(threshold, jnp.float32), forced=jnp.asarray(f, jnp.int32),
              batch_pace=jnp.asarray(objective == "batch", jnp.float32),
              stopping=bool(threshold > 0))


def calibrated_prices(entries: Sequence[Any], costs: Mapping[int, Any] | Any, *,
                      lazy_slots: int = 0, cycles: str = "fit", **kwargs) -> dict:
  """`policy_fields` arguments from calibrations (`AdaptivePolicy.from_costs`, its doc): one
  `calibration.LoopCosts` or {batch: LoopCosts}; each entry's seconds per cycle at each
  calibrated batch, a plain step's, and, unless given in `kwargs`, the priors α₀ (the mean
  first-draft acceptance the calibrations measured) and α₀_d (their per-depth profile)."""
  share = 1.0 / lazy_share(lazy_slots)
  if cycles not in CYCLES:
    raise ValueError(f"cycles must be one of {CYCLES}, got {cycles!r}")
  m = menu(entries)
  table = costs if isinstance(costs, Mapping) else {int(costs.meta.get("batch", 1)): costs}
  if not table:
    raise ValueError("costs must hold at least one calibration, got none")
  measured = [c.meta.get("alpha") for c in table.values()]
  measured = [float(x) for x in measured if isinstance(x, (int, float)) and 0 <= x <= 1]
  if "prior_alpha" not in kwargs:
    profiles = [depth_profile(c.meta.get("depth_alpha")) for c in table.values()]
    profiles = [p for p in profiles if p is not None]
    if profiles and "prior_depth" not in kwargs:
      n = max(len(p) for p in profiles)
      kwargs["prior_depth"] = np.mean([prior_by_depth(p, n) for p in profiles], axis=0).tolist()
    if measured:
      kwargs["prior_alpha"] = sum(measured) / len(measured)
  batches = sorted(table)
  rows, plain = [], []
  for b in batches:
    c = table[b]
    t_draft = c.fitted.t_draft if c.fitted is not None else 0.0
    rows.append([c.t_step + share * t_draft if e is None else entry_seconds(c, e, cycles)
                 for e in m])
    plain.append(c.t_step)
  return dict(entries=m, seconds=rows, batches=batches, plain=plain, **kwargs)


def model_prices(entries: Sequence[Any], *, c: float, v: float = 0.0, fixed: float = 0.0,
                 lazy_slots: int = 0, **kwargs) -> dict:
  """`policy_fields` arguments from the uncalibrated model (`AdaptivePolicy.from_model`):
  cycle(N, D) = 1 + fixed + v·N + c·D target steps, k = 0 costs 1 + c / P."""
  share = 1.0 / lazy_share(lazy_slots)
  check_float("c", c, 0.0)
  check_float("v", v, 0.0)
  check_float("fixed", fixed, 0.0)
  m = menu(entries)
  row = [1.0 + share * c if e is None else 1.0 + fixed + v * e.size + c * e.max_depth for e in m]
  return dict(entries=m, seconds=row, batches=(1,), plain=[1.0], **kwargs)
