"""Hugging Face checkpoints: import into specjax, export back (GPT-2, Llama, Mistral, Qwen2).

    imported = import_hf("path/to/hf_dir")          # HFImport(config, params, family, ...)
    model = imported.model()                         # specjax Transformer
    export_hf(model, "path/to/out_dir")              # config.json + model.safetensors

Formats read: `model.safetensors`, sharded `model.safetensors.index.json` + shards, and the
Flax msgpack layout Hugging Face used for GPT-2 (`flax_model.msgpack`). Written: safetensors
(sharded with an index above `max_shard_bytes`) and a `config.json` that `transformers`
loads with `AutoModelForCausalLM.from_pretrained`.

The tensor names are a declarative key map (`Rule`s, one list per family and layout). Import
is all or nothing: every tensor the config needs must be present with exactly the expected
shape, every tensor present must be used (known non-parameter buffers excepted), and all
problems are reported together, naming the tensors, before anything is built or written.

Layout conventions: torch `nn.Linear` stores [out, in], specjax and GPT-2's `Conv1D` store
[in, out]; Flax GPT-2's `FlaxConv1D` stores [out, in] (it transposes at call time); GPT-2
fuses q, k, v into one `c_attn` of width 3·D. RoPE uses the half-split (`rotate_half`) pair
layout in both libraries, so q/k weights need no permutation.

The safetensors reader and writer are ~60 lines here rather than the `safetensors`
package: the reader memory-maps the file, checks every header entry against the file size
(a truncated or corrupted file names the first tensor it cannot hold) and reads bfloat16
through `ml_dtypes` (numpy has no bf16); the writer produces the standard layout (8-byte
little-endian header length, JSON header padded to 8 bytes, contiguous data).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import re
import shutil
import struct
import tempfile
from typing import Any, Iterable, Mapping

import ml_dtypes
import numpy as np

from specjax.models.transformer import ModelConfig

FAMILIES = ("gpt2", "llama", "mistral", "qwen2")
ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                 "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SAFETENSORS, SAFETENSORS_INDEX, FLAX_MSGPACK = (
    "model.safetensors", "model.safetensors.index.json", "flax_model.msgpack")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model")
DEFAULT_SHARD_BYTES = 5 * 2**30

# ----------------------------------------------------------------------------- safetensors

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
              "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32, "I16": np.int16,
              "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_ST_CODES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
_MAX_HEADER = 100 * 2**20


def itemsize(code: str) -> int:
  """Bytes per element of a safetensors dtype code (or a numpy dtype name)."""
  return np.dtype(_ST_DTYPES.get(code, code)).itemsize


def _bad_file(path, what: str) -> ValueError:
  return ValueError(f"corrupted or truncated safetensors file {pathlib.Path(path).name!r}: {what}")


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict, dict, int]:
  """(tensors {name: {dtype, shape, data_offsets}}, metadata, data start), all validated."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise _bad_file(path, f"the file has {size} bytes, fewer than the 8-byte header length")
    (n,) = struct.unpack("<Q", head)
    if n > size - 8 or n > _MAX_HEADER:
      raise _bad_file(path, f"the header claims {n} bytes but the file has {size - 8} after "
                      "the length field")
    try:
      header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise _bad_file(path, f"the header is not valid JSON ({e})") from e
  if not isinstance(header, dict):
    raise _bad_file(path, "the header is not a JSON object")
  metadata = header.pop("__metadata__", None) or {}
  start, data_bytes = 8 + n, size - 8 - n
  for name, info in header.items():
    try:
      dtype = np.dtype(_ST_DTYPES[info["dtype"]])
      shape = tuple(int(d) for d in info["shape"])
      begin, end = (int(o) for o in info["data_offsets"])
    except (KeyError, TypeError, ValueError) as e:
      raise _bad_file(path, f"tensor {name!r} has a malformed header entry {info!r}") from e
    if end > data_bytes:
      raise _bad_file(path, f"tensor {name!r} needs bytes [{begin}, {end}) of the data section "
                      f"but the file holds only {data_bytes}")
    if not 0 <= begin <= end or end - begin != math.prod(shape) * dtype.itemsize:
      raise _bad_file(path, f"tensor {name!r}: offsets [{begin}, {end}) do not match its shape "
                      f"{shape} and dtype {info['dtype']}")
  return header, metadata, start


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """All tensors of one file as read-only numpy arrays backed by a memory map."""
  header, _, start = read_safetensors_header(path)
  if not header:
    return {}
  raw = np.memmap(path, dtype=np.uint8, mode="r")
  out = {}
  for name, info in header.items():
    begin, end = info["data_offsets"]
    dtype = np.dtype(_ST_DTYPES[info["dtype"]]).newbyteorder("<")
    out[name] = raw[start + begin:start + end].view(dtype).reshape(info["shape"])
  return out


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> None:
  """Standard safetensors layout; tensors in name order, contiguous, little-endian."""
  header, arrays, offset = {}, [], 0
  for name in sorted(tensors):
    arr = np.ascontiguousarray(tensors[name])
    if arr.dtype.byteorder == ">":
      arr = arr.byteswap().view(arr.dtype.newbyteorder("<"))
    code = _ST_CODES.get(arr.dtype.newbyteorder("="))
    if code is None:
      raise ValueError(f"tensor {name!r}: dtype {arr.dtype} has no safetensors code")
    header[name] = {"dtype": code, "shape": list(arr.shape),
                    "data_offsets": [offset, offset + arr.nbytes]}
    arrays.append(arr)
    offset += arr.nbytes
  if metadata:
    header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for arr in arrays:
      f.write(arr.tobytes())


