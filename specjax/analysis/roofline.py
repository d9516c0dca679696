"""Roofline cost model: when speculation pays, and which k to use at each batch size.

One decode step at batch B, context length L, T tokens per sequence in the pass
(docs/cost_model.md, "The roofline"):

    t(B, T) = max( (W + B·L·kv) / BW ,  T·B·F(L) / FLOPS )
              memory term               compute term

W weight bytes, kv KV-cache bytes per token per sequence, F(L) FLOPs per token
(= flops_per_token + attn_flops_per_ctx·L), BW memory bandwidth, FLOPS usable FLOP/s.
Plain decode is T = 1; verifying k drafts is T = k + 1. Speculation multiplies only the
compute term; the bytes written for the T new cache entries are ignored (T·kv ≪ W).

Units: SI throughout (bytes, seconds, FLOP/s). GB = 1e9 bytes; the KV size per token is
a power of two (128 KiB = 131072 bytes for the lecture's GQA-8 7B).

How the draft is paid for (`draft_cost`), with τ = E[τ](α, k) and c in target steps:
- "full" (default): cycle = t(B, k+1) + k·c·t(B, 1). The draft's k passes cost c plain
  target steps each at every batch size (c is assumed batch-independent).
- "verify_only": cycle = t(B, k+1). The draft is free: the lecture's 1.21× at B = 164.
- "memory_only": cycle = max((1 + k·c)·t_mem(B), t_comp(B, k+1)): the draft is counted
  while the step is memory-bound and hidden once verification is compute-bound. This is the
  one convention under which both lecture figures (2.10× at B = 1, 1.21× at B = 164) hold.
gain = τ·t(B, 1) / cycle: throughput of speculative over plain decoding at the same batch.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any

import numpy as np

from specjax.analysis import theory

__all__ = [
    "Hardware", "H100", "H200", "A100", "HARDWARE", "Workload", "param_counts", "DRAFT_COSTS",
    "memory_time", "compute_time", "step_time", "memory_bound_factor", "cycle_time", "gain",
    "break_even_batch", "best_k", "cache_budget", "max_batch", "LongContext", "long_context",
    "DraftKV", "draft_kv_cost", "calibrate",
]

DRAFT_COSTS = ("full", "verify_only", "memory_only")


def _positive(name: str, value: Any) -> float:
  try:
    v = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be a number, got {value!r}") from None
  if not math.isfinite(v) or v <= 0:
    raise ValueError(f"{name} must be positive and finite, got {value!r}")
  return v


def _nonneg(name: str, value: Any) -> float:
  try:
    v = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be a number, got {value!r}") from None
  if not math.isfinite(v) or v < 0:
    raise ValueError(f"{name} must be >= 0 and finite, got {value!r}")
  return v


def _batch(value: Any, name: str = "batch") -> float:
  """A batch size >= 1 (real-valued: break-even search works on a continuous batch)."""
  try:
    v = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be a number >= 1, got {value!r}") from None
  if not math.isfinite(v) or v < 1:
    raise ValueError(f"{name} must be >= 1 and finite, got {value!r}")
  return v


def _int(name: str, value: Any, minimum: int) -> int:
  return int(theory._check_int(name, value, minimum))


def _draft_cost(value: str) -> str:
  if value not in DRAFT_COSTS:
    raise ValueError(f"draft_cost must be one of {DRAFT_COSTS}, got {value!r}")
  return value


# ----------------------------------------------------------------------------- hardware


@dataclasses.dataclass(frozen=True)
class Hardware:
  """One accelerator: what the roofline needs. flops is the *usable* rate (the lecture
  uses 50% of the dense bf16 peak); peak_flops, when known, is the datasheet figure."""

  name: str
  bandwidth: float  # bytes/s, memory (HBM) bandwidth
  flops: float  # usable FLOP/s
  memory: float  # bytes of device memory
  peak_flops: float | None = None  # datasheet dense FLOP/s (for utilisation figures)

  def __post_init__(self):
    for field in ("bandwidth", "flops", "memory"):
      _positive(field, getattr(self, field))
    if self.peak_flops is not None:
      _positive("peak_flops", self.peak_flops)

  @property
  def ridge(self) -> float:
    """FLOP per byte at which a kernel stops being memory-bound."""
    return self.flops / self.bandwidth

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


# The lecture's H100 (SXM): 3.35 TB/s, 989 TFLOP/s dense bf16 peak, 50% usable = 494.5.
H100 = Hardware("h100", bandwidth=3.35e12, flops=494.5e12, memory=80e9, peak_flops=989e12)
# H200: the H100's compute with 141 GB of HBM3e at 4.8 TB/s; same 50% usable convention.
H200 = Hardware("h200", bandwidth=4.8e12, flops=494.5e12, memory=141e9, peak_flops=989e12)
# A100 80 GB SXM: 2.039 TB/s, 312 TFLOP/s dense bf16 peak, 50% usable.
A100 = Hardware("a100", bandwidth=2.039e12, flops=156e12, memory=80e9, peak_flops=312e12)
HARDWARE = {"h100": H100, "h200": H200, "a100": A100}


# ----------------------------------------------------------------------------- workload

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class Workload:
  """A target model serving sequences of context_len tokens.

  flops_per_token counts the matmuls (2 FLOPs per weight); attn_flops_per_ctx adds the
  attention scores and mix, 4·n_layers·n_heads·head_dim FLOPs per token per context
  position (0 in the lecture's model).
  """

  name: str
  weight_bytes: float  # W: bytes streamed per step (all parameters)
  kv_bytes_per_token: float  # K and V, all layers, one sequence, one context token
  flops_per_token: float  # F at zero context
  context_len: int  # L
  attn_flops_per_ctx: float = 0.0

  def __post_init__(self):
    _positive("weight_bytes", self.weight_bytes)
    _nonneg("kv_bytes_per_token", self.kv_bytes_per_token)
    _positive("flops_per_token", self.flops_per_token)
    _int("context_len", self.context_len, 1)
    _nonneg("attn_flops_per_ctx", self.attn_flops_per_ctx)

  def flops(self, context_len: int | None = None) -> float:
    """F(L) = flops_per_token + attn_flops_per_ctx · L."""
    L = self.context_len if context_len is None else context_len
    return self.flops_per_token + self.attn_flops_per_ctx * L

  def kv_bytes_per_seq(self, context_len: int | None = None) -> float:
    return self.kv_bytes_per_token * (self.context_len if context_len is None else context_len)

  def with_context(self, context_len: int) -> "Workload":
    return dataclasses.replace(self, context_len=_int("context_len", context_len, 1))

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def lecture_7b(cls, context_len: int = 640) -> "Workload":
    """The lecture's 7B in bf16: W = 13.5 GB, F = 13.48 GFLOP/token, GQA-8 KV
    2·32 layers·8 heads·128·2 bytes = 128 KiB/token, attention FLOPs ignored."""
    return cls("lecture-7b", weight_bytes=13.5e9, kv_bytes_per_token=128 * 1024,
               flops_per_token=13.48e9, context_len=context_len)

  @classmethod
  def from_numbers(cls, n_params: float, kv_bytes_per_token: float, context_len: int, *,
                   dtype_bytes: float = 2, flops_per_token: float | None = None,
                   name: str = "custom") -> "Workload":
    """From raw figures: W = n_params·dtype_bytes, F = 2·n_params unless given."""
    n = _positive("n_params", n_params)
    b = _positive("dtype_bytes", dtype_bytes)
    f = 2.0 * n if flops_per_token is None else flops_per_token
    return cls(name, weight_bytes=n * b, kv_bytes_per_token=kv_bytes_per_token,
               flops_per_token=f, context_len=context_len)

  @classmethod
  def from_model_config(cls, config: Any, context_len: int, dtype_bytes: float | None = None,
                        *, attention_flops: bool = True, name: str | None = None) -> "Workload":
    """From a `specjax.models.transformer.ModelConfig` (duck-typed on its fields).

    W = every parameter × dtype_bytes (the config's dtype unless given);
    kv = 2·n_layers·n_kv_heads·head_dim·dtype_bytes;
    F = 2·(attention + MLP matmul weights of all layers + the LM head d·V, tied or not);
    attention FLOPs 4·n_layers·n_heads·head_dim per context token unless attention_flops=False.
    """
    counts = param_counts(config)
    if dtype_bytes is None:
      dtype = getattr(config, "dtype", "float32")
      if dtype not in _DTYPE_BYTES:
        raise ValueError(f"config.dtype must be one of {tuple(_DTYPE_BYTES)}, got {dtype!r}")
      dtype_bytes = _DTYPE_BYTES[dtype]
    b = _positive("dtype_bytes", dtype_bytes)
    hd = getattr(config, "head_dim", config.d_model // config.n_heads)
    kv = 2 * config.n_layers * config.n_kv_heads * hd * b
    attn = 4.0 * config.n_layers * config.n_heads * hd if attention_flops else 0.0
    label = name or (f"{config.n_layers}L-d{config.d_model}-{counts['total'] / 1e6:.0f}M")
    return cls(label, weight_bytes=counts["total"] * b, kv_bytes_per_token=kv,
               flops_per_token=2.0 * counts["matmul"], context_len=context_len,
               attn_flops_per_ctx=attn)


def param_counts(config: Any) -> dict[str, int]:
  """Parameter counts of a ModelConfig, mirroring specjax.models.transformer:
  q/k/v/o (+ biases: use_bias on all, qkv_bias on q/k/v only), MLP with 2 matrices (gelu)
  or 3 (swiglu) (+ biases), two norms per layer and a final norm (LayerNorm scale + bias
  when use_bias, RMSNorm scale only), per-head q/k RMSNorms (qk_norm), token embeddings,
  learned positions, an untied head.

  Returns total, matmul (per-token matmul weights: blocks + LM head) and embedding counts.
  """
  d, n_layers, vocab = config.d_model, config.n_layers, config.vocab_size
  hd = getattr(config, "head_dim", d // config.n_heads)
  q_out, kv_out = config.n_heads * hd, config.n_kv_heads * hd
  use_bias = bool(config.use_bias)
  qkv_bias = use_bias or bool(getattr(config, "qkv_bias", False))
  swiglu = config.mlp == "swiglu"
  attn_w = d * q_out + 2 * d * kv_out + q_out * d
  attn_b = (q_out + 2 * kv_out if qkv_bias else 0) + (d if use_bias else 0)
  mlp_w = (3 if swiglu else 2) * d * config.d_ff
  mlp_b = ((2 if swiglu else 1) * config.d_ff + d) if use_bias else 0
  norm = d * (2 if (config.norm == "layernorm" and use_bias) else 1)
  qk_norm = 2 * hd if getattr(config, "qk_norm", False) else 0
  block = attn_w + attn_b + mlp_w + mlp_b + 2 * norm + qk_norm
  embed = vocab * d
  positions = config.max_len * d if config.positions == "learned" else 0
  head = 0 if config.tie_embeddings else vocab * d
  total = n_layers * block + norm + embed + positions + head
  matmul = n_layers * (attn_w + mlp_w) + vocab * d
  return {"total": int(total), "matmul": int(matmul), "embedding": int(embed + positions)}


# ----------------------------------------------------------------------------- step times
# The _arr helpers take validated numbers or numpy arrays (broadcasting); the public
# functions validate scalars first.


def _t_mem(hw: Hardware, wl: Workload, b, L):
  return (wl.weight_bytes + b * L * wl.kv_bytes_per_token) / hw.bandwidth


def _t_comp(hw: Hardware, wl: Workload, b, t, L):
  return t * b * wl.flops(L) / hw.flops


def _cycle_arr(hw, wl, b, k, c, L, draft_cost):
  t_mem = _t_mem(hw, wl, b, L)
  t_verify = np.maximum(t_mem, _t_comp(hw, wl, b, k + 1, L))
  if draft_cost == "verify_only":
    return t_verify
  if draft_cost == "memory_only":
    return np.maximum((1.0 + k * c) * t_mem, _t_comp(hw, wl, b, k + 1, L))
  return t_verify + k * c * np.maximum(t_mem, _t_comp(hw, wl, b, 1, L))


def _gain_arr(hw, wl, b, alpha, k, c, L, draft_cost):
  tau = np.asarray(theory.expected_tokens(alpha, k))
  t_plain = np.maximum(_t_mem(hw, wl, b, L), _t_comp(hw, wl, b, 1, L))
  return tau * t_plain / _cycle_arr(hw, wl, b, k, c, L, draft_cost)


def _context(wl: Workload, context_len: int | None) -> int:
  return wl.context_len if context_len is None else _int("context_len", context_len, 1)


def memory_time(hw: Hardware, wl: Workload, batch: float, context_len: int | None = None) -> float:
  """(W + B·L·kv) / BW: seconds to stream the weights and every sequence's cache once."""
  return float(_t_mem(hw, wl, _batch(batch), _context(wl, context_len)))


def compute_time(hw: Hardware, wl: Workload, batch: float, tokens_per_seq: int = 1,
                 context_len: int | None = None) -> float:
  """T·B·F(L) / FLOPS."""
  t = _int("tokens_per_seq", tokens_per_seq, 1)
  return float(_t_comp(hw, wl, _batch(batch), t, _context(wl, context_len)))


def step_time(hw: Hardware, wl: Workload, batch: float, tokens_per_seq: int = 1,
              context_len: int | None = None) -> float:
  """t(B, T) = max(memory term, compute term), in seconds."""
  return max(memory_time(hw, wl, batch, context_len),
             compute_time(hw, wl, batch, tokens_per_seq, context_len))


def memory_bound_factor(hw: Hardware, wl: Workload, batch: float, tokens_per_seq: int = 1,
                        context_len: int | None = None) -> float:
  """memory term / compute term: > 1 means memory-bound by that factor."""
  return (memory_time(hw, wl, batch, context_len)
          / compute_time(hw, wl, batch, tokens_per_seq, context_len))


def _spec_args(alpha, k, c, draft_cost):
  a = float(theory._check_unit("alpha", alpha))
  kk = _int("k", k, 0)
  cc = float(theory._check_nonneg("c", c))
  return a, kk, cc, _draft_cost(draft_cost)


def cycle_time(hw: Hardware, wl: Workload, batch: float, k: int, c: float,
               draft_cost: str = "full", context_len: int | None = None) -> float:
  """Seconds per speculative cycle (k drafts + one verification); see the module doc."""
  kk = _int("k", k, 0)
  cc = float(theory._check_nonneg("c", c))
  dc = _draft_cost(draft_cost)
  return float(_cycle_arr(hw, wl, _batch(batch), kk, cc, _context(wl, context_len), dc))


def gain(hw: Hardware, wl: Workload, batch: float, alpha: float, k: int, c: float,
         draft_cost: str = "full", context_len: int | None = None) -> float:
  """Speculative ÷ plain tokens/s at the same batch: τ·t(B, 1) / cycle_time. k = 0 → 1.

  At B = 1 (memory-bound) with "full" or "memory_only" this is theory.speedup(α, k, c).
  """
  a, kk, cc, dc = _spec_args(alpha, k, c, draft_cost)
  return float(_gain_arr(hw, wl, _batch(batch), a, kk, cc, _context(wl, context_len), dc))


def break_even_batch(hw: Hardware, wl: Workload, alpha: float, k: int, c: float,
                     draft_cost: str = "full", context_len: int | None = None,
                     max_batch: float = 1e7) -> float:
  """The (continuous) batch B >= 1 where gain(B) = 1.

  gain is constant while verification is memory-bound and falls once it is compute-bound,
  so the root is unique; found by bisection to 1e-9 relative. Returns 1.0 if speculation
  does not pay even at B = 1 and math.inf if it still pays at max_batch.
  """
  a, kk, cc, dc = _spec_args(alpha, k, c, draft_cost)
  L = _context(wl, context_len)
  hi = _batch(max_batch, "max_batch")
  f = lambda b: float(_gain_arr(hw, wl, b, a, kk, cc, L, dc)) - 1.0  # noqa: E731
  if f(1.0) <= 0:
    return 1.0
  if f(hi) > 0:
    return math.inf
  lo = 1.0
  while hi - lo > 1e-9 * hi:
    mid = 0.5 * (lo + hi)
    lo, hi = (mid, hi) if f(mid) > 0 else (lo, mid)
  return 0.5 * (lo + hi)


def best_k(hw: Hardware, wl: Workload, batch: float, alpha: float, c: float, k_max: int = 16,
           draft_cost: str = "full", context_len: int | None = None) -> tuple[int, float]:
  """argmax over k in 0..k_max of gain (0 = speculation off, gain 1); smallest k on ties."""
  a, _, cc, dc = _spec_args(alpha, 0, c, draft_cost)
  km = theory.check_size("k_max", _int("k_max", k_max, 0), theory.MAX_K,
                         "k = 0..k_max are all evaluated")
  ks = np.arange(km + 1)
  g = _gain_arr(hw, wl, _batch(batch), a, ks, cc, _context(wl, context_len), dc)
  g[0] = 1.0  # exactly: no speculation
  i = int(np.argmax(g))
  return i, float(g[i])


# ----------------------------------------------------------------------------- memory capacity


def cache_budget(hw: Hardware, wl: Workload, reserve: float = 0.05,
                 extra_bytes: float = 0.0) -> float:
  """Bytes left for KV caches: (1 − reserve)·memory − W − extra_bytes (e.g. draft weights).

  The lecture's 62.5 GB is 0.95 · 80 GB − 13.5 GB.
  """
  r = float(theory._check_unit("reserve", reserve))
  budget = (1.0 - r) * hw.memory - wl.weight_bytes - _nonneg("extra_bytes", extra_bytes)
  if budget <= 0:
    raise ValueError(f"the weights ({wl.weight_bytes:.3g} B + extra {extra_bytes:.3g} B) do not "
                     f"fit in {hw.name}'s memory ({hw.memory:.3g} B, reserve {r})")
  return budget


def max_batch(wl: Workload, memory_budget: float, context_len: int | None = None,
              extra_kv_bytes_per_token: float = 0.0) -> int:
  """floor(budget / (L · (kv + extra))): sequences whose caches fit (0 if none does)."""
  budget = _positive("memory_budget", memory_budget)
  L = _context(wl, context_len)
  per_seq = L * (wl.kv_bytes_per_token + _nonneg("extra_kv_bytes_per_token",
                                                 extra_kv_bytes_per_token))
  if per_seq <= 0:
    raise ValueError("a sequence must take some cache memory (kv_bytes_per_token is 0)")
  return int(math.floor(budget / per_seq + 1e-9))


@dataclasses.dataclass(frozen=True)
class LongContext:
  """The long-context case: the batch that fits, and how memory-bound that step is."""

  context_len: int
  memory_budget: float
  batch: int
  memory_bound_plain: float  # t_mem / t_comp at T = 1
  memory_bound_verify: float  # t_mem / t_comp at T = k + 1
  gain: dict  # draft_cost -> gain at that batch

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def long_context(hw: Hardware, wl: Workload, context_len: int, alpha: float, k: int, c: float,
                 memory_budget: float | None = None) -> LongContext:
  """Max batch at context_len within memory_budget (default `cache_budget`), and the step."""
  a, kk, cc, _ = _spec_args(alpha, k, c, "full")
  L = _int("context_len", context_len, 1)
  budget = cache_budget(hw, wl) if memory_budget is None else _positive("memory_budget",
                                                                       memory_budget)
  b = max_batch(wl, budget, L)
  if b < 1:
    raise ValueError(f"not one sequence of context_len {L} fits in memory_budget {budget:.3g} B")
  return LongContext(
      context_len=L, memory_budget=budget, batch=b,
      memory_bound_plain=memory_bound_factor(hw, wl, b, 1, L),
      memory_bound_verify=memory_bound_factor(hw, wl, b, kk + 1, L),
      gain={dc: gain(hw, wl, b, a, kk, cc, dc, L) for dc in DRAFT_COSTS})


@dataclasses.dataclass(frozen=True)
class DraftKV:
  """What a separate draft model's own cache (and weights) costs in concurrency."""

  memory_budget: float  # cache bytes available without a draft
  batch_plain: int  # max batch without a draft
  batch_spec: int  # max batch with the draft's weights and cache also resident
  concurrency_lost: float  # 1 − batch_spec / batch_plain
  tokens_per_s_plain: float  # at batch_plain
  tokens_per_s_spec: float  # at batch_spec, draft_cost as given
  gain_at_capacity: float  # tokens_per_s_spec / tokens_per_s_plain

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def draft_kv_cost(hw: Hardware, wl: Workload, alpha: float, k: int, c: float,
                  draft_kv_bytes_per_token: float, draft_weight_bytes: float = 0.0,
                  memory_budget: float | None = None, draft_cost: str = "full") -> DraftKV:
  """Both servers fill memory: plain decoding at its max batch against speculation at the
  smaller batch left once the draft's weights and per-token cache are resident. For a draft
  of the target's architecture, draft_kv_bytes_per_token ≈ (draft params / target params)
  × the target's (docs/cost_model.md, "Memory and the draft's cache"). The draft cache's
  own traffic is inside c.
  """
  a, kk, cc, dc = _spec_args(alpha, k, c, draft_cost)
  dkv = _nonneg("draft_kv_bytes_per_token", draft_kv_bytes_per_token)
  dw = _nonneg("draft_weight_bytes", draft_weight_bytes)
  budget = cache_budget(hw, wl) if memory_budget is None else _positive("memory_budget",
                                                                       memory_budget)
  b0 = max_batch(wl, budget)
  b1 = max_batch(wl, budget - dw, extra_kv_bytes_per_token=dkv) if budget > dw else 0
  if b0 < 1:
    raise ValueError(f"not one sequence fits in memory_budget {budget:.3g} B")
  tps0 = b0 / step_time(hw, wl, b0, 1)
  tps1 = (b1 * float(theory.expected_tokens(a, kk)) / cycle_time(hw, wl, b1, kk, cc, dc)
          if b1 >= 1 else 0.0)
  return DraftKV(budget, b0, b1, 1.0 - b1 / b0, tps0, tps1, tps1 / tps0)


# ----------------------------------------------------------------------------- calibration


def _best_seconds(fn, repeats: int) -> float:
  """Fastest of `repeats` timed calls after a warm-up: what the machine can do (other load
  on a shared machine only ever slows a call down)."""
  fn().block_until_ready()  # compile + warm up
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn().block_until_ready()
    times.append(time.perf_counter() - t0)
  return float(min(times))


def calibrate(*, stream_bytes: int | None = None, matmul_size: int | None = None,
              repeats: int = 5, dtype: str | None = None, name: str | None = None) -> Hardware:
  """Measure this machine's first JAX device: streaming bandwidth and matmul FLOP/s.

  Bandwidth: a sum over a float32 array of stream_bytes (read-only streaming, like the
  weights in a decode step; a copy would also time the allocation of its output).
  FLOP/s: an n × n @ n × n matmul (2n³ FLOPs) in dtype with float32 accumulation
  (default float32 on CPU, bfloat16 on accelerators). Fastest of `repeats` timed calls.
  Defaults (CPU: 64 MiB, n = 1024; accelerators: 1 GiB, n = 8192) keep it well under 10 s.
  Memory: the device's bytes_limit, or the host's physical memory on CPU.
  """
  import jax  # lazy: the rest of the roofline needs no JAX
  import jax.numpy as jnp

  dev = jax.devices()[0]
  on_cpu = dev.platform == "cpu"
  sb = _int("stream_bytes", stream_bytes if stream_bytes is not None
            else (64 if on_cpu else 1024) * 2**20, 4096)
  n = _int("matmul_size", matmul_size if matmul_size is not None else (1024 if on_cpu else 8192),
           16)
  reps = _int("repeats", repeats, 1)
  dt = dtype or ("float32" if on_cpu else "bfloat16")
  if dt not in _DTYPE_BYTES:
    raise ValueError(f"dtype must be one of {tuple(_DTYPE_BYTES)}, got {dt!r}")

  x = jax.device_put(jnp.ones((sb // 4,), jnp.float32), dev)
  stream = jax.jit(jnp.sum)
  bandwidth = (sb // 4) * 4 / _best_seconds(lambda: stream(x), reps)

  ka, kb = jax.random.split(jax.random.key(0))
  a = jax.device_put(jax.random.normal(ka, (n, n), jnp.float32).astype(dt), dev)
  b = jax.device_put(jax.random.normal(kb, (n, n), jnp.float32).astype(dt), dev)
  mm = jax.jit(lambda p, q: jnp.matmul(p, q, preferred_element_type=jnp.float32))
  flops = 2.0 * n**3 / _best_seconds(lambda: mm(a, b), reps)

  memory = None
  try:
    stats = dev.memory_stats() or {}
    memory = stats.get("bytes_limit")
  except Exception:  # memory_stats is unsupported on some backends (CPU)
    memory = None
  if not memory:
    try:
      memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
      memory = 1e9
  kind = str(getattr(dev, "device_kind", "") or dev.platform).lower().replace(" ", "_")
  return Hardware(name or f"calibrated-{kind}", bandwidth=bandwidth, flops=flops,
                  memory=float(memory))

