"""Prompt sets named by a string: the embedded held-out sets, or a JSONL file of the user's.

`load_prompts(ref, ...)` reads

- `code` / `prose`: the embedded sets. Their text is the (at most) first 64 validation
  documents of `specjax.data.corpus`'s corpus of that name (held out from training), joined
  by newlines, encoded once, and cut into `count` windows of `prompt_len` token ids at an
  even stride: the prompts the studies decode (experiments/measure.py `prompts`). These
  prompts are token ids, not text, and take no chat template. A file named `code` is
  `./code`.
- any other string: a path to a JSONL file, one prompt per line, in either format (both may
  be mixed in one file):

    {"question_id": 81, "category": "writing", "turns": ["...", "..."]}   Spec-Bench / MT-Bench
    {"prompt": "...", "id": "a", "category": "c"}                          plain text
    {"messages": [{"role": "system", "content": "..."},
                  {"role": "user", "content": "..."}], "id": "b"}          a conversation

  `question_id` (or `id`) and `category` are optional: the line number (1-based) and
  "default". A question record gives its first turn, or every turn in order with
  `multi_turn=True`; the caller decoding turn i passes its answers to turns 0..i-1 to
  `Prompt.messages(i, answers)`, which puts each answer as the assistant message after its
  turn. A `messages` record ends in a user message (its one turn); the messages before it
  are the prompt's `context`. Other keys (Spec-Bench's `reference`, ...) are ignored.

Each line is validated as it is read; a bad one is a ValueError naming the file and the line
(invalid UTF-8 or JSON, not an object, no known format or more than one, missing or mistyped
fields, empty turns or contents, unknown roles, a repeated id). Blank lines are skipped; a
file without any prompt is an error. Nothing is copied: the file is read where it is.

A `Prompt` carries `question_id` and `category` so they can travel into every result row
(`Prompt.row()`); `encode_prompt` turns one into token ids (`specjax.data.chat`: the tokenizer's
chat template when it has one and it is not opted out, plain text otherwise).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
from typing import Any, Mapping, Sequence
from specjax.data import chat
from specjax.data.corpus import load_corpus

EMBEDDED = ("code", "prose")
HELD_OUT_DOCS = 64  # validation documents of an embedded set
ROLES = ("system", "user", "assistant")
DEFAULT_CATEGORY = "default"
_FORMATS = ("turns", "prompt", "messages")


@dataclasses.dataclass(frozen=True)
class Prompt:
  """One prompt of a set.

  `turns` are the user turns in order (one unless a multi-turn question was read with
  `multi_turn=True`); `context` the (role, content) messages before the first turn;
  `token_ids` the prompt itself for the embedded sets (then `turns` is empty); `source`
  where it came from ("FILE:LINE", or the embedded set's name).
  """
  question_id: int | str
  category: str
  turns: tuple[str, ...] = ()
  context: tuple[tuple[str, str], ...] = ()
  token_ids: tuple[int, ...] | None = None
  source: str = ""

  @property
  def n_turns(self) -> int:
    """Turns a caller decodes (1 for a token-id prompt)."""
    return 1 if self.token_ids is not None else len(self.turns)

  def messages(self, turn: int = 0, answers: Sequence[str] = ()) -> list[dict[str, str]]:
    """The conversation to decode turn `turn` from: the context, then for each earlier turn
    j its user message and the assistant message `answers[j]`, then turn `turn`'s user
    message. `answers` holds exactly `turn` strings. ValueError for a token-id prompt."""
    if self.token_ids is not None:
      raise ValueError(f"prompt {self.question_id!r} of {self.source} is token ids, "
                       f"not messages")
    if isinstance(turn, bool) or not isinstance(turn, int) or not 0 <= turn < len(self.turns):
      raise ValueError(f"turn must be an int in [0, {len(self.turns)}) for prompt "
                       f"{self.question_id!r}, got {turn!r}")
    if isinstance(answers, str) or len(answers) != turn:
      raise ValueError(f"answers must be the {turn} answer(s) to turns 0..{turn - 1} of prompt "
                       f"{self.question_id!r}, got {_short(answers)}" if turn else
                       f"answers must be empty for turn 0, got {_short(answers)}")
    for j, answer in enumerate(answers):
      if not isinstance(answer, str):
        raise ValueError(f"answers[{j}] must be a string, got {type(answer).__name__}")
    out = [{"role": role, "content": content} for role, content in self.context]
    for j in range(turn):
      out += [{"role": "user", "content": self.turns[j]},
              {"role": "assistant", "content": answers[j]}]
    out.append({"role": "user", "content": self.turns[turn]})
    return out

  def row(self) -> dict[str, Any]:
    """The fields every result row of this prompt carries."""
    return {"question_id": self.question_id, "category": self.category}


# ----------------------------------------------------------------------------- by reference


def load_prompts(ref: str | os.PathLike, *, multi_turn: bool = False, count: int | None = None,
                 tokenizer=None, prompt_len: int | None = None) -> list[Prompt]:
  """The prompt set `ref` names (module docstring): an embedded set ("code", "prose": needs
  `tokenizer`, `count` and `prompt_len`) or a JSONL file (`read_jsonl`; `count` keeps the
  first `count` prompts, `tokenizer` is not needed, `prompt_len` is refused)."""
  if not isinstance(ref, (str, os.PathLike)) or not str(ref):
    raise ValueError(f"prompts must be one of {EMBEDDED} or a path to a JSONL file, "
                     f"got {ref!r}")
  _check_bool("multi_turn", multi_turn)
  if count is not None:
    _check_positive("count", count)
  if isinstance(ref, str) and ref in EMBEDDED:
    if tokenizer is None or count is None or prompt_len is None:
      raise ValueError(f"the embedded prompt set {ref!r} needs tokenizer, count and prompt_len "
                       f"(token-id windows), got tokenizer={tokenizer!r}, count={count!r}, "
                       f"prompt_len={prompt_len!r}")
    return embedded_prompts(ref, tokenizer, count=count, prompt_len=prompt_len)
  if prompt_len is not None:
    raise ValueError(f"prompt_len applies to the embedded sets {EMBEDDED} only; a prompt "
                     f"file's prompts are used whole, got prompt_len={prompt_len!r} with {ref!r}")
  path = pathlib.Path(ref)
  if not path.is_file():
    raise ValueError(f"prompts must be one of {EMBEDDED} or a path to a JSONL file, "
                     f"got {str(ref)!r} ({_not_a_file(path)})")
  prompts = read_jsonl(path, multi_turn=multi_turn)
  return prompts if count is None else prompts[:count]


def _not_a_file(path: pathlib.Path) -> str:
  """What a path that is not a regular file is, for the message."""
  import stat
  try:
    mode = path.stat().st_mode
  except OSError as e:
    return "no such file" if isinstance(e, FileNotFoundError) else (e.strerror or str(e))
  if stat.S_ISDIR(mode):
    return "a directory"
  if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISCHR(mode):
    kind = ("a pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a terminal or character device")
    return (f"{kind}, not a regular file: a prompt set is read more than once (its ids, "
            f"then its questions); save it to a file first")
  return "not a regular file"


def encode_prompt(prompt: Prompt, tokenizer, *, turn: int = 0, answers: Sequence[str] = (),
                  use_chat_template: bool = True) -> list[int]:
  """Token ids to decode turn `turn` of `prompt` from: an embedded prompt's ids as they are;
  otherwise `Prompt.messages(turn, answers)` through `specjax.data.chat.encode_messages` (the
  tokenizer's chat template unless `use_chat_template` is False or it has none)."""
  if prompt.token_ids is not None:
    if turn != 0 or len(answers):
      raise ValueError(f"prompt {prompt.question_id!r} of {prompt.source} is token ids: "
                       f"one turn, no answers; got turn={turn!r}, answers={_short(answers)}")
    chat.template_of(tokenizer, use_chat_template=use_chat_template)  # validates the flag
    return list(prompt.token_ids)
  return chat.encode_messages(tokenizer, prompt.messages(turn, answers),
                              use_chat_template=use_chat_template)


# ----------------------------------------------------------------------------- embedded


@functools.lru_cache(maxsize=len(EMBEDDED))
def held_out_texts(name: str) -> tuple[str, ...]:
  """The validation documents (at most the first `HELD_OUT_DOCS`) of the embedded corpus
  `name`, held out from training: the texts the embedded prompt sets are cut from."""
  if name not in EMBEDDED:
    raise ValueError(f"embedded prompt set must be one of {EMBEDDED}, got {name!r}")
  return tuple(d.text for d in load_corpus(name).validation[:HELD_OUT_DOCS])


def cut_prompts(tokenizer, texts: Sequence[str], count: int, prompt_len: int
                ) -> list[list[int]]:
  """`count` windows of `prompt_len` ids of `"\\n".join(texts)` encoded plainly, window i at
  i·stride with stride = max(1, (n − prompt_len) // count) for n ids: the studies' rule.
  ValueError when the text is too short for every window to be whole."""
  _check_positive("count", count)
  _check_positive("prompt_len", prompt_len)
  if not texts:
    raise ValueError("texts must not be empty")
  ids = list(tokenizer.encode("\n".join(texts)))
  stride = max(1, (len(ids) - prompt_len) // count)
  windows = [ids[i * stride:i * stride + prompt_len] for i in range(count)]
  if len(windows[-1]) < prompt_len:
    raise ValueError(f"{len(ids)} token ids cannot hold {count} prompt(s) of prompt_len "
                     f"{prompt_len}; lower count or prompt_len")
  return windows


def embedded_prompts(name: str, tokenizer, *, count: int, prompt_len: int) -> list[Prompt]:
  """The embedded set `name` as `count` token-id prompts (`cut_prompts` of
  `held_out_texts(name)`); question ids 0..count-1, category `name`."""
  windows = cut_prompts(tokenizer, held_out_texts(name), count, prompt_len)
  return [Prompt(question_id=i, category=name, token_ids=tuple(int(t) for t in w),
                 source=name) for i, w in enumerate(windows)]


# ----------------------------------------------------------------------------- JSONL


def read_jsonl(path: str | os.PathLike, *, multi_turn: bool = False) -> list[Prompt]:
  """Every prompt of a JSONL prompt file, in file order (formats in the module docstring),
  validated line by line: ValueError "FILE:LINE: what is wrong" for the first bad line, or
  naming the file when it holds no prompt."""
  _check_bool("multi_turn", multi_turn)
  path = pathlib.Path(path)
  try:
    data = path.read_bytes()
  except OSError as e:
    raise ValueError(f"cannot read prompt file {str(path)!r}: {e.strerror or e}") from e
  prompts: list[Prompt] = []
  seen: dict[Any, int] = {}
  for lineno, raw in enumerate(data.split(b"\n"), start=1):
    prompt = _parse_line(raw, path, lineno, multi_turn)
    if prompt is None:
      continue
    key = (type(prompt.question_id), prompt.question_id)
    if key in seen:
      raise ValueError(f"{path}:{lineno}: question_id {prompt.question_id!r} repeats line "
                       f"{seen[key]}")
    seen[key] = lineno
    prompts.append(prompt)
  if not prompts:
    raise ValueError(f"{path}: no prompts (the file is empty or blank)")
  return prompts


def _parse_line(raw: bytes, path: pathlib.Path, lineno: int, multi_turn: bool
                ) -> Prompt | None:
  where = f"{path}:{lineno}"
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"{where}: invalid UTF-8 at byte {e.start + 1} of the line") from e
  if lineno == 1:
    text = text.removeprefix("\ufeff")  # a byte-order mark
  if not text.strip():
    return None
  try:
    record = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"{where}: invalid JSON at column {e.colno}: {e.msg}") from e
  except ValueError:  # an integer past Python's digit limit (sys.get_int_max_str_digits)
    import sys
    raise ValueError(f"{where}: a number with more than {sys.get_int_max_str_digits()} "
                     f"digits, too long to read; write a long id as a string") from None
  except RecursionError:
    raise ValueError(f"{where}: its JSON is nested too deeply") from None
  if not isinstance(record, dict):
    raise ValueError(f"{where}: expected a JSON object, got {_json_type(record)}")
  formats = [k for k in _FORMATS if k in record]
  if not formats:
    raise ValueError(f"{where}: unknown format: expected a 'turns' (Spec-Bench / MT-Bench), "
                     f"'prompt' or 'messages' field, got keys {_short(sorted(record))}")
  if len(formats) > 1:
    raise ValueError(f"{where}: ambiguous format: a line has one of 'turns', 'prompt', "
                     f"'messages', got {' and '.join(repr(f) for f in formats)}")
  question_id, category = _identity(record, where, lineno)
  if formats[0] == "turns":
    turns = _turns(record["turns"], where)
    return Prompt(question_id, category, turns=turns if multi_turn else turns[:1],
                  source=where)
  if formats[0] == "prompt":
    return Prompt(question_id, category, turns=(_text(record["prompt"], "prompt", where),),
                  source=where)
  messages = _messages(record["messages"], where)
  return Prompt(question_id, category, turns=(messages[-1][1],), context=messages[:-1],
                source=where)


def _identity(record: Mapping, where: str, lineno: int) -> tuple[int | str, str]:
  keys = [k for k in ("question_id", "id") if k in record]
  if len(keys) > 1:
    raise ValueError(f"{where}: has both 'question_id' and 'id'; give one")
  question_id = record[keys[0]] if keys else lineno
  if not ((isinstance(question_id, int) and not isinstance(question_id, bool))
          or (isinstance(question_id, str) and question_id.strip())):
    raise ValueError(f"{where}: {keys[0]} must be an int or a non-empty string, "
                     f"got {_json_type(question_id)} {_short(question_id)}")
  category = record.get("category", DEFAULT_CATEGORY)
  if not (isinstance(category, str) and category.strip()):
    raise ValueError(f"{where}: category must be a non-empty string, "
                     f"got {_json_type(category)} {_short(category)}")
  if isinstance(question_id, str):
    _check_encodable(question_id, keys[0], where)
  _check_encodable(category, "category", where)
  return question_id, category


def _turns(value: Any, where: str) -> tuple[str, ...]:
  if not isinstance(value, list):
    raise ValueError(f"{where}: turns must be a list of strings, got {_json_type(value)}")
  if not value:
    raise ValueError(f"{where}: turns must not be empty")
  return tuple(_text(t, f"turns[{i}]", where) for i, t in enumerate(value))


def _messages(value: Any, where: str) -> tuple[tuple[str, str], ...]:
  if not isinstance(value, list):
    raise ValueError(f"{where}: messages must be a list of {{'role', 'content'}} objects, "
                     f"got {_json_type(value)}")
  if not value:
    raise ValueError(f"{where}: messages must not be empty")
  out = []
  for i, m in enumerate(value):
    name = f"messages[{i}]"
    if not isinstance(m, dict):
      raise ValueError(f"{where}: {name} must be an object with 'role' and 'content', "
                       f"got {_json_type(m)}")
    missing = [k for k in ("role", "content") if k not in m]
    extra = sorted(set(m) - {"role", "content"})
    if missing or extra:
      problem = f"missing {_short(missing)}" if missing else f"got extra {_short(extra)}"
      raise ValueError(f"{where}: {name} must have exactly the keys 'role' and 'content', "
                       f"{problem}")
    if m["role"] not in ROLES:
      raise ValueError(f"{where}: {name}.role must be one of {ROLES}, got {_short(m['role'])}")
    if not isinstance(m["content"], str):
      raise ValueError(f"{where}: {name}.content must be a string, "
                       f"got {_json_type(m['content'])}")
    _check_encodable(m["content"], f"{name}.content", where)
    out.append((m["role"], m["content"]))
  if out[-1][0] != "user":
    raise ValueError(f"{where}: the last message must be the user's (the turn to answer), "
                     f"got role {out[-1][0]!r}")
  _text(out[-1][1], f"messages[{len(out) - 1}].content", where)
  return tuple(out)


def _text(value: Any, name: str, where: str) -> str:
  if not isinstance(value, str):
    raise ValueError(f"{where}: {name} must be a string, got {_json_type(value)}")
  if not value.strip():
    raise ValueError(f"{where}: {name} is empty")
  _check_encodable(value, name, where)
  return value


def _check_encodable(value: str, name: str, where: str) -> None:
  """JSON's \\u escapes can spell a lone surrogate, which no tokenizer can encode."""
  try:
    value.encode("utf-8")
  except UnicodeEncodeError as e:
    raise ValueError(f"{where}: {name} holds an unpaired surrogate "
                     f"{value[e.start]!r} at character {e.start}") from e


# ----------------------------------------------------------------------------- checks


def _json_type(value: Any) -> str:
  if value is None:
    return "null"
  return {bool: "a boolean", int: "a number", float: "a number", str: "a string",
          list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def _short(value: Any, limit: int = 60) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[:limit - 3] + "..."


def _check_bool(name: str, value: Any) -> None:
  if not isinstance(value, bool):
    raise ValueError(f"{name} must be a bool, got {value!r}")


def _check_positive(name: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{name} must be an int >= 1, got {value!r}")
