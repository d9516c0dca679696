"""The quickstart: does speculative decoding pay on these models, and does the cost model
predict by how much?

One point = (mode, batch, temperature): mode "chain" (k drafts) or "tree" (`tree_widths`),
drafted by `drafter`: "eagle", the target's EAGLE head (for the default target, the cached
shipped default head: `training.defaults.load_default_heads`; for random
models, one trained here for `head_steps` steps), or "model", the separate draft model
(the distilled draft of the embedded pair). The main job drafts with the EAGLE head: on
the embedded target it accepts far more than the 1-layer draft model at about its cost
per cycle (BUILD_NOTES.md, "Drafters experiment").

Models and prompts by reference (`experiments/references.py`): `target` (or its older
name `models`: "default", "random", "random:SPEC", a Hugging Face or specjax model
directory), `draft` (the "model" drafter's draft model; "default": the embedded pair's, or
a random 1-layer model for another target; the EAGLE head exists for the embedded target
only) and `prompts` ("code", "prose" or a JSONL prompt file; its question ids and
categories go into the rows). The same `prompt_count` prompts (8 by default, at least
`batch`; `prompts` = an int is the older spelling of that count of "code"), in consecutive batches of `batch` rows (so batch 1 decodes them one at a time and
batch 8 all together: one workload, not a single prompt's luck), are decoded with plain
`generate` and with speculative decoding, alternately, `repeats` times (`measure.compare`, decode
phase only: each call is also timed with max_new_tokens = 1 and the prefill subtracted);
medians (or, with statistic="fastest", the fastest calls: load on a shared machine only
slows a call down) give tokens/s of both and their ratio, the measured speedup.

The prediction beside it (`specjax.calibration`, docs/cost_model.md, "Calibrated loop
costs"): the compiled loops are timed once per (batch, temperature) on a few shapes (chains
of `calibration_k` and k, and the tree), decoding the same prompts in the same batches as
the point (`calibrate(..., batch=)`), cached on disk and re-validated on the day (a probe
of the widest shape's cycle in plain steps off by more than `revalidate`, 15%, measures it
again), giving the cycle
of this point's shape in plain target steps; the tokens one loop iteration emits come from
the measured acceptance:

    each row's measured reach by draft depth, P(n ≥ d) = depth_accepted ÷ cycles
    (`calibration.row_length_probs`; chains and trees alike);

    τ_loop = the tokens per row per iteration of a batch that runs until its slowest row
             has emitted its budget (`calibration.tokens_per_iteration`; ≈ E[τ] at batch 1),
             harmonic mean over the consecutive batches of the workload
             (`calibration.tokens_per_iteration_in_batches`)
    predicted speedup = τ_loop ÷ cycle_steps(shape),  efficiency = measured ÷ predicted.

Beside it for chains, `predicted_speedup_iid`: the same with the i.i.d. model, each row's
geometric law P(n) = αⁿ(1 − α) (n < k), α^k (n = k) at its per-trial acceptance (what
E[τ] = (1 − α^(k+1)) / (1 − α) assumes). The EAGLE head's acceptance differs by draft
position, so that law has the wrong shape (BUILD_NOTES.md has the figures).

`target_dtype` serves the target's weights in float32 (as trained) or bfloat16 (products
with float32 accumulation, `transformer.with_dtype`); plain and speculative decoding always
run the same weights. The main job serves float32, as `specjax.load` does by default: on
XLA:CPU the faster dtype for this target (the few-row kernels, docs/xla_notes.md trap 13:
plain decoding 1.7-1.8x bf16's, speculative 1.6x), so one meaning of speed whatever the
entry; bf16's slower plain step gives a larger speedup over it (BUILD_NOTES.md,
"Quickstart", has both).

Temperature is a runtime value: T = 0 and T = 1 share every compiled loop. Each point
prints a verdict line; the report adds measured vs predicted speedup, acceptance by draft
position, the accepted run lengths against αⁿ(1 − α), and a sample decoded plain and
speculatively side by side (identical at T = 0).
"""

from __future__ import annotations


import numpy as np

from specjax.experiments import measure, references
from specjax.calibration import loop_costs as calibration
from specjax.analysis import theory
from specjax.verify import trees
from specjax.drafters.model import ModelDrafter
from specjax.engine import decoding
from specjax.models import cache as kv
from specjax.sweeps import report as rep

