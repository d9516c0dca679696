"""Batch break-even: measured speedup vs batch size beside the loop's calibrated prediction
and the roofline's.

`target` (or its older name `models`), `draft` and `prompts` by reference
(experiments/references.py).

One point = (batch, k). The same prompts are decoded with plain `generate` and with chain
speculative decoding of k drafts, alternated within every repeat (`measure.compare`,
decode phase only: each call is also timed with max_new_tokens = 1 and the prefill
subtracted), giving tokens/s of both and the measured speedup. Three predictions beside it,
all at the point's measured α (alpha_trial, the per-tried-token acceptance):

- calibrated (the loop's cost model, `specjax.calibration`, docs/cost_model.md,
  "Calibrated loop costs"; the prediction this experiment is judged by): the compiled
  loops are timed at this batch with the same prompts, budget and cache length as the
  measured runs (chains of `calibration_k` ∪ {k}: one calibration per batch shared by every
  k, cached on disk), giving a cycle of chain(k) in plain target steps, cycle_steps. The
  tokens one loop iteration emits come from each row's measured law of accepted lengths
  (its reach by draft depth, `calibration.row_length_probs`) through
  `calibration.tokens_per_iteration` (a batch runs until its slowest row has emitted its
  budget, so τ_loop falls with the batch; `tau_loop` without a law uses the geometric
  law at α instead):

      predicted_speedup_calibrated = τ_loop ÷ cycle_steps(chain(k)).

- standalone (`predicted_speedup`, kept for comparison): τ_pred / (k·c + v) with
  τ_pred = E[τ](α, k) and the standalone forward costs timed in the same process
  (`measure.step_costs`) at the mean decoding context L = prompt_len + max_new_tokens / 2:
  t1 (a one-token target step), v = t_verify(k + 1) ÷ t1, c = (d(2) + (k − 1)·d(1)) / (k·t1)
  (d(T): a draft forward of T tokens; the first pass of a cycle feeds 2 tokens, the last
  committed one and the root). It misses the loop's own work (acceptance, cache
  bookkeeping, the draft's scan, loop control).
- roofline (`roofline_gain`, the analytic model): `roofline.gain(hw, wl, B, α, k, c,
  draft_cost)` with hw = this machine's `roofline.calibrate()` (streaming bandwidth, matmul
  FLOP/s; once per process) and wl = the target's `Workload.from_model_config` at context L:

      t(B, T) = max((W + B·L·kv) / BW, T·B·F(L) / FLOPS),   gain = τ·t(B, 1) / cycle,
      cycle = t(B, k + 1) + k·c·t(B, 1)                       (draft_cost "full").

  It knows bandwidth and compute only, not the per-step overheads that dominate tiny models
  on a CPU, so its break-even is expected to disagree: the size of the disagreement is a
  finding.

The report (`report`) computes across the finished points: the measured break-even batch
(the smallest batch where the best speedup over k drops below 1, interpolated on log₂
batch; `break_even`), the calibrated one (the same rule on the calibrated predictions),
their ratio and whether they agree within 25% (`agreement`), the roofline's
(`roofline.break_even_batch` per k with that k's pooled α and c; overall the largest over
k), the best measured k per batch beside the calibrated and the roofline's, and a plot of
gain vs batch: roofline curves per k, calibrated predictions and measured points per k. It
also writes the break-evens to batch_breakeven_summary.json.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from typing import Mapping, Sequence

import numpy as np

from specjax.experiments import measure, references
from specjax.calibration import loop_costs as calibration, timing
from specjax.analysis import roofline, theory
from specjax.engine import decoding
from specjax.verify import trees
from specjax.sweeps import report as rep

MAX_BATCH = 4096
MAX_K = 64
MAX_REPEATS = 1000
ROOFLINE_MAX_BATCH = 1e7  # roofline.break_even_batch's search limit
FORWARD_REPEATS = 7  # at least this many timed samples per standalone forward
AGREEMENT = 0.25  # the goal: measured break-even within 25% of the calibrated one
MC_DRAWS = 4_000_000  # cap on batch × tokens × samples of tokens_per_iteration's Monte Carlo


# ----------------------------------------------------------------------------- validation


def validate(params: dict) -> None:
  """Types and ranges of one point's parameters (before any model is loaded)."""
  measure.check_int(params, "batch", 1, 1, MAX_BATCH)
  measure.check_int(params, "k", 4, 1, MAX_K)
  measure.check_int(params, "max_new_tokens", 64, 2, 1 << 16)
  measure.check_int(params, "prompt_len", 64, 8, 1 << 16)
  measure.check_int(params, "repeats", 3, 1, MAX_REPEATS)
  measure.check_int(params, "seed", 0, 0, 2**31 - 1)
  measure.check_number(params, "temperature", 0.0, 0)
  references.check_target(params)
  references.check_draft(params)
  references.check_prompts(params)
  measure.check_choice(params, "draft_cost", "full", roofline.DRAFT_COSTS)
  measure.check_int(params, "calibration_repeats", 3, 1, MAX_REPEATS)
  measure.check_choice(params, "statistic", "median", timing.STATISTICS)
  measure.check_choice(params, "recalibrate", False, (False, True))
  ks = params.get("calibration_k", ())
  if isinstance(ks, (str, bytes)) or not isinstance(ks, (list, tuple)) or not all(
      isinstance(j, int) and not isinstance(j, bool) and 1 <= j <= MAX_K for j in ks):
    raise ValueError(f"calibration_k must be a list of chain lengths (ints in [1, {MAX_K}]), "
                     f"got {ks!r}")


