"""Import a Hugging Face checkpoint into specjax and export a specjax model back.

    imported = import_hf("path/to/hf_dir")          # HFImport(config, params, family, ...)
    model = imported.model()                         # specjax Transformer
    export_hf(model, "path/to/out_dir")              # config.json + model.safetensors

Import is all or nothing: every tensor the config needs must be present with exactly the
expected shape, every tensor present must be used (known non-parameter buffers excepted),
and all problems are reported together, naming the tensors, before anything is built or
written. Export writes safetensors (sharded with an index above `max_shard_bytes`) and a
config.json that `transformers` loads with `AutoModelForCausalLM.from_pretrained`; the
directory is assembled aside and renamed into place (`specjax.files`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any, Mapping

import ml_dtypes
import numpy as np

from specjax.files import assembling, prepare_output_dir
from specjax.checkpoints.hf.config import config_from_hf, family_for, hf_config_for, read_hf_config
from specjax.checkpoints.hf.keys import IGNORED_BUFFERS, PREFIX, TIED_HEAD, Rule, rules_for
from specjax.checkpoints.hf.tensor_files import (FLAX_MSGPACK, SAFETENSORS, SAFETENSORS_INDEX,
                                                 flatten, read_tensors, write_flax_msgpack,
                                                 write_safetensors)
from specjax.checkpoints.hf.tokenizer import copy_tokenizer_files
from specjax.models.transformer import (ModelConfig, abstract_model, check_params_fit,
                                        from_params)
from specjax import sharding

DEFAULT_SHARD_BYTES = 5 * 2**30


def _np_dtype(dtype: str) -> np.dtype:
  return np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
  """{'blocks.0.attn.q.kernel': shape} of a Transformer with this config (no allocation)."""
  from flax import nnx
  return {k: tuple(v.shape) for k, v in
          flatten(nnx.to_pure_dict(abstract_model(config)[1])).items()}


def nest(flat: Mapping[str, Any]) -> dict:
  """{'blocks.0.attn.q.kernel': x} -> the nested pure dict of an nnx state (int list keys)."""
  tree: dict = {}
  for name, value in flat.items():
    node = tree
    *parents, leaf = [int(p) if p.isdigit() else p for p in name.split(".")]
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return tree


def build_model(config: ModelConfig, params: Mapping[str, Any], mesh=None):
  """A specjax Transformer holding `params` ({specjax name: array} or a nested pure dict).
  mesh: a ('data', 'model') mesh: each tensor goes straight to its shards
  (`sharding.named`: every device receives its slice), never whole onto one device."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  _, state = abstract_model(config)
  flat = params if all(isinstance(k, str) and not isinstance(v, Mapping)
                       for k, v in params.items()) else flatten(params)
  if mesh is None:
    put = lambda name, v: jnp.asarray(v)
  else:
    put = lambda name, v: jax.device_put(v, sharding.named(mesh, config, name.split("."),
                                                           np.shape(v)))
  nnx.replace_by_pure_dict(state, nest({k: put(k, v) for k, v in flat.items()}))
  return from_params(config, state)


def model_params(model) -> dict[str, np.ndarray]:
  """{specjax name: numpy array} of a Transformer (or an `LM` handle)."""
  from flax import nnx
  module = model.module() if hasattr(model, "graphdef") else model
  return {k: np.asarray(v) for k, v in
          flatten(nnx.to_pure_dict(nnx.state(module, nnx.Param))).items()}


# ----------------------------------------------------------------------------- import


def _float_dtype(tensors: Mapping[str, np.ndarray], embed_name: str | None) -> str:
  """Keep the checkpoint's precision: bfloat16 if the embedding is bf16, else float32
  (float16 and float64 become float32: ModelConfig has no other dtypes; f16 -> f32 is exact)."""
  if embed_name is not None and tensors[embed_name].dtype == ml_dtypes.bfloat16:
    return "bfloat16"
  return "float32"