MODES = ("chain", "tree")
# "eagle": the EAGLE head of the target (the default target's ships with the package,
# like the pair); "model": the separate draft model distilled from the target.
DRAFTERS = ("eagle", "model")
DRAFTER_NAMES = {"eagle": "EAGLE head", "model": "draft model"}
SAMPLE_CHARS = 240


def validate(params: dict) -> None:
  measure.check_choice(params, "mode", None, MODES)
  measure.check_choice(params, "drafter", "model", DRAFTERS)
  for name, lo in (("batch", 1), ("k", 1), ("max_new_tokens", 2), ("repeats", 1),
                   ("prompt_len", 8), ("calibration_repeats", 1), ("head_steps", 1)):
    measure.check_int(params, name, lo, lo)
  references.check_prompts(params)
  references.check_target(params)
  references.check_draft(params)
  if params.get("drafter", "model") == "eagle":
    references.check_embedded_only(params, "the quickstart's EAGLE head (drafter='eagle')",
                                   instead="use drafter='model' with draft=DIR, or "
                                   "`specjax bench --draft eagle:DIR` with a head trained "
                                   "for it")
  measure.check_choice(params, "target_dtype", "float32", ("float32", "bfloat16"))
  measure.check_number(params, "temperature", 0.0, 0)
  measure.check_choice(params, "recalibrate", False, (False, True))
  measure.check_choice(params, "statistic", "median", ("median", "fastest"))
  ks = params.get("calibration_k", (1, 2))
  if isinstance(ks, (str, bytes)) or not isinstance(ks, (list, tuple)) or not all(
      isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in ks):
    raise ValueError(f"calibration_k must be a list of chain lengths (ints >= 1), got {ks!r}")
  widths = params.get("tree_widths", (2, 1, 1, 1))
  if isinstance(widths, (str, bytes)) or not isinstance(widths, (list, tuple)) or not all(
      isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in widths) or not widths:
    raise ValueError(f"tree_widths must be a non-empty list of ints >= 1, got {widths!r}")


def _tree(mode: str, k: int, tree_widths):
  return trees.chain(k) if mode == "chain" else trees.branching(tuple(tree_widths))


def _shapes(k: int, tree_widths, calibration_k) -> list:
  """The calibrated shapes: chains of calibration_k and k, and the tree (the same for both
  modes, so the two modes of a (batch, temperature) share one calibration)."""
  ks = sorted(set(calibration_k) | {k})
  return [trees.chain(j) for j in ks] + [trees.branching(tuple(tree_widths))]


def memory(params: dict) -> int:
  """KV bytes of one point (the target's cache in the plain and speculative runs, the
  drafter's own: the draft model's or the EAGLE head's layer), from the models' preset
  configs: no model is loaded. Calibration runs one loop at a time at the same cache
  length."""
  k, widths = params.get("k", 4), params.get("tree_widths", (2, 1, 1, 1))
  slots = max(t.n_nodes for t in _shapes(k, widths, params.get("calibration_k", (1, 2))))
  n = decoding.cache_len_for(params.get("prompt_len", 64), params.get("max_new_tokens", 64),
                             slots + 1)
  which = references.target_ref(params.get("target"), params.get("models"))
  batch = params.get("batch", 1)
  target_cfg, draft_cfg = measure.model_configs(which, params.get("draft", "default"))
  own = measure.eagle_config(which) if params.get("drafter") == "eagle" else draft_cfg
  return 2 * kv.cache_bytes(target_cfg, batch, n) + kv.cache_bytes(own, batch, n)


def _label(mode: str, k: int, tree_widths, drafter: str = "model") -> str:
  """"chain k=4" (the draft model) or "EAGLE head chain k=4"."""
  shape = f"chain k={k}" if mode == "chain" else f"tree {tuple(tree_widths)}"
  return shape if drafter == "model" else f"{DRAFTER_NAMES[drafter]} {shape}"


