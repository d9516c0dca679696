"""The studies' prompts from the embedded sets: windows of held-out text cut at an even
stride (`prompts`), rounded up to whole batches (`workload`). A study's prompts by reference
(a set name or a file) go through `references.workload`, which cuts embedded sets here."""

from __future__ import annotations
from specjax.data.corpus import load_corpus


def _held_out_texts() -> list[str]:
  return [d.text for d in load_corpus("code").validation[:64]]  # held out from training


FALLBACK_TEXT = '''def _check(name, value, lo):
    if not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
    return value


class Counter:
    """Counts things."""

    def __init__(self):
        self.counts = {}

    def add(self, key):
        self.counts[key] = self.counts.get(key, 0) + 1
'''


def prompts(tok, texts, batch: int, prompt_len: int) -> list[list[int]]:
  source = "\n".join(texts) if texts else FALLBACK_TEXT * 8
  ids = tok.encode(source)
  stride = max(1, (len(ids) - prompt_len) // max(batch, 1))
  return [ids[i * stride:i * stride + prompt_len] for i in range(batch)]


def workload(tok, texts, batch: int, count: int, prompt_len: int) -> list[list[int]]:
  """`count` held-out prompts (`prompts`) rounded up to whole batches of `batch` rows, at
  least one batch: what a point decodes with `compare(..., batch=batch)`, so points of
  different batch sizes decode the same prompts."""
  return prompts(tok, texts, batch * -(-max(count, batch) // batch), prompt_len)