# ----------------------------------------------------------------------------- file layouts


def _flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, Mapping):
      out.update(_flatten(value, name + "."))
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
  return {k: np.asarray(v) for k, v in _flatten(tree).items()}


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
  try:
    index = json.loads((directory / SAFETENSORS_INDEX).read_text())
    weight_map = index["weight_map"]
  except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
    raise ValueError(f"cannot read {SAFETENSORS_INDEX} in {str(directory)!r}: {e}") from e
  for name, file in weight_map.items():
    if not isinstance(file, str) or pathlib.Path(file).name != file:
      raise ValueError(f"{SAFETENSORS_INDEX}: tensor {name!r} maps to {file!r}, not a file name")
    if not (directory / file).is_file():
      raise ValueError(f"{SAFETENSORS_INDEX}: shard {file!r} (holding tensor {name!r}) is missing")
  return weight_map


def read_tensors(directory: str | os.PathLike) -> tuple[str, dict[str, np.ndarray]]:
  """(layout, {name: array}) of a Hugging Face model directory."""
  d = pathlib.Path(directory)
  layout = checkpoint_layout(d)
  if layout == "safetensors":
    return layout, read_safetensors(d / SAFETENSORS)
  if layout == "flax":
    return layout, read_flax_msgpack(d / FLAX_MSGPACK)
  weight_map = _read_index(d)
  tensors = {}
  for file in sorted(set(weight_map.values())):
    for name, arr in read_safetensors(d / file).items():
      listed = weight_map.get(name)
      if listed is not None and listed != file:
        raise ValueError(f"tensor {name!r} is in shard {file!r} but the index lists {listed!r}")
      tensors[name] = arr
  missing = sorted(set(weight_map) - set(tensors))
  if missing:
    raise ValueError(f"{SAFETENSORS_INDEX} lists tensors that no shard holds: {missing[:5]}")
  return layout, tensors


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
    header, _, _ = read_safetensors_header(d / file)
    out.update({k: (tuple(v["shape"]), v["dtype"]) for k, v in header.items()})
  return out


# ----------------------------------------------------------------------------- configs


