"""α × k: the controlled-α drafter on a real target, measured against E[τ] and the formula.

`target` (or its older name `models`), `draft` (also a preset name: a random draft of that
size; or "eagle": a random EAGLE-shaped head on the target, `EagleDrafter.of`, whose chain's
cost is the one measured) and `prompts` by reference (experiments/references.py).
`tree`: None (a chain of k drafts) or the widths of a static tree (`trees.branching`, e.g.
(2, 2, 1, 1); k must be its depth): the same α, trees beside chains. Siblings are sampled
i.i.d. from the oracle's law, so each is the accepted one with probability α given that
the ones before it were not (exact at T = 0; at T > 0 a later sibling's is α − p(y), p(y)
the least likely token's probability): the rank law p_r = α(1 − α)^r gives E[τ]
(`theory.tree_expected_tokens`) and the Monte Carlo (`theory.simulate_tree`); z_alpha is a
chain's (None for a tree).

One point = (α, k). The drafter (`specjax.drafters.oracle.OracleDrafter`) proposes from the
target's own law mixed with a point mass so that every draft is accepted with probability
exactly α; the target is the embedded trained tiny model (or a random one for smoke runs).
All α values of one k share static shapes and run as one vectorised program, spread over
the local devices (`specjax.sweeps.parallel.device_map`; α is a runtime leaf, one compile
per k).

Per point:
  alpha_trial   accepted ÷ trials (a chain's drafts up to the first rejection): ≈ α
  tau_cycle     1 + accepted drafts per cycle (the acceptance's own count, before budget
                truncation of the last cycle) against E[τ] = (1 − α^{k+1}) / (1 − α),
                with a z-score, and a Monte Carlo simulation of the same chain alongside
  speedup       τ_cycle · t_step / t_cycle, with the draft's time cost either
                  measured (c = None): a real draft model of the chosen size (`draft`) runs
                  the same k in the compiled loop, calibrated at this batch, budget and cache
                  length (`specjax.calibration`, docs/cost_model.md, "Calibrated loop
                  costs"; cached on disk): t_step = seconds per plain decode step, t_cycle =
                  seconds per cycle of chain(k), both of the decode phase (the prefill
                  differenced out; where that is lost in timing noise even re-measured,
                  of whole calls, calibration_differenced = False), so speedup = τ_cycle ÷
                  cycle_steps;
                  modelled (c = a number): t_cycle = k·c·t_1 + t_verify(k + 1), both target
                  forwards timed standalone here (`measure.step_costs`);
                and the prediction (speedup_formula) with the same costs: with a measured
                draft the calibrated one, E[τ](α, k) ÷ cycle_steps (per cycle, as τ_cycle
                is); with a modelled c, E[τ] / (k·c + v), v = t_verify ÷ t_1. The
                standalone form E[τ] / (k·c + v) at the measured c is kept in both
                (speedup_formula_standalone; None for draft "eagle": a head has no
                standalone forward, and its c is only known through the calibration).

The oracle's own wall time is not a speedup (its drafts run the target) and is not reported.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from specjax.experiments import measure, references
from specjax.calibration import loop_costs as calibration
from specjax.engine import decoding, loop, plan
from specjax.analysis import metrics, theory
from specjax.verify import sampling, trees
from specjax.models.lm import LM
from specjax.drafters.eagle import EagleDrafter
from specjax.drafters.model import ModelDrafter
from specjax.drafters.oracle import OracleDrafter, check_alpha
from specjax.sweeps import parallel, runner
from specjax.models.presets import PRESETS
from specjax.sweeps import report as rep


def validate(params: dict) -> None:
  check_alpha(params.get("alpha"))
  if np.ndim(params.get("alpha")) != 0:
    raise ValueError(f"alpha must be one number per point, got {params.get('alpha')!r}")
  for name, lo in (("k", 1), ("batch", 1), ("max_new_tokens", 2), ("prompt_len", 8),
                   ("repeats", 1), ("mc_cycles", 100)):
    measure.check_int(params, name, lo, lo)
  if params.get("k", 1) > 32:
    raise ValueError(f"k must be <= 32, got {params['k']}")
  _shape(params.get("k", 1), params.get("tree"))
  measure.check_number(params, "temperature", 1.0, 0)
  references.check_target(params)
  references.check_prompts(params)
  measure.check_number(params, "c", None, 0, allow_none=True,
                       note=" (None: measure a real draft)")
  draft = params.get("draft", "default")
  if draft == EAGLE:
    if params.get("c") is not None:
      raise ValueError(f"c must be None with draft='eagle' (the head's cost is measured in "
                       f"the loop), got {params['c']!r}")
  elif draft not in PRESETS or os.path.isdir(str(draft)):
    references.check_draft(params, also=f", a preset name {sorted(PRESETS)} or 'eagle'")


def memory(params: dict) -> int:
  """KV bytes of one point: the target's cache twice (target + oracle) and a real draft's."""
  cache_len = decoding.cache_len_for(params.get("prompt_len", 64),
                                     params.get("max_new_tokens", 64), params.get("k", 4) + 1)
  which = references.target_ref(params.get("target"), params.get("models"))
  draft = params.get("draft", "default")
  # an EAGLE head's cache is one layer of the target's: the default draft's bound holds it
  target, draft = measure.cache_bytes(which, params.get("batch", 1), cache_len,
                                      "default" if draft in PRESETS or draft == EAGLE
                                      else draft)
  return 2 * target + draft


def _shape(k: int, tree) -> trees.TreeSpec:
  """The drafted shape of a point: a chain of k, or the static tree of `tree`'s widths (its
  depth must be k). ValueError naming `tree` otherwise."""
  if tree is None:
    return trees.chain(k)
  if (not isinstance(tree, (tuple, list)) or not tree or
      not all(isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in tree)):
    raise ValueError(f"tree must be None (a chain of k) or a non-empty tuple of widths >= 1, "
                     f"e.g. (2, 2, 1, 1), got {tree!r}")
  if len(tree) != k:
    raise ValueError(f"tree {tuple(tree)!r} is {len(tree)} deep but k is {k}: set k to the "
                     f"tree's depth")
  return trees.branching(tuple(tree))


def _oracle_run(target: LM, prompt_BP, prompt_len_B, budget_B, eos, sampler, alpha, key, *,
                tree: trees.TreeSpec, cache_len: int):
  """One point's loop (vmapped over α and the key): the run `plan.prepare` checked, with the
  oracle's α a runtime value."""
  drafter = OracleDrafter(lm=target, deterministic=False, alpha=alpha)
  s = loop.speculative_loop(target, drafter, prompt_BP, prompt_len_B, budget_B, eos, sampler,
                            key, tree=tree, cache_len=cache_len)
  return s.length, s.stats


