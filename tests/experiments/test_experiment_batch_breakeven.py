"""The batch_breakeven experiment: a tiny run through the runner (random models), the pure
break-even / best-k / calibrated-prediction analysis on synthetic records and planted loop
costs, validation and planning without models."""

import json
import math

import pytest

from specjax.experiments import batch_breakeven as bb
from specjax.experiments import measure
from specjax.calibration import loop_costs as calibration
from specjax.engine import decoding
from specjax.analysis import roofline
from specjax.verify import trees
from specjax.sweeps import launch, runner
from specjax.models import cache as kv
from specjax.training.presets import DEFAULT_PRESET, PRESETS

CONFIG = "configs/batch_breakeven.gin"
# Two points (each compiles its own plain and speculative loops, shared with its
# calibration); the multi-k analysis is covered on synthetic records below. Tiny random
# models decode in microseconds: the fastest of 3 alternated calls of 96 tokens keeps the
# decode-phase differences (budget minus the prefill) out of the load's noise (32 tokens and
# 2 calls lost it under the load of a parallel test run).
TINY = [
    'sweeps.Sweep.axes = {"batch": [1, 4], "k": [2]}',
    'sweeps.Sweep.fixed = {"max_new_tokens": 96, "prompt_len": 16, "repeats": 3, '
    '"models": "random", "calibration_k": (2,), "calibration_repeats": 3, '
    '"statistic": "fastest"}',
]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  root = tmp_path_factory.mktemp("bb")
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("SPECJAX_CACHE_DIR", str(root / "cache"))  # a fresh calibration
    summary = launch.run(CONFIG, TINY, out=str(root / "run"), progress=False)
  return summary, root / "run", root / "cache"


@pytest.mark.slow
@pytest.mark.slow  # compile-bound (5-18 s): the fast tier's 3 minutes
def test_tiny_run_metrics_are_present_and_sane(tiny_run):
  summary, out, cache = tiny_run
  assert (summary.total, summary.ok, summary.failed) == (2, 2, 0)
  records = list(runner.read_results(out / runner.RESULTS).values())
  assert sorted((r["params"]["batch"], r["params"]["k"]) for r in records) == [(1, 2), (4, 2)]
  for r in records:
    m = r["metrics"]
    for name in ("plain_tok_s", "spec_tok_s", "speedup", "c", "verify_cost",
                 "t_plain_step_ms", "predicted_speedup", "roofline_gain",
                 "predicted_speedup_calibrated", "efficiency_calibrated", "cycle_steps",
                 "tau_loop_predicted", "t_step_ms"):
      assert math.isfinite(m[name]) and m[name] > 0, (name, m[name])
    assert m["speedup"] == pytest.approx(m["spec_tok_s"] / m["plain_tok_s"])
    assert 0.0 <= m["alpha_trial"] <= 1.0 and 0.0 <= m["alpha"] <= 1.0
    assert 1.0 <= m["tau"] <= r["params"]["k"] + 1
    assert m["identical_to_plain"] is True  # greedy: speculation changes no token
    # one cache length for the calibration and the measured runs: the engine's for chain(2)
    assert m["cache_len"] == decoding.cache_len_for(16, 96, 3) and m["context_len"] == 16 + 48
    # calibrated prediction = τ per loop iteration (each row's measured law of accepted
    # lengths; one row at batch 1, whose law's mean is the measured τ) ÷ cycle
    tau = m["tau_loop_predicted"]
    if r["params"]["batch"] == 1:
      assert tau == pytest.approx(m["tau"], rel=0.15)
    assert 1.0 <= tau <= r["params"]["k"] + 1
    assert m["predicted_speedup_calibrated"] == pytest.approx(tau / m["cycle_steps"])
    assert m["efficiency_calibrated"] == pytest.approx(
        m["speedup"] / m["predicted_speedup_calibrated"])
    assert list(m["calibration"]["cycle_steps"]) == ["chain(2)"]
    assert m["calibration"]["cached"] is False
    hw = roofline.Hardware(**m["hardware"])
    wl = roofline.Workload(**m["workload"])
    assert m["roofline_gain"] == pytest.approx(roofline.gain(
        hw, wl, r["params"]["batch"], m["alpha_trial"], r["params"]["k"], m["c"]))
  # one calibration per batch, cached on disk
  assert len({r["metrics"]["calibration"]["key"] for r in records}) == 2
  assert len(list((cache / "calibration").glob("*.json"))) == 2


