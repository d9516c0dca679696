"""The weight files of a Hugging Face model directory, read and written as numpy arrays.

Layouts (the first found wins, in this order):
  'safetensors'  model.safetensors
  'sharded'      model.safetensors.index.json ({"weight_map": {tensor: shard file}}) + shards
  'flax'         flax_model.msgpack (the Flax layout of Hugging Face's Flax models:
                 flax.serialization msgpack of the nested parameter dict)

safetensors files go through the `safetensors` package. Its numpy backend reads BF16 tensors
as numpy's dtype named 'bfloat16', which exists only once `ml_dtypes` is imported (done here:
without it the package fails with "data type 'bfloat16' not understood"). Tensors are read
lazily, one at a time on access (`Tensors`), so converting a checkpoint holds one source
tensor at a time next to the converted parameters. When the package refuses a file,
`_refusal` reads the header once more to say why in the file's own terms: fewer bytes than
the header length, a header longer than the file, a header that is not JSON, or the first
tensor whose bytes the (truncated) file cannot hold. The package is stricter than a bare
header check: bytes not covered by any tensor (gaps, trailing data) are refused too.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import struct
from typing import Any, Callable, Iterator, Mapping

import ml_dtypes  # registers numpy's 'bfloat16' for the package's numpy backend
import numpy as np
import safetensors
import safetensors.numpy
from specjax.files import file_mode
from specjax.data.json_files import field, read_object

SAFETENSORS, SAFETENSORS_INDEX, FLAX_MSGPACK = (
    "model.safetensors", "model.safetensors.index.json", "flax_model.msgpack")

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
              "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32, "I16": np.int16,
              "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_OTHER_CODES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
                "U16": np.uint16, "U32": np.uint32, "U64": np.uint64, "C64": np.complex64}
_ST_CODES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # the package's own limit on the JSON header


def itemsize(code: str) -> int:
  """Bytes per element of a safetensors dtype code (or a numpy dtype name)."""
  try:
    return np.dtype({**_ST_DTYPES, **_OTHER_CODES}.get(code, code)).itemsize
  except TypeError as e:
    raise ValueError(f"unknown tensor dtype {code!r}") from e


class Tensors(Mapping):
  """{name: np.ndarray} read on access; `specs[name]` is (shape, dtype code) without reading."""

  def __init__(self, specs: Mapping[str, tuple[tuple[int, ...], str]],
               load: Callable[[str], np.ndarray]) -> None:
    self.specs = dict(specs)
    self._load = load

  def __getitem__(self, name: str) -> np.ndarray:
    if name not in self.specs:
      raise KeyError(name)
    return self._load(name)

  def __iter__(self) -> Iterator[str]:
    return iter(self.specs)

  def __len__(self) -> int:
    return len(self.specs)


# ----------------------------------------------------------------------------- safetensors


def _bad_file(path, what: str) -> ValueError:
  return ValueError(f"corrupted or truncated safetensors file {pathlib.Path(path).name!r}: {what}")


def _refusal(path: str | os.PathLike, error: Exception) -> ValueError:
  """Why the package refused `path`, named in the file's terms (the package's message when
  the header itself looks sound, e.g. gaps or trailing bytes in the data section)."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      return _bad_file(path, f"the file has {size} bytes, fewer than the 8-byte header length")
    (n,) = struct.unpack("<Q", head)
    if n > size - 8 or n > _MAX_HEADER:
      return _bad_file(path, f"the header claims {n} bytes but the file has {size - 8} after "
                       "the length field")
    try:
      header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      return _bad_file(path, f"the header is not valid JSON ({e})")
  if not isinstance(header, dict):
    return _bad_file(path, "the header is not a JSON object")
  header.pop("__metadata__", None)
  data_bytes = size - 8 - n
  for name, info in header.items():
    try:
      begin, end = (int(o) for o in info["data_offsets"])
      count = math.prod(int(d) for d in info["shape"]) * itemsize(info["dtype"])
    except (KeyError, TypeError, ValueError):
      return _bad_file(path, f"tensor {name!r} has a malformed header entry {info!r}")
    if end > data_bytes:
      return _bad_file(path, f"tensor {name!r} needs bytes [{begin}, {end}) of the data "
                       f"section but the file holds only {data_bytes}")
    if not 0 <= begin <= end or end - begin != count:
      return _bad_file(path, f"tensor {name!r}: offsets [{begin}, {end}) do not match its "
                       f"shape {info['shape']} and dtype {info['dtype']}")
  return _bad_file(path, str(error))


def _open(path: str | os.PathLike):
  try:
    return safetensors.safe_open(str(path), framework="numpy")
  except safetensors.SafetensorError as e:
    raise _refusal(path, e) from e


def safetensors_specs(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], str]]:
  """{name: (shape, dtype code)} of one file, from its (validated) header only."""
  with _open(path) as f:
    return {name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype())
            for name in f.offset_keys()}


def read_safetensors(path: str | os.PathLike) -> Tensors:
  """The tensors of one file, each read (as a numpy array) when accessed."""
  path = pathlib.Path(path)

  def load(name: str) -> np.ndarray:
    with _open(path) as f:
      try:
        return f.get_tensor(name)
      except Exception as e:  # noqa: BLE001 - the package raises its own types
        raise ValueError(f"cannot read tensor {name!r} of {path.name!r}: {e}") from e

  return Tensors(safetensors_specs(path), load)


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> None:
  """One standard safetensors file (the package's layout: little-endian, contiguous), with
  the umask's mode (the package itself writes 0600)."""
  arrays = {}
  for name in sorted(tensors):
    arr = np.ascontiguousarray(tensors[name])
    if arr.dtype.newbyteorder("=") not in _ST_CODES:
      raise ValueError(f"tensor {name!r}: dtype {arr.dtype} has no safetensors code")
    arrays[name] = arr
  meta = {str(k): str(v) for k, v in metadata.items()} if metadata else None
  safetensors.numpy.save_file(arrays, str(path), metadata=meta)
  os.chmod(path, file_mode())


