"""Parameter trees as flat safetensors files: one tensor per leaf, named by its path.

    save_flat(path, params, dtype="bfloat16", metadata={...})
    params = load_flat(path, like=abstract_params)      # the tree of `like`, leaves from the file

The shipped embedded pair (`specjax/embedded/`) is stored this way: a single file per model,
no optimizer state, readable by any safetensors reader, and independent of orbax's on-disk
layout. A leaf's name is its path in the tree with dict keys, attribute names and sequence
indices joined by '/', a trailing Variable `value` dropped (`blocks/0/attn/q/kernel`), so the
names do not depend on how a flax version flattens its variables.

Loading checks that the file holds exactly the tree's leaves with the tree's shapes (each
difference named) and casts every tensor to the dtype of `like`'s leaf.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import jax
import ml_dtypes
import numpy as np
from specjax.files import atomic_write

_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def _name(path) -> str:
  parts = []
  for entry in path:
    if isinstance(entry, jax.tree_util.DictKey):
      parts.append(str(entry.key))
    elif isinstance(entry, jax.tree_util.SequenceKey):
      parts.append(str(entry.idx))
    elif isinstance(entry, jax.tree_util.GetAttrKey):
      parts.append(entry.name)
    elif isinstance(entry, jax.tree_util.FlattenedIndexKey):
      parts.append(str(entry.key))
    else:
      parts.append(str(entry))
  while parts and parts[-1] in ("value", "raw_value"):
    parts.pop()
  return "/".join(parts)


def named_leaves(tree: Any) -> dict[str, Any]:
  """{name: leaf} of a parameter tree, in flattening order (names as the module says)."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name = _name(path)
    if name in out:
      raise ValueError(f"two leaves of the tree share the name {name!r}")
    out[name] = leaf
  return out


def save_flat(path: str | os.PathLike, params: Any, *, dtype: str = "bfloat16",
              metadata: dict | None = None) -> dict[str, int]:
  """Write `params`'s floating leaves in `dtype` (others as they are) to one safetensors file,
  atomically (`dirs.atomic_write`). Returns {name: element count}."""
  from safetensors.numpy import save


  if dtype not in _DTYPES:
    raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
  tensors = {}
  for name, leaf in named_leaves(params).items():
    a = np.asarray(jax.device_get(leaf))
    if np.issubdtype(a.dtype, np.floating) or a.dtype == ml_dtypes.bfloat16:
      a = a.astype(_DTYPES[dtype])
    tensors[name] = np.array(a, order="C")  # (ascontiguousarray makes a 0-d array 1-d)
  meta = {"format": "specjax-flat", "dtype": dtype,
          **({"metadata": json.dumps(metadata, sort_keys=True)} if metadata else {})}
  atomic_write(path, save(tensors, metadata=meta))
  return {k: int(v.size) for k, v in tensors.items()}


def load_flat(path: str | os.PathLike, *, like: Any) -> Any:
  """The tree of `like` (arrays or ShapeDtypeStructs) with its leaves read from `path`, each
  cast to `like`'s leaf dtype. ValueError naming the file and every missing, unexpected or
  mis-shaped tensor."""
  from safetensors import safe_open

  path = pathlib.Path(path)
  try:
    f = safe_open(str(path), "np")
  except Exception as e:  # noqa: BLE001 (a damaged or missing file: one line)
    raise ValueError(f"cannot read weights file {str(path)!r}: {e}") from None
  with f:
    stored = set(f.keys())
    leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    names = [_name(p) for p, _ in leaves]
    problems = [f"missing {n}" for n in names if n not in stored]
    problems += [f"unexpected {n}" for n in sorted(stored - set(names))]
    out = []
    for name, (_, leaf) in zip(names, leaves):
      if name not in stored:
        continue
      a = f.get_tensor(name)
      if tuple(a.shape) != tuple(leaf.shape):
        problems.append(f"{name} has shape {tuple(a.shape)}, the model needs "
                        f"{tuple(leaf.shape)}")
        continue
      out.append(np.asarray(a).astype(leaf.dtype))
  if problems:
    shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more"
                                       if len(problems) > 6 else "")
    raise ValueError(f"weights file {str(path)!r} does not fit the model: {shown}")
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like),
                                      [jax.numpy.asarray(a) for a in out])