@pytest.mark.slow  # compile-bound (5-18 s): the fast tier's 3 minutes
def test_tiny_run_report_has_break_even_lines_table_and_plot(tiny_run):
  _, out, _ = tiny_run
  report = (out / "report.md").read_text()
  assert "2 points finished, 0 failed" in report
  assert "## Batch break-even" in report
  assert "- Measured break-even batch" in report
  assert "- Calibrated break-even batch (loop costs calibrated at each batch" in report
  assert "- Measured vs calibrated: " in report and "25%" in report
  assert "- Measured vs roofline: " in report
  assert "| batch | k | α_trial |" in report  # every point, with its calibrated prediction
  summary = json.loads((out / "batch_breakeven_summary.json").read_text())
  assert summary["calibrated"]["status"] in ("crossed", "not reached", "below 1 everywhere")
  assert set(summary["measured_vs_calibrated"]) >= {"measured", "predicted", "ratio", "within"}
  assert "- Predicted break-even batch (roofline, draft_cost = full)" in report
  assert "| batch | measured best k |" in report
  assert "overhead-bound" in report
  assert "![gain vs batch](batch_breakeven_gain.png)" in report
  assert (out / "batch_breakeven_gain.png").stat().st_size > 5000


# ----------------------------------------------------------------------------- pure analysis


def test_break_even_interpolates_on_log_batch():
  be = bb.break_even({1: 1.5, 2: 1.2, 4: 0.8, 8: 0.5})
  assert be.status == "crossed" and be.between == (2.0, 4.0)
  assert be.batch == pytest.approx(2 ** 1.5)  # halfway on log2 between 2 and 4
  assert bb.break_even({1: 1.2, 2: 1.0, 4: 0.8}).batch == pytest.approx(2.0)  # 1 still pays
  assert bb.break_even({1: 1.0, 16: 0.0}).batch == pytest.approx(1.0)
  assert "B ≈ 2.83" in be.text()


def test_break_even_not_reached_and_below_everywhere():
  nr = bb.break_even({4: 1.1, 1: 1.3, 16: 1.0})
  assert nr.status == "not reached" and nr.batch is None
  assert "not reached" in nr.text(16) and "16" in nr.text(16)
  below = bb.break_even({1: 0.9, 4: 0.7, 2: 0.99})
  assert below.status == "below 1 everywhere" and below.batch is None
  assert "below 1 everywhere" in below.text()


def test_break_even_non_monotone_and_bad_input():
  be = bb.break_even({1: 0.95, 2: 1.1, 4: 0.9})
  assert be.status == "crossed" and be.between == (2.0, 4.0) and "batch 1" in be.note
  late = bb.break_even({1: 0.9, 2: 1.1, 4: 1.2})
  assert late.status == "not reached" and "batch 1" in late.note
  with pytest.raises(ValueError, match="at least one batch"):
    bb.break_even({1: float("nan")})
  with pytest.raises(ValueError, match="batch sizes must be >= 1"):
    bb.break_even({0.5: 1.2, 2: 0.8})


HW = {"name": "cpu-test", "bandwidth": 100e9, "flops": 2e11, "memory": 1e10,
      "peak_flops": None}
WL = roofline.Workload.from_model_config(PRESETS["tiny"].target, 96).to_dict()


def _record(batch, k, speedup, alpha=0.8, c=0.3, predicted=None, calibrated=None):
  m = {"speedup": speedup, "alpha_trial": alpha, "c": c,
       "predicted_speedup": speedup if predicted is None else predicted,
       "hardware": HW, "workload": WL}
  if calibrated is not None:
    m["predicted_speedup_calibrated"] = calibrated
  return {"params": {"batch": batch, "k": k, "draft_cost": "full"}, "status": "ok",
          "metrics": m}