def calibration_ks(k: int, calibration_k=()) -> list[int]:
  """The chains calibrated at a point: calibration_k ∪ {k} (set calibration_k to the swept
  k so that every point of a batch shares one calibration and one cache length)."""
  return sorted(set(calibration_k) | {k})


def memory(params: dict) -> int:
  """Bytes of KV cache one point holds at most: target + draft caches for the plain and the
  speculative call and for the forward timings (4 sets), at the engine's cache length for
  the longest calibrated chain (`calibration_ks`), from the models' preset configs, without
  loading any model. The calibration runs one loop at a time at the same cache length."""
  k_max = max(calibration_ks(params.get("k", 4), params.get("calibration_k", ())))
  n = decoding.cache_len_for(params.get("prompt_len", 64), params.get("max_new_tokens", 64),
                             k_max + 1)
  return 4 * sum(measure.cache_bytes(references.target_ref(params.get("target"),
                                                          params.get("models")),
                                     params.get("batch", 1), n, params.get("draft", "default")))


# ----------------------------------------------------------------------------- one point


def tau_loop(alpha: float, k: int, batch: int, tokens: int, law=None) -> float:
  """Tokens per row per loop iteration of a chain of k at per-trial acceptance α, for a
  batch that runs until each row has emitted `tokens`: `calibration.tokens_per_iteration`
  of the geometric law `calibration.chain_length_probs(α, k)`, or of `law` when given (e.g.
  each row's own, `calibration.row_length_probs`); its Monte Carlo capped at MC_DRAWS
  draws, at least 100 batches."""
  samples = int(min(2000, max(100, MC_DRAWS // (batch * tokens))))
  law = calibration.chain_length_probs(alpha, k) if law is None else law
  return calibration.tokens_per_iteration(law, batch, tokens, samples=samples)


def calibrated_speedup(costs: calibration.LoopCosts, alpha: float, k: int, batch: int,
                       tokens: int, law=None) -> tuple[float, float]:
  """(τ_loop, predicted speedup) of a chain of k from calibrated loop costs: τ_loop ÷
  costs.cycle_steps(chain(k)) (module doc); `law` as in `tau_loop`."""
  tau = tau_loop(alpha, k, batch, tokens, law)
  return tau, costs.predicted_speedup(trees.chain(k), tau)


def point(batch: int = 1, k: int = 4, max_new_tokens: int = 64, prompt_len: int = 64,
          temperature: float = 0.0, repeats: int = 3, models: str | None = None,
          draft_cost: str = "full", seed: int = 0, calibration_k: tuple = (),
          calibration_repeats: int = 3, statistic: str = "median",
          recalibrate: bool = False, target: str | None = None, draft: str = "default",
          prompts: str = "code", chat_template: bool = True) -> dict:
  """Plain vs speculative (chain of k) tokens/s of the decode phase at one batch size, α, τ,
  and the calibrated, standalone and roofline predictions of the speedup (module doc)."""

  validate(dict(batch=batch, k=k, max_new_tokens=max_new_tokens, prompt_len=prompt_len,
                temperature=temperature, repeats=repeats, models=models,
                draft_cost=draft_cost, seed=seed, calibration_k=calibration_k,
                calibration_repeats=calibration_repeats, statistic=statistic,
                recalibrate=recalibrate, target=target, draft=draft, prompts=prompts,
                chat_template=chat_template))
  models = references.target_ref(target, models)
  target, draft, tok, texts = measure.models(models, "float32", draft)
  tree = trees.chain(k)
  work = references.workload(models, tok, texts, prompts, batch, prompt_len,
                             chat_template=chat_template)
  prompt_ids = work.ids
  shapes = [trees.chain(j) for j in calibration_ks(k, calibration_k)]
  cmp = measure.calibrated_compare(target, draft, prompt_ids, shapes, tree=tree,
                                   max_new_tokens=max_new_tokens, repeats=repeats,
                                   calibration_repeats=calibration_repeats,
                                   temperature=temperature, seed=seed,
                                   recalibrate=recalibrate, statistic=statistic)
  costs = cmp.loop_costs
  sc = measure.step_costs(target, draft, batch, tree, cmp.context, cmp.cache_len,
                          max(FORWARD_REPEATS, repeats))
  summary = cmp.spec.summary()
  alpha = summary.alpha_trial
  hw = measure.hardware()
  wl = roofline.Workload.from_model_config(target.config, cmp.context)
  nan = float("nan")
  if math.isfinite(alpha):
    a = min(max(alpha, 0.0), 1.0)
    tau_pred = float(theory.expected_tokens(a, k))
    predicted = tau_pred / sc.cycle
    roof = roofline.gain(hw, wl, batch, a, k, sc.c, draft_cost)
    # Each row's own acceptance: the loop runs until its slowest row is done.
    tau_it, calibrated = calibrated_speedup(costs, a, k, batch, max_new_tokens - 1,
                                            calibration.row_length_probs(cmp.spec.stats, tree))
  else:  # no drafted token was tried (cannot happen with max_new_tokens >= 2)
    tau_pred = predicted = roof = tau_it = calibrated = nan
  return {
      "plain_tok_s": cmp.plain_tok_s, "spec_tok_s": cmp.spec_tok_s, "speedup": cmp.speedup,
      "alpha_trial": alpha, "alpha": summary.alpha, "tau": summary.tau,
      "tau_predicted": tau_pred, "c": sc.c, "verify_cost": sc.v,
      "t_plain_step_ms": 1e3 * sc.t1,
      "predicted_speedup": predicted,
      "roofline_gain": roof,
      "efficiency": cmp.efficiency(predicted),
      "predicted_speedup_calibrated": calibrated,
      "efficiency_calibrated": cmp.efficiency(calibrated),
      "tau_loop_predicted": tau_it, "cycle_steps": costs.cycle_steps(tree),
      "t_step_ms": 1e3 * costs.t_step,
      "loop_iterations": int(np.max(cmp.spec.stats["cycles"])),
      "calibration": {"cycle_steps": {key: sec / costs.t_step
                                      for key, (_, _, sec) in costs.cycles.items()},
                      "cached": bool(costs.meta.get("cached")), "key": costs.meta.get("key")},
      "identical_to_plain": cmp.identical if temperature == 0 else None,
      "context_len": cmp.context, "cache_len": cmp.cache_len,
      "hardware": hw.to_dict(), "workload": wl.to_dict(), **work.row_fields(),
  }


# ----------------------------------------------------------------------------- analysis


@dataclasses.dataclass(frozen=True)
class BreakEven:
  """Where the best speedup over k drops below 1.

  status: "crossed" (batch = the crossing, interpolated), "not reached" (it never drops
  below 1 within the range; batch None) or "below 1 everywhere" (batch None).
  """

  status: str
  batch: float | None = None
  between: tuple[float, float] | None = None  # the measured batches around the crossing
  note: str = ""

  def text(self, upper: float | None = None) -> str:
    if self.status == "crossed":
      out = f"B ≈ {self.batch:.3g}"
      if self.between is not None:
        out += f" (between batch {self.between[0]:g} and {self.between[1]:g})"
    elif self.status == "not reached":
      out = "not reached" + (f" (speedup >= 1 up to batch {upper:g})" if upper else "")
    else:
      out = "below 1 everywhere (speculation never pays)"
    return out + (f"; {self.note}" if self.note else "")


def break_even(best: Mapping[float, float]) -> BreakEven:
  """Measured break-even from {batch: best speedup over k}.

  The smallest batch where the speedup drops from >= 1 to < 1, interpolated linearly on
  log₂ batch between the two measured batches b₀ < b₁ around the drop:

      log₂ B* = log₂ b₀ + (s₀ − 1) / (s₀ − s₁) · (log₂ b₁ − log₂ b₀).

  A speedup of exactly 1 counts as "still pays". If every speedup is below 1 the answer is
  "below 1 everywhere"; if it never drops below 1 after paying, "not reached". Speedups
  below 1 before the first batch that pays (noise at small batch) are named in the note.
  """
  pts = sorted((float(b), float(s)) for b, s in best.items() if math.isfinite(s))
  if not pts:
    raise ValueError("break_even needs at least one batch with a finite speedup, got "
                     f"{dict(best)!r}")
  if any(b < 1 for b, _ in pts):
    raise ValueError(f"batch sizes must be >= 1, got {[b for b, _ in pts]}")
  if all(s < 1 for _, s in pts):
    return BreakEven("below 1 everywhere")
  first = next(i for i, (_, s) in enumerate(pts) if s >= 1)
  note = ""
  if first > 0:
    note = ("also below 1 at batch " + ", ".join(f"{b:g}" for b, _ in pts[:first])
            + " (non-monotone)")
  for (b0, s0), (b1, s1) in zip(pts[first:], pts[first + 1:]):
    if s1 < 1 <= s0:
      frac = (s0 - 1.0) / (s0 - s1)
      star = 2.0 ** (math.log2(b0) + frac * (math.log2(b1) - math.log2(b0)))
      return BreakEven("crossed", star, (b0, b1), note)
  return BreakEven("not reached", note=note)


def best_by_batch(records: Sequence[dict], metric: str = "speedup") -> dict[int, tuple[int, float]]:
  """{batch: (k with the highest `metric`, that value)} over finished points (smallest k on
  ties; points whose metric is not finite are skipped)."""
  out: dict[int, tuple[int, float]] = {}
  for r in records:
    b, k = int(r["params"]["batch"]), int(r["params"]["k"])
    s = r["metrics"].get(metric)
    if s is None or not math.isfinite(s):
      continue
    if b not in out or s > out[b][1] or (s == out[b][1] and k < out[b][0]):
      out[b] = (k, float(s))
  return out


def measured_break_even(records: Sequence[dict], metric: str = "speedup") -> BreakEven:
  """`break_even` of the best `metric` over k at every batch."""
  return break_even({b: s for b, (_, s) in best_by_batch(records, metric).items()})


CALIBRATED = "predicted_speedup_calibrated"


def has_calibrated(records: Sequence[dict]) -> bool:
  """Whether the points carry the calibrated prediction (results of older runs do not)."""
  return any(CALIBRATED in r["metrics"] for r in records)


def calibrated_break_even(records: Sequence[dict]) -> BreakEven:
  """The break-even of the calibrated predictions: `break_even` of the best calibrated
  speedup over k at every batch, interpolated on log₂ batch as the measured one is."""
  return measured_break_even(records, CALIBRATED)


@dataclasses.dataclass(frozen=True)
class Agreement:
  """Measured vs predicted break-even batch.

  ratio = measured ÷ predicted (None unless both crossed); within: |measured − predicted|
  ≤ tolerance·predicted (None when neither crossed inside the swept batches, so the goal
  cannot be judged; False when only one did).
  """

  measured: BreakEven
  predicted: BreakEven
  tolerance: float = AGREEMENT

  @property
  def ratio(self) -> float | None:
    if self.measured.status == "crossed" and self.predicted.status == "crossed":
      return self.measured.batch / self.predicted.batch
    return None

  @property
  def within(self) -> bool | None:
    if self.ratio is not None:
      return abs(self.ratio - 1.0) <= self.tolerance + 1e-12
    if self.measured.status == self.predicted.status:
      return None
    return False

  def text(self) -> str:
    pct = f"{100 * self.tolerance:g}%"
    if self.ratio is not None:
      verdict = "within" if self.within else "NOT within"
      return (f"measured ÷ predicted = {self.ratio:.2f}: {verdict} {pct} "
              f"({100 * (self.ratio - 1):+.0f}%)")
    if self.within is None:
      why = ("speculation never pays in either, so there is no break-even to compare"
             if self.measured.status == "below 1 everywhere" else
             "widen the batch range")
      return (f"neither crosses 1 inside the swept batches (both {self.measured.status}): "
              f"the {pct} goal cannot be judged; {why}")
    return (f"NOT within {pct}: measured {self.measured.status}, predicted "
            f"{self.predicted.status}")

  def to_dict(self) -> dict:
    return {"measured": self.measured.batch, "measured_status": self.measured.status,
            "predicted": self.predicted.batch, "predicted_status": self.predicted.status,
            "ratio": self.ratio, "within": self.within, "tolerance": self.tolerance}


def agreement(measured: BreakEven, predicted: BreakEven,
              tolerance: float = AGREEMENT) -> Agreement:
  """Whether two break-evens agree within `tolerance` (relative to the predicted one)."""
  if not (isinstance(tolerance, (int, float)) and math.isfinite(tolerance) and tolerance >= 0):
    raise ValueError(f"tolerance must be a finite number >= 0, got {tolerance!r}")
  return Agreement(measured, predicted, float(tolerance))


def _pooled(records: Sequence[dict]) -> tuple[float, float]:
  """(mean α_trial, median c) of some points, α clipped to [0, 1]."""
  alphas = [r["metrics"]["alpha_trial"] for r in records
            if math.isfinite(r["metrics"].get("alpha_trial", float("nan")))]
  cs = [r["metrics"]["c"] for r in records]
  a = min(max(statistics.fmean(alphas), 0.0), 1.0) if alphas else 0.0
  return a, float(statistics.median(cs))


def model_of(records: Sequence[dict]) -> tuple[roofline.Hardware, roofline.Workload]:
  """The calibrated hardware (median over the points' calibrations, which may come from
  several processes) and the workload of the smallest-batch point."""
  hws = [r["metrics"]["hardware"] for r in records]
  med = lambda key: float(statistics.median(h[key] for h in hws))  # noqa: E731
  hw = roofline.Hardware(hws[0]["name"], bandwidth=med("bandwidth"), flops=med("flops"),
                         memory=med("memory"))
  first = min(records, key=lambda r: (r["params"]["batch"], r["params"]["k"]))
  return hw, roofline.Workload(**first["metrics"]["workload"])


def _per_k(records: Sequence[dict]) -> dict[int, tuple[float, float]]:
  """{k: (mean α_trial, median c)} over the points of each k."""
  ks = sorted({int(r["params"]["k"]) for r in records})
  return {k: _pooled([r for r in records if r["params"]["k"] == k]) for k in ks}


def predicted_break_even(records: Sequence[dict], draft_cost: str = "full"
                         ) -> tuple[BreakEven, dict[int, float]]:
  """Roofline break-even: per k, `roofline.break_even_batch` at that k's pooled (mean α,
  median c); overall, the largest over k (past it no swept k pays). Returns the overall
  value as a BreakEven and {k: break-even batch} (1.0 = never pays, inf = pays at every
  batch up to roofline's max_batch)."""
  hw, wl = model_of(records)
  per_k = {k: roofline.break_even_batch(hw, wl, a, k, c, draft_cost)
           for k, (a, c) in _per_k(records).items()}
  pays = [b for b in per_k.values() if b > 1.0]
  if not pays:
    return BreakEven("below 1 everywhere"), per_k
  if math.isinf(max(pays)):
    return BreakEven("not reached"), per_k
  return BreakEven("crossed", max(pays)), per_k


def best_k_table(records: Sequence[dict], draft_cost: str = "full") -> list[dict]:
  """Per batch: the best measured k (0 = off when no k reaches speedup 1) and its speedup,
  the best of the swept k on the roofline (per-k pooled α and c, as in the plot) and
  `roofline.best_k` over 0..max swept k at the batch's pooled α and c; with calibrated
  predictions, also the best k by them (0 = off) and its predicted speedup."""
  hw, wl = model_of(records)
  per_k = _per_k(records)
  ks = list(per_k)
  calibrated = best_by_batch(records, CALIBRATED) if has_calibrated(records) else {}
  rows = []
  for b, (k_meas, s) in sorted(best_by_batch(records).items()):
    gains = {k: roofline.gain(hw, wl, b, a, k, c, draft_cost) for k, (a, c) in per_k.items()}
    k_roof = max(ks, key=lambda k: (gains[k], -k))
    a_b, c_b = _pooled([r for r in records if r["params"]["batch"] == b])
    kb, gb = roofline.best_k(hw, wl, b, a_b, c_b, k_max=max(ks), draft_cost=draft_cost)
    rows.append({
        "batch": b, "measured best k": k_meas if s >= 1 else 0, "best measured speedup": s,
        "at k": k_meas,
        "roofline best swept k": k_roof if gains[k_roof] >= 1 else 0,
        "roofline gain": gains[k_roof],
        "roofline.best_k": kb, "best_k gain": gb})
    if calibrated:
      k_cal, s_cal = calibrated.get(b, (0, float("nan")))
      rows[-1].update({"calibrated best k": k_cal if s_cal >= 1 else 0,
                       "calibrated speedup": s_cal})
  return rows


# ----------------------------------------------------------------------------- report


def _points_table(records: Sequence[dict]) -> list[dict]:
  """One row per point: α, measured speedup and the three predictions."""
  rows = []
  for r in sorted(records, key=lambda r: (r["params"]["batch"], r["params"]["k"])):
    m = r["metrics"]
    rows.append({"batch": r["params"]["batch"], "k": r["params"]["k"],
                 "α_trial": m.get("alpha_trial"), "τ": m.get("tau"),
                 "speedup": m.get("speedup"), "calibrated": m.get(CALIBRATED),
                 "efficiency": m.get("efficiency_calibrated"),
                 "cycle (steps)": m.get("cycle_steps"),
                 "standalone": m.get("predicted_speedup"), "roofline": m.get("roofline_gain")})
  return rows


def summary_of(records: Sequence[dict], draft_cost: str = "full") -> dict:
  """The break-evens of a run (what batch_breakeven_summary.json holds): measured,
  calibrated (None without calibrated predictions) and roofline, with their agreement."""
  measured = measured_break_even(records)
  roof, per_k = predicted_break_even(records, draft_cost)
  out = {"measured": dataclasses.asdict(measured),
         "roofline": dataclasses.asdict(roof),
         "roofline_per_k": {str(k): b for k, b in per_k.items()},
         "measured_vs_roofline": agreement(measured, roof).to_dict(),
         "calibrated": None, "measured_vs_calibrated": None}
  if has_calibrated(records):
    cal = calibrated_break_even(records)
    out["calibrated"] = dataclasses.asdict(cal)
    out["measured_vs_calibrated"] = agreement(measured, cal).to_dict()
  return out


def _gain_plot(records, run_dir, hw, wl, draft_cost: str, batches, per_k, measured,
               calibrated, predicted, with_cal: bool) -> str:
  """Gain vs batch: roofline curves (continuous in batch, per-k pooled α and c), calibrated
  predictions (dashed, at the swept batches) and measured markers, the break-evens marked;
  the saved plot's name."""
  finite = [b for b in per_k.values() if math.isfinite(b) and b > 1]
  b_hi = max(batches[-1], min(max(finite, default=1.0) * 1.5, 64.0 * batches[-1]))
  bs = np.geomspace(1.0, b_hi, 200)
  fig, ax = rep.new_figure(figsize=(8.5, 4))
  for k, (a, c) in _per_k(records).items():
    line, = ax.plot(bs, [roofline.gain(hw, wl, float(b), a, k, c, draft_cost) for b in bs],
                    "-", lw=1.2, label=f"roofline k={k} (α={a:.2f}, c={c:.2f})")
    mine = sorted((r for r in records if r["params"]["k"] == k),
                  key=lambda r: r["params"]["batch"])
    ax.plot([r["params"]["batch"] for r in mine], [r["metrics"]["speedup"] for r in mine], "o",
            color=line.get_color(), ms=5, label=f"measured k={k}")
    if with_cal:
      cal = [(r["params"]["batch"], r["metrics"].get(CALIBRATED, float("nan"))) for r in mine]
      ax.plot([b for b, _ in cal], [v for _, v in cal], "x--", color=line.get_color(), lw=0.9,
              ms=5, label=f"calibrated k={k}")
  ax.axhline(1.0, color="gray", lw=0.8)
  for be, style, label in ((measured, "--", "measured break-even"),
                           (calibrated, "-.", "calibrated break-even"),
                           (predicted, ":", "roofline break-even")):
    if be is not None and be.status == "crossed" and be.batch <= b_hi:
      ax.axvline(be.batch, color="black", ls=style, lw=0.9, label=label)
  ax.set_xscale("log", base=2)
  from matplotlib.ticker import FuncFormatter
  ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))  # 1, 2, 4, not 2^n
  ax.set_xlabel("batch size B")
  ax.set_ylabel("speculative ÷ plain tokens/s")
  ax.set_title(f"gain vs batch: {wl.name}, L = {wl.context_len}, draft_cost = {draft_cost}",
               fontsize=9)
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  return rep.save(fig, run_dir / "batch_breakeven_gain.png")


def _write_summary(run_dir, summary: dict) -> None:
  try:
    (run_dir / "batch_breakeven_summary.json").write_text(json.dumps(summary, indent=1))
  except (OSError, TypeError):  # the report text still carries every figure
    pass


def _roof_text(b: float) -> str:
  return "never pays" if b <= 1.0 else ("not reached" if math.isinf(b) else f"{b:.3g}")


def report(records: list[dict], run_dir) -> str:
  """Break-even measured vs calibrated vs roofline, best k per batch, the points, and the
  gain-vs-batch plot; the break-evens also go to batch_breakeven_summary.json."""

  draft_cost = records[0]["params"].get("draft_cost", "full")
  hw, wl = model_of(records)
  ks = sorted({int(r["params"]["k"]) for r in records})
  batches = sorted({int(r["params"]["batch"]) for r in records})
  measured = measured_break_even(records)
  cost_model = measured_break_even(records, "predicted_speedup")
  predicted, per_k = predicted_break_even(records, draft_cost)
  with_cal = has_calibrated(records)
  calibrated = calibrated_break_even(records) if with_cal else None
  table = best_k_table(records, draft_cost)
  varying = sorted(n for n in records[0]["params"] if n not in ("batch", "k") and len(
      {repr(r["params"].get(n)) for r in records}) > 1)

  name = _gain_plot(records, run_dir, hw, wl, draft_cost, batches, per_k, measured,
                    calibrated, predicted, with_cal)

  _write_summary(run_dir, summary_of(records, draft_cost))
  upper = float(batches[-1])
  cal_lines = [
      f"- Calibrated break-even batch (loop costs calibrated at each batch, τ per loop "
      f"iteration from each row's measured law of accepted lengths): "
      f"{calibrated.text(upper)}",
      f"- Measured vs calibrated: {agreement(measured, calibrated).text()}",
  ] if with_cal else [
      "- Calibrated break-even batch: not available (these results carry no calibrated "
      "prediction)"]
  lines = [
      "## Batch break-even", "",
      "Speedup = speculative ÷ plain tokens/s of the decode phase, measured side by side. "
      "Calibrated = tokens per loop iteration (from each row's measured law of accepted "
      "lengths, waiting for the batch's slowest row) ÷ the cycle of chain(k) in plain "
      "target steps, timed in the compiled loops at that batch (docs/cost_model.md, "
      "\"Calibrated loop costs\"). "
      "Roofline = the analytic bandwidth/compute model.", "",
      f"Hardware (calibrated here): {hw.bandwidth / 1e9:.3g} GB/s streaming, "
      f"{hw.flops / 1e9:.3g} GFLOP/s matmul. Workload {wl.name}: W = "
      f"{wl.weight_bytes / 1e6:.3g} MB, F = {wl.flops() / 1e6:.3g} MFLOP/token, "
      f"KV = {wl.kv_bytes_per_token:g} B/token, L = {wl.context_len}.", "",
      f"- Measured break-even batch (best speedup over k = {ks}): {measured.text(upper)}",
      *cal_lines,
      f"- Predicted break-even batch (roofline, draft_cost = {draft_cost}): "
      f"{predicted.text(ROOFLINE_MAX_BATCH)}; per k: "
      + ", ".join(f"k={k}: {_roof_text(b)}" for k, b in per_k.items()),
      f"- Measured vs roofline: {agreement(measured, predicted).text()}",
      f"- Standalone-forward model τ_pred / (k·c + v) break-even: {cost_model.text(upper)}",
      "",
      *([f"Note: {', '.join(varying)} also vary between these points; the analysis pools "
         "them (it assumes only batch and k vary).", ""] if varying else []),
      "Best k per batch: measured (0 = off: no k reached speedup 1), the best swept k on the "
      "roofline curves of the plot, `roofline.best_k` over 0..max k at the batch's mean "
      "α and median c" + (", and the best k by the calibrated predictions." if with_cal
                          else "."), "",
      rep.markdown_table(table, list(table[0])) if table else "", "",
      "Every point:", "",
      rep.markdown_table(_points_table(records), list(_points_table(records)[0])), "",
      f"![gain vs batch]({name})", "",
      "Reading this honestly: on a CPU with small models the engine is overhead-bound. A "
      "decode step of a model of a few MB costs far more than its bytes / bandwidth or its "
      "FLOPs / FLOP/s: dispatch, loop control, sampling and small-matmul inefficiency "
      "dominate, and those are paid per step whatever the batch. The roofline knows "
      "bandwidth and compute only (and its bandwidth is a DRAM stream, while small weights "
      "sit in cache), so its break-even and best k need not match the measured ones. The "
      "standalone-forward model prices the forwards at their measured wall times but not "
      "the speculative loop's own work between them (draft control flow, acceptance, cache "
      "commits). The calibrated model times that loop itself at each batch, so it is the "
      "one the measured break-even is judged against; what it still misses is α's "
      "variation (each batch decodes a different prompt set; batch 1 is one prompt) and "
      "timing noise. The per-point predictions use the point's own α; the roofline curves "
      "and break-evens each k's mean α and median c.", "",
  ]
  return "\n".join(lines)
