"""Prompt sets by reference (specjax.data.prompts): JSONL files in the Spec-Bench / MT-Bench
question format and the plain format, line-by-line validation (each bad line named by its
number), multi-turn message building, and the embedded held-out sets cut as the studies cut
them."""

from __future__ import annotations

import json
import pathlib

import pytest

from specjax.data import prompts as P
from specjax.data.tokenizer import ByteTokenizer

QUESTIONS = [
    {"question_id": 81, "category": "writing",
     "turns": ["Compose a travel blog post about Hawaii.",
               "Rewrite it: every sentence starts with A."]},
    {"question_id": 82, "category": "roleplay", "turns": ["Pretend to be a pirate."],
     "reference": ["ignored"]},
]
PLAIN = [
    {"prompt": "Summarise the plot of Hamlet."},
    {"prompt": "Translate 'cat' to French.", "id": "t1", "category": "translation"},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "What is 2 + 2?"}], "id": "m1"},
]


def write_lines(path: pathlib.Path, lines) -> pathlib.Path:
  """Each item: a dict (dumped as JSON), a str or bytes (written as is)."""
  out = b""
  for line in lines:
    if isinstance(line, dict):
      line = json.dumps(line, ensure_ascii=False)
    out += (line.encode("utf-8") if isinstance(line, str) else line) + b"\n"
  path.write_bytes(out)
  return path


# ----------------------------------------------------------------------------- formats


def test_question_format_first_turn(tmp_path):
  f = write_lines(tmp_path / "question.jsonl", QUESTIONS)
  got = P.load_prompts(str(f))
  assert [(p.question_id, p.category, p.turns) for p in got] == [
      (81, "writing", ("Compose a travel blog post about Hawaii.",)),
      (82, "roleplay", ("Pretend to be a pirate.",))]
  assert got[0].context == () and got[0].token_ids is None and got[0].n_turns == 1
  assert got[0].source == f"{f}:1" and got[1].source == f"{f}:2"
  assert got[0].row() == {"question_id": 81, "category": "writing"}
  assert got[0].messages() == [{"role": "user",
                                "content": "Compose a travel blog post about Hawaii."}]


def test_question_format_multi_turn(tmp_path):
  f = write_lines(tmp_path / "question.jsonl", QUESTIONS)
  p = P.load_prompts(f, multi_turn=True)[0]
  assert p.n_turns == 2 and p.turns == tuple(QUESTIONS[0]["turns"])
  assert p.messages(0) == [{"role": "user", "content": QUESTIONS[0]["turns"][0]}]
  assert p.messages(1, ["Aloha! Hawaii is..."]) == [
      {"role": "user", "content": QUESTIONS[0]["turns"][0]},
      {"role": "assistant", "content": "Aloha! Hawaii is..."},
      {"role": "user", "content": QUESTIONS[0]["turns"][1]}]
  with pytest.raises(ValueError, match=r"answers must be the 1 answer\(s\)"):
    p.messages(1)
  with pytest.raises(ValueError, match="answers must be empty for turn 0"):
    p.messages(0, ["x"])
  with pytest.raises(ValueError, match=r"turn must be an int in \[0, 2\)"):
    p.messages(2, ["a", "b"])
  with pytest.raises(ValueError, match=r"answers\[0\] must be a string"):
    p.messages(1, [3])
  with pytest.raises(ValueError, match="answers must be the 1"):
    p.messages(1, "x")  # a string is not a list of answers


def test_multi_turn_with_context(tmp_path):
  three = {"question_id": 1, "turns": ["a?", "b?", "c?"]}
  p = P.load_prompts(write_lines(tmp_path / "q.jsonl", [three]), multi_turn=True)[0]
  assert [m["role"] for m in p.messages(2, ["A", "B"])] == [
      "user", "assistant", "user", "assistant", "user"]
  assert [m["content"] for m in p.messages(2, ["A", "B"])] == ["a?", "A", "b?", "B", "c?"]
  ctx = P.Prompt("x", "c", turns=("q1", "q2"), context=(("system", "S"),))
  assert ctx.messages(1, ["A1"]) == [{"role": "system", "content": "S"},
                                     {"role": "user", "content": "q1"},
                                     {"role": "assistant", "content": "A1"},
                                     {"role": "user", "content": "q2"}]