def read_hf_config(directory: str | os.PathLike) -> dict:
  path = pathlib.Path(directory) / "config.json"
  if not path.is_file():
    raise ValueError(f"{str(directory)!r} is not a Hugging Face model directory: no config.json")
  try:
    config = json.loads(path.read_text())
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"cannot read {str(path)!r}: {e}") from e
  if not isinstance(config, dict):
    raise ValueError(f"{str(path)!r} does not hold a JSON object")
  return config


def detect_family(hf: Mapping) -> str:
  model_type = hf.get("model_type")
  if model_type in FAMILIES:
    return model_type
  arch = (hf.get("architectures") or [None])[0]
  raise ValueError(f"unsupported architecture {arch!r} (model_type {model_type!r}); supported: "
                   + ", ".join(f"{ARCHITECTURES[f]} (model_type {f!r})" for f in FAMILIES))


# transformers' defaults for fields a hand-written config.json may leave out.
_DEFAULTS = {
    "gpt2": {"n_positions": 1024, "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new",
             "tie_word_embeddings": True, "n_inner": None, "scale_attn_weights": True,
             "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False},
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "hidden_act": "silu",
              "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False},
    "mistral": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6, "hidden_act": "silu",
                "tie_word_embeddings": False, "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "hidden_act": "silu",
              "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 4096},
}
_GPT2_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # all the tanh approximation


def rope_theta_of(hf: Mapping, default: float = 10000.0) -> float:
  """θ from transformers 5's `rope_parameters` or the older `rope_theta` + `rope_scaling`.

  Only the plain ("default") rotary embedding is supported: scaled variants (linear,
  dynamic, yarn, llama3, longrope) change the frequencies and are refused.
  """
  params = hf.get("rope_parameters")
  scaling = hf.get("rope_scaling")
  if params is not None and not isinstance(params, Mapping):
    raise ValueError(f"config.json: rope_parameters must be an object, got {params!r}")
  if params and all(isinstance(v, Mapping) for v in params.values()):
    raise ValueError(f"config.json: per-layer-type rope_parameters {sorted(params)} are not "
                     "supported")
  spec = dict(params or scaling or {})
  kind = spec.get("rope_type", spec.get("type", "default"))
  if kind != "default":
    raise ValueError(f"config.json: rope type {kind!r} is not supported (specjax implements "
                     "the default rotary embedding only)")
  factor = spec.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  if factor not in (None, 1, 1.0):
    raise ValueError(f"config.json: partial_rotary_factor={factor} is not supported (needs 1.0)")
  theta = spec.get("rope_theta", hf.get("rope_theta", default))
  if theta is None:
    theta = default
  return float(theta)


def _need(hf: Mapping, family: str, *names: str):
  """The first present field among `names` (aliases), else the family default, else an error."""
  for name in names:
    if hf.get(name) is not None:
      return hf[name]
  for name in names:
    if name in _DEFAULTS[family]:
      return _DEFAULTS[family][name]
  raise ValueError(f"config.json ({family}) lacks the field {names[0]!r}")


def _require(hf: Mapping, family: str, name: str, allowed: Iterable, why: str) -> None:
  value = hf.get(name, _DEFAULTS[family].get(name))
  allowed = tuple(allowed)
  if value not in allowed:
    raise ValueError(f"config.json: {name}={value!r} is not supported for {family} ({why}; "
                     f"allowed: {allowed})")


def config_from_hf(hf: Mapping, dtype: str = "float32") -> tuple[str, ModelConfig]:
  """(family, ModelConfig) for a Hugging Face config dict; unsupported options raise."""
  family = detect_family(hf)
  if family == "gpt2":
    _require(hf, family, "activation_function", _GPT2_GELUS, "specjax uses the tanh GELU")
    _require(hf, family, "scale_attn_weights", (True,), "attention is scaled by 1/sqrt(head_dim)")
    _require(hf, family, "scale_attn_by_inverse_layer_idx", (False,), "no per-layer scaling")
    _require(hf, family, "add_cross_attention", (False,), "decoder-only")
    d = int(_need(hf, family, "n_embd", "hidden_size"))
    heads = int(_need(hf, family, "n_head", "num_attention_heads"))
    n_inner = hf.get("n_inner")
    config = ModelConfig(
        vocab_size=int(_need(hf, family, "vocab_size")), d_model=d,
        n_layers=int(_need(hf, family, "n_layer", "num_hidden_layers")), n_heads=heads,
        n_kv_heads=heads, d_ff=int(n_inner) if n_inner is not None else 4 * d,
        max_len=int(_need(hf, family, "n_positions", "max_position_embeddings")),
        norm="layernorm", positions="learned", mlp="gelu",
        tie_embeddings=bool(_need(hf, family, "tie_word_embeddings")), use_bias=True,
        norm_eps=float(_need(hf, family, "layer_norm_epsilon")), dtype=dtype)
    return family, config

  _require(hf, family, "hidden_act", ("silu",), "SwiGLU uses silu")
  if family == "llama":
    _require(hf, family, "attention_bias", (False,), "no attention biases")
    _require(hf, family, "mlp_bias", (False,), "no MLP biases")
  d = int(_need(hf, family, "hidden_size"))
  heads = int(_need(hf, family, "num_attention_heads"))
  kv = hf.get("num_key_value_heads")
  head_dim = hf.get("head_dim")
  if head_dim is not None and int(head_dim) * heads != d:
    raise ValueError(f"config.json: head_dim={head_dim} with num_attention_heads={heads} is not "
                     f"hidden_size={d} / num_attention_heads (specjax derives head_dim)")
  max_len = int(_need(hf, family, "max_position_embeddings"))
  window = _sliding_window(hf, family)
  if window is not None:
    max_len = min(max_len, window)  # beyond the window HF attends locally: exact only up to it
  config = ModelConfig(
      vocab_size=int(_need(hf, family, "vocab_size")), d_model=d,
      n_layers=int(_need(hf, family, "num_hidden_layers")), n_heads=heads,
      n_kv_heads=int(kv) if kv is not None else heads,
      d_ff=int(_need(hf, family, "intermediate_size")), max_len=max_len, norm="rmsnorm",
      positions="rope", rope_theta=rope_theta_of(hf), mlp="swiglu",
      tie_embeddings=bool(_need(hf, family, "tie_word_embeddings")), use_bias=False,
      qkv_bias=family == "qwen2", norm_eps=float(_need(hf, family, "rms_norm_eps")),
      dtype=dtype)
  return family, config


def _sliding_window(hf: Mapping, family: str) -> int | None:
  if family == "mistral":
    window = hf.get("sliding_window", _DEFAULTS[family]["sliding_window"])
  elif family == "qwen2" and hf.get("use_sliding_window", False):
    window = hf.get("sliding_window", _DEFAULTS[family]["sliding_window"])
  else:
    return None
  return int(window) if window is not None else None


def family_for(config: ModelConfig) -> str:
  """The Hugging Face family that computes exactly what this ModelConfig does."""
  c = config
  if (c.norm, c.positions, c.mlp, c.use_bias) == ("layernorm", "learned", "gelu", True):
    if c.n_kv_heads != c.n_heads:
      raise ValueError(f"GPT-2 has no grouped-query attention: n_kv_heads={c.n_kv_heads} must "
                       f"equal n_heads={c.n_heads} to export")
    return "gpt2"
  if (c.norm, c.positions, c.mlp, c.use_bias) == ("rmsnorm", "rope", "swiglu", False):
    return "qwen2" if c.qkv_bias else "llama"
  raise ValueError(
      "no Hugging Face family computes this model: GPT-2 needs norm='layernorm', "
      "positions='learned', mlp='gelu', use_bias=True; Llama/Qwen2 need norm='rmsnorm', "
      f"positions='rope', mlp='swiglu', use_bias=False; got norm={c.norm!r}, "
      f"positions={c.positions!r}, mlp={c.mlp!r}, use_bias={c.use_bias}")


def hf_config_for(config: ModelConfig, family: str | None = None,
                  base: Mapping | None = None) -> dict:
  """A config.json dict for `transformers` (base: an original config to keep extra fields
  of, such as token ids, when it is of the same family)."""
  c = config
  family = family or family_for(c)
  base = base or {}
  token_ids = ("bos_token_id", "eos_token_id", "pad_token_id")
  out = (dict(base) if base.get("model_type") == family else
         {k: base[k] for k in token_ids if k in base})
  for stale in ("torch_dtype", "rope_scaling", "layer_types", "transformers_version",
                "_name_or_path"):
    out.pop(stale, None)
  out.update(architectures=[ARCHITECTURES[family]], model_type=family, vocab_size=c.vocab_size,
             tie_word_embeddings=c.tie_embeddings, dtype=c.dtype)
  if family == "gpt2":
    out.update(n_embd=c.d_model, n_layer=c.n_layers, n_head=c.n_heads, n_inner=c.d_ff,
               n_positions=c.max_len, layer_norm_epsilon=c.norm_eps,
               activation_function="gelu_new", scale_attn_weights=True,
               scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False)
    return out
  out.update(hidden_size=c.d_model, num_hidden_layers=c.n_layers,
             num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
             head_dim=c.head_dim, intermediate_size=c.d_ff, max_position_embeddings=c.max_len,
             rms_norm_eps=c.norm_eps, hidden_act="silu", rope_theta=c.rope_theta,
             rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta})
  if family == "llama":
    out.update(attention_bias=False, mlp_bias=False)
  elif family == "qwen2":
    out.update(use_sliding_window=False, sliding_window=None)
  elif family == "mistral":
    out.update(sliding_window=None)
  return out


