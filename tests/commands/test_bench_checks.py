"""`specjax bench` and `specjax generate`: mistakes refused before any question (exit 2, one
line), the embedded questions all decoded, honest report cells (issue 40, items 4, 7, 9, 10)."""

import json
import os
import sys

import pytest

from specjax import cli
from specjax.sweeps import launch, overrides, report

RANDOM = ["--target", "random:tiny-llama", "--draft", "self"]


def _one_line_error(capsys, argv) -> str:
  try:
    code = cli.main(argv)
  except SystemExit as e:  # argparse's own flag errors
    code = e.code
  assert code == 2, argv
  err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
  assert len(err) == 1 and err[0].startswith("specjax: error:"), err
  return err[0]


def _questions(path, n=2):
  path.write_text("".join(json.dumps({"question_id": i + 1, "category": "c",
                                      "turns": ["def f():"]}) + "\n" for i in range(n)))
  return str(path)


@pytest.fixture(scope="module")
def other_tokenizer_draft(tmp_path_factory):
  """A draft model directory whose tokenizer is not the byte tokenizer of random targets."""
  pytest.importorskip("tokenizers")
  from flax import nnx

  from specjax.checkpoints import save_model
  from specjax.data.tokenizer import BPETokenizer
  from specjax.models.presets import PRESETS
  from specjax.models.transformer import Transformer
  root = tmp_path_factory.mktemp("draft")
  tok = BPETokenizer.train(["the cat sat on the mat " * 50], 300)
  (root / "tok").mkdir()
  tok.save(root / "tok")
  net = Transformer(PRESETS["tiny-llama"].replace(vocab_size=tok.vocab_size, n_layers=1),
                    rngs=nnx.Rngs(0))
  return str(save_model(root / "d", net, tokenizer_dir=root / "tok"))


BENCH_MISTAKES = {  # flags -> what the one line names
    "target": (["--target", "no/such/model", "--draft", "self"], "no/such/model"),
    "draft": (["--target", "random:tiny-llama", "--draft", "random:no-such-preset"],
              "no-such-preset"),
    "draft tokenizer": (None, "tokenizer"),
    "mesh": (RANDOM + ["--mesh", "data=64"], "64 devices"),
    "context": (RANDOM + ["--max-new-tokens", "5000"], "max_new_tokens 5000"),
    "tree": (RANDOM + ["--tree", "300"], "tree"),
}


@pytest.mark.parametrize("case", BENCH_MISTAKES, ids=list(BENCH_MISTAKES))
def test_bench_refuses_a_mistake_before_any_question(tmp_path, capsys, other_tokenizer_draft,
                                                     case):
  """Each used to write one failed row per question and exit 1."""
  flags, names = BENCH_MISTAKES[case]
  if flags is None:
    flags = ["--target", "random:tiny-llama", "--draft", other_tokenizer_draft]
  out = tmp_path / "run"
  line = _one_line_error(capsys, ["bench", "--prompts", _questions(tmp_path / "q.jsonl"),
                                  "--repeats", "1", "--max-new-tokens", "2", "--no-progress",
                                  "--out", str(out)] + flags)
  assert names in line, line
  assert not (out / "results.jsonl").exists()


def test_bench_allows_beyond_max_len_when_asked():
  """The over-long advice names --allow-beyond-max-len: bench has the flag, and it lifts a
  RoPE target's trained length."""
  from specjax.experiments import specbench
  fixed = dict(target="random:tiny-llama", draft="self", prompts="code", max_new_tokens=600)
  with pytest.raises(ValueError, match="--allow-beyond-max-len"):
    specbench.preflight(fixed)
  specbench.preflight({**fixed, "allow_beyond_max_len": True})
  args = cli.build_parser().parse_args(["bench", "--allow-beyond-max-len"])
  assert args.allow_beyond_max_len is True


RUN_MISTAKES = {
    "tree_widths": ("tree_widths=x", "tree_widths must be"),
    "chat_template": ("chat_template=1", "chat_template must be True or False"),
    "target_dtype": ("target_dtype=float16", "target_dtype must be one of"),
    "question": ("question=99", "question 99 is not a question id"),
}


@pytest.mark.parametrize("case", RUN_MISTAKES, ids=list(RUN_MISTAKES))
def test_run_specbench_refuses_a_bad_set_before_any_point(tmp_path, capsys, case):
  change, names = RUN_MISTAKES[case]
  out = tmp_path / "run"
  line = _one_line_error(capsys, ["run", "specbench", "--set", "target=random:tiny-llama",
                                  "--set", "draft=self", "--set", change, "--out", str(out),
                                  "--no-progress"])
  assert names in line and not out.exists(), line