SYNTH = [  # k = 2 pays longer than k = 4; the best over k crosses 1 between batch 8 and 16
    _record(1, 2, 1.4), _record(4, 2, 1.2), _record(8, 2, 1.05), _record(16, 2, 0.9),
    _record(1, 4, 1.6), _record(4, 4, 1.1), _record(8, 4, 0.95), _record(16, 4, 0.7),
]


def test_best_by_batch_and_measured_break_even_use_the_best_k():
  best = bb.best_by_batch(SYNTH)
  assert best == {1: (4, 1.6), 4: (2, 1.2), 8: (2, 1.05), 16: (2, 0.9)}
  tie = bb.best_by_batch([_record(1, 4, 1.3), _record(1, 2, 1.3)])
  assert tie == {1: (2, 1.3)}  # smallest k on ties
  be = bb.measured_break_even(SYNTH)
  assert be.status == "crossed" and be.between == (8.0, 16.0)
  assert be.batch == pytest.approx(2 ** (3 + 0.05 / 0.15))


def test_predicted_break_even_is_the_largest_roofline_break_even_over_k():
  hw, wl = bb.model_of(SYNTH)
  overall, per_k = bb.predicted_break_even(SYNTH)
  assert set(per_k) == {2, 4}
  for k, b in per_k.items():
    assert b == pytest.approx(roofline.break_even_batch(hw, wl, 0.8, k, 0.3))
    assert roofline.gain(hw, wl, b, 0.8, k, 0.3) == pytest.approx(1.0, abs=1e-6)
  assert overall.status == "crossed" and overall.batch == pytest.approx(max(per_k.values()))
  never = [_record(1, 2, 0.5, alpha=0.0), _record(4, 2, 0.5, alpha=0.0)]
  assert bb.predicted_break_even(never)[0].status == "below 1 everywhere"


def test_best_k_table_against_roofline_best_k():
  rows = bb.best_k_table(SYNTH)
  assert [r["batch"] for r in rows] == [1, 4, 8, 16]
  assert [r["measured best k"] for r in rows] == [4, 2, 2, 0]  # 0: off at batch 16
  assert [r["at k"] for r in rows] == [4, 2, 2, 2]
  hw, wl = bb.model_of(SYNTH)
  for r in rows:
    kb, gb = roofline.best_k(hw, wl, r["batch"], 0.8, 0.3, k_max=4)
    assert (r["roofline.best_k"], r["best_k gain"]) == (kb, pytest.approx(gb))
    g = {k: roofline.gain(hw, wl, r["batch"], 0.8, k, 0.3) for k in (2, 4)}
    best = max(g, key=lambda k: (g[k], -k))
    assert r["roofline best swept k"] == (best if g[best] >= 1 else 0)


def test_report_on_synthetic_records(tmp_path):
  text = bb.report(SYNTH, tmp_path)
  assert "- Measured break-even batch (best speedup over k = [2, 4]): B ≈ 10.1" in text
  assert "between batch 8 and 16" in text
  assert "- Predicted break-even batch (roofline, draft_cost = full):" in text
  assert "k=2:" in text and "k=4:" in text
  assert "| 16 | 0 | 0.9 | 2 |" in text
  assert (tmp_path / "batch_breakeven_gain.png").stat().st_size > 5000


# ----------------------------------------------------------------------------- calibrated


def _planted(batch):
  """Planted loop costs at a batch: a plain step of 1 ms, a chain(2) cycle of 1.5 + 0.1·B
  steps, a chain(4) cycle of 2 + 0.2·B steps (a cycle grows with the batch, a step not)."""
  return calibration.LoopCosts.from_timings(
      1e-3, {trees.chain(2): 1e-3 * (1.5 + 0.1 * batch), trees.chain(4): 1e-3 * (2 + 0.2 * batch)})