# ----------------------------------------------------------------------------- key maps


@dataclasses.dataclass(frozen=True)
class Rule:
  """One Hugging Face tensor <-> one or more specjax parameters.

  `ops` are applied in order on import and inverted in reverse order on export:
    "T"      transpose a matrix ([out, in] <-> [in, out])
    "split"  split the last axis into len(specjax) equal parts (<-> concatenate)
  """

  hf: str
  specjax: tuple[str, ...]
  ops: tuple[str, ...] = ()

  def hf_shape(self, shapes: Mapping[str, tuple]) -> tuple[int, ...]:
    """The shape the HF tensor must have, given the specjax parameter shapes."""
    parts = [tuple(shapes[p]) for p in self.specjax]
    shape = parts[0]
    for op in reversed(self.ops):
      if op == "split":
        shape = shape[:-1] + (sum(p[-1] for p in parts),)
      elif op == "T":
        shape = shape[::-1]
    return shape

  def to_specjax(self, x: np.ndarray) -> list[np.ndarray]:
    xs = [x]
    for op in self.ops:
      if op == "T":
        xs = [np.ascontiguousarray(a.T) for a in xs]
      elif op == "split":
        xs = np.split(xs[0], len(self.specjax), axis=-1)
    return list(xs)

  def to_hf(self, xs: list[np.ndarray]) -> np.ndarray:
    for op in reversed(self.ops):
      if op == "T":
        xs = [np.ascontiguousarray(a.T) for a in xs]
      elif op == "split":
        xs = [np.concatenate(xs, axis=-1)]
    return xs[0]


