"""A decoder-only transformer covering the GPT-2 and Llama families (Flax NNX).

The Llama side also carries the generic features of its descendants, each off by default:
Llama 3.x RoPE frequency scaling, per-head q/k RMSNorm and a free head_dim (Qwen3), and
sliding-window attention on the last layers (Mistral, Qwen2/3).

One call serves training, prefill, one-token decode, chain verification and tree
verification; only the positions, the cache and the block mask differ:

    logits_BTV, hidden_BTD, cache = model(tokens_BT, positions_BT, cache, block_mask)

- `cache=None`: plain causal attention over the T tokens (training, scoring).
- with a `KVCache`: the T new keys/values are written at each row's offset
  `cache.lengths[b]` and every query attends to the committed prefix `[0, lengths[b])`
  plus the new tokens allowed by `block_mask[T, T]` (causal when None, an ancestor mask for
  token trees). The cache comes back with the new entries written but `lengths` unchanged:
  committing (or rolling back) is the caller's business, done by moving `lengths`.

Numerics: the residual stream, norms, softmax and logits are float32. With
`dtype='bfloat16'` the weights are stored in bf16 and every matmul takes bf16 inputs with
float32 accumulation (`preferred_element_type`), the fast path on XLA:CPU and accelerators
(a one-row bf16 product padded where that is faster: `one_row_bf16.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models import attention, one_row_bf16
from specjax.models.fused import bcast as _bcast, project
from specjax.models import cache as kv
from specjax.analysis import roofline

Array = jax.Array

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


_INT32_MAX = 2**31 - 1  # token ids, positions and cache slots are int32

# What each ModelConfig field may hold on its own (`check_field`); rules between fields are in
# `ModelConfig.__post_init__`. kinds: ("int", lo) an int in [lo, 2**31 - 1], ("int?", lo) the
# same or None, ("bool",) True or False, ("float", lo, hi, lo_open, hi_open) a finite real
# number in that interval, ("choice", values).
_FIELD_RULES: dict[str, tuple] = {
    "vocab_size": ("int", 1), "d_model": ("int", 1), "n_layers": ("int", 1),
    "n_heads": ("int", 1), "n_kv_heads": ("int", 1), "d_ff": ("int", 1), "max_len": ("int", 1),
    "norm": ("choice", ("layernorm", "rmsnorm")), "positions": ("choice", ("learned", "rope")),
    "rope_theta": ("float", 0.0, math.inf, True, True), "mlp": ("choice", ("gelu", "swiglu")),
    "tie_embeddings": ("bool",), "use_bias": ("bool",), "qkv_bias": ("bool",),
    "norm_eps": ("float", 0.0, 1.0, True, False), "dtype": ("choice", tuple(_DTYPES)),
    "head_dim_override": ("int?", 1), "rope_scaling": ("choice", ("none", "llama3")),
    "rope_factor": ("float", 1.0, math.inf, False, True),
    "rope_low_freq_factor": ("float", 0.0, math.inf, True, True),
    "rope_high_freq_factor": ("float", 0.0, math.inf, True, True),
    "rope_original_max_len": ("int", 1), "qk_norm": ("bool",), "sliding_window": ("int?", 1),
    "window_first_layer": ("int", 0), "cache_dtype": ("choice", tuple(_DTYPES)),
}


def check_field(name: str, value, label: str | None = None):
  """Checks one ModelConfig field's value on its own and returns it unchanged.

  ints must be Python ints (not bools, not 2.5, not "2"), bools real bools ("no" and 1 are
  refused), floats finite real numbers (ints allowed) in the field's range, choices one of
  their strings. Raises ValueError naming `label` (default `ModelConfig.<name>`), the value
  and what is allowed: readers of other formats pass their own key as the label (the
  Hugging Face reader: `config.json: layer_norm_epsilon`).
  """
  label = label or f"ModelConfig.{name}"
  if name not in _FIELD_RULES:
    raise ValueError(f"unknown ModelConfig field {name!r}; allowed: {sorted(_FIELD_RULES)}")
  kind, *rule = _FIELD_RULES[name]
  is_int = isinstance(value, int) and not isinstance(value, bool)
  if kind in ("int", "int?"):
    if kind == "int?" and value is None:
      return value
    if not is_int or not rule[0] <= value <= _INT32_MAX:
      none = "None or " if kind == "int?" else ""
      raise ValueError(f"{label} must be {none}an int in [{rule[0]}, 2**31 - 1], got {value!r}")
  elif kind == "bool":
    if not isinstance(value, bool):
      raise ValueError(f"{label} must be true or false (a bool), got {value!r}")
  elif kind == "float":
    lo, hi, lo_open, hi_open = rule
    real = is_int or isinstance(value, float)
    inside = real and math.isfinite(value) and (lo < value if lo_open else lo <= value) and (
        value < hi if hi_open else value <= hi)
    if not inside:
      interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
      raise ValueError(f"{label} must be a finite number in {interval}, got {value!r}")
  elif not isinstance(value, str) or value not in rule[0]:
    raise ValueError(f"{label} must be one of {rule[0]}, got {value!r}")
  return value


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Static model description (hashable: usable as a static jit argument).

  Validated once, at construction (`check_field` per field, then the rules between fields):
  a bad value raises ValueError naming the field. A config is only a description (the
  roofline prices 70B models from one); building a model from it is checked against this
  machine's memory (`check_params_fit`).
  """

  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  d_ff: int
  max_len: int
  norm: Literal["layernorm", "rmsnorm"] = "layernorm"
  positions: Literal["learned", "rope"] = "learned"
  rope_theta: float = 10000.0
  mlp: Literal["gelu", "swiglu"] = "gelu"
  tie_embeddings: bool = True
  use_bias: bool = True  # biases on every linear layer and norm (GPT-2)
  qkv_bias: bool = False  # biases on q/k/v only (Qwen2); implied by use_bias
  norm_eps: float = 1e-5
  dtype: Literal["float32", "bfloat16"] = "float32"
  # Generic features later families need; the defaults keep every older config unchanged.
  head_dim_override: int | None = None  # per-head width when not d_model / n_heads (Qwen3)
  rope_scaling: Literal["none", "llama3"] = "none"  # frequency scaling (`rope_frequencies`)
  rope_factor: float = 8.0  # llama3 scaling: factor, low/high-frequency factors, and the
  rope_low_freq_factor: float = 1.0  # context length the model was first trained at
  rope_high_freq_factor: float = 4.0
  rope_original_max_len: int = 8192
  qk_norm: bool = False  # RMSNorm over head_dim on q and k before rope (Qwen3)
  sliding_window: int | None = None  # a query sees at most this many latest positions
  window_first_layer: int = 0  # the window applies to layers >= this one (Qwen2/3)
  # KV cache storage: float32 (default, also for bf16 weights) or bfloat16 (half the
  # memory; keys/values are rounded once when written, products accumulate in float32).
  cache_dtype: Literal["float32", "bfloat16"] = "float32"

  def __post_init__(self):
    """Every field checked alone (`check_field`: type, finiteness, range), then the rules
    between fields. Runs once per construction; nothing downstream re-validates."""
    for f in dataclasses.fields(self):
      check_field(f.name, getattr(self, f.name))
    if self.head_dim_override is None and self.d_model % self.n_heads:
      raise ValueError(f"ModelConfig.d_model ({self.d_model}) must be divisible by "
                       f"n_heads ({self.n_heads})")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"ModelConfig.n_heads ({self.n_heads}) must be divisible by "
                       f"n_kv_heads ({self.n_kv_heads})")
    if self.positions == "rope" and self.head_dim % 2:
      raise ValueError(f"rope needs an even head_dim, got {self.head_dim}")
    if self.rope_scaling == "llama3":
      if self.positions != "rope":
        raise ValueError("ModelConfig.rope_scaling='llama3' needs positions='rope'")
      if not self.rope_low_freq_factor < self.rope_high_freq_factor:
        raise ValueError("ModelConfig.rope_low_freq_factor must be below "
                         f"rope_high_freq_factor, got {self.rope_low_freq_factor} and "
                         f"{self.rope_high_freq_factor}")
    if self.window_first_layer > self.n_layers:
      raise ValueError(f"ModelConfig.window_first_layer must be an int in [0, n_layers="
                       f"{self.n_layers}], got {self.window_first_layer!r}")

  @property
  def head_dim(self) -> int:
    if self.head_dim_override is not None:
      return self.head_dim_override
    return self.d_model // self.n_heads

  def window_of(self, layer: int) -> int | None:
    """The sliding window of this layer (None: full causal attention)."""
    return self.sliding_window if layer >= self.window_first_layer else None

  @property
  def jnp_dtype(self):
    return _DTYPES[self.dtype]

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict) -> "ModelConfig":
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - fields)
    if unknown:
      raise ValueError(f"unknown ModelConfig fields {unknown}; allowed: {sorted(fields)}")
    return cls(**d)

  @classmethod
  def gpt2(cls, **overrides) -> "ModelConfig":
    """GPT-2 small by default (124M): LayerNorm, learned positions, GELU, tied head."""
    base = dict(vocab_size=50257, d_model=768, n_layers=12, n_heads=12, n_kv_heads=12,
                d_ff=3072, max_len=1024, norm="layernorm", positions="learned", mlp="gelu",
                tie_embeddings=True, use_bias=True, norm_eps=1e-5)
    return cls(**{**base, **overrides})

  @classmethod
  def llama(cls, **overrides) -> "ModelConfig":
    """A small Llama-family shape: RMSNorm, RoPE, SwiGLU, GQA, untied head, no biases."""
    base = dict(vocab_size=32000, d_model=512, n_layers=8, n_heads=8, n_kv_heads=2,
                d_ff=1376, max_len=2048, norm="rmsnorm", positions="rope", rope_theta=10000.0,
                mlp="swiglu", tie_embeddings=False, use_bias=False, norm_eps=1e-5)
    return cls(**{**base, **overrides})


