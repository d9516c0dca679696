"""Hugging Face config.json <-> specjax ModelConfig (GPT-2, Llama, Mistral, Qwen2, Qwen3).

`config_from_hf` maps a config dict to (family, ModelConfig) and refuses every option that
would make specjax compute something else (RoPE scalings other than llama3, non-tanh GELU,
biases Llama does not have, interleaved sliding-window layers, ...), naming the field, its
value and what is allowed. Every value it reads is checked for type, finiteness and range
before it becomes a ModelConfig field (`transformer.check_field`), the error naming the
config.json key: `"n_layer": 2.5`, `"layer_norm_epsilon": NaN` or `"tie_word_embeddings":
"no"` are refused, never rounded or read as truthy. Nothing here is sized by the config (no
per-layer lists), so a config claiming 10^9 layers is read at once; building a model from
it is refused against memory (`transformer.check_params_fit`). Fields a hand-written
config.json may leave out take transformers' defaults.
`family_for` / `hf_config_for` go the other way, for export.
"""

from __future__ import annotations

import os
import pathlib
from typing import Iterable, Mapping

from specjax.models.transformer import ModelConfig, check_field
from specjax.data.json_files import read_object

FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3")
ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                 "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}


def read_hf_config(directory: str | os.PathLike) -> dict:
  path = pathlib.Path(directory) / "config.json"
  if not path.is_file():
    raise ValueError(f"{str(directory)!r} is not a Hugging Face model directory: no config.json")
  return read_object(path)


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
              "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 4096,
              "max_window_layers": 28},
    "qwen3": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "hidden_act": "silu",
              "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 4096,
              "max_window_layers": 28, "head_dim": 128, "attention_bias": False},
}
_GPT2_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # all the tanh approximation


_LLAMA3_FIELDS = {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
                  "high_freq_factor": "rope_high_freq_factor",
                  "original_max_position_embeddings": "rope_original_max_len"}


def rope_fields_of(hf: Mapping, default: float = 10000.0) -> dict:
  """The ModelConfig rope fields (rope_theta, rope_scaling and its parameters) from
  transformers 5's `rope_parameters` or the older `rope_theta` + `rope_scaling`.

  Supported: the plain rotary embedding ('default') and Llama 3.1's frequency scaling
  ('llama3'); the other scalings (linear, dynamic, yarn, longrope, ...) change the
  frequencies or the attention scale differently and are refused naming the field.
  """
  params = hf.get("rope_parameters")
  scaling = hf.get("rope_scaling")
  if params is not None and not isinstance(params, Mapping):
    raise ValueError(f"config.json: rope_parameters must be an object, got {params!r}")
  if scaling is not None and not isinstance(scaling, Mapping):
    raise ValueError(f"config.json: rope_scaling must be an object, got {scaling!r}")
  if params and all(isinstance(v, Mapping) for v in params.values()):
    raise ValueError(f"config.json: per-layer-type rope_parameters {sorted(params)} are not "
                     "supported")
  field = "rope_parameters" if params else "rope_scaling"
  spec = dict(params or scaling or {})
  key = "rope_type" if "rope_type" in spec else "type"
  kind = spec.get(key, "default")
  if kind not in ("default", "llama3"):
    raise ValueError(f"config.json: {field}.{key}={kind!r} is not supported (specjax "
                     "implements the rope types 'default' and 'llama3')")
  factor = spec.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  if factor not in (None, 1, 1.0):
    raise ValueError(f"config.json: partial_rotary_factor={factor} is not supported (needs 1.0)")
  if spec.get("rope_theta") is not None:
    theta, key = spec["rope_theta"], f"{field}.rope_theta"
  elif hf.get("rope_theta") is not None:
    theta, key = hf["rope_theta"], "rope_theta"
  else:
    theta, key = default, "rope_theta"
  out = {"rope_theta": float(check_field("rope_theta", theta, f"config.json: {key}"))}
  if kind == "llama3":
    out["rope_scaling"] = "llama3"
    for name, ours in _LLAMA3_FIELDS.items():
      value, key = spec.get(name), f"{field}.{name}"
      if name == "original_max_position_embeddings" and value is None:
        value, key = hf.get("original_max_position_embeddings"), name
      if value is None:
        raise ValueError(f"config.json: {key}={value!r}: rope type 'llama3' needs a number")
      check_field(ours, value, f"config.json: {key}")
      out[ours] = value if ours == "rope_original_max_len" else float(value)
    if spec.get("attention_factor") not in (None, 1, 1.0):
      raise ValueError(f"config.json: {field}.attention_factor={spec['attention_factor']!r} is "
                       "not supported (needs 1.0)")
  return out


def rope_theta_of(hf: Mapping, default: float = 10000.0) -> float:
  """θ alone (see `rope_fields_of`, which also reads the llama3 scaling)."""
  return rope_fields_of(hf, default)["rope_theta"]