def _per_layer(n_layers: int, template: list[tuple]) -> list[Rule]:
  return [Rule(hf.format(i=i), tuple(p.format(i=i) for p in sj), ops)
          for i in range(n_layers) for hf, sj, ops in template]


def rules_for(family: str, config: ModelConfig, layout: str = "safetensors") -> list[Rule]:
  """The key map of a family and file layout ('flax' exists for GPT-2 only)."""
  c = config
  qkv = ("blocks.{i}.attn.q.{w}", "blocks.{i}.attn.k.{w}", "blocks.{i}.attn.v.{w}")
  if family == "gpt2":
    flax = layout == "flax"
    w, emb, scale, T = ("kernel", "embedding", "scale", ("T",)) if flax else ("weight", "weight",
                                                                              "weight", ())
    p = "transformer.h.{i}."
    layer = [
        (p + f"ln_1.{scale}", ("blocks.{i}.attn_norm.scale",), ()),
        (p + "ln_1.bias", ("blocks.{i}.attn_norm.bias",), ()),
        (p + f"attn.c_attn.{w}", tuple(n.format(i="{i}", w="kernel") for n in qkv),
         T + ("split",)),
        (p + "attn.c_attn.bias", tuple(n.format(i="{i}", w="bias") for n in qkv), ("split",)),
        (p + f"attn.c_proj.{w}", ("blocks.{i}.attn.o.kernel",), T),
        (p + "attn.c_proj.bias", ("blocks.{i}.attn.o.bias",), ()),
        (p + f"ln_2.{scale}", ("blocks.{i}.mlp_norm.scale",), ()),
        (p + "ln_2.bias", ("blocks.{i}.mlp_norm.bias",), ()),
        (p + f"mlp.c_fc.{w}", ("blocks.{i}.mlp.up.kernel",), T),
        (p + "mlp.c_fc.bias", ("blocks.{i}.mlp.up.bias",), ()),
        (p + f"mlp.c_proj.{w}", ("blocks.{i}.mlp.down.kernel",), T),
        (p + "mlp.c_proj.bias", ("blocks.{i}.mlp.down.bias",), ()),
    ]
    rules = [Rule(f"transformer.wte.{emb}", ("embed",)),
             Rule(f"transformer.wpe.{emb}", ("pos_embed",)),
             *_per_layer(c.n_layers, layer),
             Rule(f"transformer.ln_f.{scale}", ("final_norm.scale",)),
             Rule("transformer.ln_f.bias", ("final_norm.bias",))]
    if not c.tie_embeddings:  # Flax Dense stores [in, out] like specjax; torch Linear [out, in]
      rules.append(Rule("lm_head.kernel", ("lm_head.kernel",)) if flax else
                   Rule("lm_head.weight", ("lm_head.kernel",), ("T",)))
    return rules
  if layout == "flax":
    raise ValueError(f"the Flax msgpack layout is supported for GPT-2 only, not {family}")
  p = "model.layers.{i}."
  layer = [(p + "input_layernorm.weight", ("blocks.{i}.attn_norm.scale",), ())]
  layer += [(p + f"self_attn.{n}_proj.weight", (f"blocks.{{i}}.attn.{n}.kernel",), ("T",))
            for n in "qkvo"]
  if c.qkv_bias:
    layer += [(p + f"self_attn.{n}_proj.bias", (f"blocks.{{i}}.attn.{n}.bias",), ())
              for n in "qkv"]
  layer += [(p + "post_attention_layernorm.weight", ("blocks.{i}.mlp_norm.scale",), ())]
  layer += [(p + f"mlp.{n}_proj.weight", (f"blocks.{{i}}.mlp.{n}.kernel",), ("T",))
            for n in ("gate", "up", "down")]
  rules = [Rule("model.embed_tokens.weight", ("embed",)), *_per_layer(c.n_layers, layer),
           Rule("model.norm.weight", ("final_norm.scale",))]
  if not c.tie_embeddings:
    rules.append(Rule("lm_head.weight", ("lm_head.kernel",), ("T",)))
  return rules


