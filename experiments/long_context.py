"""Speedup vs context length at a fixed batch: the memory-bound regime returns with the cache.

Each point is one context length L (prompt tokens) at fixed batch B and chain length k: plain
and speculative decoding of the same prompts, timed side by side. As L grows the bytes a step
streams, W + B·L·kv, come to be dominated by the KV cache while its FLOPs grow only through
attention, so a step stays (or becomes again) memory-bound at any batch: verifying k + 1
tokens costs about as much as decoding one, and the speedup of small batches returns
(MagicDec; BACKGROUND.md §7).

Tokens/s are of the decode phase: each call's time minus that of the same call with
max_new_tokens = 1 (the prefill alone, the draft's included), which at long contexts would
otherwise dominate (`speedup_e2e` keeps the end-to-end ratio, `decode_share` the plain
decode phase's part of its call). Both are the fastest of `repeats` alternated calls; a
difference lost in the noise (decode phase <= 0) gives NaN: raise max_new_tokens.

Beside the measurement, the roofline (specjax.roofline) for this machine, calibrated once
per process (`roofline.calibrate`: streaming bandwidth, matmul FLOP/s) and this target
(`Workload.from_model_config`), at the measured α (per trial) and the measured c:

    t(B, T)   = max((W + B·S·kv) / BW, T·B·F(S) / FLOPS)        predicted plain step: T = 1
    predicted = E[τ](α, k)·t(B, 1) / (t(B, k+1) + k·c·t(B, 1))  ("full" draft cost)

with S = the cache length, the slots every step's attention reads (this engine attends over
the whole cache buffer, masked): the prompt's power-of-two bucket + max_new_tokens + k + 1,
rounded up to 64. c = (draft root step of 2 tokens + (k−1) one-token steps) ÷ (k · one-token
target step), timed standalone at the run's mean context. A second prediction uses the
measured forward times instead of the roofline's: E[τ](α, k) / (k·c + v), v = t_target(k+1)
÷ t_target(1). The tiny models run past their 256-token training length (RoPE positions), so
α itself changes with L; it is measured at every point.
"""

from __future__ import annotations

import functools
import math
import time

import jax

from experiments import measure
from specjax import decoding, roofline, sampling, theory
from specjax.drafters.base import LM

MAX_CONTEXT = 1 << 16
MAX_K = 32


def _preset_configs(models: str):
  """(target, draft) ModelConfigs of `measure.models(models)`, without loading anything."""
  if models == "default":
    from specjax.training.presets import PRESETS
    return PRESETS["tiny"].target, PRESETS["tiny"].draft
  from specjax.models.presets import PRESETS
  cfg = PRESETS["tiny-llama"]
  return cfg, cfg.replace(n_layers=1)


def cache_len_for(context_len: int, max_new_tokens: int, k: int) -> int:
  """Slots the runs need (the prompt's power-of-two bucket + new tokens + one cycle's k + 1),
  rounded up to a multiple of 64; passed explicitly so plain and speculative runs and the
  standalone timings all read the same cache."""
  bucket = decoding.MIN_BUCKET
  while bucket < context_len:
    bucket *= 2
  return 64 * math.ceil((bucket + max_new_tokens + k + 1) / 64)


