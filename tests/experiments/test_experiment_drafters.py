"""The drafters experiment, reduced, end to end through the runner on random tiny models
(heads trained for a few steps): one variant of every drafter kind at T = 0 (greedy: each
must reproduce plain decoding exactly) and one sampled point; rows carry the fields the
report and the issue name; report, table and plots are written; bad parameters are refused
before any work.

Performance is never timed in tests: every timed call reads a virtual clock advanced by a
planted cost model (`virtual_clock`), so the pipeline is checked deterministically, down to
the measured speedup agreeing with the predicted one."""

from __future__ import annotations

import numpy as np
import pytest

from specjax.experiments import drafters
from specjax.calibration import timing
from specjax.sweeps import launch, runner

VARIANTS = ["lookup:tree", "layer_skip:chain", "medusa:tree", "eagle:dynamic", "model:chain",
            "oracle:chain"]
FIELDS = ("drafter", "shape", "temperature", "batch", "category", "alpha", "alpha_trial",
          "tau", "acceptance_by_position", "speedup", "predicted_speedup", "efficiency",
          "identical_to_plain", "head_train_seconds")


STEP, PREFILL, CYCLE = 1e-3, 1e-2, 1.5  # planted: seconds per plain step, per prefill;
                                        # a loop iteration costs CYCLE plain steps


@pytest.fixture
def virtual_clock(monkeypatch):
  """Every timed call (`timing.alternate`, which the calibration and `measure.compare`
  share) costs PREFILL plus STEP per plain token after the first, or CYCLE·STEP per loop
  iteration of a speculative run (its slowest row's cycles), on a virtual clock."""
  now = [0.0]
  real = timing.alternate

  def cost(g) -> float:
    if g.stats is not None:
      return PREFILL + CYCLE * STEP * int(np.max(g.stats["cycles"]))
    return PREFILL + STEP * (max(len(t) for t in g.tokens) - 1)

  def timed(fn):
    def call():
      out = fn()
      now[0] += cost(out)
      return out
    return call

  def alternate(fns, repeats, timer=None):
    del timer
    return real({name: timed(fn) for name, fn in fns.items()}, repeats, timer=lambda: now[0])

  monkeypatch.setattr(timing, "alternate", alternate)


def _run(tmp_path, axes: str, prompts: int = 1, target_dtype: str = "float32"):
  # one prompt per call by default: the virtual clock prices a call by its slowest row
  return launch.run("drafters", out=str(tmp_path / "dx"), progress=False, bindings=[
      f"sweeps.Sweep.axes = {axes}",
      'sweeps.Sweep.fixed = {"k": 2, "tree_widths": (2, 1), "max_new_tokens": 32, '
      '"prompt_len": 16, "repeats": 1, "models": "random", "head_steps": 3, '
      f'"calibration_k": (), "calibration_repeats": 1, "prompts": {prompts}, '
      f'"target_dtype": "{target_dtype}"}}'])


@pytest.mark.slow
def test_drafters_reduced_end_to_end(tmp_path, monkeypatch, capsys, virtual_clock):
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))  # a fresh calibration
  axes = (f'{{"variant": {VARIANTS}, "category": ["code"], "temperature": [0.0]}}'
          .replace("'", '"'))
  s = _run(tmp_path, axes)
  assert (s.total, s.ok, s.failed) == (len(VARIANTS), len(VARIANTS), 0)
  records = runner.read_results(tmp_path / "dx" / runner.RESULTS).values()
  seen = set()
  for r in records:
    m, p = r["metrics"], r["params"]
    for field in FIELDS:
      assert field in m, (field, p)
    assert f"{m['drafter']}:{m['shape']}" == p["variant"]
    seen.add(m["drafter"])
    assert m["identical_to_plain"] is True, p  # greedy: every drafter reproduces plain
    assert 1.0 <= m["tau"] <= m["drafted_per_cycle"] + 1 and 0.0 <= m["alpha"] <= 1.0
    # the planted costs: a cycle is CYCLE steps, so speedup = τ / CYCLE, measured and
    # predicted (the prediction's τ per iteration comes from the measured reach by depth)
    assert m["cycle_steps"] == pytest.approx(CYCLE, rel=1e-6)
    assert m["speedup"] == pytest.approx(m["tau"] / CYCLE, rel=0.1)
    assert 0.8 <= m["efficiency"] <= 1.25, (p, m["efficiency"])
    assert (m["head_train_seconds"] is not None) == (m["drafter"] in ("medusa", "eagle"))
    assert m["oracle_alpha"] == (0.8 if m["drafter"] == "oracle" else None)
    assert m["label"].startswith(f"{m['drafter']} {m['shape']}")
    assert m["verdict"].startswith(m["label"] + ", code, batch 1, T=0: ")
  assert seen == set(drafters.DRAFTERS)
  err = capsys.readouterr().err
  assert err.count("× predicted, efficiency") == len(VARIANTS)  # a verdict line per point
  report = (tmp_path / "dx" / "report.md").read_text()
  assert "| drafter | code T=0 |" in report and "| eagle dynamic | " in report
  assert "### Head training" in report and "- medusa: " in report
  for png in ("drafters_speedup", "drafters_acceptance"):
    assert (tmp_path / "dx" / f"{png}.png").stat().st_size > 1000, png