_PREFIX = {"gpt2": "transformer.", "llama": "model.", "mistral": "model.", "qwen2": "model."}
# Non-parameter buffers older checkpoints carry (causal-mask and rotary tables).
IGNORED_BUFFERS = re.compile(r"^((transformer\.)?h\.\d+\.attn\.(masked_)?bias"
                      r"|(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq)$")
_TIED_HEAD = ("lm_head.weight", "lm_head.kernel")


# ----------------------------------------------------------------------------- import


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
  """{'blocks.0.attn.q.kernel': shape} of a Transformer with this config (no allocation)."""
  from flax import nnx

  from specjax.models.transformer import Transformer
  abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  return {k: tuple(v.shape) for k, v in
          _flatten(nnx.to_pure_dict(nnx.state(abstract, nnx.Param))).items()}


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
  target = np.dtype(ml_dtypes.bfloat16 if config.dtype == "bfloat16" else np.float32)
  prefix = _PREFIX[family]
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
    for head in _TIED_HEAD:
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


def build_model(config: ModelConfig, params: Mapping[str, Any]):
  """A specjax Transformer holding `params` ({specjax name: array} or a nested pure dict)."""
  import jax.numpy as jnp
  from flax import nnx

  from specjax.models.transformer import Transformer
  abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  flat = params if all(isinstance(k, str) and not isinstance(v, Mapping)
                       for k, v in params.items()) else _flatten(params)
  nnx.replace_by_pure_dict(state, nest({k: jnp.asarray(v) for k, v in flat.items()}))
  return nnx.merge(graphdef, state)