def _need(hf: Mapping, family: str, *names: str) -> tuple[str, object]:
  """(key, value) of the first present field among `names` (aliases), else the family
  default, else an error."""
  for name in names:
    if hf.get(name) is not None:
      return name, hf[name]
  for name in names:
    if name in _DEFAULTS[family]:
      return name, _DEFAULTS[family][name]
  raise ValueError(f"config.json ({family}) lacks the field {names[0]!r}")


def _field(hf: Mapping, family: str, ours: str, *names: str):
  """The ModelConfig field `ours` read from the first present key among `names` (or its
  default), checked (`check_field`) with the error naming the config.json key."""
  key, value = _need(hf, family, *names)
  return check_field(ours, value, f"config.json: {key}")


def _optional(hf: Mapping, ours: str, name: str, default=None):
  """Like `_field` for a key that may be absent or null (then `default`)."""
  value = hf.get(name)
  return default if value is None else check_field(ours, value, f"config.json: {name}")


def _flag(hf: Mapping, family: str, name: str) -> bool:
  """A true/false key (JSON true or false only: "no" or 1 are refused)."""
  value = hf.get(name, _DEFAULTS[family].get(name, False))
  if not isinstance(value, bool):
    raise ValueError(f"config.json: {name} must be true or false, got {value!r}")
  return value


def _count(hf: Mapping, family: str, name: str, minimum: int = 0) -> int:
  """A count that is no ModelConfig field of its own (max_window_layers): an int >= minimum."""
  _, value = _need(hf, family, name)
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f"config.json: {name} must be an int >= {minimum}, got {value!r}")
  return value


def _require(hf: Mapping, family: str, name: str, allowed: Iterable, why: str) -> None:
  value = hf.get(name, _DEFAULTS[family].get(name))
  allowed = tuple(allowed)
  if not any(value == a and type(value) is type(a) for a in allowed):  # true is not 1
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
    d = _field(hf, family, "d_model", "n_embd", "hidden_size")
    heads = _field(hf, family, "n_heads", "n_head", "num_attention_heads")
    config = ModelConfig(
        vocab_size=_field(hf, family, "vocab_size", "vocab_size"), d_model=d,
        n_layers=_field(hf, family, "n_layers", "n_layer", "num_hidden_layers"), n_heads=heads,
        n_kv_heads=heads, d_ff=_optional(hf, "d_ff", "n_inner", 4 * d),
        max_len=_field(hf, family, "max_len", "n_positions", "max_position_embeddings"),
        norm="layernorm", positions="learned", mlp="gelu",
        tie_embeddings=_field(hf, family, "tie_embeddings", "tie_word_embeddings"),
        use_bias=True, norm_eps=float(_field(hf, family, "norm_eps", "layer_norm_epsilon")),
        dtype=dtype)
    return family, config

  _require(hf, family, "hidden_act", ("silu",), "SwiGLU uses silu")
  if family in ("llama", "qwen3"):
    _require(hf, family, "attention_bias", (False,), "no attention biases")
  if family == "llama":
    _require(hf, family, "mlp_bias", (False,), "no MLP biases")
  d = _field(hf, family, "d_model", "hidden_size")
  heads = _field(hf, family, "n_heads", "num_attention_heads")
  head_dim = _optional(hf, "head_dim_override", "head_dim", _DEFAULTS[family].get("head_dim"))
  if head_dim is not None and head_dim * heads == d:
    head_dim = None  # the derived width: stored as the default
  n_layers = _field(hf, family, "n_layers", "num_hidden_layers")
  window, first = _sliding_window(hf, family, n_layers)
  config = ModelConfig(
      vocab_size=_field(hf, family, "vocab_size", "vocab_size"), d_model=d, n_layers=n_layers,
      n_heads=heads, n_kv_heads=_optional(hf, "n_kv_heads", "num_key_value_heads", heads),
      d_ff=_field(hf, family, "d_ff", "intermediate_size"),
      max_len=_field(hf, family, "max_len", "max_position_embeddings"), norm="rmsnorm",
      positions="rope", mlp="swiglu",
      tie_embeddings=_field(hf, family, "tie_embeddings", "tie_word_embeddings"),
      use_bias=False, qkv_bias=family == "qwen2",
      norm_eps=float(_field(hf, family, "norm_eps", "rms_norm_eps")), dtype=dtype,
      head_dim_override=head_dim, qk_norm=family == "qwen3", sliding_window=window,
      window_first_layer=first, **rope_fields_of(hf))
  return family, config


