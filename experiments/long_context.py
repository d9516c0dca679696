"""Speedup vs context length at a fixed batch: the memory-bound regime returns with the cache.

`target` (or its older name `models`), `draft` and `prompts` by reference
(experiments/references.py); a prompt file's texts are joined and cut into windows of
context_len ids (plain text, no chat template: the rows carry no question ids).

Each point is one context length L (prompt tokens) at fixed batch B and chain length k: plain
and speculative decoding of the same prompts, timed side by side. As L grows the bytes a step
streams, W + B·L·kv, come to be dominated by the KV cache while its FLOPs grow only through
attention, so a step stays (or becomes again) memory-bound at any batch: verifying k + 1
tokens costs about as much as decoding one, and the speedup of small batches returns
(the MagicDec observation; see docs/cost_model.md, "Long context").

Tokens/s are of the decode phase: each call's time minus that of the same call with
max_new_tokens = 1 (the prefill alone, the draft's included), which at long contexts would
otherwise dominate (`speedup_e2e` keeps the end-to-end ratio, `decode_share` the plain
decode phase's part of its call). Both are the fastest of `repeats` alternated calls
(`measure.compare` with decode_only; the fastest, because other load on a shared machine
only slows a call down and the decode phase is a difference of two times); a difference
lost in the noise (decode phase <= 0) gives NaN: raise max_new_tokens.

The prediction beside the measurement (`predicted_speedup`, `efficiency` = measured ÷ it) is
the loop's calibrated cost model (`specjax.calibration`, docs/cost_model.md, "Calibrated
loop costs"): the compiled plain and chain(k) loops are timed at this context, batch,
budget and cache length (the fastest of `calibration_repeats` alternated calls, cached on
disk), giving a cycle in plain target steps; the tokens one loop iteration emits come from
each row's measured law of accepted lengths (`calibration.row_length_probs`) through
`calibration.tokens_per_iteration` (a batch waits for its slowest row):

    predicted = τ_loop ÷ cycle_steps(chain(k)).

Beside it, two models for comparison. The roofline (`roofline_gain`; specjax.analysis.roofline) for
this machine, calibrated once per process (`roofline.calibrate`: streaming bandwidth,
matmul FLOP/s) and this target (`Workload.from_model_config`), at the measured α and c:

    t(B, T)   = max((W + B·S·kv) / BW, T·B·F(S) / FLOPS)        predicted plain step: T = 1
    gain      = E[τ](α, k)·t(B, 1) / (t(B, k+1) + k·c·t(B, 1))  ("full" draft cost)

with S = the cache length, the slots every step's attention reads (this engine attends over
the whole cache buffer, masked): the engine's `decoding.cache_len_for` (the prompt's
power-of-two bucket + max_new_tokens + k + 1, rounded up to a power of two). c = (draft root
step of 2 tokens + (k−1) one-token steps) ÷ (k · one-token target step), timed standalone
at the run's mean context (`measure.step_costs`, medians of 3·repeats samples). And the
standalone forward times (`predicted_speedup_timed`): E[τ](α, k) / (k·c + v), v =
t_target(k+1) ÷ t_target(1). The tiny models run past their 256-token training length
(RoPE positions), so α itself changes with L; it is measured at every point, and the
"_ref_alpha" columns hold α at `reference_alpha` to show the context's own effect.
"""

from __future__ import annotations

import math

import jax

from specjax.experiments import measure, references
from specjax.calibration import loop_costs as calibration
from specjax.engine import decoding
from specjax.analysis import roofline, theory
from specjax.verify import trees
from specjax.sweeps import report as rep

MAX_CONTEXT = 1 << 16
MAX_K = 32


