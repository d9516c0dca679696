"""Tokenizers: a byte-level tokenizer (the default, no dependencies) and an optional BPE.

ByteTokenizer: ids 0..255 are the UTF-8 bytes, then three specials:
  bos = 256, eos = 257, pad = 258, so vocab_size = 259.
The vocabulary is not rounded up to a multiple of 8: every id is a real token (no dead logits
that a sampler could draw or an exactness test would have to mask), and on the model sizes used
here the 5 extra LM-head columns would not change the speed measurably.

BPETokenizer: a byte-level BPE trained on a corpus with the `tokenizers` library (optional
extra `specjax[hf]`). Its specials <bos>, <eos>, <pad> are ids 0, 1, 2.

Both expose the same small interface (`Tokenizer` protocol): encode, decode, vocab_size,
bos_id, eos_id, pad_id, token_byte_lengths() (bytes each id stands for, used for bits/byte),
and to_spec()/save() so a checkpoint can rebuild the tokenizer it was trained with.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Iterable, Protocol

import numpy as np
from specjax.files import atomic_write
from specjax.data.json_files import loads

BYTE_VOCAB = 256


class Tokenizer(Protocol):
  vocab_size: int
  bos_id: int
  eos_id: int
  pad_id: int

  def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]: ...
  def encode_array(self, text: str) -> np.ndarray: ...
  def decode(self, ids: Iterable[int]) -> str: ...
  def token_byte_lengths(self) -> np.ndarray: ...
  def to_spec(self) -> dict: ...


class ByteTokenizer:
  """UTF-8 bytes as tokens (ids 0..255) plus bos/eos/pad (256, 257, 258)."""

  vocab_size = BYTE_VOCAB + 3
  bos_id = BYTE_VOCAB
  eos_id = BYTE_VOCAB + 1
  pad_id = BYTE_VOCAB + 2
  kind = "byte"

  def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
    ids = list(text.encode("utf-8"))
    return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

  def encode_array(self, text: str) -> np.ndarray:
    """Fast path for corpora: the bytes of `text` as a uint16 array (no specials)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

  def decode(self, ids: Iterable[int]) -> str:
    """Bytes back to text; specials and out-of-range ids are dropped, bad UTF-8 replaced."""
    data = bytes(int(i) for i in ids if 0 <= int(i) < BYTE_VOCAB)
    return data.decode("utf-8", errors="replace")

  def token_byte_lengths(self) -> np.ndarray:
    """[V] number of text bytes each id stands for (1 for bytes, 0 for specials)."""
    lengths = np.zeros((self.vocab_size,), np.int32)
    lengths[:BYTE_VOCAB] = 1
    return lengths

  def to_spec(self) -> dict:
    return {"kind": "byte"}

  def save(self, directory: str | pathlib.Path) -> None:
    """Writes DIRECTORY/tokenizer.json all or nothing (`_save_json`)."""
    _save_json(directory, json.dumps(self.to_spec()))

  def __eq__(self, other: object) -> bool:
    return isinstance(other, ByteTokenizer)

  def __hash__(self) -> int:
    return hash("ByteTokenizer")

  def __repr__(self) -> str:
    return "ByteTokenizer(vocab_size=259)"


def _save_json(directory: str | pathlib.Path, text: str) -> None:
  """DIRECTORY/tokenizer.json = `text`, written aside, fsync'd and renamed in
  (`checkpoints.dirs.atomic_write`): a process killed while saving leaves the old file or
  the new one, never a truncated tokenizer.json that every later load would refuse."""
  atomic_write(pathlib.Path(directory) / "tokenizer.json", text)


_MISSING_TOKENIZERS = (
    "the BPE tokenizer needs the optional `tokenizers` package: "
    "install it with `pip install 'specjax[hf]'` (or `pip install tokenizers`), "
    "or use the default byte tokenizer")


def _import_tokenizers():
  try:
    import tokenizers  # noqa: F401  (optional dependency)
  except ImportError as e:
    raise ImportError(_MISSING_TOKENIZERS) from e
  return tokenizers


