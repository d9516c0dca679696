"""Token-tree shapes at equal node budgets: chain vs branching vs optimised vs dynamic.

`target` (or its older name `models`), `draft` and `prompts` by reference
(experiments/references.py; `prompts` = an int is the older spelling of `prompt_count`).

Each point is one (shape, budget N, temperature): the target verifies N drafted nodes per
cycle (root excluded) whatever the shape,

- chain: N drafts in a row, parents (-1, 0, 1, ..., N-1);
- branching: a `branch_width`-ary tree filled breadth first (a binary heap for width 2:
  parent of node i is (i-1) // width), exactly N nodes;
- optimal: `trees.optimal(N, p)`, Sequoia's dynamic program, with p[r] = P(the rank-r child
  is the accepted one | its parent was accepted) measured once per process (and per
  temperature) on a calibration run of a wide static tree (`calib_widths`);
- dynamic: an EAGLE-2 `DynamicTree(N, depth, width)` grown from the draft's cumulative
  confidence every cycle (width grown until width + (depth-1)·width² >= N).

Every point decodes the same `prompts` held-out prompts (8 by default, rounded up to whole
batches) in consecutive batches of `batch` rows (`measure.workload`, `decoding.in_batches`),
as the quickstart does; `target_dtype` serves the target in float32 or bfloat16.
Candidates are the draft's top-k (deterministic, point-mass rule) unless deterministic=False;
the greedy identity with plain decoding is checked at T = 0. Plain and speculative decoding
of the same prompts are timed side by side (`measure.compare`), decode phase only (each call
is also timed with max_new_tokens = 1 and the prefill subtracted), as in the quickstart.

The prediction beside the measurement is the loop's calibrated cost model
(`specjax.calibration`, docs/cost_model.md, "Calibrated loop costs"): the compiled loop of
this point's shape is timed at this batch, temperature, budget and cache length with the
same drafter (cached on disk), giving its cycle in plain target steps; the tokens one loop
iteration emits come from the measured reach by depth, P(n ≥ d) = depth_accepted ÷ cycles
(`calibration.length_probs_from_reach`), through `calibration.tokens_per_iteration` (a
batch runs until its slowest row has emitted its budget):

    predicted = τ_loop ÷ cycle_steps(tree),   efficiency = measured / predicted speedup.

Kept beside it (`predicted_speedup_standalone`, decode_ms / draft_ms / verify_ms): the
prediction from standalone forward timings at the run's mean context length (same process,
same cache length; `measure.step_costs`),

    cycle     = t_draft(2) + Σ_{levels 2..D} t_draft(W) + t_target(N + 1)
    predicted = τ · t_target(1) / cycle,

one draft pass per tree level (a level's nodes share a pass: W = the widest fed level; the
root step feeds 2 tokens), one target pass over the N + 1 nodes; it misses the loop's own
work (acceptance, bookkeeping, cache compaction).

Every run and timing of a point reads the cache length `decoding.cache_len_for` gives for
2 (N + 1) slots per cycle (more if the drafter writes more): the shapes of one budget then
share a length (attention reads every slot, so a longer cache would tax one shape alone)
and plain decoding compiles once.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from specjax.experiments import measure, references
from specjax.calibration import loop_costs as loop_calibration
from specjax.engine import decoding
from specjax.verify import sampling, trees
from specjax.calibration import timing
from specjax.drafters.model import ModelDrafter
from specjax.sweeps import report as rep

SHAPES = ("chain", "branching", "optimal", "dynamic")
MAX_BUDGET = 64


def validate(params: dict) -> None:
  measure.check_choice(params, "shape", None, SHAPES)
  measure.check_int(params, "budget", 1, 1, MAX_BUDGET)
  for name, lo in (("batch", 1), ("max_new_tokens", 2), ("repeats", 1), ("prompt_len", 8),
                   ("dynamic_depth", 1), ("dynamic_width", 1), ("branch_width", 2),
                   ("seed", 0)):
    measure.check_int(params, name, lo, lo)
  measure.check_number(params, "temperature", 0.0, 0)
  references.check_target(params)
  references.check_draft(params)
  measure.check_int(params, "calibration_repeats", 3, 1)
  measure.check_choice(params, "statistic", "median", timing.STATISTICS)
  measure.check_choice(params, "recalibrate", False, (False, True))
  references.check_prompts(params)
  measure.check_choice(params, "target_dtype", "float32", ("float32", "bfloat16"))
  if not isinstance(params.get("deterministic", True), bool):
    raise ValueError(f"deterministic must be True or False, got {params['deterministic']!r}")
  widths = params.get("calib_widths", (4, 2, 2))
  if (isinstance(widths, (str, bytes)) or not isinstance(widths, (list, tuple)) or not widths
      or any(not isinstance(w, int) or isinstance(w, bool) or w < 1 for w in widths)):
    raise ValueError(f"calib_widths must be a non-empty sequence of ints >= 1 (children per "
                     f"node at each depth), got {widths!r}")
  if max(widths) < 2:
    raise ValueError(f"calib_widths must have a width >= 2 somewhere to measure acceptance "
                     f"beyond rank 0, got {widths!r}")
  if trees.branching(tuple(widths)).size > 4 * MAX_BUDGET:
    raise ValueError(f"calib_widths {widths!r} makes a calibration tree of "
                     f"{trees.branching(tuple(widths)).size} nodes; at most {4 * MAX_BUDGET}")


def branching_tree(budget: int, width: int = 2) -> trees.TreeSpec:
  """Exactly `budget` nodes, `width` children per node, filled breadth first."""
  return trees.TreeSpec((-1,) + tuple((i - 1) // width for i in range(1, budget + 1)))


def dynamic_tree(budget: int, depth: int, width: int) -> trees.DynamicTree:
  depth = min(budget, depth)
  while width + (depth - 1) * width ** 2 < budget:
    width += 1
  return trees.DynamicTree(budget=budget, depth=depth, width=width)


def _cache_len(prompt_len: int, max_new_tokens: int, tree, draft) -> int:
  """The cache length of every run and timing of a tree (module doc): 2 (N + 1) slots
  reserved for a cycle, more if the drafter writes more."""
  return decoding.cache_len_for(prompt_len, max_new_tokens,
                                max(2 * tree.n_nodes, measure.cycle_slots(tree, draft)))


@functools.lru_cache(maxsize=None)
def calibration(models: str, temperature: float, calib_widths: tuple, batch: int,
                prompt_len: int, max_new_tokens: int, deterministic: bool,
                seed: int, prompts="code", target_dtype: str = "float32",
                draft: str = "default", prompt_count: int = 8,
                chat_template: bool = True) -> tuple[float, ...]:
  """Sequoia's rank probabilities from one run of the wide tree `branching(calib_widths)`
  over the point's workload (all its prompts as one batch: only counts are read):
  p_r = a_r Π_{s<r} (1 − a_s) with a_r the measured acceptance of tried rank-r candidates
  (`metrics.rank_probs_from_counts`). Computed once per process for each setting."""
  target, draft, tok, texts = measure.models(models, target_dtype, draft)
  tree = trees.branching(calib_widths)
  gen = decoding.speculative_generate(
      target, ModelDrafter.of(draft, deterministic=deterministic),
      references.batched_workload(models, tok, texts, prompts, prompt_count, batch, prompt_len,
                                  chat_template=chat_template).ids, tree=tree,
      max_new_tokens=max_new_tokens,
      sampler=sampling.make_sampler(temperature), seed=seed,
      cache_len=_cache_len(prompt_len, max_new_tokens, tree, draft))
  probs = np.minimum(np.asarray(gen.tree_summary().rank_probs, np.float64), 1.0)
  if probs.sum() > 1.0:  # rounding only: at most one sibling is ever accepted
    probs = probs / probs.sum()
  return tuple(float(p) for p in probs)


def make_tree(shape: str, budget: int, rank_probs=None, branch_width: int = 2,
              dynamic_depth: int = 5, dynamic_width: int = 3):
  if shape == "chain":
    return trees.chain(budget)
  if shape == "branching":
    return branching_tree(budget, branch_width)
  if shape == "optimal":
    return trees.optimal(budget, rank_probs)
  return dynamic_tree(budget, dynamic_depth, dynamic_width)


def point(shape: str, budget: int, temperature: float = 0.0, batch: int = 1,
          max_new_tokens: int = 64, prompt_len: int = 64, repeats: int = 3,
          calib_widths: tuple = (4, 2, 2), branch_width: int = 2, dynamic_depth: int = 5,
          dynamic_width: int = 3, deterministic: bool = True, models: str | None = None,
          seed: int = 0, calibration_repeats: int = 3, statistic: str = "median",
          recalibrate: bool = False, prompts="code", target_dtype: str = "float32",
          target: str | None = None, draft: str = "default", prompt_count: int = 8,
          chat_template: bool = True) -> dict:
  models = references.target_ref(target, models)
  draft_ref = draft
  target, draft, tok, texts = measure.models(models, target_dtype, draft_ref)
  rank_probs = None
  if shape == "optimal":
    rank_probs = calibration(models, float(temperature), tuple(calib_widths), batch,
                             prompt_len, max_new_tokens, deterministic, seed, prompts,
                             target_dtype, draft_ref, prompt_count, chat_template)
  tree = make_tree(shape, budget, rank_probs, branch_width, dynamic_depth, dynamic_width)
  work = references.batched_workload(models, tok, texts, prompts, prompt_count, batch,
                                     prompt_len, chat_template=chat_template)
  prompt_ids = work.ids
  cmp = measure.calibrated_compare(
      target, draft, prompt_ids, [tree], tree=tree, batch=batch,
      max_new_tokens=max_new_tokens, repeats=repeats, calibration_repeats=calibration_repeats,
      temperature=temperature, seed=seed, recalibrate=recalibrate, statistic=statistic,
      cache_len=_cache_len(prompt_len, max_new_tokens, tree, draft),
      drafter_for=lambda model, _t: ModelDrafter.of(model, deterministic=deterministic))
  costs = cmp.loop_costs
  sc = measure.step_costs(target, draft, batch, tree, cmp.context, cmp.cache_len, 3 * repeats)
  ts = cmp.spec.tree_summary()
  st = cmp.spec.stats
  # Each row's own reach by depth: a batch runs until its slowest row is done, and the
  # workload's batches one after another (harmonic mean over them).
  tau_loop = loop_calibration.run_tokens_per_iteration(st, tree, batch, max_new_tokens - 1)
  predicted = cmp.predicted(tau_loop)
  standalone = ts.tau / sc.cycle
  static = isinstance(tree, trees.TreeSpec)
  return {
      "tau": ts.tau, "alpha": ts.utilisation,
      "depth_acceptance": ts.to_dict()["depth_acceptance"],
      "plain_tok_s": cmp.plain_tok_s, "spec_tok_s": cmp.spec_tok_s, "speedup": cmp.speedup,
      "predicted_speedup": predicted,
      "efficiency": cmp.efficiency(predicted),
      "tau_loop_predicted": tau_loop, "cycle_steps": costs.cycle_steps(tree),
      "t_step_ms": 1e3 * costs.t_step, "calibration_cached": bool(costs.meta.get("cached")),
      "predicted_speedup_standalone": standalone,
      "efficiency_standalone": cmp.efficiency(standalone),
      "identical_to_plain": cmp.identical if temperature == 0 else None,
      "nodes_per_cycle": ts.verified / ts.cycles if ts.cycles else float("nan"),
      "depth": tree.max_depth, "width": tree.max_width,
      "decode_ms": 1e3 * sc.t1, "draft_ms": 1e3 * sc.t_draft,
      "verify_ms": 1e3 * sc.t_verify,
      "tree": (f"levels {tree.level_sizes[1:].tolist()}" if static else
               f"dynamic depth {tree.depth} width {tree.width}"),
      "parents": list(tree.parents) if static else None,
      "pretty": tree.pretty() if static else str(tree),
      "rank_probs": list(rank_probs) if rank_probs is not None else None,
      "cache_len": cmp.cache_len, "backend": jax.default_backend(),
      "prompts": len(prompt_ids), **work.row_fields(),
  }


def memory(params: dict) -> int:
  """KV bytes of the largest speculative run of the point (target + draft caches, the
  calibration tree's included), from the preset configs: nothing is loaded."""
  budget = params["budget"]
  slots = max(2 * (budget + 1), 2 * trees.branching(tuple(params.get("calib_widths",
                                                                     (4, 2, 2)))).n_nodes)
  if params.get("shape") == "dynamic":
    slots = max(slots, dynamic_tree(budget, params.get("dynamic_depth", 5),
                                    params.get("dynamic_width", 3)).region)
  cache_len = decoding.cache_len_for(params.get("prompt_len", 64),
                                     params.get("max_new_tokens", 64), slots)
  return sum(measure.cache_bytes(references.target_ref(params.get("target"),
                                                      params.get("models")),
                                 params.get("batch", 1), cache_len,
                                 params.get("draft", "default")))


def report(records: list[dict], run_dir) -> str:
  temps = sorted({r["params"].get("temperature", 0.0) for r in records})
  shapes = [s for s in SHAPES if any(r["params"]["shape"] == s for r in records)]

  def rows(shape, t):
    return sorted((r for r in records if r["params"]["shape"] == shape
                   and r["params"].get("temperature", 0.0) == t),
                  key=lambda r: r["params"]["budget"])

  figs = {}
  for key, ylabel in (("tau", "τ (tokens per verification)"),
                      ("speedup", "speedup vs plain")):
    fig, axs = rep.new_figure(ncols=len(temps), figsize=(4.5 * len(temps), 3.4), squeeze=False)
    for ax, t in zip(axs[0], temps):
      for shape in shapes:
        rs = rows(shape, t)
        if not rs:
          continue
        line, = ax.plot([r["params"]["budget"] for r in rs], [r["metrics"][key] for r in rs],
                        "o-", label=shape)
        if key == "speedup":
          ax.plot([r["params"]["budget"] for r in rs],
                  [r["metrics"]["predicted_speedup"] for r in rs], "x--",
                  color=line.get_color())
          if all("predicted_speedup_standalone" in r["metrics"] for r in rs):
            ax.plot([r["params"]["budget"] for r in rs],
                    [r["metrics"]["predicted_speedup_standalone"] for r in rs], "+:",
                    color=line.get_color())
      if key == "speedup":
        ax.axhline(1.0, color="gray", lw=0.8)
      ax.set_xscale("log", base=2)
      ax.set_xlabel("node budget N")
      ax.set_ylabel(ylabel)
      ax.set_title(f"T = {t}")
      ax.legend(fontsize=8)
    figs[key] = rep.save(fig, run_dir / f"tree_shapes_{key}.png")

  largest = max(r["params"]["budget"] for r in records)
  fig, axs = rep.new_figure(ncols=len(temps), figsize=(4.5 * len(temps), 3.4), squeeze=False)
  trees_text = []
  for ax, t in zip(axs[0], temps):
    for shape in shapes:
      rs = [r for r in rows(shape, t) if r["params"]["budget"] == largest]
      if not rs:
        continue
      acc = [np.nan if a is None else a for a in rs[0]["metrics"]["depth_acceptance"]]
      ax.plot(range(1, len(acc) + 1), acc, "o-", label=shape)
      if t == temps[0]:
        trees_text += [f"{shape} (N = {largest}):", "", "```",
                       rs[0]["metrics"]["pretty"], "```", ""]
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("tree depth d")
    ax.set_ylabel("P(depth-d node accepted | parent accepted)")
    ax.set_title(f"N = {largest}, T = {t}")
    ax.legend(fontsize=8)
  figs["depth"] = rep.save(fig, run_dir / "tree_shapes_depth.png")

  calib = sorted({(r["params"].get("temperature", 0.0), tuple(r["metrics"]["rank_probs"]))
                  for r in records if r["metrics"].get("rank_probs")})
  lines = ["## Tree shapes at equal node budgets", "",
           "τ = tokens per verification; speedup = speculative ÷ plain tokens/s measured side "
           "by side (decode phase); dashed = predicted from the calibrated loop costs (tokens "
           "per loop iteration from the measured acceptance by depth ÷ the shape's cycle in "
           "plain target steps, timed in the compiled loop; docs/cost_model.md, \"Calibrated "
           "loop costs\"); dotted = predicted from standalone forward timings (one draft pass "
           "per level + one target pass over N + 1 nodes). See experiments/tree_shapes.py.",
           "",
           f"![tau vs budget per shape]({figs['tau']})", "",
           f"![speedup vs budget per shape]({figs['speedup']})", "",
           f"![acceptance by tree depth]({figs['depth']})", ""]
  if calib:
    lines += ["Calibration (rank probabilities p_r for `trees.optimal`):", ""]
    lines += [f"- T = {t}: {', '.join(f'{p:.3f}' for p in probs)}" for t, probs in calib]
    lines.append("")
  if trees_text:
    lines += [f"Static shapes at N = {largest}, T = {temps[0]}:", "", *trees_text]
  return "\n".join(lines)
