"""The quickstart (reduced: fewer tokens, one repeat) and the α × k sweep, end to end through
the runner: every point finishes, metrics are sane, report and plots are written.

The quickstart uses the embedded trained pair when it is already cached (CI runs the main
job first, which trains it) and random tiny models otherwise, so a lone test run does not
train for minutes.
"""

from __future__ import annotations

import pytest

from specjax.experiments import alpha_k_sweep, quickstart
from specjax.sweeps import launch, runner
from specjax.training import defaults


def _models() -> str:
  return "default" if defaults.entry_dir("tiny", "code").exists() else "random"


@pytest.mark.slow
def test_quickstart_reduced_end_to_end(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))  # a fresh calibration
  models = _models()
  s = launch.run("quickstart", out=str(tmp_path / "qs"), progress=False, bindings=[
      'sweeps.Sweep.axes = {"mode": ["chain", "tree"], "batch": [1, 2], '
      '"temperature": [0.0, 1.0]}',
      # tiny random models decode in microseconds: the fastest of 3 alternated calls keeps
      # the decode-phase differences (64 tokens minus the prefill) out of the load's noise
      f'sweeps.Sweep.fixed = {{"k": 3, "tree_widths": (2, 1, 1), "max_new_tokens": 96, '
      f'"prompt_len": 16, "repeats": 3, "models": "{models}", "calibration_k": (1,), '
      f'"calibration_repeats": 3, "statistic": "fastest", "prompts": 2, "drafter": "model", '
      f'"target_dtype": "float32"}}'])  # fixed merges into the config's: override its own
  assert (s.total, s.ok, s.failed) == (8, 8, 0)
  records = runner.read_results(tmp_path / "qs" / runner.RESULTS).values()
  for r in records:
    m, p = r["metrics"], r["params"]
    if p["temperature"] == 0.0:
      assert m["identical_to_plain"] is True, r  # greedy: speculative output == plain output
      assert m["sample"]["plain"] == m["sample"]["speculative"]
    else:
      assert m["identical_to_plain"] is None
    assert 1.0 <= m["tau"] <= 4.0 and 0.0 <= m["alpha"] <= 1.0
    assert m["speedup"] > 0 and m["predicted_speedup"] > 0 and m["cycle_steps"] > 0
    assert 1.0 <= m["tau_loop_predicted"] <= 4.0  # each row's measured law
    if p["mode"] == "chain":  # beside it, the i.i.d. model's (geometric law at each row's α)
      assert 1.0 <= m["tau_loop_iid"] <= m["tau_predicted"] + 1e-9
      assert m["predicted_speedup_iid"] == pytest.approx(m["tau_loop_iid"] / m["cycle_steps"])
    else:
      assert "predicted_speedup_iid" not in m
    label = "chain k=3" if p["mode"] == "chain" else "tree (2, 1, 1)"
    assert m["verdict"].startswith(f"{label}, batch {p['batch']}, T={p['temperature']:g}: ")
    assert "× measured" in m["verdict"] and "efficiency" in m["verdict"]
    assert sum(m["run_lengths"]) == sum(m["depth_tried"][:1])  # every cycle tries depth 1
    # the same 2 prompts at both batches: two batch-1 calls, or one batch of 2
    assert m["prompts"] == 2 and len(m["alpha_by_prompt"]) == 2
    assert all(a is None or 0.0 <= a <= 1.0 for a in m["alpha_by_prompt"])
  # one calibration per (batch, temperature), shared by both modes (cached on disk)
  cals = {(r["params"]["batch"], r["params"]["temperature"]): r["metrics"]["calibration"]["key"]
          for r in records}
  assert len(set(cals.values())) == 4
  assert len(list((tmp_path / "cache" / "calibration").glob("*.json"))) == 4
  err = capsys.readouterr().err
  assert err.count("× predicted, efficiency") == 8  # a verdict line per point
  report = (tmp_path / "qs" / "report.md").read_text()
  assert "8 points finished, 0 failed" in report
  assert "chain k=3, batch 1, T=0: " in report and "### Sample: plain vs speculative" in report
  assert "outputs identical" in report
  assert "same 2 held-out code prompts" in report and "Acceptance by prompt" in report
  for png in ("quickstart_speedup", "quickstart_acceptance", "quickstart_run_lengths"):
    assert (tmp_path / "qs" / f"{png}.png").stat().st_size > 1000, png
  assert s.table.count("\n") >= 10 and "efficiency" in s.table