@functools.lru_cache(maxsize=None)
def _run_fn(tree: trees.TreeSpec, cache_len: int):
  return functools.partial(_oracle_run, tree=tree, cache_len=cache_len)


@functools.lru_cache(maxsize=32)
def _costs(tree: trees.TreeSpec, batch: int, max_new_tokens: int, prompt_len: int,
           temperature: float, models: str, draft: str, repeats: int, seed: int,
           prompts: str = "code", chat_template: bool = True) -> dict:
  """Costs of one (shape, batch): the calibrated loop costs of a real draft's chain(k) or
  tree (plain step and cycle, decode phase, `calibration.calibrate`), standalone forwards
  (t_1, t_verify of the shape's nodes, the draft's passes) at the mean decoding context,
  and the real draft's α from one run of its loop (already compiled by the calibration)."""
  target, tok, texts = measure.target_model(models)
  # sampled candidates, as the oracle's; a head's weights are random: acceptance comes from
  # the oracle, cost from the head (which has no standalone forward: draft_lm None)
  if draft == EAGLE:
    draft_lm, drafter = None, EagleDrafter.of(target, seed=seed + 1)
  else:
    draft_lm = measure.draft_model(draft, models)
    drafter = ModelDrafter.of(draft_lm, deterministic=False)
  prompt_ids = references.workload(models, tok, texts, prompts, batch, prompt_len,
                                   chat_template=chat_template).ids
  cache_len = calibration.default_cache_len(target, drafter, prompt_ids, [tree],
                                            max_new_tokens)
  costs = calibration.calibrate(target, drafter, prompt_ids, [tree],
                                max_new_tokens=max_new_tokens, repeats=repeats,
                                temperature=temperature, seed=seed, cache_len=cache_len)
  run = decoding.speculative_generate(
      target, drafter, prompt_ids, tree=tree, max_new_tokens=max_new_tokens,
      sampler=sampling.make_sampler(temperature), seed=seed, cache_len=cache_len)
  sc = measure.step_costs(target, draft_lm, batch, tree, prompt_len + max_new_tokens // 2,
                          cache_len, repeats)
  return {"t_step": costs.t_step, "t_cycle_real": costs.cycle_seconds(tree),
          "cycle_steps": costs.cycle_steps(tree),
          "calibration_cached": bool(costs.meta.get("cached")),
          # False: the decode phase was lost in timing noise even re-measured, so the
          # calibration timed whole calls (prefill included; `timing.decode_seconds`)
          "calibration_differenced": bool(costs.meta.get("prefill_differenced", True)),
          "t1": sc.t1, "v": sc.v, "c_measured": sc.c,
          "real_draft_alpha": run.summary().alpha_trial}


