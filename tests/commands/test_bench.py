"""`specjax bench`: Spec-Bench rows per question, the category table, resume, bad files."""

import json

import pytest

from specjax import cli

QUESTIONS = [
    {"question_id": 81, "category": "coding", "turns": ["def add(a, b):\n", "and a test?"]},
    {"question_id": 82, "category": "coding", "turns": ["class Point:\n"]},
    {"question_id": "w1", "category": "writing", "turns": ["# A function that sorts\n"]},
]
FIELDS = {"question_id", "category", "prompt_tokens", "new_tokens", "tau", "alpha",
          "plain_tok_s", "spec_tok_s", "speedup", "speedup_decode", "identical_to_plain",
          "accept_by_position", "loop_fraction"}


def _write(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return path


def _rows(run_dir):
  return [json.loads(l) for l in (run_dir / "results.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_bench_writes_a_row_per_question_and_the_table_then_resumes(tmp_path, capsys):
  qs = _write(tmp_path / "q.jsonl", QUESTIONS)
  argv = ["bench", "--target", "default", "--draft", "eagle:default", "--prompts", str(qs),
          "--k", "3", "--max-new-tokens", "8", "--repeats", "1", "--out",
          str(tmp_path / "run"), "--no-progress"]
  assert cli.main(argv) == 0
  rows = _rows(tmp_path / "run")
  assert sorted(str(r["params"]["question"]) for r in rows) == ["81", "82", "w1"]
  for r in rows:
    assert FIELDS <= set(r["metrics"]), FIELDS - set(r["metrics"])
    assert r["metrics"]["identical_to_plain"] is True and r["metrics"]["new_tokens"] == 8
  report = (tmp_path / "run" / "report.md").read_text()
  for line in ("| coding | 2 |", "| writing | 1 |", "| overall | 3 |", "by draft position"):
    assert line in report
  capsys.readouterr()
  assert cli.main(argv) == 0  # resumes: nothing decoded again
  assert "0 questions finished, 0 failed, 3 already done" in capsys.readouterr().out
  assert len(_rows(tmp_path / "run")) == 3


@pytest.mark.slow  # compile-heavy (fast-tier durations)
def test_every_drafter_kind_and_a_tree_run_under_bench(tmp_path):
  qs = _write(tmp_path / "q.jsonl", QUESTIONS[:1])
  for i, extra in enumerate((["--draft", "lookup"], ["--draft", "layer-skip:2"],
                             ["--draft", "medusa:default", "--k", "4"],
                             ["--draft", "default", "--tree", "2,1"])):
    out = tmp_path / f"run{i}"
    assert cli.main(["bench", "--prompts", str(qs), "--max-new-tokens", "6", "--repeats",
                     "1", "--out", str(out), "--no-progress"] + extra) == 0, extra
    assert _rows(out)[0]["metrics"]["identical_to_plain"] is True


@pytest.mark.parametrize("content, message", [
    ('{"question_id": 1, "category": "c", "turns": ["x"]}\n{"turns": 5}\n', ":2:"),
    ("not json\n", ":1:"),
])
def test_a_bad_question_file_is_one_line_naming_the_line(tmp_path, capsys, content, message):
  qs = tmp_path / "bad.jsonl"
  qs.write_text(content)
  assert cli.main(["bench", "--prompts", str(qs), "--out", str(tmp_path / "r")]) == 2
  err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
  assert len(err) == 1 and message in err[0] and "bad.jsonl" in err[0], err


@pytest.mark.parametrize("argv, message", [
    (["--k", "0"], "--k: must be an int >= 1 or 'auto'"),
    (["--tree", "2,x"], "--tree: must be ints >= 1 separated by commas"),
    (["--max-new-tokens", "0"], "max_new_tokens must be an int >= 1"),
    (["--limit", "0"], "--limit must be an int >= 1"),
])
def test_bad_flags_are_one_line(tmp_path, capsys, argv, message):
  try:
    code = cli.main(["bench", "--out", str(tmp_path / "r")] + argv)
  except SystemExit as e:  # argparse's own flag errors
    code = e.code
  assert code == 2
  err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
  assert len(err) == 1 and message in err[0], err


@pytest.mark.slow
def test_multi_turn_feeds_each_answer_back(tmp_path, monkeypatch):
  """`--multi-turn`: turn 2's conversation holds turn 1 and the model's own answer to it (the
  plain run's output) as the assistant turn; one row per question over both turns."""
  from specjax.experiments import specbench
  qs = _write(tmp_path / "q.jsonl", QUESTIONS[:2])
  calls = []
  real = specbench.encode_prompt

  def recording(prompt, tok, *, turn=0, answers=(), use_chat_template=True):
    calls.append((prompt.question_id, turn, list(answers)))
    return real(prompt, tok, turn=turn, answers=answers, use_chat_template=use_chat_template)

  monkeypatch.setattr(specbench, "encode_prompt", recording)
  common = dict(target="random:tiny-llama", draft="self", prompts=str(qs), k=2,
                max_new_tokens=6, repeats=1)
  m = specbench.point(81, multi_turn=True, **common)
  assert [c[:2] for c in calls] == [(81, 0), (81, 1)] and calls[1][2] != [""]
  run = specbench.loaded("random:tiny-llama", "self", 2, None, 0.0, None)
  prompt = specbench.prompt_set(str(qs), "random:tiny-llama", "self", 2, None, 0.0, None,
                                True)[81]
  assert m["turns"] == 2 and m["turn_prompt_tokens"] == [
      len(real(prompt, run.tokenizer)), len(real(prompt, run.tokenizer, turn=1,
                                                 answers=calls[1][2]))]
  assert m["identical_to_plain"] is True and m["new_tokens"] == 12  # 6 per turn
  calls.clear()
  single = specbench.point(81, **common)  # the default: the first turn alone
  assert [c[:2] for c in calls] == [(81, 0)] and "turns" not in single
  assert single["prompt_tokens"] == m["prompt_tokens"] and single["new_tokens"] == 6
  assert specbench.point(82, multi_turn=True, **common)["turns"] == 1  # a one-turn question