def validate(params: dict) -> None:
  context_len = measure.check_int(params, "context_len", None, 8, MAX_CONTEXT)
  measure.check_int(params, "batch", 1, 1)
  k = measure.check_int(params, "k", 4, 1, MAX_K)
  new = measure.check_int(params, "max_new_tokens", 64, 2)
  measure.check_int(params, "repeats", 3, 1)
  measure.check_int(params, "seed", 0, 0)
  measure.check_number(params, "temperature", 0.0, 0)
  measure.check_number(params, "reference_alpha", 0.8, 0, 1, hi_open=True)
  measure.check_int(params, "calibration_repeats", 3, 1)
  measure.check_choice(params, "recalibrate", False, (False, True))
  models = references.check_target(params)
  references.check_draft(params)
  references.check_prompts(params)
  for cfg in measure.model_configs(models, params.get("draft", "default")):  # the engine refuses to decode past max_len
    need = context_len + new + k + 1
    if need > cfg.max_len:
      raise ValueError(f"context_len {context_len} + max_new_tokens {new} + k {k} + 1 = {need} "
                       f"exceeds the model's max_len {cfg.max_len} (the length its positions "
                       f"were trained for); the longest context_len here is "
                       f"{cfg.max_len - new - k - 1}")


def memory(params: dict) -> int:
  """KV bytes of the speculative run: target + draft caches of batch × cache_len slots."""
  s = decoding.cache_len_for(params["context_len"], params.get("max_new_tokens", 64),
                             params.get("k", 4) + 1)
  return sum(measure.cache_bytes(references.target_ref(params.get("target"),
                                                      params.get("models")),
                                 params.get("batch", 1), s, params.get("draft", "default")))


def long_prompts(tok, texts, batch: int, context_len: int) -> list[list[int]]:
  """`batch` prompts of exactly context_len tokens (the source text repeated if short)."""
  texts = list(texts) if texts else [measure.FALLBACK_TEXT]
  reps = max(1, math.ceil((context_len + 64 * batch) / max(1, len("\n".join(texts)))))
  prompts = measure.prompts(tok, texts * reps, batch, context_len)
  if any(len(p) != context_len for p in prompts):
    raise ValueError(f"could not build prompts of context_len {context_len} from the corpus")
  return prompts


def source_texts(which: str, prompts: str, texts):
  """The texts long prompts are cut from: the target's own for "code" (`measure.models`),
  the held-out prose, or a prompt file's first turns as plain text (no chat template: a
  window of context_len ids spans several prompts, so rows carry no question ids)."""
  ref, _ = references.prompt_spec(prompts)
  if ref in references.EMBEDDED:
    return references.embedded_texts(which, ref, texts)
  return [p.turns[0] for p in references.file_prompts(ref)]