def group(params_list: list[dict]) -> list[dict]:
  first = {**_DEFAULTS, **params_list[0]}
  k, batch = first["k"], first["batch"]
  which = references.target_ref(first["target"], first["models"])
  target, tok, texts = measure.target_model(which)
  lm = LM.of(target)
  work = references.workload(which, tok, texts, first["prompts"], batch, first["prompt_len"],
                             chat_template=first["chat_template"])
  prompts = work.ids
  # the host API's checks, once (a RoPE target may run past max_len, as before); the loop
  # itself is vmapped over α, so it is called directly with the checked arguments
  shape = _shape(k, first["tree"])
  run = plan.prepare(lm, OracleDrafter(lm=lm, alpha=jnp.float32(1)), prompts, plan.of(tree=shape),
                     max_new_tokens=first["max_new_tokens"],
                     sampler=sampling.make_sampler(first["temperature"]),
                     allow_beyond_max_len=target.config.positions != "learned")
  prep = run.batch
  alphas = jnp.asarray([float(p["alpha"]) for p in params_list], jnp.float32)
  # each point's keys from its own complete parameters: the same numbers alone or in a group
  complete = [runner.with_defaults(point, p) for p in params_list]
  keys = parallel.point_keys([runner.point_seed(p, "loop") for p in complete])
  length, st = parallel.device_map(
      _run_fn(shape, prep.cache_len), alphas, keys,
      shared=(lm, jnp.asarray(prep.prompt_BP), jnp.asarray(prep.prompt_len_B),
              jnp.asarray(prep.budget_B), run.eos, run.sampler))
  length, st = jax.device_get((length, st))
  costs = _costs(shape, batch, first["max_new_tokens"], first["prompt_len"],
                 float(first["temperature"]), which, first["draft"],
                 first["repeats"], first["seed"], first["prompts"], first["chat_template"])
  out = []
  for i, params in enumerate(params_list):
    out.append(_metrics(float(params["alpha"]), shape, length[i], prep.prompt_len_B,
                        {f: np.asarray(getattr(st, f))[i] for f in ("cycles", "drafted",
                                                                     "accepted", "cycle_log")},
                        costs, first["c"], first["mc_cycles"],
                        runner.point_seed(complete[i], "monte_carlo")))
    out[-1].update(work.row_fields())
  return out


def _metrics(alpha, shape, length_B, prompt_len_B, st, costs, c, mc_cycles, seed) -> dict:
  k = shape.max_depth
  s = metrics.summarize(cycles=st["cycles"], drafted=st["drafted"], accepted=st["accepted"],
                        emitted=np.asarray(length_B) - prompt_len_B,
                        cycle_log=st["cycle_log"], k=k)
  log = st["cycle_log"]
  per_cycle = 1.0 + log[log >= 0].astype(np.float64)
  tau_cycle = float(per_cycle.mean())
  tau_se = float(per_cycle.std(ddof=1) / np.sqrt(per_cycle.size)) if per_cycle.size > 1 else 0.0
  if shape.is_chain:
    expected = float(theory.expected_tokens(alpha, k))
    mc = theory.simulate_chain(alpha, k, cycles=mc_cycles, seed=seed)
  else:  # sibling r is the accepted one with probability α(1 − α)^r (module doc)
    ranks = alpha * (1 - alpha) ** np.arange(shape.max_width)
    expected = shape.expected_tokens(ranks)
    mc = theory.simulate_tree(shape.draft_parents, ranks, samples=mc_cycles, seed=seed)
  modelled = c is not None
  c_used = float(c) if modelled else costs["c_measured"]
  v = costs["v"]
  standalone = None if c_used is None else expected / (k * c_used + v)
  if modelled:
    t_cycle = costs["t1"] * (k * c_used + v)
    formula = standalone
  else:
    t_cycle = costs["t_cycle_real"]
    formula = expected / costs["cycle_steps"]
  trials = s.trials
  z_alpha = ((s.alpha_trial - alpha) / np.sqrt(alpha * (1 - alpha) / trials)
             if 0 < alpha < 1 and trials else 0.0) if shape.is_chain else None
  return {
      "alpha_trial": s.alpha_trial, "alpha_trial_ci": list(s.alpha_trial_ci),
      "z_alpha": None if z_alpha is None else float(z_alpha), "trials": trials,
      "shape": "chain" if shape.is_chain else f"tree {shape.size} nodes, depth {k}",
      "tau": s.tau, "tau_cycle": tau_cycle, "tau_cycle_se": tau_se,
      "tau_expected": expected,
      "z_tau": (tau_cycle - expected) / tau_se if tau_se > 0 else 0.0,
      "tau_mc": mc.tau, "tau_mc_se": mc.tau_se,
      "histogram": list(s.histogram), "cycles": s.cycles,
      "cost": "modelled" if modelled else "measured", "c": c_used, "verify_cost": v,
      "speedup": tau_cycle * costs["t_step"] / t_cycle,
      "speedup_formula": formula,
      "predicted_from": "modelled" if modelled else "calibrated",
      "cycle_steps": None if modelled else costs["cycle_steps"],
      "calibration_cached": None if modelled else costs["calibration_cached"],
      "calibration_differenced": None if modelled else costs["calibration_differenced"],
      "speedup_formula_standalone": standalone,
      "speedup_formula_mc": mc.tau * formula / expected,
      "t_step_ms": 1e3 * costs["t_step"], "t_cycle_ms": 1e3 * t_cycle,
      "real_draft_alpha": costs["real_draft_alpha"] if not modelled else None,
      "backend": jax.default_backend(), "devices": jax.local_device_count(),
  }


