"""Checkpoints: load any model directory, save specjax models, inspect.

    model, tokenizer = load_model(path)

`path` may be
  - a Hugging Face model directory (config.json + safetensors, sharded or not, or GPT-2's
    flax_model.msgpack),
  - a checkpoint written by `specjax import-hf` / `save_model` (orbax, kind 'specjax-model'),
  - a checkpoint written by the trainer (orbax, kind 'specjax-lm').
The tokenizer is the Hugging Face `tokenizer.json` found there (read with `tokenizers`), the
specjax tokenizer a trained checkpoint records, or the byte tokenizer when there is none.

The package: `orbax_io` (generic orbax save/restore), `trained` (trainer checkpoints),
`flat` (one flat safetensors file), `hf/` (Hugging Face import/export), and here the
'specjax-model' kind plus the loaders that dispatch on what a directory holds (output
directories are written all or nothing by `specjax.files`).

A `save_model` checkpoint directory holds one orbax step (params in the model's dtype,
ModelConfig, metadata: kind, family, the original config.json) plus the tokenizer files. It
is assembled in a temporary sibling directory and renamed into place, so a failed import
leaves nothing at the output path.

Imports point one way: `specjax.training` imports `specjax.checkpoints` (orbax_io, trained),
never the reverse. The Hugging Face machinery is imported inside the functions, so training
code importing `specjax.checkpoints.orbax_io` does not pull it in.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

from specjax import sharding
from specjax.checkpoints import hf, orbax_io
from specjax.checkpoints.hf.tensor_files import FLAX_MSGPACK, SAFETENSORS, SAFETENSORS_INDEX
from specjax.checkpoints.hf.tokenizer import copy_tokenizer_files
from specjax.checkpoints.trained import TRAINED_KIND, load_trained, stored_config
from specjax.files import assembling, prepare_output_dir
from specjax.models.transformer import abstract_model, from_params, param_count, with_dtype

MODEL_KIND = "specjax-model"  # written by save_model (import-hf)


def is_hf_dir(path: str | os.PathLike) -> bool:
  p = pathlib.Path(path)
  return (p / "config.json").is_file() and any(
      (p / n).is_file() for n in (SAFETENSORS, SAFETENSORS_INDEX, FLAX_MSGPACK))


def is_orbax_dir(path: str | os.PathLike) -> bool:
  return orbax_io.latest_step(path) is not None


def save_model(directory: str | os.PathLike, model, *, metadata: dict | None = None,
               tokenizer_dir: str | os.PathLike | None = None, step: int = 0,
               overwrite: bool = False) -> pathlib.Path:
  """Save a Transformer with its ModelConfig as an orbax checkpoint (atomic directory).

  tokenizer_dir: copy the tokenizer files found there (Hugging Face or specjax BPE).
  metadata: extra JSON-ready fields (the kind 'specjax-model' is added).
  """
  from flax import nnx

  out = prepare_output_dir(directory, overwrite)
  meta = {**(metadata or {}), "kind": MODEL_KIND}
  module = model.module() if hasattr(model, "graphdef") else model
  params = nnx.state(module, nnx.Param)
  with assembling(out) as tmp:
    orbax_io.save(tmp, step, params=params, config=module.config, metadata=meta, keep=None)
    if tokenizer_dir is not None:
      copy_tokenizer_files(tokenizer_dir, tmp)
  return out


def load_checkpoint(directory: str | os.PathLike, *, config=None, step: int | None = None,
                    mesh=None):
  """Restore a save_model / trainer checkpoint: (Transformer, metadata).

  config: the expected ModelConfig; a checkpoint saved with another one raises ValueError
  listing each differing field (orbax_io.restore).
  mesh: a ('data', 'model') mesh (default: `sharding.default_mesh`, else one device): every
  array is read straight into its shards (`sharding.abstract_params`), no whole copy on one
  device first.
  """
  directory = pathlib.Path(directory)
  if not is_orbax_dir(directory):
    raise ValueError(f"no specjax checkpoint found in {str(directory)!r}")
  meta = orbax_io.read_meta(directory, step)
  kind = meta["metadata"].get("kind")
  mesh = sharding.check_mesh(mesh)
  if kind == TRAINED_KIND:
    trained = load_trained(directory, step=step, config=config, mesh=mesh)
    return trained.module(), {**trained.metadata, "step": trained.step}
  stored = stored_config(directory, meta)
  _, target = abstract_model(stored)
  if mesh is not None:
    target = sharding.abstract_params(mesh, stored, target)
  restored = orbax_io.restore(directory, params_target=target, config=config or stored,
                              step=step)
  return from_params(stored, restored.params), {**restored.metadata, "step": restored.step}


def load_model(path: str | os.PathLike, *, dtype: str | None = None, config=None,
               step: int | None = None, mesh=None) -> tuple[Any, Any]:
  """(Transformer, tokenizer) from a Hugging Face directory or a specjax orbax checkpoint.

  dtype: None keeps the stored precision; 'float32' / 'bfloat16' converts.
  config: (orbax checkpoints) the expected ModelConfig; a mismatch raises listing fields.
  mesh: load every weight straight into its shards on this ('data', 'model') mesh (default:
  `sharding.default_mesh`, the CLI's --mesh; else one device).
  """
  mesh = sharding.check_mesh(mesh)
  with sharding.on(mesh):  # parameters sized against the mesh's devices (check_params_fit)
    return _load_model(pathlib.Path(path), dtype, config, step, mesh)


def _load_model(path: pathlib.Path, dtype, config, step, mesh) -> tuple[Any, Any]:
  if not path.is_dir():
    raise ValueError(f"model path {str(path)!r} is not a directory")
  if is_hf_dir(path) or (path / "config.json").is_file() and not is_orbax_dir(path):
    imported = hf.import_hf(path, dtype=dtype)  # names what is missing or broken
    return imported.model(mesh=mesh), hf.load_tokenizer_for(path, imported.hf_config)
  if is_orbax_dir(path):
    model, meta = load_checkpoint(path, config=config, step=step, mesh=mesh)
    if dtype is not None and dtype != model.config.dtype:
      model = with_dtype(model, dtype)  # each shard cast where it lies
    if meta.get("kind") == TRAINED_KIND:
      return model, hf.recorded_tokenizer(meta["tokenizer"], path)
    return model, hf.load_tokenizer_for(path, meta.get("hf_config"))
  raise ValueError(f"{str(path)!r} is neither a Hugging Face model directory (config.json + "
                   "model.safetensors / model.safetensors.index.json / flax_model.msgpack) nor a "
                   "specjax orbax checkpoint")


def _np_dtype(dtype: str):
  import ml_dtypes
  import numpy as np
  return np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)


def describe(path: str | os.PathLike) -> dict:
  """What `specjax inspect` prints: format, family, config, parameter count, bytes, dtypes."""
  import math

  path = pathlib.Path(path)
  if not path.is_dir():
    raise ValueError(f"checkpoint path {str(path)!r} is not a directory")
  disk = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
  if is_hf_dir(path) or (path / "config.json").is_file() and not is_orbax_dir(path):
    hf_config = hf.read_hf_config(path)
    family, config = hf.config_from_hf(hf_config)
    headers = {k: v for k, v in hf.tensor_headers(path).items()
               if not hf.IGNORED_BUFFERS.match(k)}
    dtypes = sorted({d for _, d in headers.values()})
    params = sum(math.prod(s) for s, _ in headers.values())
    nbytes = sum(math.prod(s) * hf.itemsize(d) for s, d in headers.values())
    config = config.replace(dtype="bfloat16" if dtypes == ["BF16"] else "float32")
    return {"format": "huggingface", "layout": hf.checkpoint_layout(path), "family": family,
            "architecture": (hf_config.get("architectures") or [None])[0],
            "config": config.to_dict(), "parameters": params, "bytes": nbytes,
            "dtypes": dtypes, "tensors": len(headers), "disk_bytes": disk}
  if is_orbax_dir(path):
    orbax_io.check_step(path)  # the files a restore needs: a damaged step is named here
    meta = orbax_io.read_meta(path)
    config = stored_config(path, meta)
    shapes = _stored_arrays(path, orbax_io.latest_step(path))
    if shapes:
      params = sum(math.prod(s) for s, _ in shapes)
      nbytes = sum(math.prod(s) * d.itemsize for s, d in shapes)
      dtypes = sorted({str(d) for _, d in shapes})
    else:  # no array metadata: count from the config
      params = param_count(config)
      nbytes = params * _np_dtype(config.dtype).itemsize
      dtypes = [config.dtype]
    m = meta["metadata"]
    with orbax_io.Checkpointer(path, keep=None, read_only=True) as ckpt:
      steps = ckpt.all_steps()
    return {"format": "orbax", "kind": m.get("kind"), "family": m.get("family"),
            "steps": steps, "config": config.to_dict(), "parameters": params, "bytes": nbytes,
            "dtypes": dtypes, "tokenizer": m.get("tokenizer"), "disk_bytes": disk}
  raise ValueError(f"{str(path)!r} is neither a Hugging Face model directory nor a specjax "
                   "orbax checkpoint")


def _stored_arrays(path: pathlib.Path, step: int) -> list[tuple[tuple, Any]]:
  """[(shape, dtype)] of the stored parameter arrays, read from orbax metadata only."""
  import jax
  import numpy as np
  import orbax.checkpoint as ocp
  try:
    meta = ocp.StandardCheckpointHandler().metadata(path / str(step) / "params")
    tree = meta.tree if hasattr(meta, "tree") else meta
    return [(tuple(x.shape), np.dtype(x.dtype)) for x in jax.tree.leaves(tree)]
  except Exception:  # noqa: BLE001 - metadata layout differs across orbax versions
    return []