def point(context_len: int, batch: int = 4, k: int = 4, max_new_tokens: int = 64,
          temperature: float = 0.0, repeats: int = 3, models: str | None = None,
          seed: int = 0, reference_alpha: float = 0.8, calibration_repeats: int = 3,
          recalibrate: bool = False, target: str | None = None, draft: str = "default",
          prompts: str = "code") -> dict:
  models = references.target_ref(target, models)
  target, draft, tok, texts = measure.models(models, "float32", draft)
  tree = trees.chain(k)
  prompt_ids = long_prompts(tok, source_texts(models, prompts, texts), batch, context_len)
  cmp = measure.calibrated_compare(target, draft, prompt_ids, [tree], tree=tree,
                                   max_new_tokens=max_new_tokens, repeats=repeats,
                                   calibration_repeats=calibration_repeats,
                                   temperature=temperature, seed=seed,
                                   recalibrate=recalibrate, statistic="fastest")
  costs, cache_len = cmp.loop_costs, cmp.cache_len
  sc = measure.step_costs(target, draft, batch, tree, cmp.context, cache_len, 3 * repeats)
  c, v = sc.c, sc.v
  summary = cmp.spec.summary()
  alpha = summary.alpha_trial if summary.alpha_trial == summary.alpha_trial else 0.0
  alpha = min(max(alpha, 0.0), 1.0)
  tau_pred = float(theory.expected_tokens(alpha, k))
  measured = cmp.speedup

  def calibrated(law) -> tuple[float, float]:
    tau = calibration.tokens_per_iteration(law, batch, max_new_tokens - 1)
    return tau, costs.predicted_speedup(tree, tau)

  # Each row's own acceptance (the loop runs until its slowest row is done).
  tau_loop, predicted = calibrated(calibration.row_length_probs(cmp.spec.stats, tree))
  hw = measure.hardware()
  wl = roofline.Workload.from_model_config(target.config, cache_len)
  roof = roofline.gain(hw, wl, batch, alpha, k, c)
  # At a fixed α the context's own effect shows, apart from the tiny models' α drift.
  tau_ref = float(theory.expected_tokens(reference_alpha, k))
  kv_bytes = batch * cache_len * wl.kv_bytes_per_token
  return {
      "plain_tok_s": cmp.plain_tok_s, "spec_tok_s": cmp.spec_tok_s, "speedup": measured,
      "speedup_e2e": cmp.plain_s / cmp.spec_s, "prefill_ms": 1e3 * cmp.plain_prefill_s,
      "decode_share": (cmp.plain_s - cmp.plain_prefill_s) / cmp.plain_s,
      "predicted_speedup": predicted,
      "efficiency": cmp.efficiency(predicted),
      "tau_loop_predicted": tau_loop, "cycle_steps": costs.cycle_steps(tree),
      "t_step_ms": 1e3 * costs.t_step, "calibration_cached": bool(costs.meta.get("cached")),
      "predicted_speedup_ref_alpha": calibrated(
          calibration.chain_length_probs(reference_alpha, k))[1],
      "roofline_gain": roof, "efficiency_roofline": cmp.efficiency(roof),
      "predicted_speedup_timed": tau_pred / sc.cycle,
      "predicted_speedup_timed_ref_alpha": tau_ref / sc.cycle,
      "roofline_gain_ref_alpha": roofline.gain(hw, wl, batch, reference_alpha, k, c),
      "alpha": summary.alpha, "alpha_trial": summary.alpha_trial, "tau": summary.tau,
      "tau_predicted": tau_pred, "c": c, "verify_cost": v,
      "plain_step_ms": 1e3 * sc.t1,
      "roofline_step_ms": 1e3 * roofline.step_time(hw, wl, batch, 1),
      "memory_bound_factor": roofline.memory_bound_factor(hw, wl, batch, 1),
      "memory_bound_factor_verify": roofline.memory_bound_factor(hw, wl, batch, k + 1),
      "kv_share": kv_bytes / (kv_bytes + wl.weight_bytes),
      "identical_to_plain": cmp.identical if temperature == 0 else None,
      "cache_len": cache_len, "bandwidth_GBs": hw.bandwidth / 1e9,
      "flops_G": hw.flops / 1e9, "backend": jax.default_backend(),
  }


def report(records: list[dict], run_dir) -> str:
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
    mg = lambda name: [r["metrics"].get(name, float("nan")) for r in rows]  # noqa: E731
    ax_s.plot(x, m("predicted_speedup"), "*-", color=col, label=f"{label} calibrated")
    ax_s.plot(x, mg("roofline_gain"), "x--", color=col, label=f"{label} roofline")
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
      "calibrated = predicted from the loop's calibrated costs at that context (tokens per "
      "loop iteration from the measured α ÷ the cycle in plain target steps, timed in the "
      "compiled loop; docs/cost_model.md, \"Calibrated loop costs\"; efficiency = measured "
      "÷ calibrated); roofline = predicted from this machine's calibrated bandwidth "
      f"({hw['bandwidth_GBs']:.3g} GB/s) and FLOP/s ({hw['flops_G']:.3g} GFLOP/s) at the "
      "measured α (per trial, annotated: the tiny models were trained on 256-token windows) "
      "and c; timed = predicted from standalone forward timings; the lines 'at α=…' hold α "
      "at `reference_alpha` to show the context's own effect. Decode phase only (prefill "
      "subtracted). Memory-bound factor > 1: the step streams bytes longer than it computes "
      "(see experiments/long_context.py).", "",
      f"![measured vs predicted speedup vs context]({name})", ""])