@pytest.mark.slow
def test_quickstart_drafts_with_an_eagle_head(tmp_path, monkeypatch):
  """drafter "eagle": the target's EAGLE head (trained here for a few steps on the random
  target) drafts the chain and the tree; greedy output identical to plain, rows and labels
  name the drafter, its calibration is its own."""
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
  s = launch.run("quickstart", out=str(tmp_path / "qs"), progress=False, bindings=[
      'sweeps.Sweep.axes = {"mode": ["chain", "tree"], "drafter": ["eagle", "model"]}',
      'sweeps.Sweep.fixed = {"k": 3, "tree_widths": (2, 1, 1), "max_new_tokens": 32, '
      '"prompt_len": 16, "repeats": 1, "models": "random", "calibration_k": (1,), '
      '"calibration_repeats": 1, "statistic": "fastest", "prompts": 2, "batch": 1, '
      '"temperature": 0.0, "head_steps": 2, "target_dtype": "float32"}'])
  assert (s.total, s.ok, s.failed) == (4, 4, 0)
  records = runner.read_results(tmp_path / "qs" / runner.RESULTS).values()
  for r in records:
    m, p = r["metrics"], r["params"]
    assert m["identical_to_plain"] is True, r
    assert m["drafter"] == p["drafter"]
    shape = "chain k=3" if p["mode"] == "chain" else "tree (2, 1, 1)"
    label = f"EAGLE head {shape}" if p["drafter"] == "eagle" else shape
    assert m["verdict"].startswith(f"{label}, batch 1, T=0: "), m["verdict"]
  keys = {r["params"]["drafter"]: r["metrics"]["calibration"]["key"] for r in records}
  assert keys["eagle"] != keys["model"]  # a drafter's calibration is its own
  report = (tmp_path / "qs" / "report.md").read_text()
  assert "- EAGLE head, batch 1, T=0" in report and "- draft model, batch 1, T=0" in report


@pytest.mark.slow
def test_alpha_k_sweep_runs_vectorised_and_tracks_the_dial(tmp_path, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))  # a fresh calibration
  s = launch.run("alpha_k_sweep", out=str(tmp_path / "ak"), progress=False,
                 bindings=['sweeps.Sweep.axes = {"alpha": [0.3, 0.9], "k": [3]}',
                           'sweeps.Sweep.fixed = {"models": "random", "max_new_tokens": 48, '
                           '"batch": 4, "repeats": 1, "mc_cycles": 2000, "temperature": 1.0}'])
  assert (s.total, s.ok, s.failed) == (2, 2, 0)
  records = sorted(runner.read_results(tmp_path / "ak" / runner.RESULTS).values(),
                   key=lambda r: r["params"]["alpha"])
  for r in records:
    m = r["metrics"]
    assert abs(m["z_alpha"]) < 4.0, m  # measured α agrees with the dial
    assert abs(m["z_tau"]) < 4.0, m  # measured τ agrees with E[τ]
    assert m["cost"] == "measured" and m["speedup"] > 0 and m["speedup_formula"] > 0
    # measured draft: the calibrated loop costs give both the speedup and the prediction
    assert m["predicted_from"] == "calibrated" and m["cycle_steps"] > 0
    assert m["speedup_formula"] == pytest.approx(m["tau_expected"] / m["cycle_steps"])
    assert m["speedup"] == pytest.approx(m["tau_cycle"] / m["cycle_steps"])
    assert m["speedup_formula_standalone"] > 0  # the standalone-forward column, kept
    assert sum(m["histogram"]) == m["cycles"]
  assert records[1]["metrics"]["tau_cycle"] > records[0]["metrics"]["tau_cycle"]
  for png in ("alpha_k_speedup", "alpha_k_tau", "alpha_k_heatmap", "alpha_k_run_lengths"):
    assert (tmp_path / "ak" / f"{png}.png").stat().st_size > 1000, png
  text = (tmp_path / "ak" / "report.md").read_text()
  assert "## α × k" in text and "calibrated cycle of the real draft" in text
  assert len(list((tmp_path / "cache" / "calibration").glob("*.json"))) == 1  # one per k


def _one_alpha_k_point(tmp_path, monkeypatch, alpha: float, fixed: str) -> dict:
  """The metrics of a one-point α × k run (random target, a fresh calibration cache) whose
  fixed parameters are `fixed` (gin dict items)."""
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
  s = launch.run("alpha_k_sweep", out=str(tmp_path / "ak"), progress=False,
                 bindings=[f'sweeps.Sweep.axes = {{"alpha": [{alpha}]}}',
                           f'sweeps.Sweep.fixed = {{"models": "random", "repeats": 1, {fixed}}}'])
  assert (s.total, s.ok, s.failed) == (1, 1, 0)
  (record,) = runner.read_results(tmp_path / "ak" / runner.RESULTS).values()
  return record["metrics"]