def test_calibrated_speedup_is_tau_per_iteration_over_cycle_steps():
  costs = _planted(1)
  tau, pred = bb.calibrated_speedup(costs, 1.0, 2, 1, 30)  # α = 1: every cycle emits 3
  assert tau == pytest.approx(3.0) and pred == pytest.approx(3.0 / 1.6)
  tau1, _ = bb.calibrated_speedup(costs, 0.6, 4, 1, 63)
  tau8, pred8 = bb.calibrated_speedup(_planted(8), 0.6, 4, 8, 63)
  assert tau8 < tau1 <= float(1 + 0.6 + 0.6**2 + 0.6**3 + 0.6**4) + 0.05  # waits for the slowest
  assert tau8 == pytest.approx(calibration.tokens_per_iteration(
      calibration.chain_length_probs(0.6, 4), 8, 63))
  assert pred8 == pytest.approx(tau8 / (2 + 1.6))
  big = bb.tau_loop(0.6, 4, 4096, 63)  # the Monte Carlo stays bounded at large batch
  assert 1.0 <= big < tau8


def _calibrated_records():
  """Measured speedups and planted-cost calibrated predictions over batch and k."""
  out = []
  for b in (1, 2, 4, 8, 16):
    for k, meas in ((2, 1.5 - 0.05 * b), (4, 1.7 - 0.07 * b)):
      _, pred = bb.calibrated_speedup(_planted(b), 0.8, k, b, 63)
      out.append(_record(b, k, meas, calibrated=pred))
  return out


def test_calibrated_break_even_interpolates_the_best_calibrated_prediction():
  recs = _calibrated_records()
  best = {b: s for b, (_, s) in bb.best_by_batch(recs, bb.CALIBRATED).items()}
  cal = bb.calibrated_break_even(recs)
  assert cal.status == "crossed"
  assert cal.batch == pytest.approx(bb.break_even(best).batch)
  lo, hi = cal.between
  assert best[lo] >= 1 > best[hi]
  assert not bb.has_calibrated(SYNTH) and bb.has_calibrated(recs)


def test_agreement_within_25_percent():
  crossed = lambda b: bb.BreakEven("crossed", b)  # noqa: E731
  ok = bb.agreement(crossed(10.0), crossed(8.5))
  assert ok.ratio == pytest.approx(10 / 8.5) and ok.within is True
  assert "within 25%" in ok.text() and "NOT" not in ok.text()
  far = bb.agreement(crossed(4.0), crossed(8.0))
  assert far.ratio == pytest.approx(0.5) and far.within is False
  assert "NOT within 25% (-50%)" in far.text()
  assert bb.agreement(crossed(10.0), crossed(8.0)).within is True  # exactly 25%
  both = bb.agreement(bb.BreakEven("not reached"), bb.BreakEven("not reached"))
  assert both.ratio is None and both.within is None and "cannot be judged" in both.text()
  one = bb.agreement(crossed(4.0), bb.BreakEven("not reached"))
  assert one.within is False and "NOT within 25%" in one.text()
  assert one.to_dict() == {"measured": 4.0, "measured_status": "crossed", "predicted": None,
                           "predicted_status": "not reached", "ratio": None, "within": False,
                           "tolerance": 0.25}
  with pytest.raises(ValueError, match="tolerance must be a finite number >= 0, got -1"):
    bb.agreement(crossed(1.0), crossed(1.0), -1)


def test_report_states_the_calibrated_break_even_and_the_verdict(tmp_path):
  recs = _calibrated_records()
  text = bb.report(recs, tmp_path)
  cal = bb.calibrated_break_even(recs)
  meas = bb.measured_break_even(recs)
  assert f"- Calibrated break-even batch (loop costs calibrated at each batch, τ per loop " \
         f"iteration from each row's measured law of accepted lengths): " \
         f"B ≈ {cal.batch:.3g}" in text
  verdict = bb.agreement(meas, cal)
  assert f"- Measured vs calibrated: measured ÷ predicted = {verdict.ratio:.2f}" in text
  assert ("NOT within 25%" in text) == (not verdict.within)
  assert "calibrated best k" in text and "| batch | k | α_trial |" in text
  summary = json.loads((tmp_path / "batch_breakeven_summary.json").read_text())
  assert summary["calibrated"]["batch"] == pytest.approx(cal.batch)
  assert summary["measured_vs_calibrated"]["ratio"] == pytest.approx(verdict.ratio)
  # results without calibrated predictions (older runs) still report
  old = bb.report(SYNTH, tmp_path)
  assert "- Calibrated break-even batch: not available" in old