# ----------------------------------------------------------------------------- config -> model
# The one place a ModelConfig becomes a model structure without allocating: checkpoint
# restore targets, Hugging Face conversion, the trainer's jitted steps and `param_count` all
# start from `abstract_model`.


def abstract_model(config: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
  """(graphdef, params) of a Transformer with this config, without allocating.

  params is the nnx.Param state with `jax.ShapeDtypeStruct` leaves (`nnx.eval_shape`): a
  restore target, or a shape/dtype listing. A Transformer holds nothing but nnx.Param, so
  `nnx.merge(graphdef, real_params)` rebuilds the module from arrays of this structure.
  Each call returns a fresh state (callers may fill it in place). Refuses (ValueError) a
  config whose parameters exceed this machine's memory (`check_params_fit`).
  """
  check_params_fit(config)  # before the structure is traced: one Python object per layer
  model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  graphdef, params, _ = nnx.split(model, nnx.Param, ...)
  return graphdef, params


@functools.lru_cache(maxsize=64)
def graphdef_for(config: ModelConfig) -> nnx.GraphDef:
  """The (cached, immutable) graphdef of a Transformer with this config."""
  return abstract_model(config)[0]


def from_params(config: ModelConfig, params) -> "Transformer":
  """The Transformer with this config holding `params` (an nnx.State of nnx.Param)."""
  return nnx.merge(graphdef_for(config), params)


EMBEDDING = -1  # the `capture` index of the embedding output (Hugging Face hidden_states[0])


def check_capture(config: ModelConfig, capture) -> tuple[int, ...]:
  """Validates a `capture` tuple (layer indices -1..n_layers, see `Transformer.__call__`)."""
  if not isinstance(capture, tuple) or not all(
      isinstance(i, int) and not isinstance(i, bool) and EMBEDDING <= i <= config.n_layers
      for i in capture):
    raise ValueError(f"capture must be a tuple of layer indices in [{EMBEDDING}, "
                     f"{config.n_layers}] ({EMBEDDING} = the embedding output, n_layers = the "
                     f"final norm's output), got {capture!r}")
  return capture


def cast_floats(tree, dtype):
  """Cast floating leaves to `dtype` (mixed precision: float32 master weights, bf16 compute)."""
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                      tree)