def test_plain_format_and_defaults(tmp_path):
  f = write_lines(tmp_path / "plain.jsonl", PLAIN)
  got = P.load_prompts(f)
  assert [(p.question_id, p.category) for p in got] == [(1, "default"), ("t1", "translation"),
                                                         ("m1", "default")]
  assert got[0].turns == ("Summarise the plot of Hamlet.",)
  assert got[2].context == (("system", "Be brief."),) and got[2].turns == ("What is 2 + 2?",)
  assert got[2].messages() == PLAIN[2]["messages"]


def test_mixed_formats_blank_lines_crlf_bom(tmp_path):
  lines = ["\ufeff" + json.dumps(PLAIN[0]), "", "   ", json.dumps(QUESTIONS[0]) + "\r",
           json.dumps(PLAIN[2])]
  f = write_lines(tmp_path / "mixed.jsonl", lines)
  got = P.load_prompts(f)
  assert [p.question_id for p in got] == [1, 81, "m1"]  # default ids are line numbers
  assert [p.source.rsplit(":", 1)[1] for p in got] == ["1", "4", "5"]
  # no trailing newline at the end of the file
  f.write_bytes(json.dumps(PLAIN[0]).encode())
  assert len(P.load_prompts(f)) == 1


def test_count_and_unicode(tmp_path):
  rows = [{"prompt": f"héllo ✓ {i} — «ok»", "id": i} for i in range(5)]
  f = write_lines(tmp_path / "u.jsonl", rows)
  got = P.load_prompts(f, count=3)
  assert [p.question_id for p in got] == [0, 1, 2] and got[0].turns == ("héllo ✓ 0 — «ok»",)
  assert len(P.load_prompts(f, count=50)) == 5


def test_the_file_is_read_in_place(tmp_path):
  f = write_lines(tmp_path / "q.jsonl", QUESTIONS)
  before = sorted(tmp_path.iterdir())
  P.load_prompts(f)
  assert sorted(tmp_path.iterdir()) == before


# ----------------------------------------------------------------------------- bad lines


GOOD = json.dumps({"prompt": "fine"})
BAD_LINES = [
    (b"{not json", "invalid JSON at column 2"),
    (b'{"prompt": "caf\xe9"}', "invalid UTF-8 at byte 16"),
    (b'["a list"]', "expected a JSON object, got an array"),
    (b'"text"', "expected a JSON object, got a string"),
    (b'{"question": "x"}', "unknown format: expected a 'turns'"),
    (b'{"prompt": "x", "turns": ["y"]}', "ambiguous format"),
    (b'{"turns": []}', "turns must not be empty"),
    (b'{"turns": "one"}', "turns must be a list of strings, got a string"),
    (b'{"turns": ["ok", 3]}', r"turns\[1\] must be a string, got a number"),
    (b'{"turns": ["ok", "  "]}', r"turns\[1\] is empty"),
    (b'{"prompt": ""}', "prompt is empty"),
    (b'{"prompt": null}', "prompt must be a string, got null"),
    (b'{"prompt": "x", "question_id": true}', "question_id must be an int or a non-empty"),
    (b'{"prompt": "x", "id": 1.5}', "id must be an int or a non-empty string"),
    (b'{"prompt": "x", "id": ""}', "id must be an int or a non-empty string"),
    (b'{"prompt": "x", "id": 1, "question_id": 1}', "has both 'question_id' and 'id'"),
    (b'{"prompt": "x", "category": 5}', "category must be a non-empty string"),
    (b'{"prompt": "x", "category": ""}', "category must be a non-empty string"),
    (b'{"prompt": "\\ud800"}', "unpaired surrogate"),
    (b'{"messages": []}', "messages must not be empty"),
    (b'{"messages": {"role": "user"}}', "messages must be a list"),
    (b'{"messages": ["hi"]}', r"messages\[0\] must be an object"),
    (b'{"messages": [{"role": "user"}]}', r"messages\[0\] must have exactly the keys.*missing"),
    (b'{"messages": [{"role": "user", "content": "x", "name": "n"}]}', "got extra"),
    (b'{"messages": [{"role": "bot", "content": "x"}]}', r"messages\[0\].role must be one of"),
    (b'{"messages": [{"role": "user", "content": ["x"]}]}', "content must be a string"),
    (b'{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}',
     "the last message must be the user's"),
    (b'{"messages": [{"role": "user", "content": " "}]}', r"messages\[0\].content is empty"),
]