class BPETokenizer:
  """Byte-level BPE backed by a `tokenizers.Tokenizer` (optional dependency)."""

  kind = "bpe"
  SPECIALS = ("<bos>", "<eos>", "<pad>")

  def __init__(self, backend) -> None:
    self._tok = backend
    self.vocab_size = int(backend.get_vocab_size())
    self.bos_id, self.eos_id, self.pad_id = (backend.token_to_id(s) for s in self.SPECIALS)
    if None in (self.bos_id, self.eos_id, self.pad_id):
      raise ValueError(f"BPE tokenizer lacks the special tokens {self.SPECIALS}")

  @classmethod
  def train(cls, texts: Iterable[str], vocab_size: int) -> "BPETokenizer":
    """Train a byte-level BPE with `vocab_size` ids (256 base bytes + 3 specials + merges)."""
    if vocab_size < BYTE_VOCAB + len(cls.SPECIALS):
      raise ValueError(f"vocab_size must be >= {BYTE_VOCAB + len(cls.SPECIALS)} for a "
                       f"byte-level BPE, got {vocab_size}")
    tk = _import_tokenizers()
    backend = tk.Tokenizer(tk.models.BPE())
    backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(cls.SPECIALS), show_progress=False,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer=trainer)
    return cls(backend)

  @classmethod
  def from_json(cls, text: str) -> "BPETokenizer":
    tk = _import_tokenizers()
    return cls(tk.Tokenizer.from_str(text))

  def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
    ids = self._tok.encode(text, add_special_tokens=False).ids
    return ([self.bos_id] if bos else []) + list(ids) + ([self.eos_id] if eos else [])

  def encode_array(self, text: str) -> np.ndarray:
    return np.asarray(self.encode(text), dtype=np.int32)

  def decode(self, ids: Iterable[int]) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

  def token_byte_lengths(self) -> np.ndarray:
    """[V] bytes per id: a ByteLevel token spells one visible character per byte."""
    lengths = np.zeros((self.vocab_size,), np.int32)
    for i in range(self.vocab_size):
      piece = self._tok.id_to_token(i)
      if piece is not None and piece not in self.SPECIALS:
        lengths[i] = len(piece)
    return lengths

  def to_json(self) -> str:
    return self._tok.to_str()

  def to_spec(self) -> dict:
    text = self.to_json()
    return {"kind": "bpe", "vocab_size": self.vocab_size,
            "sha256": hashlib.sha256(text.encode()).hexdigest()}

  def save(self, directory: str | pathlib.Path) -> None:
    """Writes DIRECTORY/tokenizer.json all or nothing (`_save_json`)."""
    _save_json(directory, self.to_json())

  def __repr__(self) -> str:
    return f"BPETokenizer(vocab_size={self.vocab_size})"


def load_tokenizer(path: str | pathlib.Path | None = None) -> Tokenizer:
  """The tokenizer stored at `path` (a tokenizer.json file or a directory holding one).

  None or "byte" gives the ByteTokenizer. A directory or file whose JSON says {"kind": "byte"}
  also gives the ByteTokenizer; any other tokenizer.json is loaded as a BPE (needs `tokenizers`).
  """
  if path is None or str(path) == "byte":
    return ByteTokenizer()
  p = pathlib.Path(path)
  if p.is_dir():
    p = p / "tokenizer.json"
  if not p.is_file():
    raise ValueError(f"tokenizer path {str(path)!r} is not a tokenizer.json file or a "
                     "directory holding one (use None or 'byte' for the byte tokenizer)")
  try:
    text = p.read_text()
  except (OSError, UnicodeDecodeError) as e:
    raise ValueError(f"cannot read tokenizer file {str(p)!r}: {e}") from e
  data = loads(text, f"tokenizer file {str(p)!r}")
  if isinstance(data, dict) and data.get("kind") == "byte":
    return ByteTokenizer()
  return BPETokenizer.from_json(text)


def tokenizer_from_spec(spec: dict, directory: str | pathlib.Path | None = None) -> Tokenizer:
  """Rebuild a tokenizer from `to_spec()`; a BPE needs the directory holding tokenizer.json."""
  kind = spec.get("kind")
  if kind == "byte":
    return ByteTokenizer()
  if kind == "bpe":
    if directory is None:
      raise ValueError("a BPE tokenizer spec needs the directory holding tokenizer.json")
    tok = load_tokenizer(directory)
    if tok.to_spec() != spec:
      raise ValueError(f"tokenizer.json in {str(directory)!r} does not match the recorded "
                       f"spec {spec}")
    return tok
  raise ValueError(f"tokenizer kind must be 'byte' or 'bpe', got {kind!r}")


def _pieces(tok, n: int) -> list:
  """The strings of ids 0..n-1: a `tokenizers` backend's pieces where the tokenizer has one
  (BPETokenizer, the Hugging Face wrapper), else each id decoded alone."""
  backend = getattr(tok, "_tok", None)
  if backend is not None and hasattr(backend, "id_to_token"):
    return [backend.id_to_token(i) for i in range(n)]
  return [tok.decode([i]) for i in range(n)]


def vocab_mismatch(target_tok, draft_tok) -> str | None:
  """Why a draft's tokenizer is not the target's, in a few words, or None when the ids both
  have spell the same tokens (the same tokenizer, or one with extra ids at the end: a padded
  vocabulary, docs/exactness.md). None when either tokenizer is unknown (None)."""
  if target_tok is None or draft_tok is None or target_tok == draft_tok:
    return None
  n = min(target_tok.vocab_size, draft_tok.vocab_size)
  for i, (a, b) in enumerate(zip(_pieces(target_tok, n), _pieces(draft_tok, n))):
    if a != b:
      return f"id {i} is {a!r} in the target's tokenizer but {b!r} in the draft's"
  return None