def with_dtype(model: "Transformer", dtype: str) -> "Transformer":
  """The same model with its weights stored in `dtype` ("float32" or "bfloat16"): products
  then take `dtype` inputs with float32 accumulation (serving a float32-trained model in
  bf16 halves its weight traffic; on XLA:CPU it also makes a multi-row verify pass cost about
  one one-row step, docs/xla_notes.md, trap 7)."""
  if dtype not in _DTYPES:
    raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {dtype!r}")
  if model.config.dtype == dtype:
    return model
  params = nnx.state(model, nnx.Param)
  return from_params(model.config.replace(dtype=dtype), cast_floats(params, _DTYPES[dtype]))


def param_count(config: ModelConfig) -> int:
  """Number of parameters, from the config alone in closed form (`roofline.param_counts`,
  tested against the abstract model's leaves): nothing is traced, so it answers at once for
  any size, 10^9 layers included."""
  return roofline.param_counts(config)["total"]


def param_bytes(config: ModelConfig) -> int:
  """Bytes of the parameters in the config's dtype (float32: 4 per parameter, bf16: 2)."""
  return param_count(config) * jnp.dtype(config.jnp_dtype).itemsize


@functools.lru_cache(maxsize=1)
def machine_memory() -> tuple[int, str] | None:
  """(bytes, what) of the memory a model is built in: the default device's limit when it
  reports one (accelerators), else the host's physical memory; None when neither is known.
  Read once per process."""
  try:
    stats = jax.local_devices()[0].memory_stats() or {}
  except Exception:  # noqa: BLE001 - backends without memory stats (CPU)
    stats = {}
  if stats.get("bytes_limit"):
    return int(stats["bytes_limit"]), f"{jax.local_devices()[0].device_kind} memory"
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory"
  except (ValueError, OSError, AttributeError):
    return None


