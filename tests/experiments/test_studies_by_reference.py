"""Every study takes its target, draft and prompts by reference (experiments/references.py):
each study's validation and memory estimate accept a Hugging Face directory target (its
config read from the files, no weights loaded), refuse what only the embedded pair has in
one line, and one study (the quickstart, through `specjax run ... --set target=DIR`) runs
end to end on a Hugging Face pair with a Spec-Bench-format prompt file."""

from __future__ import annotations

import json
import pathlib

import pytest

from specjax.experiments import (adaptive, alpha_k_sweep, batch_breakeven, drafters, exactness,
                         long_context, quickstart, references, tree_shapes)

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_testing import llama_dir as _llama_dir, theirs  # noqa: E402

QUESTIONS = [{"question_id": 7, "category": "writing", "turns": ["write a poem about the sea"]},
             {"question_id": 9, "category": "chat", "turns": ["Hello, how are you?"]}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  root = tmp_path_factory.mktemp("hf")
  target, draft = _llama_dir(root / "target", 2, 0), _llama_dir(root / "draft", 1, 1)
  questions = root / "questions.jsonl"
  questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
  return str(target), str(draft), str(questions)


def _studies(target, draft, prompts):
  """(name, module, valid params) of every study, on the Hugging Face pair."""
  common = {"target": target, "draft": draft, "prompts": prompts}
  return [
      ("quickstart", quickstart, {"mode": "chain", "drafter": "model", **common}),
      ("alpha_k_sweep", alpha_k_sweep, {"alpha": 0.5, "k": 2, **common}),
      ("tree_shapes", tree_shapes, {"shape": "chain", "budget": 4, **common}),
      ("long_context", long_context, {"context_len": 64, "k": 2, "max_new_tokens": 8,
                                      **common}),
      ("batch_breakeven", batch_breakeven, {"batch": 1, "k": 2, **common}),
      ("drafters", drafters, {"variant": "model:chain", **common}),
      ("adaptive", adaptive, {"policy": "adaptive", **common}),
      ("exactness", exactness, {"case": "model/chain", "target": target, "draft": draft}),
  ]


def test_every_study_accepts_a_hf_directory_target(pair):
  target, draft, prompts = pair
  cfg = references.target_config(target)
  assert (cfg.vocab_size, cfg.n_layers, cfg.d_model) == (448, 2, 64)  # read, not loaded
  for name, study, params in _studies(target, draft, prompts):
    study.validate(params)
    assert study.memory(params) > 0, name
    study.validate({**params, "target": None, "models": target})  # the older name


@pytest.mark.parametrize("change,pattern", [
    ({"target": "no/such/dir"}, r"target must be .* got 'no/such/dir' \(no such directory\)"),
    ({"draft": "no/such/dir"}, r"draft must be .* got 'no/such/dir' \(no such directory\)"),
    ({"prompts": "no/such/file.jsonl"}, r"prompts must be one of .* \(no such file\)"),
])
def test_every_study_refuses_a_bad_reference_naming_it(pair, change, pattern):
  target, draft, prompts = pair
  for name, study, params in _studies(target, draft, prompts):
    if name == "exactness" and "prompts" in change:
      continue  # the exactness study takes no prompts
    with pytest.raises(ValueError, match=pattern):
      study.validate({**params, **change})


def test_a_directory_that_holds_no_model_is_refused(tmp_path, pair):
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match=r"^target .*empty: .*neither a Hugging Face"):
    quickstart.validate({"mode": "chain", "target": str(tmp_path / "empty")})


def test_what_only_the_embedded_pair_has_is_refused_in_one_line(pair, tmp_path):
  target, draft, prompts = pair
  with pytest.raises(ValueError, match=r"quickstart's EAGLE head .* embedded target only"):
    quickstart.validate({"mode": "chain", "drafter": "eagle", "target": target})
  with pytest.raises(ValueError, match=r"medusa head this study trains exists for the "
                                       r"embedded target only"):
    drafters.validate({"variant": "medusa:chain", "target": target})
  with pytest.raises(ValueError, match=r"category 'prose' picks an embedded prompt set"):
    drafters.validate({"variant": "model:chain", "target": target, "prompts": prompts,
                       "category": "prose"})
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"turns": ["fine"]}\n{"turns": []}\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:2: turns must not be empty"):
    tree_shapes.validate({"shape": "chain", "budget": 4, "prompts": str(bad)})


def test_prompt_references_and_the_older_count():
  assert references.prompt_spec(8) == ("code", 8)
  assert references.prompt_spec("prose") == ("prose", None)
  with pytest.raises(ValueError, match=r"prompts must be an int >= 1"):
    references.prompt_spec(0)
  assert references.target_ref(None, "random") == "random"
  assert references.target_ref("x", "default") == "x"  # --set target wins over a config's


@pytest.mark.slow
def test_quickstart_runs_on_a_hf_pair_by_reference(pair, tmp_path, monkeypatch):
  """`specjax run quickstart --set target=DIR --set draft=DIR --set prompts=FILE`: the
  prompts rendered with the target's chat template, identical to plain at T = 0, and the
  question ids and categories in the row."""
  from specjax import cli
  from specjax.data.prompts import encode_prompt, load_prompts
  from specjax.sweeps import runner
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
  target, draft, prompts = pair
  out = tmp_path / "qs"
  assert cli.main(["run", "quickstart", "--out", str(out), "--no-progress",
                   "--axis", "mode=chain", "--axis", "batch=1", "--axis", "temperature=0.0",
                   "--set", f"target={target}", "--set", f"draft={draft}",
                   "--set", f"prompts={prompts}", "--set", "drafter=model",
                   "--set", "prompt_count=2", "--set", "max_new_tokens=8", "--set", "k=2",
                   "--set", "repeats=1", "--set", "calibration_repeats=1",
                   "--set", "target_dtype=float32", "--set", "statistic=fastest"]) == 0
  (record,) = runner.read_results(out / runner.RESULTS).values()
  m = record["metrics"]
  assert record["params"]["target"] == target and m["identical_to_plain"] is True
  assert m["question_ids"] == [7, 9] and m["categories"] == ["writing", "chat"]
  tok = references.load_target(target)[1]
  first = encode_prompt(load_prompts(prompts)[0], tok)
  assert first == theirs(pathlib.Path(target), [{"role": "user", "content": QUESTIONS[0][
      "turns"][0]}])  # transformers' apply_chat_template
  assert m["sample"]["prompt"] == tok.decode(first[-80:])[:quickstart.SAMPLE_CHARS]
