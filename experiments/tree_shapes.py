"""Token-tree shapes at equal node budgets: chain vs branching vs optimised vs dynamic.

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

Candidates are the draft's top-k (deterministic, point-mass rule) unless deterministic=False;
the greedy identity with plain decoding is checked at T = 0. Plain and speculative decoding
of the same prompts are timed side by side (`measure.median_alternating`), end to end as in
the quickstart (the short prompt's prefill included).

The prediction beside the measurement comes from standalone forward timings at the run's
mean context length (same process, same cache length):

    cycle     = t_draft(2) + Σ_{levels 2..D} t_draft(W) + t_target(N + 1)
    predicted = τ · t_target(1) / cycle,       efficiency = measured / predicted speedup,

one draft pass per tree level (a level's nodes share a pass: W = the widest fed level; the
root step feeds 2 tokens), one target pass over the N + 1 nodes. What efficiency loses is
loop overhead (acceptance, bookkeeping, cache compaction).
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from experiments import measure
from specjax import decoding, sampling, trees
from specjax.drafters.base import LM
from specjax.drafters.model import ModelDrafter

SHAPES = ("chain", "branching", "optimal", "dynamic")
MAX_BUDGET = 64


def _int_at_least(params: dict, name: str, lo: int, default: int, hi: int | None = None):
  v = params.get(name, default)
  if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
    allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    raise ValueError(f"{name} must be an int {allowed}, got {v!r}")


def validate(params: dict) -> None:
  if params.get("shape") not in SHAPES:
    raise ValueError(f"shape must be one of {SHAPES}, got {params.get('shape')!r}")
  _int_at_least(params, "budget", 1, 1, MAX_BUDGET)
  for name, lo, default in (("batch", 1, 1), ("max_new_tokens", 1, 1), ("repeats", 1, 1),
                            ("prompt_len", 8, 8), ("dynamic_depth", 1, 1),
                            ("dynamic_width", 1, 1), ("branch_width", 2, 2), ("seed", 0, 0)):
    _int_at_least(params, name, lo, default)
  t = params.get("temperature", 0.0)
  if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0:
    raise ValueError(f"temperature must be a number >= 0, got {t!r}")
  if params.get("models", "default") not in ("default", "random"):
    raise ValueError(f"models must be 'default' or 'random', got {params.get('models')!r}")
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


def _pow2(n: int) -> int:
  b = decoding.MIN_BUCKET
  while b < n:
    b *= 2
  return b


def _cache_len(prompt_len: int, max_new_tokens: int, slots: int) -> int:
  """A power of two holding the prompt's bucket, the new tokens and one cycle's slots."""
  return _pow2(_pow2(prompt_len) + max_new_tokens + slots)


def _tree_cache_len(prompt_len: int, max_new_tokens: int, tree, drafter) -> int:
  """The cache length of every run and timing of a tree: 2 (N + 1) slots reserved for a
  cycle (more if the drafter writes more), so the shapes of one budget share a length and
  plain decoding compiles once."""
  return _cache_len(prompt_len, max_new_tokens,
                    max(2 * tree.n_nodes, drafter.slots_needed(tree)))


def _draft_rows(tree) -> list[int]:
  """Rows fed by each draft pass of one cycle: the root step (2), then one per level."""
  if isinstance(tree, trees.DynamicTree):
    return [2] + [tree.width] * (tree.depth - 1)
  depth = tree.max_depth
  width = int(tree.level_sizes[1:depth].max()) if depth > 1 else 0
  return [2] + [width] * (depth - 1)


@functools.lru_cache(maxsize=None)
def _timing(models: str, which: str, batch: int, t: int, context: int, cache_len: int,
            repeats: int) -> float:
  """Forward seconds, cached per process: every shape and budget reuses the same timings."""
  target, draft, _, _ = measure.models(models)
  lm = LM.of(target if which == "target" else draft)
  return measure.forward_seconds(lm, batch, t, context, cache_len, repeats)


@functools.lru_cache(maxsize=None)
def calibration(models: str, temperature: float, calib_widths: tuple, batch: int,
                prompt_len: int, max_new_tokens: int, deterministic: bool,
                seed: int) -> tuple[float, ...]:
  """Sequoia's rank probabilities from one run of the wide tree `branching(calib_widths)`:
  p_r = a_r Π_{s<r} (1 − a_s) with a_r the measured acceptance of tried rank-r candidates
  (`trees.rank_probs_from_counts`). Computed once per process for each setting."""
  target, draft, tok, texts = measure.models(models)
  prompts = measure.prompts(tok, texts, batch, prompt_len)
  tree = trees.branching(calib_widths)
  drafter = ModelDrafter.of(draft, deterministic=deterministic)
  gen = decoding.speculative_generate(
      target, drafter, prompts, tree=tree, max_new_tokens=max_new_tokens,
      sampler=sampling.make_sampler(temperature), seed=seed,
      cache_len=_tree_cache_len(prompt_len, max_new_tokens, tree, drafter))
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
          dynamic_width: int = 3, deterministic: bool = True, models: str = "default",
          seed: int = 0) -> dict:
  target, draft, tok, texts = measure.models(models)
  prompts = measure.prompts(tok, texts, batch, prompt_len)
  sampler = sampling.make_sampler(temperature)
  rank_probs = None
  if shape == "optimal":
    rank_probs = calibration(models, float(temperature), tuple(calib_widths), batch,
                             prompt_len, max_new_tokens, deterministic, seed)
  tree = make_tree(shape, budget, rank_probs, branch_width, dynamic_depth, dynamic_width)
  drafter = ModelDrafter.of(draft, deterministic=deterministic)
  # One cache length for plain and speculative runs and timings (attention reads every slot).
  cache_len = _tree_cache_len(prompt_len, max_new_tokens, tree, drafter)
  common = dict(max_new_tokens=max_new_tokens, sampler=sampler, seed=seed, cache_len=cache_len)
  timed = measure.median_alternating({
      "plain": lambda: decoding.generate(target, prompts, **common),
      "spec": lambda: decoding.speculative_generate(target, drafter, prompts, tree=tree,
                                                    **common)}, repeats)
  (plain_s, plain), (spec_s, spec) = timed["plain"], timed["spec"]
  plain_tok_s, spec_tok_s = plain.emitted / plain_s, spec.emitted / spec_s
  ts = spec.tree_summary()

  context = prompt_len + max_new_tokens // 2
  ftime = lambda which, t: _timing(models, which, batch, t, context, cache_len,  # noqa: E731
                                   3 * repeats)
  t1 = ftime("target", 1)
  t_draft = sum(ftime("draft", rows) for rows in _draft_rows(tree))
  t_verify = ftime("target", tree.n_nodes)
  predicted = ts.tau * t1 / (t_draft + t_verify)
  measured = spec_tok_s / plain_tok_s
  static = isinstance(tree, trees.TreeSpec)
  return {
      "tau": ts.tau, "alpha": ts.utilisation,
      "depth_acceptance": ts.to_dict()["depth_acceptance"],
      "plain_tok_s": plain_tok_s, "spec_tok_s": spec_tok_s, "speedup": measured,
      "predicted_speedup": predicted,
      "efficiency": measured / predicted if predicted > 0 else float("nan"),
      "identical_to_plain": plain.tokens == spec.tokens if temperature == 0 else None,
      "nodes_per_cycle": ts.verified / ts.cycles if ts.cycles else float("nan"),
      "depth": tree.max_depth, "width": tree.max_width,
      "decode_ms": 1e3 * t1, "draft_ms": 1e3 * t_draft, "verify_ms": 1e3 * t_verify,
      "tree": (f"levels {tree.level_sizes[1:].tolist()}" if static else
               f"dynamic depth {tree.depth} width {tree.width}"),
      "parents": list(tree.parents) if static else None,
      "pretty": tree.pretty() if static else str(tree),
      "rank_probs": list(rank_probs) if rank_probs is not None else None,
      "cache_len": cache_len, "backend": jax.default_backend(),
  }


def memory(params: dict) -> int:
  """KV bytes of the largest speculative run of the point (target + draft caches, the
  calibration tree's included), from the preset configs: nothing is loaded."""
  if params.get("models", "default") == "default":
    from specjax.training.presets import PRESETS
    target_cfg, draft_cfg = PRESETS["tiny"].target, PRESETS["tiny"].draft
  else:
    from specjax.models.presets import PRESETS
    target_cfg = PRESETS["tiny-llama"]
    draft_cfg = target_cfg.replace(n_layers=1)
  from specjax.models import cache as kv
  budget = params["budget"]
  slots = max(2 * (budget + 1), 2 * trees.branching(tuple(params.get("calib_widths",
                                                                     (4, 2, 2)))).n_nodes)
  if params.get("shape") == "dynamic":
    slots = max(slots, dynamic_tree(budget, params.get("dynamic_depth", 5),
                                    params.get("dynamic_width", 3)).region)
  cache_len = _cache_len(params.get("prompt_len", 64), params.get("max_new_tokens", 64), slots)
  batch = params.get("batch", 1)
  return kv.cache_bytes(target_cfg, batch, cache_len) + kv.cache_bytes(draft_cfg, batch,
                                                                       cache_len)


def report(records: list[dict], run_dir) -> str:
  from specjax import report as rep
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
           "by side; dashed = predicted from forward timings (one draft pass per level + one "
           "target pass over N + 1 nodes). See experiments/tree_shapes.py.", "",
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