def _model_axis() -> int:
  """The size of the active mesh's `model` axis (1 without a mesh; `specjax.sharding`)."""
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty else dict(mesh.shape).get("model", 1)


def check_params_fit(config: ModelConfig, *, what: str = "model",
                     limit: int | None = None) -> int:
  """The one check of "parameter bytes of a ModelConfig vs memory", made before a model is
  built from a config (`Transformer.__init__`, `abstract_model`, so every restore target,
  Hugging Face import, trainer and CLI model goes through it): refuses (ValueError) a config
  whose parameters alone exceed `limit` bytes (default: `machine_memory()`, the device's
  limit or the host's physical memory; an accelerator's limit times the `model` axis when
  loading under a mesh, `sharding.on`), naming the config's sizes, the bytes and the limit.
  Parameters that fit can still leave too little for caches and activations: those are
  checked where they are sized (`cache.check_fits`, the trainer's estimate). Costs a few
  multiplications (`param_count` is closed form). Returns the parameter bytes."""
  need = param_bytes(config)
  source = "the given limit"
  if limit is None:
    known = machine_memory()
    if known is None:
      return need
    limit, source = known
    split = _model_axis()  # loading onto a mesh (`sharding.on`): each device holds ~1/M
    if split > 1 and source != "physical memory":  # of the weights (CPU devices share one host)
      limit, source = limit * split, f"{source} x {split} devices of the mesh's model axis"
  if need > limit:
    c = config
    raise ValueError(
        f"{what}: a ModelConfig with n_layers={c.n_layers}, d_model={c.d_model}, "
        f"d_ff={c.d_ff}, vocab_size={c.vocab_size} has {param_count(c):,} parameters, "
        f"{need / 1e9:.4g} GB in {c.dtype}, more than this machine's {limit / 1e9:.4g} GB "
        f"({source}): lower n_layers, d_model, d_ff or vocab_size")
  return need


# ----------------------------------------------------------------------------- layers


def _normal(stddev: float):
  return jax.nn.initializers.normal(stddev)


class Dense(nnx.Module):
  """y = x @ W (+ b); W stored [in, out] in the model dtype, accumulated in float32."""

  def __init__(self, d_in: int, d_out: int, *, bias: bool, dtype, rngs: nnx.Rngs,
               stddev: float = 0.02):
    self.kernel = nnx.Param(_normal(stddev)(rngs.params(), (d_in, d_out), dtype))
    self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None

  def __call__(self, x: Array) -> Array:
    w = self.kernel[...]
    y = one_row_bf16.one_row_safe_matmul("...i,io->...o", x.astype(w.dtype), w)
    if self.bias is not None:
      y = y + _bcast(self.bias[...].astype(jnp.float32), y)
    return y


class Norm(nnx.Module):
  """LayerNorm (scale + optional bias) or RMSNorm, computed in float32."""

  def __init__(self, d: int, *, kind: str, bias: bool, eps: float, dtype):
    self.kind, self.eps = kind, eps
    self.scale = nnx.Param(jnp.ones((d,), dtype))
    self.bias = nnx.Param(jnp.zeros((d,), dtype)) if bias else None

  def __call__(self, x: Array) -> Array:
    x = x.astype(jnp.float32)
    if self.kind == "layernorm":
      x = x - jnp.mean(x, axis=-1, keepdims=True)
    y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
    y = y * _bcast(self.scale[...].astype(jnp.float32), y)
    if self.bias is not None:
      y = y + _bcast(self.bias[...].astype(jnp.float32), y)
    return y