@pytest.mark.slow  # compile-heavy (fast-tier durations)
def test_drafters_sampled_point_on_prose(tmp_path, monkeypatch, virtual_clock):
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
  s = _run(tmp_path, '{"variant": ["lookup:chain"], "category": ["prose"], '
                     '"temperature": [1.0]}', prompts=3)
  assert (s.total, s.ok) == (1, 1)
  (r,) = runner.read_results(tmp_path / "dx" / runner.RESULTS).values()
  m = r["metrics"]
  assert m["prompts"] == 3 and sum(m["run_lengths"]) > 0  # three batch-1 calls, pooled
  assert m["identical_to_plain"] is None and m["category"] == "prose"
  assert m["temperature"] == 1.0 and m["tau_iid"] is not None


@pytest.mark.slow
def test_drafters_on_a_bf16_served_target(tmp_path, monkeypatch, virtual_clock):
  """The target served in bfloat16 (heads trained on its float32 weights, the EAGLE and
  Medusa drafters reading the bf16 target's embedding, LM head and features): every drafter
  kind that runs on the target still reproduces plain bf16 decoding at T = 0."""
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
  variants = ["medusa:tree", "eagle:chain", "layer_skip:chain"]
  axes = (f'{{"variant": {variants}, "category": ["code"], "temperature": [0.0]}}'
          .replace("'", '"'))
  s = _run(tmp_path, axes, target_dtype="bfloat16")
  assert (s.total, s.ok, s.failed) == (3, 3, 0)
  for r in runner.read_results(tmp_path / "dx" / runner.RESULTS).values():
    assert r["params"]["target_dtype"] == "bfloat16"
    assert r["metrics"]["identical_to_plain"] is True, r["params"]["variant"]


@pytest.mark.parametrize("change, match", [
    ({"target_dtype": "float16"}, r"target_dtype must be one of \('float32', 'bfloat16'\)"),
    ({"variant": "lookup:dynamic"}, r"variant must be one of .*'eagle:dynamic'"),
    ({"variant": "medusa"}, "variant must be one of"),
    ({"category": "poetry"}, r"category must be one of \('code', 'prose'\), got 'poetry'"),
    ({"temperature": -1.0}, "temperature must be a finite number"),
    ({"max_ngram": 0}, "max_ngram must be an int >= 1, got 0"),
    ({"max_ngram": 2, "min_ngram": 3}, "min_ngram"),
    ({"skip_layers": 2}, r"layers must be an int in \[1, 1\]"),
    ({"oracle_alpha": 1.5}, "oracle_alpha must be a finite number"),
    ({"tree_widths": ()}, "tree_widths must be a non-empty list"),
    ({"variant": "eagle:dynamic", "tree_widths": (2, 2, 2)},
     "the dynamic tree of the same budget"),
    ({"calibration_k": [0]}, "calibration_k must be a list of ints >= 1"),
    ({"models": "huge"}, r"target must be .* got 'huge' \(no such directory\)"),
    ({"dynamic_confidence": 0.0}, r"dynamic_confidence must be None or a finite number > 0 \(the "
                                  r"dynamic tree's scoring temperature"),
])
def test_validation(change, match):
  params = {"variant": "lookup:chain", "models": "random", **change}
  with pytest.raises(ValueError, match=match):
    drafters.validate(params)


def test_the_dynamic_trees_scoring_temperature_follows_the_sampler_unless_given():
  assert drafters.confidence_for(None, 0.0) == drafters.T0_CONFIDENCE < 1.0
  assert drafters.confidence_for(None, 0.7) == 1.0
  assert drafters.confidence_for(0.5, 0.0) == drafters.confidence_for(0.5, 1.0) == 0.5
  tree = drafters.drafter_and_tree("eagle", "dynamic", 0.0, models="random", k=2,
                                   tree_widths=(2, 1), skip_layers=None, max_ngram=3,
                                   min_ngram=1, oracle_alpha=0.8, head_steps=1)[1]
  assert tree.confidence == drafters.T0_CONFIDENCE


def test_memory_counts_each_drafters_own_cache():
  base = {"models": "random", "batch": 2, "prompt_len": 16, "max_new_tokens": 32}
  mem = {v: drafters.memory({**base, "variant": v}) for v in
         ("lookup:chain", "medusa:tree", "eagle:chain", "layer_skip:chain", "oracle:chain")}
  assert mem["lookup:chain"] == mem["medusa:tree"] > 0  # no cache of their own
  assert mem["lookup:chain"] < mem["eagle:chain"] < mem["oracle:chain"]
  assert mem["layer_skip:chain"] < mem["oracle:chain"]
