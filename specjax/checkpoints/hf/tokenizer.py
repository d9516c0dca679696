"""Tokenizers in a model directory: Hugging Face `tokenizer.json` behind specjax's Tokenizer
interface (with the directory's chat template and EOS ids, `specjax.data.chat`), finding which
tokenizer a directory holds, and copying the tokenizer files along with a model.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import shutil
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from specjax.data.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer, tokenizer_from_spec
from specjax.data.chat import merge_eos_ids
from specjax.data.chat import load_chat_template
from specjax.data.json_files import read_object
from specjax.files import atomic_write

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "chat_template.jinja")


_SLOW_FILES = ("vocab.json", "merges.txt", "tokenizer.model")


def _backend(d: pathlib.Path, tokenizers):
  """The `tokenizers.Tokenizer` of a directory, as transformers loads it: tokenizer.json;
  else GPT-2's byte-level BPE from vocab.json + merges.txt; else a SentencePiece
  tokenizer.model converted by transformers (refused, naming what to install, without it)."""
  if (d / "tokenizer.json").is_file():
    try:
      return tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception type
      raise ValueError(f"cannot read {str(d / 'tokenizer.json')!r}: {e}") from e
  if (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
    try:
      bpe = tokenizers.models.BPE.from_file(str(d / "vocab.json"), str(d / "merges.txt"))
    except Exception as e:  # noqa: BLE001
      raise ValueError(f"cannot read {str(d / 'vocab.json')!r} with merges.txt as a byte-level "
                       f"BPE: {' '.join(str(e).split())}") from None
    backend = tokenizers.Tokenizer(bpe)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.post_processor = tokenizers.processors.ByteLevel(trim_offsets=False)
    tc = read_object(d / "tokenizer_config.json") if (d / "tokenizer_config.json").is_file() \
        else {}
    specials = []
    for entry in (tc.get("added_tokens_decoder") or {}).values():
      if isinstance(entry, Mapping) and isinstance(entry.get("content"), str):
        specials.append(entry["content"])
    for field in ("bos_token", "eos_token", "unk_token", "pad_token"):
      tok = tc.get(field)
      tok = tok.get("content") if isinstance(tok, Mapping) else tok
      if isinstance(tok, str):
        specials.append(tok)
    known = [t for t in dict.fromkeys(specials) if backend.token_to_id(t) is not None]
    if known:
      backend.add_special_tokens(known)
    return backend
  if (d / "tokenizer.model").is_file():
    try:
      import transformers
    except ImportError:
      raise ValueError(f"{str(d / 'tokenizer.model')!r} is a SentencePiece tokenizer, which "
                       f"specjax reads through transformers: pip install transformers "
                       f"sentencepiece (or give the model's tokenizer.json)") from None
    try:
      fast = transformers.AutoTokenizer.from_pretrained(str(d), use_fast=True)
      return fast.backend_tokenizer
    except Exception as e:  # noqa: BLE001 - conversion raises many kinds
      raise ValueError(f"cannot convert {str(d / 'tokenizer.model')!r} with transformers "
                       f"({' '.join(str(e).split())[:160]}): pip install sentencepiece "
                       f"protobuf, or give the model's tokenizer.json") from None
  present = [n for n in _SLOW_FILES if (d / n).is_file()]
  raise ValueError(f"{str(d)!r} holds {present} but no tokenizer.json: a byte-level BPE "
                   f"needs both vocab.json and merges.txt")


def recorded_tokenizer(spec: Mapping, directory: str | os.PathLike) -> Any:
  """The tokenizer a specjax checkpoint's metadata records (`to_spec()`), read back from its
  directory: a Hugging Face one (kind "hf", the files `HFTokenizer.save` wrote beside the
  weights; refused when they no longer match the recorded digest) or a specjax one."""
  if spec.get("kind") != "hf":
    return tokenizer_from_spec(dict(spec), directory)
  tok = load_tokenizer_for(directory)
  if not isinstance(tok, HFTokenizer) or tok.to_spec() != dict(spec):
    raise ValueError(f"the tokenizer files in {str(directory)!r} do not match the recorded "
                     f"tokenizer {dict(spec)}")
  return tok


def load_tokenizer_for(directory: str | os.PathLike, hf_config: dict | None = None) -> Any:
  """The tokenizer stored in `directory`: a Hugging Face tokenizer.json (HFTokenizer), a
  specjax tokenizer file, or the byte tokenizer when there is no tokenizer.json."""
  path = pathlib.Path(directory) / "tokenizer.json"
  if not path.is_file():
    if any((pathlib.Path(directory) / n).is_file() for n in _SLOW_FILES):
      return HFTokenizer.from_dir(directory, hf_config)  # what transformers loads: never bytes
    return ByteTokenizer()
  data = read_object(path)
  if data.get("kind") == "byte":
    return ByteTokenizer()
  vocab = {t.get("content") for t in data.get("added_tokens", []) if isinstance(t, dict)}
  if set(BPETokenizer.SPECIALS) <= vocab:
    return load_tokenizer(directory)  # a BPE trained by specjax
  return HFTokenizer.from_dir(directory, hf_config)


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
  """Copy the Hugging Face tokenizer files present in `src` (a specjax byte-tokenizer marker
  file, {"kind": "byte"}, is not a Hugging Face tokenizer and is skipped)."""
  copied = []
  for name in TOKENIZER_FILES:
    path = pathlib.Path(src) / name
    if not path.is_file():
      continue
    if name == "tokenizer.json" and _is_byte_marker(path):
      continue
    shutil.copyfile(path, pathlib.Path(dst) / name)
    copied.append(name)
  return copied


def _is_byte_marker(path: pathlib.Path) -> bool:
  try:
    return read_object(path).get("kind") == "byte"
  except ValueError:
    return False


def generation_eos_ids(config: Mapping, path: str | os.PathLike = "generation_config.json"
                       ) -> tuple[int, ...]:
  """generation_config.json's `eos_token_id` as a tuple (an int, a list of ints, or absent /
  null: ()); ValueError naming `path` for any other value."""
  if not isinstance(config, Mapping):
    raise ValueError(f"{str(path)!r} must hold a JSON object, got {type(config).__name__}")
  value = config.get("eos_token_id")
  values = value if isinstance(value, list) else [] if value is None else [value]
  if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
    raise ValueError(f"{str(path)!r}: eos_token_id must be an int >= 0 or a list of them, "
                     f"got {value!r}")
  return tuple(values)


# ----------------------------------------------------------------------------- tokenizer


class HFTokenizer:
  """A Hugging Face `tokenizer.json` behind specjax's Tokenizer interface.

  bos/eos/pad ids come from tokenizer_config.json (token strings), else from the model's
  config.json / generation_config.json ids; any of them may be None (no such token).
  `eos_ids` are the ids to stop on: every id of generation_config.json's `eos_token_id` (an
  int or a list; without one, config.json's), then `eos_id`, each once. `chat_template` is
  the directory's template (`specjax.data.chat.load_chat_template`, read on first use), None
  without one.
  """

  kind = "hf"

  def __init__(self, backend, *, bos_id: int | None, eos_id: int | None,
               pad_id: int | None, eos_ids: Sequence[int] = (),
               directory: str | os.PathLike | None = None) -> None:
    self._tok = backend
    self.vocab_size = int(backend.get_vocab_size())
    self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
    self.eos_ids = merge_eos_ids(eos_ids, eos_id)
    self.directory = None if directory is None else str(directory)

  @classmethod
  def from_dir(cls, directory: str | os.PathLike, hf_config: Mapping | None = None
               ) -> "HFTokenizer":
    d = pathlib.Path(directory)
    try:
      import tokenizers
    except ImportError as e:
      raise ImportError("reading a Hugging Face tokenizer.json needs the `tokenizers` package "
                        "(pip install 'specjax[hf]')") from e
    backend = _backend(d, tokenizers)
    extra = {}
    for name in ("generation_config.json", "tokenizer_config.json"):
      extra[name] = read_object(d / name) if (d / name).is_file() else {}
    tc, gc, mc = extra["tokenizer_config.json"], extra["generation_config.json"], hf_config or {}

    def token_id(field: str) -> int | None:
      tok = tc.get(f"{field}_token")
      if isinstance(tok, Mapping):
        tok = tok.get("content")
      if isinstance(tok, str) and backend.token_to_id(tok) is not None:
        return int(backend.token_to_id(tok))
      for source in (gc, mc):
        value = source.get(f"{field}_token_id")
        if isinstance(value, list):
          value = value[0] if value else None
        if isinstance(value, int):
          return value
      return None

    # transformers' rule: generation_config.json's eos_token_id, else config.json's
    eos_ids = (generation_eos_ids(gc, d / "generation_config.json")
               or generation_eos_ids(mc, d / "config.json"))
    return cls(backend, bos_id=token_id("bos"), eos_id=token_id("eos"), pad_id=token_id("pad"),
               eos_ids=eos_ids, directory=d)

  @functools.cached_property
  def chat_template(self):
    """The directory's chat template (`specjax.data.chat.ChatTemplate`), or None."""
    return None if self.directory is None else load_chat_template(self.directory)

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                          add_generation_prompt: bool = True) -> list[int]:
    """transformers' `apply_chat_template(messages, add_generation_prompt=True)` ids: the
    template's text encoded without added specials (BOS only where the template writes it).
    ValueError naming the directory when it has no chat template."""
    if self.chat_template is None:
      raise ValueError(f"{self.directory or 'this tokenizer'!r} has no chat template "
                       f"(chat_template in tokenizer_config.json, or chat_template.jinja)")
    return self.chat_template.encode(self, messages, add_generation_prompt=add_generation_prompt)

  def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
    ids = list(self._tok.encode(text, add_special_tokens=False).ids)
    head = [self.bos_id] if bos and self.bos_id is not None else []
    tail = [self.eos_id] if eos and self.eos_id is not None else []
    return head + ids + tail

  def encode_array(self, text: str) -> np.ndarray:
    return np.asarray(self.encode(text), dtype=np.int32)

  def decode(self, ids: Iterable[int]) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

  def token_byte_lengths(self) -> np.ndarray:
    """[V] UTF-8 bytes each id decodes to (0 for special tokens)."""
    return np.asarray([len(self._tok.decode([i], skip_special_tokens=True).encode("utf-8"))
                       for i in range(self.vocab_size)], np.int32)

  def to_json(self) -> str:
    return self._tok.to_str()

  def save(self, directory: str | os.PathLike) -> None:
    """Writes the tokenizer into `directory` as Hugging Face lays it out, so that
    `load_tokenizer_for(directory)` reads back an equal one (a head trained on this target
    keeps it beside its checkpoint): the files it was read from (`TOKENIZER_FILES`: special
    ids, chat template, EOS ids), and tokenizer.json itself (all or nothing)."""
    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if self.directory is not None and pathlib.Path(self.directory).resolve() != out.resolve():
      copy_tokenizer_files(self.directory, out)
    atomic_write(out / "tokenizer.json", self.to_json())

  def to_spec(self) -> dict:
    return {"kind": "hf", "vocab_size": self.vocab_size,
            "sha256": hashlib.sha256(self.to_json().encode()).hexdigest()}

  def __repr__(self) -> str:
    return (f"HFTokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id})")