def rope_frequencies(config: ModelConfig) -> Array:
  """The D/2 inverse frequencies ω_i = θ^(-2i/D) of the rotary embedding (float32).

  rope_scaling 'llama3' (Llama 3.1+) rescales them by wavelength λ_i = 2π/ω_i, with
  L = rope_original_max_len, s = rope_factor, l/h the low/high-frequency factors:
    λ_i < L/h            ω_i unchanged (high frequencies)
    λ_i > L/l            ω_i / s       (low frequencies)
    otherwise            (1 - a)·ω_i/s + a·ω_i with a = (L/λ_i - l) / (h - l) (smooth)
  computed in float32 in the same order as `transformers` (agreeing to float32 rounding: the
  libraries' float32 pow differs by an ulp at some exponents).
  """
  c, d = config, config.head_dim
  inv = 1.0 / (c.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # [D/2]
  if c.rope_scaling == "llama3":
    factor, low, high = c.rope_factor, c.rope_low_freq_factor, c.rope_high_freq_factor
    old = c.rope_original_max_len
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    inv = jnp.where(medium, smoothed, scaled)
  return inv


def rope(x_BTHD: Array, positions_BT: Array, theta_or_freqs) -> Array:
  """Rotary embedding in the half-split layout Hugging Face uses (`rotate_half`).

  Pair (x[i], x[i + D/2]) is rotated by angle position · ω_i, with ω_i = θ^(-2i/D) when a
  float θ is given, or the D/2 frequencies given (`rope_frequencies`, scaled variants).
  """
  d = x_BTHD.shape[-1]
  if isinstance(theta_or_freqs, (int, float)):
    inv_freq = 1.0 / (theta_or_freqs ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # [D/2]
  else:
    inv_freq = theta_or_freqs.astype(jnp.float32)
  angles = positions_BT.astype(jnp.float32)[..., None] * inv_freq[None, None]  # [B, T, D/2]
  cos = jnp.cos(angles)[:, :, None, :]  # [B, T, 1, D/2]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x_BTHD.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Attention(nnx.Module):

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c, dt = config, config.jnp_dtype
    self.config = c
    qkv_bias = c.use_bias or c.qkv_bias
    resid_std = 0.02 / math.sqrt(2 * c.n_layers)
    self.q = Dense(c.d_model, c.n_heads * c.head_dim, bias=qkv_bias, dtype=dt, rngs=rngs)
    self.k = Dense(c.d_model, c.n_kv_heads * c.head_dim, bias=qkv_bias, dtype=dt, rngs=rngs)
    self.v = Dense(c.d_model, c.n_kv_heads * c.head_dim, bias=qkv_bias, dtype=dt, rngs=rngs)
    self.o = Dense(c.n_heads * c.head_dim, c.d_model, bias=c.use_bias, dtype=dt, rngs=rngs,
                   stddev=resid_std)
    qk = dict(kind="rmsnorm", bias=False, eps=c.norm_eps, dtype=dt)
    self.q_norm = Norm(c.head_dim, **qk) if c.qk_norm else None
    self.k_norm = Norm(c.head_dim, **qk) if c.qk_norm else None

  def projections(self) -> tuple[Dense, Dense, Dense]:
    """The layers that read the block's input, in output order (`project`)."""
    return self.q, self.k, self.v

  def __call__(self, x_BTD, positions_BT, cache, layer, block_mask_TT):
    c = self.config
    b, t, _ = x_BTD.shape
    q, k, v = project(x_BTD, self.projections())
    q = q.reshape(b, t, c.n_heads, c.head_dim)
    k = k.reshape(b, t, c.n_kv_heads, c.head_dim)
    v = v.reshape(b, t, c.n_kv_heads, c.head_dim)
    if self.q_norm is not None:  # per-head RMSNorm before rope (Qwen3)
      q, k = self.q_norm(q), self.k_norm(k)
    if c.positions == "rope":  # θ alone: the plain path, computed as it always was
      freqs = c.rope_theta if c.rope_scaling == "none" else rope_frequencies(c)
      q = rope(q, positions_BT, freqs)
      k = rope(k, positions_BT, freqs)
    window = c.window_of(layer)
    if cache is None:
      out = attention.causal_attention(q, k, v, block_mask_TT, window=window)
    else:
      cache = kv.write(cache, layer, k, v)
      out = attention.attend(cache, layer, q, block_mask_TT, window=window)
    return self.o(out.reshape(b, t, c.n_heads * c.head_dim)), cache


class MLP(nnx.Module):

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c, dt = config, config.jnp_dtype
    self.kind = c.mlp
    resid_std = 0.02 / math.sqrt(2 * c.n_layers)
    self.up = Dense(c.d_model, c.d_ff, bias=c.use_bias, dtype=dt, rngs=rngs)
    self.gate = (Dense(c.d_model, c.d_ff, bias=c.use_bias, dtype=dt, rngs=rngs)
                 if c.mlp == "swiglu" else None)
    self.down = Dense(c.d_ff, c.d_model, bias=c.use_bias, dtype=dt, rngs=rngs, stddev=resid_std)

  def projections(self) -> tuple[Dense, ...]:
    """SwiGLU's layers that read the input, in output order (`project`; none for GELU)."""
    return () if self.gate is None else (self.gate, self.up)

  def __call__(self, x):
    if self.gate is None:
      h = jax.nn.gelu(self.up(x), approximate=True)  # GPT-2's tanh GELU
    else:
      gate, up = project(x, self.projections())
      h = jax.nn.silu(gate) * up  # SwiGLU
    return self.down(h)


class Block(nnx.Module):

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c = config
    norm = dict(kind=c.norm, bias=c.norm == "layernorm" and c.use_bias, eps=c.norm_eps,
                dtype=c.jnp_dtype)
    self.attn_norm = Norm(c.d_model, **norm)
    self.attn = Attention(c, rngs=rngs)
    self.mlp_norm = Norm(c.d_model, **norm)
    self.mlp = MLP(c, rngs=rngs)

  def __call__(self, x, positions, cache, layer, block_mask):
    h, cache = self.attn(self.attn_norm(x), positions, cache, layer, block_mask)
    x = x + h
    return x + self.mlp(self.mlp_norm(x)), cache


class Transformer(nnx.Module):
  """Decoder-only LM. See the module docstring for the call contract."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    check_params_fit(config)  # before any parameter is allocated
    c, dt = config, config.jnp_dtype
    self.config = c
    self.embed = nnx.Param(_normal(0.02)(rngs.params(), (c.vocab_size, c.d_model), dt))
    self.pos_embed = (nnx.Param(_normal(0.01)(rngs.params(), (c.max_len, c.d_model), dt))
                      if c.positions == "learned" else None)
    self.blocks = nnx.List([Block(c, rngs=rngs) for _ in range(c.n_layers)])
    self.final_norm = Norm(c.d_model, kind=c.norm, bias=c.norm == "layernorm" and c.use_bias,
                           eps=c.norm_eps, dtype=dt)
    self.lm_head = (None if c.tie_embeddings else
                    Dense(c.d_model, c.vocab_size, bias=False, dtype=dt, rngs=rngs))

  def __call__(self, tokens_BT: Array, positions_BT: Array, cache: kv.KVCache | None = None,
               block_mask_TT: Array | None = None, capture: tuple[int, ...] = ()):
    """Returns (logits_BTV float32, hidden_BTD float32 after the final norm, cache).

    capture: a static tuple of layer indices whose outputs the caller also wants (drafters
    that read the target's hidden states: EAGLE, Medusa). Index i < n_layers is the residual
    stream after block i; i = n_layers is the final norm's output (what the LM head reads);
    i = -1 (`EMBEDDING`) is the embedding output entering block 0.
    With a non-empty `capture` a fourth item is returned: features_BTCD float32, C =
    len(capture), in the order given. The computation is the same pass either way.
    """
    check_capture(self.config, capture)
    x = jnp.take(self.embed[...], tokens_BT, axis=0).astype(jnp.float32)
    if self.pos_embed is not None:
      x = x + jnp.take(self.pos_embed[...], positions_BT, axis=0).astype(jnp.float32)
    kept = {EMBEDDING: x} if EMBEDDING in capture else {}
    for layer, block in enumerate(self.blocks):
      x, cache = block(x, positions_BT, cache, layer, block_mask_TT)
      if layer in capture:
        kept[layer] = x
    hidden = self.final_norm(x)
    logits = self.logits(hidden)
    if not capture:
      return logits, hidden, cache
    kept[self.config.n_layers] = hidden
    return logits, hidden, cache, jnp.stack([kept[i] for i in capture], axis=2)

  def logits(self, hidden_BTD: Array) -> Array:
    """The LM head alone (EAGLE-style drafters reuse the target's head)."""
    if self.lm_head is not None:
      return self.lm_head(hidden_BTD)
    w = self.embed[...]
    return one_row_bf16.one_row_safe_matmul("btd,vd->btv", hidden_BTD.astype(w.dtype), w)