EAGLE = "eagle"  # the `draft` that times a random EAGLE-shaped head on the target
_DEFAULTS = dict(batch=1, max_new_tokens=96, prompt_len=32, temperature=1.0, c=None,
                 draft="default", models=None, repeats=3, mc_cycles=20_000, seed=0,
                 target=None, prompts="code", chat_template=True, tree=None)


def point(alpha: float, k: int, batch: int = 1, max_new_tokens: int = 96, prompt_len: int = 32,
          temperature: float = 1.0, c: float | None = None, draft: str = "default",
          models: str | None = None, repeats: int = 3, mc_cycles: int = 20_000,
          seed: int = 0, target: str | None = None, prompts: str = "code",
          chat_template: bool = True, tree: tuple | None = None) -> dict:
  return group([dict(alpha=alpha, k=k, batch=batch, max_new_tokens=max_new_tokens,
                     prompt_len=prompt_len, temperature=temperature, c=c, draft=draft,
                     models=models, repeats=repeats, mc_cycles=mc_cycles, seed=seed,
                     target=target, prompts=prompts, chat_template=chat_template,
                     tree=tree)])[0]


# ----------------------------------------------------------------------------- report


def _by_alpha(records):
  out: dict[float, list] = {}
  for r in records:
    out.setdefault(float(r["params"]["alpha"]), []).append(r)
  return {a: sorted(rs, key=lambda r: r["params"]["k"]) for a, rs in sorted(out.items())}


def _speedup_plot(groups, run_dir) -> str:
  """Speedup vs k per α: measured points, formula at the measured costs (lines)."""
  fig, ax = rep.new_figure(figsize=(6, 3.8))
  for a, rs in groups.items():
    ks = [r["params"]["k"] for r in rs]
    line, = ax.plot(ks, [r["metrics"]["speedup"] for r in rs], "o", label=f"α={a:g} measured")
    ax.plot(ks, [r["metrics"]["speedup_formula"] for r in rs], "-", color=line.get_color(),
            label=f"α={a:g} predicted")
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.set_xlabel("k (drafts per cycle)")
  ax.set_ylabel("speedup vs plain")
  ax.legend(fontsize=7, ncol=2)
  return rep.save(fig, run_dir / "alpha_k_speedup.png")


def _tau_plot(groups, ks_all, run_dir) -> str:
  """τ vs k: measured (per-cycle count, ± 2 se), E[τ] curve, Monte Carlo."""
  fig, ax = rep.new_figure(figsize=(6, 3.8))
  kk = np.arange(1, max(ks_all) + 1)
  for a, rs in groups.items():
    ks = [r["params"]["k"] for r in rs]
    line, = ax.plot(kk, theory.expected_tokens(a, kk) * np.ones_like(kk, float), "-",
                    label=f"α={a:g} E[τ]")
    ax.errorbar(ks, [r["metrics"]["tau_cycle"] for r in rs],
                yerr=[2 * r["metrics"]["tau_cycle_se"] for r in rs], fmt="o",
                color=line.get_color(), label=f"α={a:g} measured")
    ax.plot(ks, [r["metrics"]["tau_mc"] for r in rs], "x", color=line.get_color())
  ax.set_xlabel("k")
  ax.set_ylabel("τ (tokens per cycle)")
  ax.set_title("measured (o, ±2 se), E[τ] (line), Monte Carlo (x)", fontsize=9)
  ax.legend(fontsize=7, ncol=2)
  return rep.save(fig, run_dir / "alpha_k_tau.png")