# ----------------------------------------------------------------------------- validation, plan


GOOD = {"batch": 4, "k": 2, "max_new_tokens": 8, "prompt_len": 16, "temperature": 0.0,
        "repeats": 1, "models": "random", "draft_cost": "full", "seed": 0}


@pytest.mark.parametrize("name,value,pattern", [
    ("batch", 0, r"batch must be an int in \[1, 4096\], got 0"),
    ("batch", 2.0, r"batch must be an int in \[1, 4096\], got 2.0"),
    ("batch", True, r"batch must be an int"),
    ("k", 0, r"k must be an int in \[1, 64\], got 0"),
    ("k", "4", r"k must be an int in \[1, 64\], got '4'"),
    ("temperature", -0.5, r"temperature must be a finite number >= 0, got -0.5"),
    ("temperature", float("inf"), r"temperature must be a finite number >= 0"),
    ("temperature", "hot", r"temperature must be a finite number >= 0, got 'hot'"),
    ("repeats", 0, r"repeats must be an int in \[1, 1000\], got 0"),
    ("models", "huge", r"target must be 'default', 'random', .* got 'huge' \(no such directory\)"),
    ("draft_cost", "free", r"draft_cost must be one of"),
    ("prompt_len", 4, r"prompt_len must be an int in \[8, "),
    ("max_new_tokens", 1, r"max_new_tokens must be an int in \[2, "),
    ("calibration_k", (2, 0), r"calibration_k must be a list of chain lengths"),
    ("calibration_k", "2", r"calibration_k must be a list of chain lengths"),
    ("calibration_repeats", 0, r"calibration_repeats must be an int in \[1, 1000\], got 0"),
    ("statistic", "mean", r"statistic must be one of \('median', 'fastest'\), got 'mean'"),
])
def test_validate_rejects_bad_values_naming_the_parameter(name, value, pattern):
  bb.validate(GOOD)
  with pytest.raises(ValueError, match=pattern):
    bb.validate({**GOOD, name: value})


def test_plan_of_the_default_config_loads_no_model(monkeypatch):
  def boom(which):
    raise AssertionError(f"plan loaded models {which!r}")
  monkeypatch.setattr(measure, "models", boom)
  sweep, _ = launch.load_sweep(CONFIG)
  points = launch.plan(sweep)
  assert sweep.name == "batch_breakeven" and len(points) == 7 * 4
  assert {p.params["models"] for p in points} == {"default"}
  with pytest.raises(ValueError, match=r"sweep point .*k must be an int in \[1, 64\], got 0"):
    launch.plan(launch.load_sweep(CONFIG, ['sweeps.Sweep.axes = {"batch": [1], "k": [0]}'])[0])


def test_memory_estimate_is_the_default_presets_kv_caches():
  pair = PRESETS[DEFAULT_PRESET]
  n = decoding.cache_len_for(64, 64, 8 + 1)  # the engine's rule for a chain of k = 8
  assert n == 256  # bucket(64) + 64 + 8 + 1 = 137 -> 256
  expected = 4 * (kv.cache_bytes(pair.target, 64, n) + kv.cache_bytes(pair.draft, 64, n))
  assert bb.memory({"batch": 64, "k": 8, "prompt_len": 64, "max_new_tokens": 64}) == expected
  assert bb.memory({"batch": 1, "k": 1}) < expected
  # the longest calibrated chain sets the cache length
  assert bb.memory({"batch": 64, "k": 1, "calibration_k": (1, 8)}) == expected
