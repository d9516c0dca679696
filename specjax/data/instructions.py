"""Instruction prompts built from the embedded corpora: what a chat target answers to make its
own training data (`specjax.data.selfdistill`), and the contamination check against an
evaluation set.

    recipe = Recipe(seed=0)                    # name + parameters: Recipe.spec()
    recipe.messages(i)                         # the i-th conversation, [{"role", "content"}]
    shared_ngrams(texts, reference_texts, n=8) # which texts share an n-gram of words

The recipe ("stdlib-instruct-v1"). Passages come from the training splits of the embedded
corpora (`specjax.data.corpus`): functions and classes of the standard library's code (cut
out with `ast`, at most `max_chars` characters) and paragraphs of its prose (pydoc topics
and module docstrings, grouped up to `max_chars`). Prompt i is a pure function of (seed, i):
numpy's PCG64 seeded with (seed, i) picks the source (code with probability
`code_fraction`), the passage, the task and one of the task's phrasings. Code tasks:
explain, document (write a docstring), complete (the first half of the function given),
summarise, answer a question (what it returns, what each parameter does, when it raises, an
example call), review. Prose tasks: summarise, explain simply, answer a question (the main
point, the terms it defines, an example), rewrite as notes, continue the passage. The
conversation is one user message; the chat template (the target tokenizer's) adds the rest.

Evaluation sets stay out: `shared_ngrams` finds any text sharing a run of n words
(lower-cased `\\w+` tokens) with a reference text; the data command skips prompts that
share an 8-gram with the `--exclude` files (a Spec-Bench question file), and a test checks
the whole recipe against the shipped Spec-Bench questions.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
import textwrap
from typing import Iterable, Sequence

import numpy as np

from specjax.data.corpus import load_corpus

RECIPE_NAME = "stdlib-instruct-v1"

# Phrasings per task; {name} is the function/class name, {kind} "function" or "class",
# {passage} the text (code is fenced). Order is part of the recipe: append only.
CODE_TASKS: dict[str, tuple[str, ...]] = {
    "explain": (
        "Explain what the following Python {kind} does, step by step.\n\n{passage}",
        "What does `{name}` do? Walk me through this code.\n\n{passage}",
        "I found this {kind} in the Python standard library. Can you explain how it "
        "works?\n\n{passage}",
    ),
    "document": (
        "Write a docstring for this Python {kind}.\n\n{passage}",
        "Document `{name}`: describe its parameters, return value and behaviour.\n\n{passage}",
    ),
    "complete": (
        "Complete the following Python {kind}.\n\n{head}",
        "Here is the beginning of `{name}`. Finish the implementation.\n\n{head}",
    ),
    "summarise": (
        "Summarise in two or three sentences what this code is for.\n\n{passage}",
        "Give a one-paragraph summary of the {kind} `{name}`.\n\n{passage}",
    ),
    "question": (
        "What does `{name}` return, and in which cases?\n\n{passage}",
        "What is the role of each parameter of `{name}`?\n\n{passage}",
        "When can `{name}` raise an exception? Answer from the code below.\n\n{passage}",
        "Show an example call of `{name}` and the result it gives.\n\n{passage}",
    ),
    "review": (
        "Review this Python {kind}: is there anything you would change, and why?\n\n{passage}",
    ),
}
PROSE_TASKS: dict[str, tuple[str, ...]] = {
    "summarise": (
        "Summarise the following passage from the Python documentation.\n\n{passage}",
        "Give me the key points of this text in a short list.\n\n{passage}",
    ),
    "explain": (
        "Explain this passage in simple terms for a beginner.\n\n{passage}",
        "Rewrite the following explanation so that a new programmer can follow it.\n\n"
        "{passage}",
    ),
    "question": (
        "Read the passage and tell me its main point.\n\n{passage}",
        "Which terms does this passage define, and what do they mean?\n\n{passage}",
        "Give a short Python example that illustrates the passage below.\n\n{passage}",
    ),
    "notes": (
        "Turn this documentation into concise study notes.\n\n{passage}",
    ),
    "complete": (
        "Continue this passage from the Python documentation.\n\n{head}",
    ),
}


@dataclasses.dataclass(frozen=True)
class Recipe:
  """The prompt recipe (module doc). `spec()` is what a data manifest records; two recipes
  with equal specs make the same prompts."""

  seed: int = 0
  code_fraction: float = 0.5     # P(a prompt is about code) (else prose)
  sample_fraction: float = 0.5   # P(a batch is answered at T = 1) (else T = 0)
  max_chars: int = 1500          # a passage's length cap in characters
  corpus_bytes: int = 4_000_000  # text read from each embedded corpus (its training split)
  name: str = RECIPE_NAME

  def __post_init__(self):
    for field in ("code_fraction", "sample_fraction"):
      value = getattr(self, field)
      if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{field} must be in [0, 1], got {value!r}")
    for field, low in (("seed", 0), ("max_chars", 200), ("corpus_bytes", 10_000)):
      value = getattr(self, field)
      if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{field} must be an int >= {low}, got {value!r}")
    if self.name != RECIPE_NAME:
      raise ValueError(f"recipe name must be {RECIPE_NAME!r}, got {self.name!r}")

  def spec(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_spec(cls, spec: dict) -> "Recipe":
    return cls(**spec)

  def item(self, i: int) -> dict:
    """Prompt i: {"source": "code" | "prose", "doc", "task", "text"} (module doc)."""
    rng = np.random.Generator(np.random.PCG64([self.seed, i]))
    code = rng.random() < self.code_fraction
    pool = _code_passages(self.max_chars, self.corpus_bytes) if code else \
        _prose_passages(self.max_chars, self.corpus_bytes)
    doc, name, kind, passage = pool[int(rng.integers(len(pool)))]
    tasks = CODE_TASKS if code else PROSE_TASKS
    task = sorted(tasks)[int(rng.integers(len(tasks)))]
    phrasings = tasks[task]
    template = phrasings[int(rng.integers(len(phrasings)))]
    head = _head(passage, code)
    if code:
      passage, head = _fence(passage), _fence(head)
    text = template.format(name=name, kind=kind, passage=passage, head=head)
    return {"source": "code" if code else "prose", "doc": doc, "task": task, "text": text}

  def messages(self, i: int) -> list[dict[str, str]]:
    """The conversation of prompt i: one user message."""
    return [{"role": "user", "content": self.item(i)["text"]}]

  def batch_temperature(self, batch_index: int) -> float:
    """The temperature of batch `batch_index` (1.0 with probability sample_fraction)."""
    rng = np.random.Generator(np.random.PCG64([self.seed, 1 << 40, batch_index]))
    return 1.0 if rng.random() < self.sample_fraction else 0.0


def _fence(code: str) -> str:
  return f"```python\n{code.rstrip()}\n```"


def _head(passage: str, code: bool) -> str:
  """The first half of a passage by lines (code: at least its signature line)."""
  lines = passage.rstrip().splitlines()
  return "\n".join(lines[:max(1, len(lines) // 2)]) + ("\n" if code else "")


@functools.lru_cache(maxsize=4)
def _code_passages(max_chars: int, corpus_bytes: int) -> tuple[tuple[str, str, str, str], ...]:
  """(document, name, "function" | "class", source) of every top-level or class-level def
  and class of at most max_chars characters (and 3 lines or more), in corpus order."""
  out = tuple(d for d in _code_defs(corpus_bytes) if len(d[3]) <= max_chars)
  if not out:
    raise ValueError("the code corpus yielded no passages")
  return out


@functools.lru_cache(maxsize=2)
def _code_defs(corpus_bytes: int) -> tuple[tuple[str, str, str, str], ...]:
  """Every top-level or class-level def and class of 3 lines or more (`_code_passages`)."""
  out = []
  for doc in load_corpus("code", max_bytes=corpus_bytes).train:
    try:
      tree = ast.parse(doc.text)
    except (SyntaxError, ValueError):
      continue
    lines = doc.text.splitlines()
    nodes = [(n, "") for n in tree.body]
    nodes += [(m, n.name + ".") for n in tree.body if isinstance(n, ast.ClassDef)
              for m in n.body]
    for node, prefix in nodes:
      if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        continue
      start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
      source = textwrap.dedent("\n".join(lines[start:node.end_lineno]))
      if source.count("\n") + 1 >= 3:
        kind = "class" if isinstance(node, ast.ClassDef) else "function"
        out.append((doc.name, prefix + node.name, kind, source))
  return tuple(out)


@functools.lru_cache(maxsize=4)
def _prose_passages(max_chars: int, corpus_bytes: int) -> tuple[tuple[str, str, str, str], ...]:
  """(document, "", "passage", text): consecutive paragraphs of each prose document grouped
  up to max_chars characters (groups under 200 characters dropped), in corpus order."""
  out = []
  for doc in load_corpus("prose", max_bytes=corpus_bytes).train:
    group: list[str] = []
    for para in (p.strip() for p in re.split(r"\n\s*\n", doc.text)):
      if not para or len(para) > max_chars:
        continue
      if group and len("\n\n".join(group + [para])) > max_chars:
        out.append((doc.name, "", "passage", "\n\n".join(group)))
        group = []
      group.append(para)
    if group:
      out.append((doc.name, "", "passage", "\n\n".join(group)))
  out = [item for item in out if len(item[3]) >= 200]
  if not out:
    raise ValueError("the prose corpus yielded no passages")
  return tuple(out)


# ----------------------------------------------------------------------------- overlap


_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
  """Lower-cased `\\w+` tokens: the words n-grams are made of."""
  return _WORD.findall(text.lower())


def ngrams(text: str, n: int = 8) -> set[tuple[str, ...]]:
  w = words(text)
  return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def reference_ngrams(texts: Iterable[str], n: int = 8) -> frozenset:
  """The n-grams of every reference text, one set."""
  out: set = set()
  for t in texts:
    out |= ngrams(t, n)
  return frozenset(out)


def shared_ngrams(texts: Sequence[str], reference, n: int = 8) -> dict[int, tuple[str, ...]]:
  """{index: one shared n-gram} for each of `texts` sharing a run of n words with the
  reference (texts, or a `reference_ngrams` set)."""
  ref = reference if isinstance(reference, frozenset) else reference_ngrams(reference, n)
  found = {}
  for i, t in enumerate(texts):
    common = ngrams(t, n) & ref
    if common:
      found[i] = min(common)
  return found


def evaluation_texts(path) -> list[str]:
  """Every turn (and reference answer, where the file has them) of a question file
  (`specjax.data.prompts.read_jsonl`'s formats): the text an evaluation set holds."""
  import json
  out = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      if not line.strip():
        continue
      row = json.loads(line)
      for key in ("turns", "reference"):
        value = row.get(key) or []
        out += [v for v in ([value] if isinstance(value, str) else value)
                if isinstance(v, str)]
      for key in ("prompt", "question", "text"):
        if isinstance(row.get(key), str):
          out.append(row[key])
  return out