# ----------------------------------------------------------------------------- Flax msgpack


def flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
  """{'a': {'b': x}} -> {'a.b': x} (dict keys joined with dots, any depth)."""
  out = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, Mapping):
      out.update(flatten(value, name + "."))
    else:
      out[name] = value
  return out


def read_flax_msgpack(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """The nested parameter dict of a Hugging Face Flax checkpoint, flattened with dots."""
  from flax import serialization
  try:
    tree = serialization.msgpack_restore(pathlib.Path(path).read_bytes())
  except Exception as e:  # noqa: BLE001 - msgpack raises several unrelated types
    raise ValueError(f"corrupted or truncated Flax msgpack file {pathlib.Path(path).name!r}: "
                     f"{e}") from e
  if not isinstance(tree, Mapping):
    raise ValueError(f"Flax msgpack file {pathlib.Path(path).name!r} does not hold a dict of "
                     "parameters")
  if set(tree) == {"params"}:
    tree = tree["params"]
  return {k: np.asarray(v) for k, v in flatten(tree).items()}


def write_flax_msgpack(path: str | os.PathLike, tensors: Mapping[str, np.ndarray]) -> None:
  """{'a.b.kernel': x} written nested ({'a': {'b': {'kernel': x}}}) with flax.serialization,
  as Hugging Face's Flax `save_pretrained` did (no outer 'params' collection)."""
  from flax import serialization
  tree: dict = {}
  for name in sorted(tensors):
    node = tree
    *parents, leaf = name.split(".")
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = np.ascontiguousarray(tensors[name])
  pathlib.Path(path).write_bytes(serialization.msgpack_serialize(tree))


# ----------------------------------------------------------------------------- directories


def checkpoint_layout(directory: str | os.PathLike) -> str:
  """'safetensors', 'sharded' or 'flax' (the first found, in that order)."""
  d = pathlib.Path(directory)
  for name, layout in ((SAFETENSORS, "safetensors"), (SAFETENSORS_INDEX, "sharded"),
                       (FLAX_MSGPACK, "flax")):
    if (d / name).is_file():
      return layout
  other = sorted(p.name for p in d.glob("*.bin")) if d.is_dir() else []
  hint = (f" (found {other}: PyTorch pickles are not read; re-save with transformers' "
          "save_pretrained, which writes safetensors)") if other else ""
  raise ValueError(f"{str(directory)!r} holds no {SAFETENSORS}, {SAFETENSORS_INDEX} or "
                   f"{FLAX_MSGPACK}{hint}")


def _read_index(directory: pathlib.Path) -> dict[str, str]:
  path = directory / SAFETENSORS_INDEX
  weight_map = field(read_object(path), "weight_map", "object", where=repr(str(path)))
  for name, file in weight_map.items():
    if not isinstance(file, str) or pathlib.Path(file).name != file:
      raise ValueError(f"{SAFETENSORS_INDEX}: tensor {name!r} maps to {file!r}, not a file name")
    if not (directory / file).is_file():
      raise ValueError(f"{SAFETENSORS_INDEX}: shard {file!r} (holding tensor {name!r}) is missing")
  return weight_map


def read_tensors(directory: str | os.PathLike) -> tuple[str, Mapping[str, np.ndarray]]:
  """(layout, {name: array}) of a Hugging Face model directory (safetensors read lazily)."""
  d = pathlib.Path(directory)
  layout = checkpoint_layout(d)
  if layout == "safetensors":
    return layout, read_safetensors(d / SAFETENSORS)
  if layout == "flax":
    return layout, read_flax_msgpack(d / FLAX_MSGPACK)
  weight_map = _read_index(d)
  shards = {file: read_safetensors(d / file) for file in sorted(set(weight_map.values()))}
  owner: dict[str, str] = {}
  for file, shard in shards.items():
    for name in shard:
      listed = weight_map.get(name)
      if listed is not None and listed != file:
        raise ValueError(f"tensor {name!r} is in shard {file!r} but the index lists {listed!r}")
      owner[name] = file
  missing = sorted(set(weight_map) - set(owner))
  if missing:
    raise ValueError(f"{SAFETENSORS_INDEX} lists tensors that no shard holds: {missing[:5]}")
  specs = {name: shards[file].specs[name] for name, file in owner.items()}
  return layout, Tensors(specs, lambda name: shards[owner[name]][name])


def tensor_headers(directory: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], str]]:
  """{name: (shape, dtype code)} without reading tensor data (for `inspect`)."""
  d = pathlib.Path(directory)
  layout = checkpoint_layout(d)
  if layout == "flax":
    return {k: (tuple(v.shape), _ST_CODES.get(v.dtype, str(v.dtype)))
            for k, v in read_flax_msgpack(d / FLAX_MSGPACK).items()}
  files = [SAFETENSORS] if layout == "safetensors" else sorted(set(_read_index(d).values()))
  out = {}
  for file in files:
    out.update(safetensors_specs(d / file))
  return out