@pytest.mark.parametrize("line,match", BAD_LINES, ids=[m for _, m in BAD_LINES])
def test_bad_line_names_file_and_line(tmp_path, line, match):
  f = tmp_path / "bad.jsonl"
  f.write_bytes(b"\n".join([GOOD.encode(), b"", GOOD.replace("fine", "ok").encode(), line,
                            GOOD.encode()]) + b"\n")
  with pytest.raises(ValueError, match=match) as e:
    P.load_prompts(f)
  msg = str(e.value)
  assert msg.startswith(f"{f}:4: ") and "\n" not in msg


def test_repeated_id(tmp_path):
  f = write_lines(tmp_path / "dup.jsonl", [{"prompt": "a", "id": "x"}, {"prompt": "b"},
                                           {"prompt": "c", "id": "x"}])
  with pytest.raises(ValueError, match=rf"{f}:3: question_id 'x' repeats line 1"):
    P.load_prompts(f)
  # an explicit id equal to another line's default (its line number)
  f = write_lines(tmp_path / "dup2.jsonl", [{"prompt": "a"}, {"prompt": "b", "id": 1}])
  with pytest.raises(ValueError, match=rf"{f}:2: question_id 1 repeats line 1"):
    P.load_prompts(f)
  # 1 and "1" are different ids
  f = write_lines(tmp_path / "ok.jsonl", [{"prompt": "a"}, {"prompt": "b", "id": "1"}])
  assert [p.question_id for p in P.load_prompts(f)] == [1, "1"]


@pytest.mark.parametrize("content", [b"", b"\n\n  \n", b"\xef\xbb\xbf\n"])
def test_empty_file(tmp_path, content):
  f = tmp_path / "empty.jsonl"
  f.write_bytes(content)
  with pytest.raises(ValueError, match=rf"^{f}: no prompts"):
    P.load_prompts(f)


def test_bad_references_and_arguments(tmp_path):
  with pytest.raises(ValueError, match=r"one of \('code', 'prose'\) or a path.*no such file"):
    P.load_prompts(tmp_path / "missing.jsonl")
  with pytest.raises(ValueError, match="a directory"):
    P.load_prompts(tmp_path)
  with pytest.raises(ValueError, match="or a path to a JSONL file"):
    P.load_prompts("")
  with pytest.raises(ValueError, match="or a path to a JSONL file"):
    P.load_prompts(3)
  f = write_lines(tmp_path / "q.jsonl", QUESTIONS)
  with pytest.raises(ValueError, match="prompt_len applies to the embedded sets"):
    P.load_prompts(f, prompt_len=32)
  with pytest.raises(ValueError, match="count must be an int >= 1, got 0"):
    P.load_prompts(f, count=0)
  with pytest.raises(ValueError, match="multi_turn must be a bool"):
    P.load_prompts(f, multi_turn=1)
  with pytest.raises(ValueError, match="needs tokenizer, count and prompt_len"):
    P.load_prompts("code", count=2)
  with pytest.raises(ValueError, match="cannot read prompt file"):
    P.read_jsonl(tmp_path / "nope.jsonl")


# ----------------------------------------------------------------------------- token ids


def test_encode_prompt(tmp_path):
  tok = ByteTokenizer()
  f = write_lines(tmp_path / "q.jsonl", QUESTIONS + PLAIN)
  got = P.load_prompts(f, multi_turn=True)
  assert P.encode_prompt(got[0], tok) == tok.encode(QUESTIONS[0]["turns"][0])
  # no chat template: the conversation's contents joined by newlines
  assert P.encode_prompt(got[0], tok, turn=1, answers=["A"]) == tok.encode(
      "\n".join([QUESTIONS[0]["turns"][0], "A", QUESTIONS[0]["turns"][1]]))
  assert P.encode_prompt(got[4], tok) == tok.encode("Be brief.\nWhat is 2 + 2?")
  with pytest.raises(ValueError, match="use_chat_template must be a bool"):
    P.encode_prompt(got[0], tok, use_chat_template=None)


