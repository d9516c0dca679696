"""Token streams and batches for language-model training.

A split becomes one stream: BOS doc0 EOS BOS doc1 EOS ... (documents in corpus order). A
training batch is B windows of seq_len + 1 tokens at random offsets; the offsets of step s are
drawn from numpy's PCG64 seeded with (seed, s), so the batch of every step is a pure function
of (seed, step): a run resumed at step s sees exactly the batches an uninterrupted run would
(the data-order state is just seed and step). Validation uses fixed, evenly spaced,
non-overlapping windows.

A loss mask (self-distillation data, `specjax.data.selfdistill`) rides beside a stream: 1
where a token is learned, 0 where it is context only. `train_mask` / `validation_mask` are
None for corpus text (every token learned); `train_batch_mask` and `validation_masks` cut
the same windows out of it as `train_batch` and `validation_windows` do out of the tokens.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specjax.data.corpus import Corpus, Document
from specjax.data.tokenizer import Tokenizer


def encode_documents(docs: tuple[Document, ...], tokenizer: Tokenizer) -> np.ndarray:
  """[N] int32 stream: BOS text EOS for each document in order."""
  bos = np.asarray([tokenizer.bos_id], np.int32)
  eos = np.asarray([tokenizer.eos_id], np.int32)
  parts = []
  for doc in docs:
    parts += [bos, tokenizer.encode_array(doc.text).astype(np.int32), eos]
  return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


@dataclasses.dataclass(frozen=True)
class TokenData:
  """Encoded train and validation streams of one corpus under one tokenizer."""
  train: np.ndarray        # [N_train] int32
  validation: np.ndarray   # [N_val] int32
  corpus_name: str
  fingerprint: str         # the corpus fingerprint
  train_mask: np.ndarray | None = None       # [N_train] uint8 loss mask (None: all ones)
  validation_mask: np.ndarray | None = None  # [N_val] uint8 loss mask (None: all ones)

  @classmethod
  def from_corpus(cls, corpus: Corpus, tokenizer: Tokenizer) -> "TokenData":
    return cls(encode_documents(corpus.train, tokenizer),
               encode_documents(corpus.validation, tokenizer), corpus.name, corpus.fingerprint)

  def learned_tokens(self) -> np.ndarray:
    """The training tokens the loss mask keeps (all of them without a mask): what token
    frequencies are counted over (an EAGLE-3 head's draft vocabulary)."""
    return self.train if self.train_mask is None else self.train[self.train_mask > 0]

  def check_fits(self, seq_len: int) -> None:
    for split in ("train", "validation"):
      n = len(getattr(self, split))
      if n < seq_len + 1:
        raise ValueError(f"seq_len {seq_len} does not fit the {split} split of corpus "
                         f"{self.corpus_name!r} ({n} tokens); use a shorter seq_len or a "
                         "larger corpus")

  def _train_starts(self, seed: int, step: int, batch_size: int, seq_len: int) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64([seed, step]))
    return rng.integers(0, len(self.train) - seq_len, size=batch_size)

  def train_batch(self, seed: int, step: int, batch_size: int, seq_len: int,
                  grad_accum: int = 1) -> np.ndarray:
    """[grad_accum, batch_size // grad_accum, seq_len + 1] int32 windows for `step`."""
    starts = self._train_starts(seed, step, batch_size, seq_len)
    windows = self.train[starts[:, None] + np.arange(seq_len + 1)[None, :]]
    return windows.reshape(grad_accum, batch_size // grad_accum, seq_len + 1)

  def train_batch_mask(self, seed: int, step: int, batch_size: int, seq_len: int,
                       grad_accum: int = 1) -> np.ndarray | None:
    """The loss mask of `train_batch`'s windows (same shape, uint8), None without a mask."""
    if self.train_mask is None:
      return None
    starts = self._train_starts(seed, step, batch_size, seq_len)
    windows = self.train_mask[starts[:, None] + np.arange(seq_len + 1)[None, :]]
    return windows.reshape(grad_accum, batch_size // grad_accum, seq_len + 1)

  def _validation_starts(self, seq_len: int, max_windows: int) -> np.ndarray:
    stream = self.validation
    count = min(max_windows, max(1, (len(stream) - 1) // seq_len))
    return np.linspace(0, len(stream) - seq_len - 1, count).astype(np.int64)

  def validation_windows(self, seq_len: int, max_windows: int) -> np.ndarray:
    """[n, seq_len + 1] evenly spaced windows over the validation stream (n <= max_windows)."""
    starts = self._validation_starts(seq_len, max_windows)
    return self.validation[starts[:, None] + np.arange(seq_len + 1)[None, :]]

  def validation_masks(self, seq_len: int, max_windows: int) -> np.ndarray | None:
    """The loss mask of `validation_windows`' windows (uint8), None without a mask."""
    if self.validation_mask is None:
      return None
    starts = self._validation_starts(seq_len, max_windows)
    return self.validation_mask[starts[:, None] + np.arange(seq_len + 1)[None, :]]


def padded_chunks(batch: int, windows: np.ndarray, masks: np.ndarray | None = None):
  """Chunks (windows, weight, masks) of `batch` rows for an evaluation in equal-size calls:
  the last chunk padded with copies of the first row at weight 0 (masks None stays None)."""
  n = len(windows)
  pad = (-n) % batch
  def padded(a):
    return None if a is None else np.concatenate([a, np.repeat(a[:1], pad, axis=0)])
  windows, masks = padded(windows), padded(masks)
  weight = np.concatenate([np.ones((n,), np.float32), np.zeros((pad,), np.float32)])
  for i in range(0, n + pad, batch):
    yield (windows[i:i + batch], weight[i:i + batch],
           None if masks is None else masks[i:i + batch])