@pytest.mark.slow
def test_alpha_k_sweep_tree_tracks_the_rank_law(tmp_path, monkeypatch):
  """A static tree at the same α: measured τ agrees with E[τ] of i.i.d. siblings (rank law
  α(1 − α)^r; |z| < 4) and is far from a chain's E[τ] of the same depth (the negative
  control: the tree's extra siblings are counted)."""
  m = _one_alpha_k_point(tmp_path, monkeypatch, 0.5,
                         '"k": 3, "tree": (2, 2, 1), "max_new_tokens": 120, "batch": 8, '
                         '"mc_cycles": 5000, "temperature": 0.0')
  assert m["shape"] == "tree 10 nodes, depth 3" and m["z_alpha"] is None
  assert m["tau_expected"] == pytest.approx(1 + 0.75 + 0.75 ** 2 + 0.75 ** 2 * 0.5)
  assert abs(m["z_tau"]) < 4.0, m
  assert abs(m["tau_mc"] - m["tau_expected"]) < 5 * m["tau_mc_se"]
  chain = 1 + 0.5 + 0.25 + 0.125  # E[τ] of a chain of 3 at α = 0.5
  assert (m["tau_cycle"] - chain) / m["tau_cycle_se"] > 4.0
  assert "Shapes: tree 10 nodes, depth 3" in (tmp_path / "ak" / "report.md").read_text()


@pytest.mark.slow
def test_alpha_k_sweep_times_a_random_eagle_head(tmp_path, monkeypatch):
  """draft='eagle': the oracle's α with a random EAGLE-shaped head's measured chain cost
  (the accelerator check's form): calibrated speedup and prediction, no standalone column,
  and the calibration timed the head's loop."""
  m = _one_alpha_k_point(tmp_path, monkeypatch, 0.8,
                         '"k": 3, "draft": "eagle", "max_new_tokens": 32, "batch": 2, '
                         '"mc_cycles": 500, "temperature": 0.0')
  assert m["predicted_from"] == "calibrated" and m["cycle_steps"] > 0
  assert m["speedup"] == pytest.approx(m["tau_cycle"] / m["cycle_steps"])
  assert m["speedup_formula_standalone"] is None and m["c"] is None
  (cal,) = (tmp_path / "cache" / "calibration").glob("*.json")
  assert "EagleDrafter" in cal.read_text()


@pytest.mark.parametrize("change, match", [
    ({"draft": "eagle", "c": 0.1}, "c must be None with draft='eagle'"),
    ({"k": 2, "tree": (2, 2, 1)}, r"tree \(2, 2, 1\) is 3 deep but k is 2"),
    ({"tree": (2, 0)}, "tree must be None .* tuple of widths >= 1"),
    ({"tree": "wide"}, "tree must be None"),
    ({"alpha": 1.2}, "alpha must lie in"),
    ({"alpha": [0.5]}, "alpha must be one number per point"),
    ({"k": 0}, "k must be an int >= 1"),
    ({"temperature": -1.0}, "temperature"),
    ({"c": "cheap"}, "c must be None"),
    ({"draft": "huge"}, "draft must be 'default'"),
    ({"models": "gpt5"}, r"target must be .* got 'gpt5'"),
])
def test_alpha_k_sweep_validation(change, match):
  with pytest.raises(ValueError, match=match):
    alpha_k_sweep.validate({"alpha": 0.5, "k": 2, **change})


@pytest.mark.parametrize("change, match", [
    ({"mode": "beam"}, "mode must be one of"),
    ({"batch": 0}, "batch must be an int >= 1"),
    ({"models": "x"}, r"target must be .* got 'x'"),
    ({"temperature": -1.0}, "temperature"),
    ({"calibration_k": (0,)}, "calibration_k must be"),
    ({"tree_widths": ()}, "tree_widths must be"),
    ({"recalibrate": "yes"}, "recalibrate must be one of"),
    ({"statistic": "mean"}, "statistic must be one of"),
    ({"prompts": 0}, "prompts must be an int >= 1"),
    ({"drafter": "medusa"}, "drafter must be one of"),
    ({"head_steps": 0}, "head_steps must be an int >= 1"),
])
def test_quickstart_validation(change, match):
  with pytest.raises(ValueError, match=match):
    quickstart.validate({"mode": "chain", **change})


def test_all_configs_plan_without_loading_models():
  for name in launch.available_configs():
    sweep, _ = launch.load_sweep(name)
    assert launch.plan(sweep), name


def test_sweep_larger_than_memory_is_refused_before_work(tmp_path):
  with pytest.raises(ValueError, match="GiB but only .* GiB is available"):
    launch.run("quickstart", out=str(tmp_path / "big"), progress=False,
               bindings=['sweeps.Sweep.axes = {"mode": ["chain"], "batch": [10000000]}'])
  assert not (tmp_path / "big").exists()