def verdict(label: str, batch: int, temperature: float, speedup: float,
            predicted: float, efficiency: float, speedup_e2e: float | None = None,
            loop_fraction: float | None = None, loops: str | None = None) -> str:
  """"chain k=4, batch 1, T=0: 2.10× measured (decode phase; 1.90× end to end), 2.00×
  predicted, efficiency 1.05; loops 3% of tokens, 0/8 outputs end in one"."""
  e2e = "" if speedup_e2e is None else f" (decode phase; {speedup_e2e:.2f}× end to end)"
  loop = ("" if loop_fraction is None else
          f"; loops {100 * loop_fraction:.0f}% of tokens" + (f", {loops} outputs end in one"
                                                             if loops else ""))
  return (f"{label}, batch {batch}, T={temperature:g}: {speedup:.2f}× measured{e2e}, "
          f"{predicted:.2f}× predicted, efficiency {efficiency:.2f}{loop}")


def point(mode: str, batch: int = 1, k: int = 4, tree_widths: tuple = (2, 1, 1, 1),
          max_new_tokens: int = 64, prompt_len: int = 64, temperature: float = 0.0,
          repeats: int = 3, models: str | None = None, seed: int = 0,
          calibration_k: tuple = (1, 2), calibration_repeats: int = 3,
          recalibrate: bool = False, statistic: str = "median",
          target_dtype: str = "float32", prompts="code", drafter: str = "model",
          head_steps: int = 8, revalidate: float | None = calibration.REVALIDATE, target: str | None = None,
          draft: str = "default", prompt_count: int = 8,
          chat_template: bool = True) -> dict:
  models = references.target_ref(target, models)
  target, tok, texts = measure.target_model(models, target_dtype)
  # The draft model is loaded (and trained, on its first use) only when it drafts.
  draft = measure.models(models, target_dtype, draft)[1] if drafter == "model" else None
  tree = _tree(mode, k, tree_widths)
  work = references.batched_workload(models, tok, texts, prompts, prompt_count, batch,
                                     prompt_len, chat_template=chat_template)
  all_ids = work.ids
  shapes = _shapes(k, tree_widths, calibration_k)
  # Chains draft sampled candidates. Trees draft distinct top-k ones at T = 0 (the
  # point-mass rule: i.i.d. siblings would all be the argmax and the tree would degenerate
  # into its chain) and i.i.d. samples of q at T > 0, where the point-mass rule would accept
  # a candidate only with its target probability. The calibration drafts the same way, so
  # its loops are these loops.
  topk = temperature == 0

  def drafter_for(model, shape):
    deterministic = topk and not shape.is_chain
    if drafter == "eagle":
      return measure.eagle_drafter(target, models, deterministic, head_steps)
    return ModelDrafter.of(model, deterministic=deterministic)

  cmp = measure.calibrated_compare(
      target, draft, all_ids, shapes, tree=tree, batch=batch, max_new_tokens=max_new_tokens,
      repeats=repeats, calibration_repeats=calibration_repeats, temperature=temperature,
      seed=seed, recalibrate=recalibrate, statistic=statistic, revalidate=revalidate,
      drafter_for=drafter_for)
  summary = cmp.spec.summary()
  if mode == "chain":
    alpha = summary.alpha_trial
    tau_pred = float(theory.expected_tokens(alpha, k))
  else:
    alpha = summary.alpha
    tau_pred = summary.tau
  # Each row's own law: a batch loops until its slowest row is done, and rows differ.
  tau_loop = calibration.run_tokens_per_iteration(cmp.spec.stats, tree, batch,
                                                  max_new_tokens - 1)
  tau_iid = (calibration.run_tokens_per_iteration(cmp.spec.stats, tree, batch,
                                                  max_new_tokens - 1, iid=True)
             if mode == "chain" else None)
  row = measure.speculative_row(
      cmp, tau_loop, temperature,
      cycle_name=lambda key, n, d: key if key.startswith("chain") else f"tree N={n} D={d}",
      tau_loop_iid=tau_iid, target=target, prompt_ids=all_ids)
  label = _label(mode, k, tree_widths, drafter)
  line = verdict(label, batch, temperature, cmp.speedup, row["predicted_speedup"],
                 row["efficiency"], row["speedup_e2e"], row["loop_fraction"],
                 f"{row['rows_ending_in_loop']}/{row['rows']}")
  if "divergences" in row:
    worst = max((d["ulps"] or 0) for d in row["divergences"])
    line += (f"; {len(row['divergences'])} output(s) differ from plain "
             + (f"only at numerical ties (<= {worst:.1f} ulps of {target.config.dtype})"
                if row["only_ties"] else f"BEYOND numerical ties ({worst:.1f} ulps)"))
  measure.say(line)
  decode = (lambda ids: tok.decode(ids)[:SAMPLE_CHARS]) if tok is not None else str
  return {
      "verdict": line, "label": label, "drafter": drafter, **row, "prompts": len(all_ids),
      **work.row_fields(),
      "alpha_by_prompt": _alpha_by_row(cmp.spec.stats),
      "tau_predicted": tau_pred,
      "alpha_used_for_prediction": alpha,
      "sample": {"prompt": decode(all_ids[0][-80:]),
                 "plain": decode(cmp.plain.tokens[0]),
                 "speculative": decode(cmp.spec.tokens[0])},
  }