def model_params(model) -> dict[str, np.ndarray]:
  """{specjax name: numpy array} of a Transformer (or an `LM` handle)."""
  from flax import nnx
  module = model.module() if hasattr(model, "graphdef") else model
  return {k: np.asarray(v) for k, v in
          _flatten(nnx.to_pure_dict(nnx.state(module, nnx.Param))).items()}


@dataclasses.dataclass
class HFImport:
  """A Hugging Face checkpoint converted to specjax names (numpy arrays in config.dtype)."""

  config: ModelConfig
  params: dict[str, np.ndarray]
  family: str
  layout: str
  hf_config: dict

  def model(self):
    return build_model(self.config, self.params)


def import_hf(directory: str | os.PathLike, *, dtype: str | None = None) -> HFImport:
  """Read and convert a Hugging Face model directory (config.json + weights).

  dtype: None keeps the checkpoint's precision (bf16 stays bf16); 'float32' or 'bfloat16'
  converts. Raises ValueError naming the field or tensor on any mismatch.
  """
  if dtype not in (None, "float32", "bfloat16"):
    raise ValueError(f"dtype must be None, 'float32' or 'bfloat16', got {dtype!r}")
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    raise ValueError(f"Hugging Face model directory {str(directory)!r} does not exist")
  hf = read_hf_config(directory)
  family, config = config_from_hf(hf)
  layout, tensors = read_tensors(directory)
  rules = rules_for(family, config, "flax" if layout == "flax" else "safetensors")
  embed = next((n for n in (rules[0].hf, rules[0].hf[len(_PREFIX[family]):]) if n in tensors),
               None)
  config = config.replace(dtype=dtype or _float_dtype(tensors, embed))
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


def prepare_output_dir(out: str | os.PathLike, overwrite: bool) -> pathlib.Path:
  """Refuse a non-empty output directory unless `overwrite` (checked before any work)."""
  out = pathlib.Path(out)
  if out.exists() and not out.is_dir():
    raise ValueError(f"output path {str(out)!r} exists and is not a directory")
  if out.is_dir() and any(out.iterdir()) and not overwrite:
    raise ValueError(f"output directory {str(out)!r} is not empty (pass overwrite to replace it)")
  return out


def publish_dir(tmp: pathlib.Path, out: pathlib.Path) -> None:
  """Move a completed temporary directory to `out` (replacing it) in one rename."""
  old = None
  if out.exists():
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.rename(out, old)
  os.rename(tmp, out)
  if old is not None:
    shutil.rmtree(old, ignore_errors=True)


