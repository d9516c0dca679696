"""A GGUF file through ggml-org's `gguf` package: its metadata and its tensors, dequantized.

    f = open_gguf("model.gguf")          # GGUFFile; ValueError naming the file otherwise
    f.meta("llama.block_count")           # a metadata value (str, int, float, bool, list)
    f.tensor("blk.0.attn_q.weight")       # float32 numpy array, numpy (row-major) order

GGUF lists a tensor's dimensions fastest-first (ne0, ne1, ...); numpy order is the reverse,
so a linear layer's weight comes out [out, in], as torch stores it. Quantized blocks are
dequantized by `gguf.quants.dequantize` (the package's reference implementation); only the
types in `TENSOR_TYPES` are accepted, the others refused naming the tensor and its type.
A file that is not GGUF, or one cut short (a header, metadata or a tensor past the end of
the file), is refused in one line naming the file and where it ends.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import numpy as np

TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
MAGIC = b"GGUF"
_MISSING = object()


def gguf_package():
  """The `gguf` module, or ImportError saying how to install it."""
  try:
    import gguf
  except ImportError as e:
    raise ImportError("reading a GGUF file needs the `gguf` package (pip install "
                      "'specjax[gguf]')") from e
  return gguf


def is_gguf_file(path: str | os.PathLike) -> bool:
  """Whether `path` is a file starting with GGUF's magic bytes."""
  p = pathlib.Path(path)
  try:
    with open(p, "rb") as fh:
      return p.is_file() and fh.read(4) == MAGIC
  except OSError:
    return False


class GGUFFile:
  """An opened GGUF file: `meta(key)`, `tensor(name)`, `tensor_names`, `shape(name)`."""

  def __init__(self, path: pathlib.Path, reader) -> None:
    self.path = path
    self._reader = reader
    self._fields = reader.fields
    self._tensors = {t.name: t for t in reader.tensors}

  @property
  def tensor_names(self) -> list[str]:
    return list(self._tensors)

  def has(self, key: str) -> bool:
    return key in self._fields

  def meta(self, key: str, default: Any = _MISSING) -> Any:
    """The value of metadata `key` (a str, number, bool or list); `default` when absent,
    else ValueError naming the key and the file."""
    field = self._fields.get(key)
    if field is None:
      if default is _MISSING:
        raise ValueError(f"GGUF file {str(self.path)!r} lacks the metadata key {key!r}")
      return default
    value = field.contents()
    return value.tolist() if isinstance(value, np.ndarray) else value

  def type_name(self, name: str) -> str:
    return self._tensors[name].tensor_type.name

  def shape(self, name: str) -> tuple[int, ...]:
    """The tensor's shape in numpy order (GGUF's dimensions reversed)."""
    return tuple(int(n) for n in reversed(self._tensors[name].shape))

  def tensor(self, name: str) -> np.ndarray:
    """The tensor as float32 in numpy order; ValueError naming it for an uncovered type."""
    t = self._tensors[name]
    kind = t.tensor_type.name
    if kind not in TENSOR_TYPES:
      raise ValueError(f"GGUF file {str(self.path)!r}: tensor {name!r} has type {kind}, not "
                       f"supported (supported: {', '.join(TENSOR_TYPES)})")
    x = dequantize(np.asarray(t.data), t.tensor_type)
    return np.asarray(x, np.float32).reshape(self.shape(name))


def dequantize(data: np.ndarray, qtype) -> np.ndarray:
  """A tensor's stored blocks as floats: `gguf.quants.dequantize` (ggml-org's reference)."""
  return gguf_package().quants.dequantize(data, qtype)


def open_gguf(path: str | os.PathLike) -> GGUFFile:
  """Open a GGUF file (module doc): ValueError naming the file when it is not GGUF, is cut
  short, or a tensor lies past its end."""
  p = pathlib.Path(path)
  if not p.is_file():
    raise ValueError(f"GGUF file {str(p)!r} does not exist" if not p.exists() else
                     f"GGUF file {str(p)!r} is not a file")
  size = p.stat().st_size
  with open(p, "rb") as fh:
    head = fh.read(4)
  if head != MAGIC:
    raise ValueError(f"{str(p)!r} is not a GGUF file (it starts with {head!r}, not {MAGIC!r})")
  gguf = gguf_package()
  try:
    reader = gguf.GGUFReader(p, "r")
  except Exception as e:  # noqa: BLE001 - the reader raises ValueError, IndexError, ...
    raise ValueError(f"GGUF file {str(p)!r} ({size:,} bytes) is truncated or damaged: cannot "
                     f"read its header and metadata ({type(e).__name__}: {e})") from None
  for t in reader.tensors:
    end = int(t.data_offset) + int(t.n_bytes)
    if end > size or np.asarray(t.data).nbytes != int(t.n_bytes):
      raise ValueError(f"GGUF file {str(p)!r} is truncated: tensor {t.name!r} ends at byte "
                       f"{end:,} but the file has {size:,} bytes")
  return GGUFFile(p, reader)