def _alpha_by_row(stats) -> list:
  """Each prompt's acceptance per draft tried (None where it ran no cycle)."""
  tried = np.asarray(stats["depth_tried"]).sum(axis=1)
  accepted = np.asarray(stats["depth_accepted"]).sum(axis=1)
  return [float(a / t) if t else None for a, t in zip(accepted, tried)]


# ----------------------------------------------------------------------------- report


def _tag(r: dict) -> str:
  p = r["params"]
  who = "EAGLE " if p.get("drafter", "model") == "eagle" else ""
  return f"{who}{p['mode']} b{p['batch']} T{p.get('temperature', 0.0):g}"


def _plot_speedups(records, run_dir, rep) -> str:
  fig, ax = rep.new_figure(figsize=(5, 4))
  hi = 1.0
  for r in records:
    m = r["metrics"]
    ax.plot(m["predicted_speedup"], m["speedup"],
            "o" if r["params"]["mode"] == "chain" else "s",
            color="C0" if r["params"].get("temperature", 0.0) == 0 else "C1")
    ax.annotate(_tag(r), (m["predicted_speedup"], m["speedup"]), fontsize=7,
                xytext=(3, 3), textcoords="offset points")
    hi = max(hi, m["predicted_speedup"], m["speedup"])
  ax.plot([0, 1.1 * hi], [0, 1.1 * hi], color="gray", lw=0.8, label="measured = predicted")
  ax.axhline(1.0, color="gray", lw=0.5, ls=":")
  ax.set_xlabel("predicted speedup (calibrated loop costs)")
  ax.set_ylabel("measured speedup")
  ax.set_title("o chain, s tree; blue T=0, orange T=1", fontsize=8)
  ax.legend(fontsize=7)
  return rep.save(fig, run_dir / "quickstart_speedup.png")


def _plot_acceptance(records, run_dir, rep) -> str:
  fig, ax = rep.new_figure(figsize=(5.5, 3.5))
  for r in records:
    m = r["metrics"]
    tried = np.asarray(m["depth_tried"], float)
    acc = np.where(tried > 0, np.asarray(m["depth_accepted"], float) / np.maximum(tried, 1),
                   np.nan)
    ax.plot(np.arange(1, acc.size + 1), acc, "o-" if r["params"]["mode"] == "chain" else "s--",
            label=_tag(r))
  ax.set_xlabel("draft position (depth)")
  ax.set_ylabel("P(accepted | reached)")
  ax.set_ylim(0, 1.02)
  ax.legend(fontsize=6, ncol=2)
  return rep.save(fig, run_dir / "quickstart_acceptance.png")


def _plot_run_lengths(records, run_dir, rep) -> str | None:
  chains = [r for r in records if r["params"]["mode"] == "chain"]
  if not chains:
    return None
  fig, axes = rep.new_figure(ncols=len(chains), figsize=(2.6 * len(chains), 2.8), squeeze=False)
  for ax, r in zip(axes[0], chains):
    m = r["metrics"]
    hist = np.asarray(m["run_lengths"], float)
    n = np.arange(hist.size)
    law = calibration.chain_length_probs(m["alpha_trial"], hist.size - 1)
    ax.bar(n, hist / max(hist.sum(), 1), color="C0", alpha=0.7, label="measured")
    ax.plot(n, law, "k.-", label="αⁿ(1−α)")
    ax.set_title(f"{_tag(r)}, α={m['alpha_trial']:.2f}", fontsize=8)
    ax.set_xlabel("accepted run length n")
  axes[0][0].set_ylabel("fraction of cycles")
  axes[0][0].legend(fontsize=6)
  return rep.save(fig, run_dir / "quickstart_run_lengths.png")