def test_encode_prompt_with_a_chat_template(tmp_path):
  from hf_testing import CHATML, write_tokenizer_dir

  from specjax.checkpoints.hf.tokenizer import HFTokenizer
  tok = HFTokenizer.from_dir(write_tokenizer_dir(tmp_path / "tok",
                                                 config={"chat_template": CHATML}))
  p = P.load_prompts(write_lines(tmp_path / "q.jsonl", QUESTIONS), multi_turn=True)[0]
  ids = P.encode_prompt(p, tok, turn=1, answers=["A"])
  assert ids == tok.apply_chat_template(p.messages(1, ["A"]))
  assert P.encode_prompt(p, tok, turn=1, answers=["A"], use_chat_template=False) == tok.encode(
      "\n".join([p.turns[0], "A", p.turns[1]]))


# ----------------------------------------------------------------------------- embedded


def test_cut_prompts_rule():
  tok = ByteTokenizer()
  texts = ["abcdefghij", "klmnopqrst"]  # 21 ids joined by "\n"
  ids = tok.encode("\n".join(texts))
  got = P.cut_prompts(tok, texts, 3, 6)
  stride = (21 - 6) // 3
  assert got == [ids[i * stride:i * stride + 6] for i in range(3)]
  assert P.cut_prompts(tok, texts, 18, 4) == [ids[i:i + 4] for i in range(18)]  # stride 1
  with pytest.raises(ValueError, match="21 token ids cannot hold 19 prompt"):
    P.cut_prompts(tok, texts, 19, 4)
  with pytest.raises(ValueError, match="prompt_len must be an int >= 1"):
    P.cut_prompts(tok, texts, 2, 0)
  with pytest.raises(ValueError, match="texts must not be empty"):
    P.cut_prompts(tok, [], 2, 4)


@pytest.mark.parametrize("name", ["code", "prose"])
def test_embedded_sets(name):
  tok = ByteTokenizer()
  got = P.load_prompts(name, tokenizer=tok, count=5, prompt_len=24)
  texts = P.held_out_texts(name)
  assert 0 < len(texts) <= P.HELD_OUT_DOCS  # the validation split's first documents
  assert [p.token_ids for p in got] == [tuple(w) for w in P.cut_prompts(tok, texts, 5, 24)]
  assert [p.question_id for p in got] == list(range(5))
  assert {p.category for p in got} == {name} and all(len(p.token_ids) == 24 for p in got)
  assert P.encode_prompt(got[1], tok) == list(got[1].token_ids)
  with pytest.raises(ValueError, match="is token ids, not messages"):
    got[0].messages()
  with pytest.raises(ValueError, match="one turn, no answers"):
    P.encode_prompt(got[0], tok, turn=1)


def test_embedded_code_matches_the_studies():
  """`code` is experiments/measure.py's held-out prompts, cut by its `prompts` rule."""
  measure = pytest.importorskip("specjax.experiments.measure")
  tok = ByteTokenizer()
  texts = measure._held_out_texts()
  assert tuple(texts) == P.held_out_texts("code")
  want = measure.prompts(tok, texts, 6, 32)
  assert [list(p.token_ids) for p in P.load_prompts("code", tokenizer=tok, count=6,
                                                    prompt_len=32)] == want
  assert measure.workload(tok, texts, 4, 6, 16) == P.cut_prompts(tok, texts, 8, 16)


def test_a_file_named_like_an_embedded_set(tmp_path, monkeypatch):
  write_lines(tmp_path / "code", [{"prompt": "mine"}])
  monkeypatch.chdir(tmp_path)
  assert P.load_prompts("./code")[0].turns == ("mine",)
  assert P.load_prompts(pathlib.Path("code"))[0].turns == ("mine",)  # a Path is a path