def convert_in(rules: list[Rule], tensors: Mapping[str, np.ndarray], config: ModelConfig,
               family: str) -> dict[str, np.ndarray]:
  """Apply the key map: {specjax name: array in config.dtype}; raises listing every problem."""
  shapes = param_shapes(config)
  target = _np_dtype(config.dtype)
  prefix = PREFIX[family]
  problems, used, out = [], set(), {}

  def resolve(name):
    if name in tensors:
      return name
    if name.startswith(prefix) and name[len(prefix):] in tensors:
      return name[len(prefix):]  # checkpoints of the base model (no head) lack the prefix
    return None

  for rule in rules:
    name = resolve(rule.hf)
    if name is None:
      problems.append(f"missing tensor {rule.hf!r} (for {', '.join(rule.specjax)})")
      continue
    used.add(name)
    x = tensors[name]
    want = rule.hf_shape(shapes)
    if tuple(x.shape) != want:
      problems.append(f"tensor {name!r} has shape {tuple(x.shape)}, expected {want} "
                      f"(for {', '.join(rule.specjax)})")
      continue
    if not np.issubdtype(x.dtype, np.floating) and x.dtype != ml_dtypes.bfloat16:
      problems.append(f"tensor {name!r} has dtype {x.dtype}, expected a floating type")
      continue
    for sj, part in zip(rule.specjax, rule.to_specjax(np.asarray(x))):
      out[sj] = part.astype(target)
  if config.tie_embeddings:  # a tied head some exporters still write: must equal the embedding
    for head in TIED_HEAD:
      if head in tensors and "embed" in out:
        used.add(head)
        h = np.asarray(tensors[head])
        h = h.T if head.endswith("kernel") else h
        if h.shape != out["embed"].shape or not np.array_equal(h.astype(target), out["embed"]):
          problems.append(f"tensor {head!r} differs from the embedding but the config ties them "
                          "(tie_word_embeddings=true)")
  unexpected = sorted(n for n in set(tensors) - used if not IGNORED_BUFFERS.match(n))
  problems += [f"unexpected tensor {n!r} (shape {tuple(tensors[n].shape)}): not part of a "
               f"{family} model with this config" for n in unexpected]
  if problems:
    shown = problems[:12] + ([f"... and {len(problems) - 12} more"] if len(problems) > 12 else [])
    raise ValueError(f"checkpoint does not match the {family} config ({len(problems)} "
                     "problem(s)):\n  " + "\n  ".join(shown))
  return out


@dataclasses.dataclass
class HFImport:
  """A Hugging Face checkpoint converted to specjax names (numpy arrays in config.dtype)."""

  config: ModelConfig
  params: dict[str, np.ndarray]
  family: str
  layout: str
  hf_config: dict

  def model(self, mesh=None):
    """The Transformer; with a mesh, each weight placed straight into its shards."""
    return build_model(self.config, self.params, mesh)


def import_hf(directory: str | os.PathLike, *, dtype: str | None = None) -> HFImport:
  """Read and convert a Hugging Face model directory (config.json + weights).

  dtype: None keeps the checkpoint's precision (bf16 stays bf16); 'float32' or 'bfloat16'
  converts. Raises ValueError naming the field or tensor on any mismatch, and, before any
  tensor is read, when the config's parameters exceed this machine's memory
  (`transformer.check_params_fit`).
  """
  if dtype not in (None, "float32", "bfloat16"):
    raise ValueError(f"dtype must be None, 'float32' or 'bfloat16', got {dtype!r}")
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    raise ValueError(f"Hugging Face model directory {str(directory)!r} does not exist")
  hf = read_hf_config(directory)
  family, config = config_from_hf(hf)
  # Before any tensor is read or any per-layer key listed: the parameters must fit this
  # machine at the smallest precision they can come in (the stored dtype is known later).
  what = f"Hugging Face model {str(directory)!r} (config.json)"
  check_params_fit(config.replace(dtype=dtype or "bfloat16"), what=what)
  layout, tensors = read_tensors(directory)
  rules = rules_for(family, config, "flax" if layout == "flax" else "safetensors")
  embed = next((n for n in (rules[0].hf, rules[0].hf[len(PREFIX[family]):]) if n in tensors),
               None)
  config = config.replace(dtype=dtype or _float_dtype(tensors, embed))
  check_params_fit(config, what=what)
  params = convert_in(rules, tensors, config, family)
  return HFImport(config=config, params=params, family=family, layout=layout, hf_config=hf)