def _sample_table(r: dict) -> list[str]:
  s = r["metrics"]["sample"]

  def cell(text: str) -> str:
    return "<pre>" + (text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
                      .replace("|", "&#124;").replace("\n", "<br>")) + "</pre>"

  same = "identical" if s["plain"] == s["speculative"] else "different (sampled)"
  return [f"**{r['metrics']['verdict']}** — outputs {same}", "",
          f"Prompt (its end): {cell(s['prompt'])}", "",
          "| plain | speculative |", "|---|---|",
          f"| {cell(s['plain'])} | {cell(s['speculative'])} |", ""]


def _cache_note(cal: dict) -> str:
  """', cached (probe 1.03)' / ', recalibrated (probe 1.18)' / '' for a fresh calibration."""
  check = cal.get("revalidated")
  if cal.get("cached"):
    return ", cached" + (f" (probe {check['ratio']:.2f})" if check else "")
  return f", recalibrated (probe {check['ratio']:.2f})" if check else ""


def report(records: list[dict], run_dir) -> str:
  records = sorted(records, key=lambda r: r.get("index", 0))
  lines = ["## Quickstart", "",
           "Speedup = speculative ÷ plain tokens/s of the decode phase, measured side by side "
           "(end to end, prefill included, in brackets and the `speedup_e2e` column); loops = "
           "the share of emitted tokens continuing an n-gram cycle of period <= 8 repeated >= 3 "
           "times, and how many plain outputs end in one (such text any drafter predicts); "
           "predicted = tokens per loop iteration (from the measured acceptance) ÷ the "
           "calibrated cycle cost in plain target steps (docs/cost_model.md, \"Calibrated "
           "loop costs\"); efficiency = measured ÷ predicted.", ""]
  lines += [f"- {r['metrics']['verdict']}" for r in records] + [""]
  counts = sorted({r["metrics"].get("prompts", r["params"]["batch"]) for r in records})
  lines += [f"Every point decodes the same {'/'.join(map(str, counts))} held-out code prompts "
            "in consecutive batches of its batch size (batch 1: one prompt at a time). "
            "Acceptance by prompt (per draft tried):", ""]
  for r in records:
    alphas = r["metrics"].get("alpha_by_prompt") or []
    lines.append(f"- {_tag(r)}: " + " ".join("-" if a is None else f"{a:.2f}"
                                              for a in alphas))
  lines.append("")
  lines += [f"![measured vs predicted speedup]({_plot_speedups(records, run_dir, rep)})",
            f"![acceptance by draft position]({_plot_acceptance(records, run_dir, rep)})"]
  runs = _plot_run_lengths(records, run_dir, rep)
  if runs:
    lines.append(f"![accepted run lengths]({runs})")
  lines += ["", "### Calibrated cycle costs (plain target steps)", ""]
  seen = set()
  for r in records:
    cal = r["metrics"].get("calibration", {})
    key = (r["params"]["batch"], r["params"].get("temperature", 0.0),
           r["params"].get("drafter", "model"))
    if key in seen or not cal:
      continue
    seen.add(key)
    shapes = ", ".join(f"{s} {v:.2f}" for s, v in cal["cycle_steps"].items())
    fit = cal.get("fit_steps")
    fit_text = "" if fit is None else (
        f"; fit {fit['t_fixed']:.2f} + {fit['t_verify']:.2f}·(N+1) + {fit['t_draft']:.2f}·D "
        f"(rms {100 * fit['rel_rms']:.1f}%)")
    lines.append(f"- {DRAFTER_NAMES[key[2]]}, batch {key[0]}, T={key[1]:g} "
                 f"(t_step {r['metrics']['t_step_ms']:.3f} ms"
                 f"{_cache_note(cal)}): {shapes}{fit_text}")
  lines += ["", "### Sample: plain vs speculative", ""]
  smallest = min(r["params"]["batch"] for r in records)
  picked = [r for r in records if r["params"]["batch"] == smallest]
  chains = [r for r in picked if r["params"]["mode"] == "chain"]
  for r in (chains or picked)[:2]:
    lines += _sample_table(r)
  return "\n".join(lines)
