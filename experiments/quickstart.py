"""The quickstart: plain vs chain vs tree speculative decoding on the embedded models.

Each point is one (mode, batch): the same prompts (held-out code from the embedded corpus)
are decoded with plain `generate` and with speculative decoding, alternately, `repeats`
times (`measure.compare`); medians give tokens/s of both and their ratio (the speedup,
measured side by side). The analytic prediction beside it uses what the point measured
itself:

    predicted speedup = τ_pred / (D·c + v)      τ_pred = E[τ](α_trial, k) for chains,
                                                the measured τ for trees,

with D draft passes per cycle (k for a chain, one per level for a tree), N drafted nodes,
c = the draft's cost per pass in target decode steps, measured as (d(2) + (D − 1)·d(W)) ÷
(D·t_1) — the first pass feeds 2 tokens (the catch-up rule), later passes W (1 for a chain,
the widest level for a tree) — and v = target forward of N + 1 tokens ÷ one-token decode
t_1, all timed in the same process at one cache length (`decoding.cache_len_for`).
Efficiency = measured ÷ predicted speedup.
"""

from __future__ import annotations

import jax

from experiments import measure
from specjax import theory, trees

MODES = ("chain", "tree")


def validate(params: dict) -> None:
  measure.check_choice(params, "mode", None, MODES)
  for name, lo in (("batch", 1), ("k", 1), ("max_new_tokens", 1), ("repeats", 1),
                   ("prompt_len", 8)):
    measure.check_int(params, name, lo, lo)
  measure.check_choice(params, "models", "default", measure.MODELS)
  measure.check_number(params, "temperature", 0.0, 0)


def _tree(mode: str, k: int, tree_widths):
  return trees.chain(k) if mode == "chain" else trees.branching(tuple(tree_widths))


def memory(params: dict) -> int:
  """KV bytes of one point (target + draft caches of plain and speculative runs and of the
  forward timings), from the models' preset configs: no model is loaded."""
  from specjax import decoding
  tree = _tree(params.get("mode", "chain"), params.get("k", 4),
               params.get("tree_widths", (2, 1, 1, 1)))
  n = decoding.cache_len_for(params.get("prompt_len", 64), params.get("max_new_tokens", 64),
                             tree.n_nodes)
  return 3 * sum(measure.cache_bytes(params.get("models", "default"), params.get("batch", 1),
                                     n))


def point(mode: str, batch: int = 1, k: int = 4, tree_widths: tuple = (2, 1, 1, 1),
          max_new_tokens: int = 64, prompt_len: int = 64, temperature: float = 0.0,
          repeats: int = 3, models: str = "default", seed: int = 0) -> dict:
  target, draft, tok, texts = measure.models(models)
  tree = _tree(mode, k, tree_widths)
  # Trees draft distinct top-k candidates (the point-mass rule): i.i.d. sampled siblings
  # would all be the argmax at T = 0 and the tree would degenerate into its chain.
  cmp = measure.compare(target, draft, measure.prompts(tok, texts, batch, prompt_len),
                        tree=tree, max_new_tokens=max_new_tokens, repeats=repeats,
                        temperature=temperature, seed=seed, deterministic=(mode == "tree"))
  summary = cmp.spec.summary()
  if mode == "chain":
    alpha = summary.alpha_trial
    tau_pred = float(theory.expected_tokens(alpha, k))
  else:
    alpha = summary.alpha
    tau_pred = summary.tau
  predicted = cmp.predicted(tau_pred)
  return {
      "plain_tok_s": cmp.plain_tok_s, "spec_tok_s": cmp.spec_tok_s, "speedup": cmp.speedup,
      "alpha": summary.alpha, "alpha_trial": summary.alpha_trial,
      "alpha_ci": list(summary.alpha_ci), "tau": summary.tau, "tau_predicted": tau_pred,
      "c": cmp.costs.c, "verify_cost": cmp.costs.v, "predicted_speedup": predicted,
      "efficiency": cmp.efficiency(predicted),
      "identical_to_plain": cmp.identical if temperature == 0 else None,
      "drafted_per_cycle": tree.size, "alpha_used_for_prediction": alpha,
      "backend": jax.default_backend(),
  }


def report(records: list[dict], run_dir) -> str:
  from specjax.sweeps import report as rep
  fig, ax = rep.new_figure(figsize=(5.5, 3.5))
  for mode in MODES:
    rows = sorted((r for r in records if r["params"]["mode"] == mode),
                  key=lambda r: r["params"]["batch"])
    if not rows:
      continue
    b = [r["params"]["batch"] for r in rows]
    line, = ax.plot(b, [r["metrics"]["speedup"] for r in rows], "o-", label=f"{mode} measured")
    ax.plot(b, [r["metrics"]["predicted_speedup"] for r in rows], "x--", color=line.get_color(),
            label=f"{mode} predicted")
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("batch")
  ax.set_ylabel("speedup vs plain")
  ax.legend(fontsize=8)
  name = rep.save(fig, run_dir / "quickstart_speedup.png")
  lines = ["## Quickstart", "",
           "Speedup = speculative ÷ plain tokens/s, measured side by side; predicted from the "
           "measured α, c and verification cost (see experiments/quickstart.py).", "",
           f"![speedup vs batch]({name})", ""]
  return "\n".join(lines)
