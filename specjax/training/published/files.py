"""What every published head format shares: reading a head's files (safetensors, PyTorch
`.bin`/`.pt` pickles through torch, config.json), writing them, the target a head is for,
and the one-line refusals.

Reading. A head directory holds config.json and its weights in one or more `*.safetensors`
files (read with the `safetensors` package, as `checkpoints.hf` does) or, in older
releases, PyTorch pickles (`pytorch_model.bin`, `medusa_lm_head.pt`), read with
`torch.load(weights_only=True)`; torch is imported only then (the `[hf]` extra), and a
missing torch is refused naming the extra. Safetensors win where a directory holds both.
Every tensor comes back as a numpy array in float32 (the heads run in float32; float16 and
bfloat16 widen exactly).

Writing. An export directory is assembled aside and renamed into place (`dirs.assembling`):
on any error nothing appears at the output path.

Head directories are the trainer's (`training.heads.save_head` / `load_head`: orbax, bound
to the target's config and parameter fingerprint). Those live in `training`, which imports
`checkpoints`; the format modules import them inside their functions, the one place in
`checkpoints/` that calls into `training`.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Mapping

import numpy as np
from specjax.checkpoints.hf import read_safetensors
from specjax.files import assembling, prepare_output_dir
from specjax.checkpoints.hf import write_safetensors
from specjax.training.heads import load_head
from specjax.training.heads import save_head
from specjax.data.json_files import read_object

CONFIG = "config.json"
_PICKLES = ("*.bin", "*.pt", "*.pth")


def read_config(directory: str | os.PathLike, required: bool = True) -> dict:
  """config.json of a head directory as a dict ({} when absent and not `required`)."""
  path = pathlib.Path(directory) / CONFIG
  if not path.is_file():
    if required:
      raise ValueError(f"{str(directory)!r} holds no {CONFIG}")
    return {}
  return read_object(path)


def weight_files(directory: str | os.PathLike) -> list[pathlib.Path]:
  """The weight files of a head directory: its safetensors files, else its pickles."""
  d = pathlib.Path(directory)
  if d.exists() and not d.is_dir():
    raise ValueError(f"head directory {str(directory)!r} is a file, not a directory: give "
                     f"the directory holding the head's config.json and weights")
  if not d.is_dir():
    raise ValueError(f"head directory {str(directory)!r} does not exist")
  files = sorted(d.glob("*.safetensors"))
  if not files:
    files = sorted(p for pattern in _PICKLES for p in d.glob(pattern))
  if not files:
    raise ValueError(f"{str(directory)!r} holds no weights (*.safetensors, *.bin or *.pt)")
  return files


def _torch():
  try:
    import torch
  except ModuleNotFoundError:
    raise ValueError("reading PyTorch .bin/.pt weights needs torch: pip install "
                     "'specjax[hf]' (or re-save the head as safetensors)") from None
  return torch


def _read_pickle(path: pathlib.Path) -> dict[str, np.ndarray]:
  torch = _torch()
  try:
    state = torch.load(path, map_location="cpu", weights_only=True)
  except Exception as e:  # torch raises many kinds for a damaged or unsafe pickle
    if "weights_only" in str(e) or "Unsupported global" in str(e):
      raise ValueError(f"{path.name!r} is a PyTorch pickle that holds more than tensors "
                       f"(code or objects a safe load refuses to run), so specjax will not "
                       f"load it: re-save the head's state dict alone, or as safetensors") \
          from None
    raise ValueError(f"cannot read {path.name!r} as PyTorch weights: "
                     f"{' '.join(str(e).split())[:200]}") from None
  if not isinstance(state, Mapping):
    raise ValueError(f"{path.name!r} holds a {type(state).__name__}, not a state dict")
  out = {}
  for name, t in state.items():
    if isinstance(t, torch.Tensor):
      out[str(name)] = t.detach().to(torch.float32).numpy() if t.is_floating_point() \
          else t.detach().numpy()
  return out


def read_weights(directory: str | os.PathLike) -> dict[str, np.ndarray]:
  """{tensor name: array} of a head directory (floating tensors as float32)."""
  out: dict[str, np.ndarray] = {}
  for path in weight_files(directory):
    tensors = (read_safetensors(path) if path.suffix == ".safetensors"
               else _read_pickle(path))
    for name in tensors:
      if name in out:
        raise ValueError(f"tensor {name!r} appears in more than one weight file of "
                         f"{str(directory)!r}")
      x = np.asarray(tensors[name])
      out[name] = x.astype(np.float32) if x.dtype.kind == "f" or x.dtype.name == "bfloat16" \
          else x
      if out[name].dtype.kind == "f" and not np.isfinite(out[name]).all():
        bad = int(np.size(out[name]) - np.isfinite(out[name]).sum())
        raise ValueError(f"tensor {name!r} of {path.name!r} holds {bad} non-finite values "
                         f"(NaN or inf): the head's weights are damaged")
  return out


def check_shape(name: str, array, want: tuple[int, ...], what: str) -> None:
  """The one-line refusal of a tensor that does not fit the target."""
  have = tuple(np.shape(array))
  if have != tuple(want):
    raise ValueError(f"tensor {name!r} has shape {have} but the target needs {tuple(want)} "
                     f"({what}): the head was made for another model")


def check_embedding(tensors, target) -> None:
  """A head that ships its own copy of the embedding must ship the target's, up to bfloat16
  rounding (specjax drafts with the target's embedding, as EAGLE and EAGLE-3 do)."""
  if "embed_tokens.weight" not in tensors:
    return
  ours = np.asarray(target.embed[...], np.float32)
  theirs = np.asarray(tensors["embed_tokens.weight"])
  if theirs.shape != ours.shape:
    raise ValueError(f"tensor embed_tokens.weight has shape {theirs.shape} but the target's "
                     f"embedding is {ours.shape}")
  if not np.allclose(theirs.astype(np.float32), ours, rtol=2.0 ** -7, atol=0.0):
    raise ValueError("tensor embed_tokens.weight differs from the target's embedding beyond "
                     "bfloat16 rounding (specjax drafts with the target's own)")


def write_dir(out: str | os.PathLike, tensors: Mapping[str, np.ndarray], weights_name: str,
              config: dict, overwrite: bool = False) -> pathlib.Path:
  """config.json + one safetensors file, written all or nothing."""
  out = prepare_output_dir(out, overwrite)
  with assembling(out) as tmp:
    write_safetensors(tmp / weights_name, {k: np.ascontiguousarray(v)
                                           for k, v in tensors.items()})
    (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
  return out


def target_of(target, tokenizer=None) -> tuple[Any, Any]:
  """(Transformer, tokenizer) of a target: a module or an `LM` handle (a reference is
  resolved by the caller, `specjax.resolve.load_target`: training sits below resolve)."""
  if isinstance(target, (str, os.PathLike)):
    raise TypeError(f"target {str(target)!r}: pass the target model (resolve a reference "
                    f"with specjax.resolve.load_target first)")
  if hasattr(target, "graphdef"):  # an LM handle
    target = target.module()
  return target, tokenizer


def lm_head_DV(module) -> np.ndarray:
  """The target's LM head as float32 [D, V] (the tied embedding transposed)."""
  if module.lm_head is not None:
    return np.asarray(module.lm_head.kernel[...], np.float32)
  return np.asarray(module.embed[...], np.float32).T


def floats(x, dtype: str) -> np.ndarray:
  """An array in an export dtype ('float32' or 'bfloat16')."""
  if dtype == "bfloat16":
    import ml_dtypes
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)
  if dtype != "float32":
    raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
  return np.asarray(x, np.float32)


def load_bound_head(head_dir, module, kind: str):
  """`training.heads.load_head` of a head directory for this target (refused, naming the
  differing fields, for another one)."""
  from flax import nnx

  return load_head(head_dir, target=(module.config, nnx.state(module, nnx.Param)), kind=kind)


def save_bound_head(out_dir, kind, params, module, tokenizer, metadata: dict,
                    overwrite: bool = False) -> pathlib.Path:
  """`training.heads.save_head` bound to this target."""
  from flax import nnx

  return save_head(out_dir, kind, params, (module.config, nnx.state(module, nnx.Param)),
                   tokenizer, metadata=metadata, overwrite=overwrite)
