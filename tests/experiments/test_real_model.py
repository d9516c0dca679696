"""The real-model study (experiments/real_model.py, benchmarks/real_model.py): question
selection per category, the system syntax and checks, the calibrated prediction of an
adaptive run, the table and report assembled from rows, and (slow) the whole run on a small
random Llama written by transformers, specjax beside transformers, resumed."""

import importlib.util
import json
import math
import pathlib
import types

import numpy as np
import pytest

from specjax.calibration import loop_costs as calibration
from specjax.verify import trees
from specjax.experiments import real_model, real_model_report

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "benchmarks" / "specbench_questions.jsonl"


def _front():
  spec = importlib.util.spec_from_file_location("real_model_front",
                                                ROOT / "benchmarks" / "real_model.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _questions(path, cats):
  path.write_text("".join(json.dumps({"question_id": i + 1, "category": c,
                                      "turns": [f"question {i + 1}"]}) + "\n"
                          for i, c in enumerate(cats)))
  return str(path)


def test_select_takes_the_first_n_of_each_category_in_file_order(tmp_path):
  qs = _questions(tmp_path / "q.jsonl", ["a", "b", "a", "c", "b", "a", "b"])
  assert real_model.select(qs, 1) == [1, 2, 4]
  assert real_model.select(qs, 2) == [1, 3, 2, 5, 4]  # grouped by category, a first
  assert real_model.select(qs, 9) == [1, 3, 6, 2, 5, 7, 4]
  with pytest.raises(ValueError, match="per_category must be an int >= 1, got 0"):
    real_model.select(qs, 0)


def test_the_shipped_question_file_has_spec_benchs_13_categories():
  ids = real_model.select(str(SHIPPED), 5)
  assert len(ids) == 65 and len(set(ids)) == 65
  assert len(real_model.select(str(SHIPPED), 1)) == 13
  assert len(real_model.select(str(SHIPPED), 80)) == 480


@pytest.mark.parametrize("text, parsed", [("lookup@4", ("lookup", 4)),
                                          ("layer-skip:8@auto", ("layer-skip:8", "auto")),
                                          ("eagle:default@tree:3x1x1",
                                           ("eagle:default", ("tree", (3, 1, 1)))),
                                          ("lookup@dyn:4x2", ("lookup", ("dyn", (4, 2))))])
def test_system_syntax(text, parsed):
  assert real_model.parse_system(text) == parsed


def test_tree_systems_run_their_shapes_and_are_priced_by_their_static_twin():
  tree = real_model.shape_of(("tree", (3, 1, 1)))
  assert tree == trees.branching((3, 1, 1)) and tree.size == 9 and tree.max_depth == 3
  dyn = real_model.shape_of(("dyn", (3, 1, 1)), temperature=0.0)
  assert (dyn.budget, dyn.depth, dyn.width) == (9, 3, 3)
  assert dyn.confidence == real_model.DYN_T0_CONFIDENCE
  assert real_model.shape_of(("dyn", (3, 1, 1)), temperature=1.0).confidence == 1.0
  assert real_model.calibrated_shape(("dyn", (3, 1, 1))) == tree
  assert real_model.calibrated_shape(4) == trees.chain(4) == real_model.shape_of(4)
  assert real_model.shape_of("auto") is None


@pytest.mark.parametrize("text", ["lookup", "lookup@0", "lookup@x", "@4", "layer-skip:x@4",
                                  "lookup@tree:", "lookup@tree:3x0", "lookup@dyn:ax2",
                                  "lookup@bush:3"])
def test_bad_system_is_one_error(text):
  with pytest.raises(ValueError, match="systems entry"):
    real_model.parse_system(text)


@pytest.mark.parametrize("change, match", [
    ({"hf_systems": ["plain", "assisted"]}, "no hf_draft"),
    ({"hf_systems": ["lookup"]}, "needs 'plain'"),
    ({"hf_systems": ["plain", "beam"]}, "not one of"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an int >= 1"),
    ({"temperature": -1.0}, "temperature"),
])
def test_validation(change, match):
  with pytest.raises(ValueError, match=match):
    real_model.validate({"systems": ["lookup@4"], **change})


def test_adaptive_prediction_counts_each_chosen_cycle_and_each_plain_token():
  costs = calibration.LoopCosts.from_timings(
      0.01, {trees.chain(1): 0.015, trees.chain(2): 0.02, trees.chain(4): 0.03,
             trees.chain(6): 0.04})
  gen = types.SimpleNamespace(choices=np.array([0, 2, 3, 3]),
                              menu=["k=0", "k=1", "k=2", "k=4", "k=6"],
                              plain_steps=np.array([5]), tokens=[list(range(21))])
  # 5 plain steps + a chain of 2 (2 steps) + two chains of 4 (3 steps each) = 13 steps
  assert real_model.adaptive_prediction(costs, gen) == pytest.approx(20 / 13)


def _cell(tokens, seconds, **extra):
  return {"new_tokens": tokens, "seconds": seconds, **extra}


def _record(q, cat, temp, systems, agree=True):
  m = {"question_id": q, "category": cat, "temperature": temp, "systems": systems,
       "loadavg": [0.1, 0.2], "torch_threads": 2}
  if temp == 0:
    m["agree_with_transformers"] = ({"identical": True} if agree else
                                    {"identical": False, "divergence": {"position": 7,
                                                                        "ulps": 1.5}})
  return {"params": {"target": "t", "prompts": "p", "max_new_tokens": 10, "repeats": 1},
          "metrics": m}


def test_table_aggregates_like_spec_bench_and_report_lists_mismatches(tmp_path):
  recs = [
      _record(1, "rag", 0.0, {
          "specjax plain": _cell(10, 1.0, tau=1.0, identical_to_plain=None),
          "specjax lookup@4": _cell(10, 0.5, tau=3.0, identical_to_plain=True,
                                    speedup_decode=2.2, predicted_speedup=2.0,
                                    depth_tried=[4, 2], depth_accepted=[2, 1]),
          "transformers plain": _cell(10, 2.0, tau=1.0, identical_to_plain=True),
          "transformers lookup(10)": _cell(10, 1.0, tau=2.0, identical_to_plain=True)}),
      _record(2, "rag", 0.0, {
          "specjax plain": _cell(10, 1.0, tau=1.0, identical_to_plain=None),
          "specjax lookup@4": _cell(10, 1.0, tau=1.0, identical_to_plain=False,
                                    speedup_decode=1.0, predicted_speedup=1.0,
                                    divergences=[{"position": 3, "ulps": 40.0}],
                                    depth_tried=[6, 3, 1], depth_accepted=[3, 0, 0]),
          "transformers plain": _cell(10, 2.0, tau=1.0, identical_to_plain=True),
          "transformers lookup(10)": _cell(10, 2.0, tau=1.0, identical_to_plain=True)},
          agree=False),
      _record(3, "qa", 0.0, {"specjax plain": _cell(20, 1.0, tau=1.0),
                             "specjax lookup@4": _cell(20, 2.0, tau=1.0,
                                                       identical_to_plain=True)}),
  ]
  rows = {(r["category"], r["system"]): r for r in real_model_report.table(recs)}
  lookup = rows[("rag", "specjax lookup@4")]
  assert lookup["tok_s"] == pytest.approx(20 / 1.5)  # Σ tokens ÷ Σ seconds
  assert lookup["speedup"] == pytest.approx((20 / 1.5) / 10)  # ÷ specjax plain's, same qs
  assert lookup["tau"] == pytest.approx(2.0) and lookup["identical"] == 1
  assert lookup["predicted_speedup"] == pytest.approx(1.5)
  assert lookup["efficiency"] == pytest.approx(1.6 / 1.5)
  hf = rows[("rag", "transformers lookup(10)")]
  assert hf["speedup"] == pytest.approx((20 / 3) / 5)  # over transformers' own plain
  assert rows[("overall", "specjax lookup@4")]["questions"] == 3
  assert rows[("qa", "specjax lookup@4")]["speedup"] == pytest.approx(0.5)
  # acceptance by position: counts pooled over questions (a shorter list padded), not means
  assert lookup["acceptance_by_position"] == pytest.approx([0.5, 0.2, 0.0])
  assert rows[("qa", "specjax lookup@4")]["acceptance_by_position"] == []
  text = real_model_report.report(recs, tmp_path)
  assert "| rag | 2 | 1.00 · 1.00× · 10.0 | 2.00 · 1.33× · 13.3 |" in text
  assert "specjax lookup@4: identical to specjax plain on 2/3 questions" in text
  assert "question 2: specjax lookup@4 left plain at token 3 (40.0 ulps)" in text
  assert "identical tokens on 2/3 questions" in text
  assert "- specjax lookup@4: 0.500 / 0.200 / 0.000" in text
  assert "question 2 (rag): first difference at token 7 (1.5 ulps" in text
  assert json.loads((tmp_path / "table.json").read_text())[0]["temperature"] == 0.0
  assert not any(math.isnan(r["tok_s"]) for r in rows.values())


def test_front_builds_the_question_axis_and_refuses_bad_flags(capsys):
  front = _front()
  args = front.build_parser().parse_args(["run", "--target", "DIR", "--per-category", "2",
                                          "--systems", "lookup@2,layer-skip:3@auto"])
  axes, fixed = front.bindings(args)
  assert "'temperature': [0.0, 1.0]" in axes and axes.count(",") >= 26
  assert "'systems': ['lookup@2', 'layer-skip:3@auto']" in fixed
  assert "'hf_systems': ['plain', 'lookup']" in fixed
  assert front.main(["run", "--target", "DIR", "--systems", "lookup@0"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "lookup@0" in err[0]


@pytest.mark.slow
def test_real_model_run_beside_transformers_resumes(tmp_path, monkeypatch):
  pytest.importorskip("transformers")
  from hf_testing import llama_dir as _llama_dir
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
  target = _llama_dir(tmp_path / "target", 2, 0)
  qs = tmp_path / "q.jsonl"
  qs.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n"
                        for i, (c, t) in enumerate([("rag", "the cat sat on the mat, the cat"),
                                                    ("qa", "Hello, how are you?"),
                                                    ("rag", "a b c a b c")], 1)))
  out = tmp_path / "run"
  argv = ["run", "--target", str(target), "--prompts", str(qs), "--per-category", "1",
          "--temperatures", "0", "--systems", "lookup@2,layer-skip:1@auto",
          "--max-new-tokens", "6", "--repeats", "1", "--calibration-repeats", "1",
          "--torch-threads", "1", "--out", str(out), "--no-progress"]
  front = _front()
  assert front.main(argv) == 0
  rows = [json.loads(line)["metrics"] for line in (out / "results.jsonl").read_text().splitlines()]
  assert sorted(r["question_id"] for r in rows) == [1, 2]
  for r in rows:
    s = r["systems"]
    assert set(s) == {"specjax plain", "specjax lookup@2", "specjax layer-skip:1@auto",
                      "transformers plain", "transformers lookup(10)"}
    assert s["specjax lookup@2"]["identical_to_plain"] is True
    assert s["specjax layer-skip:1@auto"]["identical_to_plain"] is True
    assert s["transformers lookup(10)"]["identical_to_plain"] is True
    assert r["agree_with_transformers"]["identical"] is True  # same weights, same ids
    assert s["specjax lookup@2"]["predicted_speedup"] > 0
    tried, accepted = s["specjax lookup@2"]["depth_tried"], s["specjax lookup@2"]["depth_accepted"]
    assert len(tried) == 2 and all(0 <= a <= t for a, t in zip(accepted, tried))
  report = (out / "report.md").read_text()
  assert "### T = 0" in report and "| rag | 1 |" in report
  assert front.main(argv) == 0  # resumed: nothing left to do
  assert len((out / "results.jsonl").read_text().splitlines()) == 2


@pytest.mark.slow  # transformers' import and generate: tens of seconds on a loaded CPU
def test_hf_peer_generate_is_greedy_and_counts_forwards():
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from specjax.experiments import hf_peer
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, initializer_range=0.5)
  model = transformers.LlamaForCausalLM(cfg).eval()
  prompt = [3, 5, 7, 3, 5, 7, 3, 5]
  ids = list(prompt)
  with torch.inference_mode():
    for _ in range(6):  # the greedy law, by hand
      ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
  plain = hf_peer.generate(model, prompt, 6, min_new_tokens=6)
  assert plain.tokens == ids[len(prompt):]
  assert plain.forwards == 6 and plain.tau == 1.0  # one forward per token
  lookup = hf_peer.generate(model, prompt, 6, min_new_tokens=6, lookup_tokens=3)
  assert lookup.tokens == plain.tokens and lookup.forwards <= plain.forwards
  sampled = [hf_peer.generate(model, prompt, 6, temperature=1.0, seed=s).tokens
             for s in (1, 1, 2)]
  assert sampled[0] == sampled[1]  # seeded: the same draw again


def test_an_auto_system_runs_the_policy_its_calibration_prices():
  """K = auto runs the adaptive policy priced by the drafter's calibration (its priors
  included): cheap verification and a drafter that accepted most drafts make it speculate;
  the uncalibrated default (`decoding.default_policy`) charges a drafter with no model of its
  own a full target step per draft pass, so prompt lookup never speculated under it."""
  from specjax.calibration import loop_costs as calibration
  from specjax.drafters.lookup import LookupDrafter
  from specjax.experiments import real_model
  from specjax.verify import trees
  chains = {trees.chain(k): 1.0 + 0.05 * k for k in real_model.AUTO_CHAINS}
  costs = calibration.LoopCosts.from_timings(1.0, chains, meta={"batch": 1, "alpha": 0.7})
  lookup = LookupDrafter(max_ngram=3)
  pol = real_model.auto_policy(costs, lookup)
  assert pol.names == ["k=0", "k=1", "k=2", "k=4", "k=6"]
  assert float(pol.prior_alpha) == pytest.approx(0.7)
  assert pol.names[pol.choose(0.7, 1)] != "k=0"  # priced by the calibration: speculate
  assert pol.names[pol.choose(0.05, 1)] == "k=0"  # and not where drafts are rarely accepted
  assert np.asarray(pol.seconds)[0, 1:].tolist() == pytest.approx(
      [1.0 + 0.05 * k for k in real_model.AUTO_CHAINS])  # the calibration's own cycles
  assert np.asarray(pol.seconds)[0, 0] == pytest.approx(1.0)  # lookup: no catch-up cost


def test_an_auto_system_of_medusa_heads_menus_only_the_chains_they_draft():
  """Medusa draws one head per level: 3 heads draft no chain of 4 or 6, so K = auto's menu
  and the chains its calibration times are 1 and 2 of 1, 2, 4, 6 (the study asked 4 heads
  for a chain of 6 and failed every question: 'tree depth 6 exceeds the 4 Medusa heads'); a
  drafter with no depth limit keeps the whole menu."""
  import jax
  from specjax.calibration import loop_costs as calibration
  from specjax.drafters.lookup import LookupDrafter
  from specjax.drafters.medusa import MedusaDrafter
  from specjax.experiments import real_model
  from specjax.verify import trees
  from specjax_testing import TINY, model
  target = model(TINY["llama"], seed=0)
  d = target.config.d_model
  heads = {"w": jax.numpy.zeros((3, d, d)), "b": jax.numpy.zeros((3, d))}
  medusa = MedusaDrafter.of(target, heads)
  assert real_model.auto_chains(medusa) == (1, 2)
  assert real_model.auto_chains(LookupDrafter(max_ngram=3)) == real_model.AUTO_CHAINS
  chains = {trees.chain(k): 1.0 + 0.05 * k for k in real_model.auto_chains(medusa)}
  costs = calibration.LoopCosts.from_timings(1.0, chains, meta={"batch": 1, "alpha": 0.5})
  assert real_model.auto_policy(costs, medusa).names == ["k=0", "k=1", "k=2"]