def test_every_embedded_question_is_decodable_and_the_axis_follows_the_prompts(tmp_path):
  """The embedded ids are 0..15 (question 16 was never a prompt, prompt 0 never decoded);
  `run specbench --set prompts=FILE` sweeps the file's ids, not the config's."""
  from specjax.experiments import specbench
  embedded = specbench.prompt_set("code", "random:tiny-llama", "self", 4, None, 0.0, None)
  assert specbench.question_ids("code") == sorted(embedded)
  sweep, _ = launch.load_sweep("specbench")
  assert list(sweep.axes["question"]) == specbench.question_ids("code")
  qs = _questions(tmp_path / "q.jsonl", 3)
  sweep, _ = launch.load_sweep("specbench", (), [overrides.parse_set(f"prompts={qs}"),
                                                 overrides.parse_set("target=random"),
                                                 overrides.parse_set("draft=self")])
  assert [p.params["question"] for p in launch.plan(sweep)] == [1, 2, 3]
  sweep, _ = launch.load_sweep("specbench", (), [overrides.parse_set(f"prompts={qs}"),
                                                 overrides.parse_axis("question=2,3")])
  assert list(sweep.axes["question"]) == [2, 3]  # an axis given wins


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_prompt_file_mistakes_name_what_they_are(tmp_path, capsys):
  long_id = tmp_path / "long.jsonl"
  long_id.write_text('{"question_id": ' + "7" * 5000 + ', "turns": ["x"]}\n')
  line = _one_line_error(capsys, ["bench", "--prompts", str(long_id)])
  assert "long.jsonl:1:" in line and "digits" in line and "set_int_max_str_digits" not in line
  fifo = tmp_path / "pipe"
  os.mkfifo(fifo)
  line = _one_line_error(capsys, ["bench", "--prompts", str(fifo)])
  assert "a pipe" in line and "no such file" not in line


GENERATE = {  # generate flags -> (named, not named)
    "tree context": (["--tree", "1000,1000"], "--tree 1000,1000", "--k 4"),
    "tree and k": (["--tree", "2,1", "--k", "3"], "--k 3 with --tree 2,1", None),
    "chat random": (["--chat"], "--target-config tiny-llama", "None"),
}


@pytest.mark.parametrize("case", GENERATE, ids=list(GENERATE))
def test_generate_messages_name_the_flag_given(capsys, case):
  flags, named, not_named = GENERATE[case]
  line = _one_line_error(capsys, ["generate", "--target-config", "tiny-llama",
                                  "--draft-config", "tiny-llama:n_layers=1",
                                  "--max-new-tokens", "2", "--repeats", "1"] + flags)
  assert named in line and (not_named is None or not_named not in line), line


def _record(question, category, tau, decode):
  m = {"question_id": question, "category": category, "prompt_tokens": 3, "new_tokens": 2,
       "tau": tau, "alpha": None, "plain_tok_s": 10.0, "spec_tok_s": 12.0, "speedup": 1.2,
       "speedup_decode": decode, "plain_s": 1.0, "spec_s": 0.8, "accept_by_position": [],
       "loop_fraction": 0.0, "identical_to_plain": True}
  return {"id": str(question), "index": question, "params": {"question": question},
          "status": "ok", "metrics": m}


def test_the_report_escapes_cells_and_explains_empty_ones(tmp_path):
  from specjax.experiments import specbench
  records = [_record(1, "a|b\nc", None, None), _record(2, "plain", None, 1.5)]
  text = specbench.report(records, tmp_path)
  assert "| a\\|b c | 1 | n/a |" in text and "nan" not in text
  assert "τ n/a: no speculative cycle ran" in text
  assert "1 of 2 questions without one: decode phase lost in timing noise" in text
  table = report.results_table("specbench", records, ["question"])
  assert "question_id" not in table and "| question |" in table
  kept = report.results_table("t", [_record(1, "c", 2.0, 1.0)], ["prompt"])
  assert "question_id" in kept  # a metric is dropped only when it repeats its axis


def test_an_old_study_import_gets_its_new_path(tmp_path, monkeypatch):
  config = tmp_path / "old.gin"
  config.write_text("from __gin__ import dynamic_registration\nimport specjax.sweeps as "
                    "sweeps\nimport experiments.exactness as exactness\n")
  monkeypatch.setitem(sys.modules, "experiments", None)  # as outside the checkout
  with pytest.raises(ValueError, match="import specjax.experiments.exactness"):
    launch.load_sweep(str(config))


@pytest.mark.slow
def test_bench_on_an_edited_prompt_file_never_resumes_the_old_rows(tmp_path, capsys):
  qs = _questions(tmp_path / "q.jsonl", 1)
  argv = ["bench", "--prompts", qs, "--repeats", "1", "--max-new-tokens", "2",
          "--no-progress", "--out", str(tmp_path / "run")] + RANDOM
  assert cli.main(argv) == 0
  rows = (tmp_path / "run" / "results.jsonl").read_text()
  (tmp_path / "q.jsonl").write_text(json.dumps({"question_id": 1, "category": "c",
                                                "turns": ["a longer question: def g():"]}))
  capsys.readouterr()
  line = _one_line_error(capsys, argv)
  assert "other inputs" in line and "prompts" in line and "q.jsonl" in line
  assert (tmp_path / "run" / "results.jsonl").read_text() == rows