def validate(params: dict) -> None:
  def integer(name, lo, default, hi=None):
    v = params.get(name, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
      allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
      raise ValueError(f"{name} must be an int {allowed}, got {v!r}")
    return v

  context_len = integer("context_len", 8, None, MAX_CONTEXT)
  integer("batch", 1, 1)
  k = integer("k", 1, 4, MAX_K)
  new = integer("max_new_tokens", 2, 64)
  integer("repeats", 1, 3)
  integer("seed", 0, 0)
  t = params.get("temperature", 0.0)
  if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0:
    raise ValueError(f"temperature must be a number >= 0, got {t!r}")
  ra = params.get("reference_alpha", 0.8)
  if isinstance(ra, bool) or not isinstance(ra, (int, float)) or not 0 <= ra < 1:
    raise ValueError(f"reference_alpha must be a number in [0, 1), got {ra!r}")
  models = params.get("models", "default")
  if models not in ("default", "random"):
    raise ValueError(f"models must be 'default' or 'random', got {models!r}")
  for cfg in _preset_configs(models):
    need = context_len + new + k + 1
    if cfg.positions == "learned" and need > cfg.max_len:
      raise ValueError(f"context_len {context_len} + max_new_tokens {new} + k {k} + 1 = {need} "
                       f"exceeds the model's max_len {cfg.max_len} (learned positions)")


def memory(params: dict) -> int:
  """KV bytes of the speculative run: target + draft caches of batch × cache_len slots."""
  from specjax.models import cache as kv
  target_cfg, draft_cfg = _preset_configs(params.get("models", "default"))
  b = params.get("batch", 1)
  s = cache_len_for(params["context_len"], params.get("max_new_tokens", 64), params.get("k", 4))
  return kv.cache_bytes(target_cfg, b, s) + kv.cache_bytes(draft_cfg, b, s)


@functools.lru_cache(maxsize=1)
def hardware() -> roofline.Hardware:
  """This machine's roofline, measured once per process (default sizes: a 64 MiB stream and
  a 1024² matmul on CPU, well under a second; 1 GiB and 8192² on accelerators)."""
  return roofline.calibrate(repeats=3)


def long_prompts(tok, texts, batch: int, context_len: int) -> list[list[int]]:
  """`batch` prompts of exactly context_len tokens (the source text repeated if short)."""
  texts = list(texts) if texts else [measure.FALLBACK_TEXT]
  reps = max(1, math.ceil((context_len + 64 * batch) / max(1, len("\n".join(texts)))))
  prompts = measure.prompts(tok, texts * reps, batch, context_len)
  if any(len(p) != context_len for p in prompts):
    raise ValueError(f"could not build prompts of context_len {context_len} from the corpus")
  return prompts


def fastest_alternating(fns: dict, repeats: int) -> dict:
  """{name: (fastest seconds, last result)}: one warm-up call each (compilation), then every
  callable in turn `repeats` times. The fastest call, not the median: the decode phase is a
  difference of two calls' times, and other load on a shared machine only slows a call down."""
  last = {name: fn() for name, fn in fns.items()}
  best = {name: float("inf") for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      last[name] = jax.block_until_ready(fn())
      best[name] = min(best[name], time.perf_counter() - start)
  return {name: (best[name], last[name]) for name in fns}


def point(context_len: int, batch: int = 4, k: int = 4, max_new_tokens: int = 64,
          temperature: float = 0.0, repeats: int = 3, models: str = "default",
          seed: int = 0, reference_alpha: float = 0.8) -> dict:
  target, draft, tok, texts = measure.models(models)
  prompts = long_prompts(tok, texts, batch, context_len)
  cache_len = cache_len_for(context_len, max_new_tokens, k)
  common = dict(sampler=sampling.make_sampler(temperature), seed=seed, cache_len=cache_len)

  def plain_fn(n):
    return lambda: decoding.generate(target, prompts, max_new_tokens=n, **common)

  def spec_fn(n):
    return lambda: decoding.speculative_generate(target, draft, prompts, k=k, max_new_tokens=n,
                                                 **common)

  timed = fastest_alternating({
      "plain": plain_fn(max_new_tokens), "spec": spec_fn(max_new_tokens),
      "plain_prefill": plain_fn(1), "spec_prefill": spec_fn(1)}, repeats)
  (plain_s, plain), (spec_s, spec) = timed["plain"], timed["spec"]
  plain_pre_s, spec_pre_s = timed["plain_prefill"][0], timed["spec_prefill"][0]
  decoded = plain.emitted - batch  # tokens after the prefill's
  nan = float("nan")
  plain_tok_s = decoded / (plain_s - plain_pre_s) if plain_s > plain_pre_s else nan
  spec_tok_s = decoded / (spec_s - spec_pre_s) if spec_s > spec_pre_s else nan
  measured = spec_tok_s / plain_tok_s
  summary = spec.summary()
  alpha = summary.alpha_trial if summary.alpha_trial == summary.alpha_trial else 0.0

  # Standalone forward timings at the run's mean context, same cache length.
  context = context_len + max_new_tokens // 2
  lm_t, lm_d = LM.of(target), LM.of(draft)
  reps = 3 * repeats
  t1 = measure.forward_seconds(lm_t, batch, 1, context, cache_len, reps)
  tv = measure.forward_seconds(lm_t, batch, k + 1, context, cache_len, reps)
  d2 = measure.forward_seconds(lm_d, batch, 2, context, cache_len, reps)
  d1 = measure.forward_seconds(lm_d, batch, 1, context, cache_len, reps) if k > 1 else 0.0
  c = (d2 + (k - 1) * d1) / (k * t1)
  v = tv / t1
  tau_pred = float(theory.expected_tokens(alpha, k))
  predicted_timed = tau_pred / (k * c + v)

  hw = hardware()
  wl = roofline.Workload.from_model_config(target.config, cache_len)
  predicted = roofline.gain(hw, wl, batch, alpha, k, c)
  # At a fixed α the context's own effect shows, apart from the tiny models' α drift.
  tau_ref = float(theory.expected_tokens(reference_alpha, k))
  kv_bytes = batch * cache_len * wl.kv_bytes_per_token
  return {
      "plain_tok_s": plain_tok_s, "spec_tok_s": spec_tok_s, "speedup": measured,
      "speedup_e2e": plain_s / spec_s, "prefill_ms": 1e3 * plain_pre_s,
      "decode_share": (plain_s - plain_pre_s) / plain_s,
      "predicted_speedup": predicted,
      "efficiency": measured / predicted if predicted > 0 else nan,
      "predicted_speedup_timed": predicted_timed,
      "predicted_speedup_timed_ref_alpha": tau_ref / (k * c + v),
      "roofline_gain_ref_alpha": roofline.gain(hw, wl, batch, reference_alpha, k, c),
      "alpha": summary.alpha, "alpha_trial": summary.alpha_trial, "tau": summary.tau,
      "tau_predicted": tau_pred, "c": c, "verify_cost": v,
      "plain_step_ms": 1e3 * t1,
      "roofline_step_ms": 1e3 * roofline.step_time(hw, wl, batch, 1),
      "memory_bound_factor": roofline.memory_bound_factor(hw, wl, batch, 1),
      "memory_bound_factor_verify": roofline.memory_bound_factor(hw, wl, batch, k + 1),
      "kv_share": kv_bytes / (kv_bytes + wl.weight_bytes),
      "identical_to_plain": plain.tokens == spec.tokens if temperature == 0 else None,
      "cache_len": cache_len, "bandwidth_GBs": hw.bandwidth / 1e9,
      "flops_G": hw.flops / 1e9, "backend": jax.default_backend(),
  }


def report(records: list[dict], run_dir) -> str:
  from specjax import report as rep
  groups: dict = {}
  for r in records:
    key = tuple(sorted((n, repr(v)) for n, v in r["params"].items() if n != "context_len"))
    groups.setdefault(key, []).append(r)
  fig, (ax_s, ax_t, ax_m) = rep.new_figure(ncols=3, figsize=(14, 3.8))
  for rows in groups.values():
    rows.sort(key=lambda r: r["params"]["context_len"])
    p = rows[0]["params"]
    label = f"B={p.get('batch', 4)} k={p.get('k', 4)} T={p.get('temperature', 0.0)}"
    x = [r["params"]["context_len"] for r in rows]
    m = lambda name: [r["metrics"][name] for r in rows]  # noqa: E731
    line, = ax_s.plot(x, m("speedup"), "o-", label=f"{label} measured")
    col = line.get_color()
    for xi, yi, a in zip(x, m("speedup"), m("alpha_trial")):  # α moves with L too
      ax_s.annotate(f"α={a:.2f}", (xi, yi), textcoords="offset points", xytext=(0, 6),
                    fontsize=7, color=col, ha="center")
    ax_s.plot(x, m("predicted_speedup"), "x--", color=col, label=f"{label} roofline")
    ax_s.plot(x, m("predicted_speedup_timed"), "s:", color=col, label=f"{label} timed")
    ref = p.get("reference_alpha", 0.8)
    ax_s.plot(x, m("roofline_gain_ref_alpha"), "+-.", color=col, alpha=0.6,
              label=f"{label} roofline at α={ref:g}")
    ax_s.plot(x, m("predicted_speedup_timed_ref_alpha"), "d-.", color=col, alpha=0.6,
              label=f"{label} timed at α={ref:g}")
    ax_t.plot(x, m("plain_step_ms"), "o-", color=col, label=f"{label} forward timing")
    ax_t.plot(x, m("roofline_step_ms"), "x--", color=col, label=f"{label} roofline")
    ax_m.plot(x, m("memory_bound_factor"), "o-", color=col, label=f"{label} T=1")
    ax_m.plot(x, m("memory_bound_factor_verify"), "x--", color=col,
              label=f"{label} T=k+1")
  ax_s.axhline(1.0, color="gray", lw=0.8)
  ax_m.axhline(1.0, color="gray", lw=0.8)
  for ax, ylabel in ((ax_s, "speedup vs plain"), (ax_t, "plain decode step (ms)"),
                     (ax_m, "memory-bound factor (t_mem / t_comp)")):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (prompt tokens)")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
  ax_t.set_yscale("log")
  ax_m.set_yscale("log")
  name = rep.save(fig, run_dir / "long_context.png")
  hw = records[0]["metrics"]
  return "\n".join([
      "## Long context", "",
      "Speedup = speculative ÷ plain tokens/s measured side by side at each context length; "
      "roofline = predicted from this machine's calibrated bandwidth "
      f"({hw['bandwidth_GBs']:.3g} GB/s) and FLOP/s ({hw['flops_G']:.3g} GFLOP/s) at the "
      "measured α (per trial, annotated: the tiny models were trained on 256-token windows) "
      "and c; timed = predicted from standalone forward timings; the lines 'at α=…' hold α "
      "at `reference_alpha` to show the context's own effect. Decode phase only (prefill "
      "subtracted). Memory-bound factor > 1: the step streams bytes longer than it computes "
      "(see experiments/long_context.py).", "",
      f"![measured vs predicted speedup vs context]({name})", ""])
