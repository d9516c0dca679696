"""The tree-shapes and long-context experiments: their configs plan without loading models,
tiny runs through the runner give sane metrics and a report with plots, and validation
rejects bad values naming the parameter.

Compilation dominates: the tiny settings share one prompt bucket (16) and cache length (64)
across both experiments, so plain decoding and the forward timings compile once, and each
tree test compiles at most one new tree shape (optimal on random models is the chain).
"""

import math

import pytest

from specjax.experiments import long_context, measure, tree_shapes
from specjax.sweeps import launch, runner


def _records(run_dir):
  records = list(runner.read_results(run_dir / runner.RESULTS).values())
  assert records and all(r["status"] == "ok" for r in records), records
  return records


@pytest.mark.parametrize("name", ["tree_shapes", "long_context"])
def test_config_parses_and_plans_without_loading_models(name, monkeypatch):
  def refuse(which):
    raise AssertionError(f"planning loaded models {which!r}")
  monkeypatch.setattr(measure, "models", refuse)
  sweep, _ = launch.load_sweep(f"configs/{name}.gin")
  points = launch.plan(sweep)
  assert len(points) == (32 if name == "tree_shapes" else 5)  # long_context: 64 .. 896
  assert all(sweep.memory_fn(p.params) > 0 for p in points)


BUDGET = 6  # calib_widths (2, 2) is the 6-node branching tree: one compile for both


def _run_trees(tmp_path, shapes, monkeypatch):
  """A tiny tree_shapes sweep at N = BUDGET, T = 0; checks what every shape must satisfy.
  Decode-phase timings of tiny random models: 32 tokens, the fastest of 2 alternated calls
  (3 in the calibration, which refuses a decode phase timed at or below zero) keep the
  differences out of the load's noise (2 calibration calls failed once on a
  loaded machine)."""
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))  # a fresh calibration
  out = tmp_path / "run"
  s = launch.run("tree_shapes", [
      f'sweeps.Sweep.axes = {{"shape": {shapes!r}, "budget": [{BUDGET}], "temperature": [0.0]}}'
      .replace("'", '"'),
      'sweeps.Sweep.fixed = {"max_new_tokens": 32, "prompt_len": 16, "repeats": 2, '
      '"calib_widths": (2, 2), "models": "random", "calibration_repeats": 3, '
      '"statistic": "fastest", "prompts": 2, "target_dtype": "float32"}'], out=str(out),
      progress=False)
  assert (s.total, s.ok, s.failed) == (len(shapes), len(shapes), 0)
  by_shape = {r["params"]["shape"]: r["metrics"] for r in _records(out)}
  for shape, m in by_shape.items():
    assert m["tau"] >= 1.0 and 0.0 <= m["alpha"] <= 1.0, (shape, m)
    assert m["identical_to_plain"] is True, shape
    assert m["nodes_per_cycle"] == BUDGET, shape  # every shape verifies exactly N nodes
    # decode-phase rates are differences of wall times: NaN (documented) when one vanishes
    assert math.isnan(m["speedup"]) or (m["plain_tok_s"] > 0 and m["spec_tok_s"] > 0
                                        and m["speedup"] > 0 and m["efficiency"] > 0)
    # the prediction: τ per loop iteration (measured reach by depth) ÷ calibrated cycle
    assert m["predicted_speedup"] == pytest.approx(m["tau_loop_predicted"] / m["cycle_steps"])
    assert 1.0 <= m["tau_loop_predicted"] <= m["depth"] + 1 and m["cycle_steps"] > 0
    assert m["calibration_cached"] is False and m["t_step_ms"] > 0
    assert m["predicted_speedup_standalone"] > 0 and m["verify_ms"] > 0  # the extra column
    assert m["cache_len"] == 64 and m["prompts"] == 2  # two batch-1 calls per timing
    assert 1 <= len(m["depth_acceptance"]) == m["depth"]
  report = (out / "report.md").read_text()
  for png in ("tree_shapes_tau.png", "tree_shapes_speedup.png", "tree_shapes_depth.png"):
    assert f"]({png})" in report and (out / png).stat().st_size > 1000
  assert "## Tree shapes at equal node budgets" in report
  return by_shape, report


@pytest.mark.slow
def test_tree_shapes_chain(tmp_path, monkeypatch):
  by_shape, report = _run_trees(tmp_path, ["chain"], monkeypatch)
  assert by_shape["chain"]["parents"] == list(range(-1, BUDGET))
  assert by_shape["chain"]["rank_probs"] is None and "| chain | 6 |" in report


@pytest.mark.slow
def test_tree_shapes_branching_and_optimal(tmp_path, monkeypatch):
  by_shape, report = _run_trees(tmp_path, ["branching", "optimal"], monkeypatch)
  assert by_shape["branching"]["parents"] == [-1, 0, 0, 1, 1, 2, 2]  # exactly N nodes
  assert by_shape["branching"]["pretty"].startswith("root") and "branching (N = 6):" in report
  assert len(by_shape["optimal"]["parents"]) == BUDGET + 1
  assert len(by_shape["optimal"]["rank_probs"]) == 2  # calibrated on the (2, 2) tree
  assert "rank probabilities" in report
  assert tree_shapes.calibration.cache_info().currsize == 1  # once per process and setting