# ----------------------------------------------------------------------------- export


def convert_out(rules: list[Rule], params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  missing = sorted({p for r in rules for p in r.specjax} - set(params))
  if missing:
    raise ValueError(f"model lacks parameters {missing[:5]} the key map needs")
  return {r.hf: r.to_hf([np.asarray(params[p]) for p in r.specjax]) for r in rules}


def _shards(tensors: Mapping[str, np.ndarray], max_bytes: int) -> list[dict[str, np.ndarray]]:
  shards: list[dict] = [{}]
  size = 0
  for name in sorted(tensors):
    n = tensors[name].nbytes
    if shards[-1] and size + n > max_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = tensors[name]
    size += n
  return shards


def _write_shards(directory: pathlib.Path, tensors: Mapping[str, np.ndarray],
                  max_bytes: int) -> None:
  """model.safetensors, or shards and their index above `max_bytes`."""
  shards = _shards(tensors, max_bytes)
  meta = {"format": "pt"}
  if len(shards) == 1:
    write_safetensors(directory / SAFETENSORS, shards[0], meta)
    return
  weight_map = {}
  for i, shard in enumerate(shards):
    file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    write_safetensors(directory / file, shard, meta)
    weight_map.update({name: file for name in shard})
  index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
           "weight_map": weight_map}
  (directory / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))


def export_hf(model, out: str | os.PathLike, *, dtype: str | None = None,
              tokenizer_dir: str | os.PathLike | None = None, base_config: Mapping | None = None,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
              layout: str = "safetensors") -> pathlib.Path:
  """Write a Transformer (or (config, params)) as a Hugging Face directory.

  layout: 'safetensors' (model.safetensors, sharded above max_shard_bytes) or 'flax' (one
  flax_model.msgpack in the Flax models' parameter layout). dtype: None keeps the model's
  dtype. tokenizer_dir: copy the Hugging Face tokenizer files
  found there. base_config: an original config.json to keep unrelated fields (token ids) of.
  The directory is assembled in a temporary sibling and renamed into place: on any error
  nothing is written at `out`.
  """
  if dtype not in (None, "float32", "bfloat16"):
    raise ValueError(f"dtype must be None, 'float32' or 'bfloat16', got {dtype!r}")
  if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
    raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
  if layout not in ("safetensors", "flax"):
    raise ValueError(f"layout must be 'safetensors' or 'flax', got {layout!r}")
  out = prepare_output_dir(out, overwrite)
  if isinstance(model, tuple):
    config, params = model
  else:
    config, params = model.config, model_params(model)
  config = config.replace(dtype=dtype or config.dtype)
  family = family_for(config)
  target = _np_dtype(config.dtype)
  shapes = param_shapes(config)
  bad = [f"{k}: shape {tuple(np.shape(params.get(k)))}, expected {s}" for k, s in shapes.items()
         if k not in params or tuple(np.shape(params[k])) != s]
  if bad:
    raise ValueError("parameters do not match the config:\n  " + "\n  ".join(bad[:8]))
  tensors = convert_out(rules_for(family, config, layout),
                        {k: np.asarray(v).astype(target) for k, v in params.items()})
  hf = hf_config_for(config, family, base_config)

  with assembling(out) as tmp:
    (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    if tokenizer_dir is not None:
      copy_tokenizer_files(tokenizer_dir, tmp)
    if layout == "flax":
      write_flax_msgpack(tmp / FLAX_MSGPACK, tensors)
    else:
      _write_shards(tmp, tensors, max_shard_bytes)
  return out