def _sliding_window(hf: Mapping, family: str, n_layers: int) -> tuple[int | None, int]:
  """(window, first windowed layer), as transformers reads them: Mistral windows every
  layer; Qwen2/3 only with use_sliding_window, the layers from max_window_layers on (or as
  `layer_types` says, which must then be full layers followed by sliding ones). Reads no
  per-layer list it is not given (constant time in n_layers)."""
  if family == "mistral":
    window = (_optional(hf, "sliding_window", "sliding_window") if "sliding_window" in hf
              else _DEFAULTS[family]["sliding_window"])
    return window, 0
  if family not in ("qwen2", "qwen3"):
    return None, 0
  use = _flag(hf, family, "use_sliding_window")
  window = None
  if use:
    window = (_optional(hf, "sliding_window", "sliding_window") if "sliding_window" in hf
              else _DEFAULTS[family]["sliding_window"])
  types = hf.get("layer_types")
  if types is None:  # the layers from max_window_layers on, when windowed
    first = _count(hf, family, "max_window_layers")
    return (None, 0) if window is None or first >= n_layers else (window, first)
  if (not isinstance(types, list) or len(types) != n_layers
      or any(t not in ("full_attention", "sliding_attention") for t in types)):
    shown = types if not isinstance(types, list) or len(types) <= 8 else (
        f"[{len(types)} entries]")
    raise ValueError(f"config.json: layer_types={shown!r} must list 'full_attention' or "
                     f"'sliding_attention' for each of the {n_layers} layers")
  first = types.index("sliding_attention") if "sliding_attention" in types else n_layers
  if any(t != "sliding_attention" for t in types[first:]):
    raise ValueError(f"config.json: layer_types={types!r} is not supported (specjax windows "
                     "a final run of layers: full_attention layers, then sliding_attention)")
  if first == n_layers or window is None:
    if first < n_layers:
      raise ValueError(f"config.json: layer_types lists sliding_attention layers but "
                       f"sliding_window is {window!r} (use_sliding_window={use!r})")
    return None, 0
  return window, first


def family_for(config: ModelConfig) -> str:
  """The Hugging Face family that computes exactly what this ModelConfig does."""
  c = config
  if (c.norm, c.positions, c.mlp, c.use_bias) == ("layernorm", "learned", "gelu", True):
    if c.n_kv_heads != c.n_heads:
      raise ValueError(f"GPT-2 has no grouped-query attention: n_kv_heads={c.n_kv_heads} must "
                       f"equal n_heads={c.n_heads} to export")
    extras = {"qk_norm": False, "sliding_window": None, "head_dim_override": None,
              "qkv_bias": False}
    for name, want in extras.items():
      if getattr(c, name) != want:
        raise ValueError(f"GPT-2 has no {name}: {name}={getattr(c, name)!r} must be {want!r} to "
                         "export")
    return "gpt2"
  if (c.norm, c.positions, c.mlp, c.use_bias) == ("rmsnorm", "rope", "swiglu", False):
    if c.qk_norm:
      if c.qkv_bias:
        raise ValueError("no Hugging Face family has both qk_norm and qkv_bias (Qwen3's "
                         "attention_bias also puts a bias on the output projection)")
      return "qwen3"
    if c.qkv_bias:
      return "qwen2"
    if c.sliding_window is not None:
      if c.window_first_layer != 0:
        raise ValueError(f"window_first_layer={c.window_first_layer}: Mistral windows every "
                         "layer; only Qwen2/Qwen3 (qkv_bias or qk_norm) window the last layers")
      return "mistral"
    return "llama"
  raise ValueError(
      "no Hugging Face family computes this model: GPT-2 needs norm='layernorm', "
      "positions='learned', mlp='gelu', use_bias=True; Llama/Mistral/Qwen need "
      f"norm='rmsnorm', positions='rope', mlp='swiglu', use_bias=False; got norm={c.norm!r}, "
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
  rope = {"rope_type": "default", "rope_theta": c.rope_theta}
  if c.rope_scaling == "llama3":
    rope.update(rope_type="llama3", **{hf_name: getattr(c, ours)
                                       for hf_name, ours in _LLAMA3_FIELDS.items()})
  out.update(hidden_size=c.d_model, num_hidden_layers=c.n_layers,
             num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
             head_dim=c.head_dim, intermediate_size=c.d_ff, max_position_embeddings=c.max_len,
             rms_norm_eps=c.norm_eps, hidden_act="silu", rope_theta=c.rope_theta,
             rope_parameters=rope)
  if family == "llama":
    out.update(attention_bias=False, mlp_bias=False)
  elif family in ("qwen2", "qwen3"):
    windowed = c.sliding_window is not None
    out.update(use_sliding_window=windowed, sliding_window=c.sliding_window,
               max_window_layers=c.window_first_layer if windowed else c.n_layers,
               layer_types=[("sliding_attention" if c.window_of(i) is not None else
                             "full_attention") for i in range(c.n_layers)])
    if family == "qwen3":
      out.update(attention_bias=False)
  elif family == "mistral":
    out.update(sliding_window=c.sliding_window)
  return out