def _heatmap(groups, ks_all, run_dir) -> str:
  """The α × k heatmap of the measured speedup."""
  alphas = list(groups)
  grid = np.full((len(alphas), len(ks_all)), np.nan)
  for i, a in enumerate(alphas):
    for r in groups[a]:
      grid[i, ks_all.index(r["params"]["k"])] = r["metrics"]["speedup"]
  fig, ax = rep.new_figure(figsize=(1.2 + 0.8 * len(ks_all), 1.2 + 0.5 * len(alphas)))
  im = ax.imshow(grid, cmap="RdYlGn", origin="lower", aspect="auto",
                 vmin=min(np.nanmin(grid), 0.9), vmax=max(np.nanmax(grid), 1.1))
  for i in range(len(alphas)):
    for j in range(len(ks_all)):
      if np.isfinite(grid[i, j]):
        ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7)
  ax.set_xticks(range(len(ks_all)), [str(k) for k in ks_all])
  ax.set_yticks(range(len(alphas)), [f"{a:g}" for a in alphas])
  ax.set_xlabel("k")
  ax.set_ylabel("α")
  fig.colorbar(im, ax=ax, label="speedup")
  return rep.save(fig, run_dir / "alpha_k_heatmap.png")


def _run_length_plot(groups, ks_all, run_dir) -> str:
  """Accepted run-length histogram at the largest k: measured vs geometric theory."""
  kmax = max(ks_all)
  top = [(a, r) for a, rs in groups.items() for r in rs if r["params"]["k"] == kmax]
  fig, ax = rep.new_figure(figsize=(6, 3.5))
  width = 0.8 / max(len(top), 1)
  n = np.arange(kmax + 1)
  for j, (a, r) in enumerate(top):
    h = np.asarray(r["metrics"]["histogram"], float)
    freq = h / max(h.sum(), 1)
    ax.bar(n + j * width - 0.4 + width / 2, freq, width, label=f"α={a:g}")
    if r["params"].get("tree") is None:  # a chain's geometric law (a tree's differs)
      theo = np.where(n < kmax, a ** n * (1 - a), a ** kmax)
      ax.plot(n + j * width - 0.4 + width / 2, theo, "k_", ms=8)
  ax.set_xlabel(f"accepted drafts per cycle (k = {kmax}); black: αⁿ(1 − α), α^k")
  ax.set_ylabel("fraction of cycles")
  ax.legend(fontsize=7)
  return rep.save(fig, run_dir / "alpha_k_run_lengths.png")


def report(records: list[dict], run_dir) -> str:
  groups = _by_alpha(records)
  ks_all = sorted({r["params"]["k"] for r in records})
  speed_png = _speedup_plot(groups, run_dir)
  tau_png = _tau_plot(groups, ks_all, run_dir)
  heat_png = _heatmap(groups, ks_all, run_dir)
  hist_png = _run_length_plot(groups, ks_all, run_dir)
  worst_z = max(abs(r["metrics"]["z_tau"]) for r in records)
  worst_za = max((abs(r["metrics"]["z_alpha"]) for r in records
                  if r["metrics"]["z_alpha"] is not None), default=float("nan"))
  shapes = sorted({r["metrics"].get("shape", "chain") for r in records})
  cost = records[0]["metrics"]["cost"]
  return "\n".join([
      "## α × k", "",
      "The controlled-α drafter makes every draft acceptable with probability α exactly; "
      f"draft cost {cost} (see experiments/alpha_k_sweep.py). Prediction (lines of the "
      "speedup plot): "
      + ("E[τ](α, k) ÷ the calibrated cycle of the real draft's chain(k) in plain target "
         "steps, timed in the compiled loop (docs/cost_model.md, \"Calibrated loop costs\")"
         if cost == "measured" else "E[τ](α, k) / (k·c + v) at the modelled c")
      + f". Shapes: {', '.join(shapes)} (a tree's E[τ] from the rank law α(1 − α)^r of "
      f"i.i.d. siblings). Largest |z| of measured α vs the dial (chains): {worst_za:.2f}; "
      f"of measured τ vs E[τ]: {worst_z:.2f} (|z| > 3.3 would flag a disagreement at the "
      "1e-3 level).", "",
      f"![speedup vs k]({speed_png})", "", f"![tau vs k]({tau_png})", "",
      f"![alpha x k heatmap]({heat_png})", "", f"![run lengths]({hist_png})", ""])
