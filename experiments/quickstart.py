"""The quickstart: plain vs chain vs tree speculative decoding on the embedded models.

Each point is one (mode, batch): the same prompts (held-out code from the embedded corpus)
are decoded with plain `generate` and with speculative decoding, alternately, `repeats`
times; medians give tokens/s of both and their ratio (the speedup, measured side by side).
The analytic prediction beside it uses what the point measured itself:

    predicted speedup = τ_pred / (D·c + v(N+1))      τ_pred = E[τ](α_trial, k) for chains,
                                                     the measured τ for trees,

with D draft passes per cycle (k for a chain, one per level for a tree), N drafted nodes,
c = the draft's cost per pass in target decode steps, measured as (d(2) + (D − 1)·d(W)) ÷
(D·t_1) — the first pass feeds 2 tokens (the catch-up rule), later passes W (1 for a chain,
the widest level for a tree) — and v(T) = target forward of T tokens ÷ one-token decode t_1,
all timed in the same process. Efficiency = measured ÷ predicted speedup.
"""

from __future__ import annotations

import statistics

import jax

from experiments import measure
from specjax import decoding, sampling, theory
from specjax.drafters.base import LM
from specjax.drafters.model import ModelDrafter

MODES = ("chain", "tree")


def validate(params: dict) -> None:
  if params.get("mode") not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {params.get('mode')!r}")
  for name, lo in (("batch", 1), ("k", 1), ("max_new_tokens", 1), ("repeats", 1),
                   ("prompt_len", 8)):
    v = params.get(name, lo)
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
      raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
  if params.get("models", "default") not in ("default", "random"):
    raise ValueError(f"models must be 'default' or 'random', got {params.get('models')!r}")
  t = params.get("temperature", 0.0)
  if not isinstance(t, (int, float)) or t < 0:
    raise ValueError(f"temperature must be a number >= 0, got {t!r}")


def memory(params: dict) -> int:
  """KV bytes of one point (target + draft caches of plain and speculative runs and of the
  forward timings), from the embedded pair's preset configs: no model is loaded."""
  from specjax.models import cache as kv
  from specjax.training.presets import PRESETS
  pair = PRESETS["tiny"]
  b = params.get("batch", 1)
  n = 2 * (params.get("prompt_len", 64) + params.get("max_new_tokens", 64)
           + max(params.get("k", 4), 16) + 1)
  return 3 * (kv.cache_bytes(pair.target, b, n) + kv.cache_bytes(pair.draft, b, n))


def point(mode: str, batch: int = 1, k: int = 4, tree_widths: tuple = (2, 1, 1, 1),
          max_new_tokens: int = 64, prompt_len: int = 64, temperature: float = 0.0,
          repeats: int = 3, models: str = "default", seed: int = 0) -> dict:
  target, draft, tok, texts = measure.models(models)
  prompts = measure.prompts(tok, texts, batch, prompt_len)
  sampler = sampling.make_sampler(temperature)
  spec_kwargs = {"k": k}
  n_drafted = k
  if mode == "tree":
    from specjax import trees
    tree = trees.branching(tuple(tree_widths))
    spec_kwargs = {"tree": tree}
    n_drafted = tree.size
  common = dict(max_new_tokens=max_new_tokens, sampler=sampler, seed=seed)

  def plain():
    return decoding.generate(target, prompts, **common)

  # Trees draft distinct top-k candidates (the point-mass rule): i.i.d. sampled siblings
  # would all be the argmax at T = 0 and the tree would degenerate into its chain.
  drafter = ModelDrafter.of(draft, deterministic=(mode == "tree"))

  def spec():
    return decoding.speculative_generate(target, drafter, prompts, **spec_kwargs, **common)

  plain(), spec()  # compile both
  plain_runs, spec_runs = [], []
  for _ in range(repeats):  # alternate: drift hits both alike
    plain_runs.append(plain())
    spec_runs.append(spec())
  plain_s = statistics.median(r.seconds for r in plain_runs)
  spec_s = statistics.median(r.seconds for r in spec_runs)
  plain_tok_s = plain_runs[0].emitted / plain_s
  spec_tok_s = spec_runs[0].emitted / spec_s
  summary = spec_runs[0].summary()

  # Costs measured in this process: verification and draft step against one decode step.
  lm_t, lm_d = LM.of(target), LM.of(draft)
  cache_len = 2 * (prompt_len + max_new_tokens + n_drafted + 1)
  context = prompt_len + max_new_tokens // 2
  # Draft passes per cycle: k for a chain, one per tree level (a level's nodes share a pass).
  draft_steps = k if mode == "chain" else len(tree_widths)
  width = 1 if mode == "chain" else int(max(tree.level_sizes[1:draft_steps], default=1))
  costs = measure.step_costs(lm_t, lm_d, batch, n_drafted + 1, draft_steps, width, context,
                             cache_len, repeats)
  c, v = costs["c"], costs["v"]
  if mode == "chain":
    alpha = summary.alpha_trial
    tau_pred = float(theory.expected_tokens(alpha, k))
  else:
    alpha = summary.alpha
    tau_pred = summary.tau
  predicted = tau_pred / (draft_steps * c + v)
  measured = spec_tok_s / plain_tok_s
  return {
      "plain_tok_s": plain_tok_s, "spec_tok_s": spec_tok_s, "speedup": measured,
      "alpha": summary.alpha, "alpha_trial": summary.alpha_trial,
      "alpha_ci": list(summary.alpha_ci), "tau": summary.tau, "tau_predicted": tau_pred,
      "c": c, "verify_cost": v, "predicted_speedup": predicted,
      "efficiency": measured / predicted if predicted > 0 else float("nan"),
      "identical_to_plain": (plain_runs[0].tokens == spec_runs[0].tokens
                             if temperature == 0 else None),
      "drafted_per_cycle": n_drafted, "alpha_used_for_prediction": alpha,
      "backend": jax.default_backend(),
  }


def report(records: list[dict], run_dir) -> str:
  from specjax import report as rep
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