@pytest.mark.slow  # compile-heavy (fast-tier durations)
def test_tree_shapes_dynamic(tmp_path, monkeypatch):
  by_shape, _ = _run_trees(tmp_path, ["dynamic"], monkeypatch)
  assert by_shape["dynamic"]["parents"] is None and "budget=6" in by_shape["dynamic"]["pretty"]


@pytest.mark.slow  # compile-bound (5-18 s): the fast tier's 3 minutes
def test_long_context_speedup_vs_context_and_report(tmp_path, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))  # a fresh calibration
  out = tmp_path / "run"
  s = launch.run("long_context", [
      'sweeps.Sweep.axes = {"context_len": [12, 16]}',  # one prompt bucket: one compile
      'sweeps.Sweep.fixed = {"batch": 1, "k": 2, "max_new_tokens": 32, "repeats": 2, '
      '"models": "random", "calibration_repeats": 2}'], out=str(out),
      progress=False)  # decode phase >> prefill
  assert (s.total, s.ok, s.failed) == (2, 2, 0)
  records = _records(out)
  for r in records:
    m = r["metrics"]
    assert m["tau"] >= 1.0 and m["identical_to_plain"] is True
    # Decode-phase rates are differences of two wall times: on a loaded machine the
    # difference can vanish, and the experiment then reports NaN (documented), never <= 0.
    assert math.isnan(m["speedup"]) or m["speedup"] > 0
    assert m["predicted_speedup"] > 0 and m["predicted_speedup_timed"] > 0
    # the prediction: τ per loop iteration (the row's measured law of accepted lengths) ÷
    # calibrated cycle; one row at batch 1, so that τ is the measured one (but for the cut
    # last cycle and the Monte Carlo)
    assert m["predicted_speedup"] == pytest.approx(m["tau_loop_predicted"] / m["cycle_steps"])
    assert 1.0 <= m["tau_loop_predicted"] <= 3.0
    assert m["tau_loop_predicted"] == pytest.approx(m["tau"], rel=0.15)
    assert m["predicted_speedup_ref_alpha"] > 0 and m["roofline_gain"] > 0
    assert m["calibration_cached"] is False
    assert m["memory_bound_factor"] > 0 and m["roofline_step_ms"] > 0 and m["c"] > 0
    assert 0 < m["kv_share"] < 1 and m["cache_len"] == 64
    assert m["speedup_e2e"] > 0 and m["prefill_ms"] > 0 and m["decode_share"] < 1
  report = (out / "report.md").read_text()
  assert "calibrated = predicted from the loop's calibrated costs" in report
  assert len(list((tmp_path / "cache" / "calibration").glob("*.json"))) == 2  # one per context
  assert "](long_context.png)" in report and (out / "long_context.png").stat().st_size > 1000
  assert measure.hardware.cache_info().currsize == 1  # calibrated once per process


@pytest.mark.parametrize("change, match", [
    ({"shape": "star"}, "shape must be one of"),
    ({"budget": 0}, r"budget must be an int in \[1, 64\], got 0"),
    ({"budget": 65}, r"budget must be an int in \[1, 64\], got 65"),
    ({"temperature": -1.0}, "temperature must be a finite number >= 0"),
    ({"prompt_len": 4}, "prompt_len must be an int >= 8"),
    ({"calib_widths": (1, 1)}, "calib_widths must have a width >= 2"),
    ({"calib_widths": ()}, "calib_widths must be a non-empty sequence"),
    ({"models": "huge"}, r"target must be .* got 'huge' \(no such directory\)"),
])
def test_tree_shapes_validate_rejects_bad_values(change, match):
  with pytest.raises(ValueError, match=match):
    tree_shapes.validate({"shape": "chain", "budget": 4, **change})


@pytest.mark.parametrize("change, match", [
    ({"context_len": 4}, r"context_len must be an int in \[8, 65536\], got 4"),
    ({"context_len": 1 << 17}, "context_len must be an int in"),
    ({"context_len": "long"}, "context_len must be an int"),
    ({"batch": 0}, "batch must be an int >= 1, got 0"),
    ({"k": 0}, r"k must be an int in \[1, 32\], got 0"),
    ({"max_new_tokens": 1}, "max_new_tokens must be an int >= 2, got 1"),  # decode phase
    ({"temperature": "hot"}, "temperature must be a finite number >= 0"),
    ({"models": "huge"}, r"target must be .* got 'huge' \(no such directory\)"),
    # past the positions the models were trained for: refused before work, not mid-sweep
    # (the shipped target: 1,024 positions)
    ({"context_len": 2048}, r"2048 \+ max_new_tokens 64 \+ k 4 \+ 1 = 2117 exceeds the "
                            r"model's max_len 1024 .* the longest context_len here is 955"),
])
def test_long_context_validate_rejects_bad_values(change, match):
  with pytest.raises(ValueError, match=match):
    long_context.validate({"context_len": 64, **change})


def test_bad_value_in_a_binding_fails_before_any_work(tmp_path):
  with pytest.raises(ValueError, match="sweep point .*budget must be an int"):
    launch.run("tree_shapes", ['sweeps.Sweep.axes = {"shape": ["chain"], "budget": [0]}'],
               out=str(tmp_path / "run"), progress=False)
  with pytest.raises(ValueError, match="sweep point .*k must be an int"):
    launch.run("long_context", ['sweeps.Sweep.fixed = {"k": 0}'], out=str(tmp_path / "run"),
               progress=False)
  assert not (tmp_path / "run").exists()