def export_hf(model, out: str | os.PathLike, *, dtype: str | None = None,
              tokenizer_dir: str | os.PathLike | None = None, base_config: Mapping | None = None,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False) -> pathlib.Path:
  """Write a Transformer (or (config, params)) as a Hugging Face directory.

  dtype: None keeps the model's dtype. tokenizer_dir: copy the Hugging Face tokenizer files
  found there. base_config: an original config.json to keep unrelated fields (token ids) of.
  The directory is assembled in a temporary sibling and renamed into place: on any error
  nothing is written at `out`.
  """
  if dtype not in (None, "float32", "bfloat16"):
    raise ValueError(f"dtype must be None, 'float32' or 'bfloat16', got {dtype!r}")
  if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
    raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
  out = prepare_output_dir(out, overwrite)
  if isinstance(model, tuple):
    config, params = model
  else:
    config, params = model.config, model_params(model)
  config = config.replace(dtype=dtype or config.dtype)
  family = family_for(config)
  target = np.dtype(ml_dtypes.bfloat16 if config.dtype == "bfloat16" else np.float32)
  shapes = param_shapes(config)
  bad = [f"{k}: shape {tuple(np.shape(params.get(k)))}, expected {s}" for k, s in shapes.items()
         if k not in params or tuple(np.shape(params[k])) != s]
  if bad:
    raise ValueError("parameters do not match the config:\n  " + "\n  ".join(bad[:8]))
  tensors = convert_out(rules_for(family, config),
                        {k: np.asarray(v).astype(target) for k, v in params.items()})
  hf = hf_config_for(config, family, base_config)

  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
  try:
    (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    shards = _shards(tensors, max_shard_bytes)
    meta = {"format": "pt"}
    if len(shards) == 1:
      write_safetensors(tmp / SAFETENSORS, shards[0], meta)
    else:
      weight_map = {}
      for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(tmp / file, shard, meta)
        weight_map.update({name: file for name in shard})
      index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
               "weight_map": weight_map}
      (tmp / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
    if tokenizer_dir is not None:
      copy_tokenizer_files(tokenizer_dir, tmp)
    publish_dir(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out


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
    data = json.loads(path.read_text())
  except (OSError, UnicodeDecodeError, json.JSONDecodeError):
    return False
  return isinstance(data, dict) and data.get("kind") == "byte"


# ----------------------------------------------------------------------------- tokenizer


class HFTokenizer:
  """A Hugging Face `tokenizer.json` behind specjax's Tokenizer interface.

  bos/eos/pad ids come from tokenizer_config.json (token strings), else from the model's
  config.json / generation_config.json ids; any of them may be None (no such token).
  """

  kind = "hf"

  def __init__(self, backend, *, bos_id: int | None, eos_id: int | None,
               pad_id: int | None) -> None:
    self._tok = backend
    self.vocab_size = int(backend.get_vocab_size())
    self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id

  @classmethod
  def from_dir(cls, directory: str | os.PathLike, hf_config: Mapping | None = None
               ) -> "HFTokenizer":
    d = pathlib.Path(directory)
    try:
      import tokenizers
    except ImportError as e:
      raise ImportError("reading a Hugging Face tokenizer.json needs the `tokenizers` package "
                        "(pip install 'specjax[hf]')") from e
    try:
      backend = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception type
      raise ValueError(f"cannot read {str(d / 'tokenizer.json')!r}: {e}") from e
    extra = {}
    for name in ("generation_config.json", "tokenizer_config.json"):
      try:
        extra[name] = json.loads((d / name).read_text())
      except (OSError, json.JSONDecodeError):
        extra[name] = {}
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

    return cls(backend, bos_id=token_id("bos"), eos_id=token_id("eos"), pad_id=token_id("pad"))

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

  def to_spec(self) -> dict:
    return {"kind": "hf", "vocab_size": self.vocab_size,
            "sha256": hashlib.sha256(self.to_json().encode()).hexdigest()}

  def __repr__(self) -> str:
    return (f"HFTokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id})")
