"""Token trees vs chains at an equal node budget: τ, tokens/s, speedup and efficiency.

    python benchmarks/bench_trees.py [--pair truncated|perturbed|default] [--budgets 8 16]
                                     [--temperatures 0 1] [--out results.json]

For every node budget N: the chain of N drafts, the best static tree for the measured
acceptance by candidate rank (`trees.optimal`, rank probabilities measured on a calibration
run of a wide tree), and a dynamic (EAGLE-2 style) tree of N nodes; all against plain
decoding of the same target, same prompts, same batch, in one process. Candidates are the
draft's top-k (deterministic, point-mass rule) unless --sampled.

Model pairs:
- truncated (default): a GPT-2-small-shaped random target (blocks scaled so that context
  matters, sharpened logits) and a draft made of its first `--draft-layers` blocks with the
  target's embedding and head (LayerSkip-style self-draft: correlated with the target,
  c ≈ draft_layers / n_layers).
- perturbed: the target with Gaussian noise on every weight (high α, c ≈ 1: τ only).
- default: the trained tiny pair of `specjax.training.defaults.load_default_pair` (trains it
  on first use, minutes on a CPU), prompts from its corpus.

Predicted tokens/s of a configuration = τ / (draft time + verify time), from forwards
timed in a compiled loop at the same context length (`bench_core.looped_forward`): the
draft's root step (2 tokens), one step per further level (at the level's width), and the
target's pass over N + 1 tokens. Efficiency =
measured speedup ÷ that prediction's speedup (decode time of one token ÷ cycle time × τ);
what is lost is loop overhead (acceptance, bookkeeping, compaction).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.engine import decoding
from specjax.verify import sampling, trees
from specjax.models.lm import LM
from specjax.drafters.levels import _plan
from specjax.drafters.model import ModelDrafter
from specjax.models.presets import PRESETS
from specjax.models.transformer import Transformer
from specjax.verify.trees import DynamicTree

from _timing import write_results  # benchmarks/_timing.py
from bench_core import looped_forward, time_looped


# ----------------------------------------------------------------------------- model pairs


def random_target(cfg, seed=0, mix=20.0, logit_scale=4.0) -> Transformer:
  """Random weights with non-trivial behaviour: block outputs scaled by `mix` so the context
  matters, logits sharpened by `logit_scale`."""
  m = Transformer(cfg, rngs=nnx.Rngs(seed))
  for block in m.blocks:
    block.attn.o.kernel[...] = block.attn.o.kernel[...] * mix
    block.mlp.down.kernel[...] = block.mlp.down.kernel[...] * mix
  if m.lm_head is not None:
    m.lm_head.kernel[...] = m.lm_head.kernel[...] * logit_scale
  else:
    m.final_norm.scale[...] = m.final_norm.scale[...] * logit_scale
  return m


def truncated_draft(target: Transformer, n_layers: int) -> Transformer:
  """The target's first n_layers blocks with its embedding, final norm and head."""
  cfg = target.config.replace(n_layers=n_layers)
  draft = Transformer(cfg, rngs=nnx.Rngs(0))
  draft.embed[...] = target.embed[...]
  if target.pos_embed is not None:
    draft.pos_embed[...] = target.pos_embed[...]
  for i in range(n_layers):
    nnx.update(draft.blocks[i], nnx.state(target.blocks[i]))
  nnx.update(draft.final_norm, nnx.state(target.final_norm))
  if target.lm_head is not None:
    nnx.update(draft.lm_head, nnx.state(target.lm_head))
  return draft


def perturbed_draft(target: Transformer, noise: float, seed: int = 1) -> Transformer:
  graphdef, state = nnx.split(target)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  noisy = [x + noise * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype)
           for x, k in zip(leaves, keys)]
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, noisy))


def make_pair(args):
  if args.pair == "default":
    from specjax.training.defaults import load_default_pair
    pair = load_default_pair(args.preset, "code")
    target, draft = pair.target_module(), pair.draft_module()
    texts = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)",
             "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser(",
             "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self",
             "for i in range(10):\n    for j in range(i):\n        if (i + j) % 3 == 0:\n"]
    prompts = [pair.tokenizer.encode(texts[b % len(texts)])[:args.context]
               for b in range(args.batch)]
    width = min(len(p) for p in prompts)
    return target, draft, [p[:width] for p in prompts]
  cfg = PRESETS[args.target].replace(dtype=args.dtype)
  target = random_target(cfg, mix=args.mix)
  if args.pair == "truncated":
    draft = truncated_draft(target, args.draft_layers)
  else:
    draft = perturbed_draft(target, args.noise)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, cfg.vocab_size, args.context).tolist() for _ in range(args.batch)]
  return target, draft, prompts


# ----------------------------------------------------------------------------- timings


def forward_time(lm: LM, batch: int, context: int, cache_len: int, t: int, repeats: int,
                 window: int = 0) -> float:
  """Median seconds of one forward of t tokens after `context` committed tokens (a window
  mask of t + window columns when window > 0, as tree levels use), timed inside a compiled
  loop as the decoding loop runs it (`bench_core.looped_forward`: the fused weights
  concatenated once, the cache donated and fed back)."""
  fn = looped_forward(lm, t, context, cache_len, batch=batch, window=window)
  return time_looped({"fwd": fn}, repeats)["fwd"]


def draft_steps(tree) -> list[tuple[int, int]]:
  """(rows, window columns before the block) of every draft forward in one cycle."""
  if isinstance(tree, DynamicTree):
    lookback = 1 + (tree.depth - 2) * tree.width if tree.depth > 1 else 0
    return [(2, 0)] + [(tree.width, lookback)] * (tree.depth - 1)
  plan = _plan(tree)
  level = (plan.width, 0 if tree.is_chain else plan.lookback)
  return [(2, 0)] + [level] * (plan.depth - 1)


# ----------------------------------------------------------------------------- runs


def timed_runs(fn, repeats: int):
  fn()  # compile
  runs = [fn() for _ in range(repeats)]
  return runs, statistics.median(r.seconds for r in runs)


def describe(tree) -> str:
  if isinstance(tree, DynamicTree):
    return f"dynamic(N={tree.budget}, depth={tree.depth}, width={tree.width})"
  if tree.is_chain:
    return f"chain({tree.size})"
  return (f"static(N={tree.size}, depth={tree.max_depth}, width={tree.max_width}, "
          f"levels={tree.level_sizes[1:].tolist()})")


def run_temperature(target, draft, prompts, temperature: float, args, cache_len: int,
                    timing_cache: dict) -> dict:
  sampler = sampling.make_sampler(temperature)
  n = args.new_tokens
  drafter = ModelDrafter.of(draft, deterministic=not args.sampled)
  lm_t, lm_d = LM.of(target), LM.of(draft)
  batch = len(prompts)
  context = len(prompts[0]) + n // 2  # a typical context length during the run

  def ftime(lm, t, window=0):
    key = (id(lm.config), lm.config, t, window)
    if key not in timing_cache:
      timing_cache[key] = forward_time(lm, batch, context, cache_len, t, args.repeats,
                                       window)
    return timing_cache[key]

  plain_runs, plain_s = timed_runs(lambda: decoding.generate(
      target, prompts, max_new_tokens=n, sampler=sampler, seed=0, cache_len=cache_len),
      args.repeats)
  plain_tok_s = batch * n / plain_s
  t1 = ftime(lm_t, 1)
  out = {"temperature": temperature, "plain_tok_s": plain_tok_s, "decode_ms": 1e3 * t1,
         "configs": []}

  def spec(tree, label, budget):
    runs, secs = timed_runs(lambda: decoding.speculative_generate(
        target, drafter, prompts, tree=tree, max_new_tokens=n, sampler=sampler, seed=0,
        cache_len=cache_len), args.repeats)
    if temperature == 0.0:
      assert all(r.tokens == plain_runs[0].tokens for r in runs), "greedy identity broken"
    ts = runs[0].tree_summary()
    t_draft = sum(ftime(lm_d, rows, window) for rows, window in draft_steps(tree))
    t_verify = ftime(lm_t, tree.n_nodes)
    cycle = t_draft + t_verify
    predicted_speedup = ts.tau * t1 / cycle
    tok_s = batch * n / secs
    measured_speedup = tok_s / plain_tok_s
    row = {"budget": budget, "label": label, "shape": describe(tree),
           "parents": None if isinstance(tree, DynamicTree) else list(tree.parents),
           "tau": ts.tau, "utilisation": ts.utilisation,
           "depth_acceptance": ts.depth_acceptance, "rank_acceptance": ts.rank_acceptance,
           "rank_probs": ts.rank_probs, "tok_s": tok_s, "speedup": measured_speedup,
           "draft_ms": 1e3 * t_draft, "verify_ms": 1e3 * t_verify,
           "c": (t_draft / t1) / max(tree.size, 1),
           "predicted_speedup": predicted_speedup,
           "efficiency": measured_speedup / predicted_speedup}
    out["configs"].append(row)
    print(f"  T={temperature} N={budget:>2} {label:<8} {describe(tree):<58} τ={ts.tau:5.2f} "
          f"util={ts.utilisation:4.2f} {tok_s:7.1f} tok/s speedup={measured_speedup:4.2f} "
          f"pred={predicted_speedup:4.2f} eff={row['efficiency']:4.2f}", flush=True)
    return ts

  # Calibration: acceptance by rank from a wide tree (4, then 2 candidates a node).
  calib = spec(trees.branching((4, 2, 2)), "calib", trees.branching((4, 2, 2)).size)
  probs = np.asarray(calib.rank_probs)
  probs = np.minimum(probs, 1.0)
  if probs.sum() > 1.0:
    probs = probs / probs.sum()
  out["rank_probs"] = probs.tolist()
  for budget in args.budgets:
    spec(trees.chain(budget), "chain", budget)
    best = trees.optimal(budget, probs)
    spec(best, "optimal", budget)
    depth = min(budget, args.dynamic_depth)
    width = args.dynamic_width
    while width + (depth - 1) * width ** 2 < budget:
      width += 1
    spec(DynamicTree(budget=budget, depth=depth, width=width), "dynamic", budget)
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--pair", choices=("truncated", "perturbed", "default"), default="truncated")
  p.add_argument("--target", default="gpt2-small", help="preset for random targets")
  p.add_argument("--preset", default="tiny", help="training preset for --pair default")
  p.add_argument("--draft-layers", type=int, default=2)
  p.add_argument("--noise", type=float, default=0.25)
  p.add_argument("--mix", type=float, default=20.0, help="random targets: scale of the blocks' "
                 "output projections (1 = init: the model nearly repeats its input, a truncated "
                 "draft agrees with it; 20: chaotic, it does not)")
  p.add_argument("--dtype", default="float32")
  p.add_argument("--budgets", type=int, nargs="+", default=[8, 16])
  p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
  p.add_argument("--dynamic-depth", type=int, default=5)
  p.add_argument("--dynamic-width", type=int, default=3)
  p.add_argument("--sampled", action="store_true", help="sampled candidates (q) for static "
                 "shapes instead of the draft's top-k")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--context", type=int, default=32)
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--out", default=None)
  args = p.parse_args()
  target, draft, prompts = make_pair(args)
  biggest = max(max(args.budgets), trees.branching((4, 2, 2)).size) + 1
  cache_len = decoding.cache_len_for(len(prompts[0]), args.new_tokens, 2 * biggest)
  results = {"backend": jax.default_backend(), "devices": str(jax.devices()),
             "machine": platform.machine(), "load_average": os.getloadavg(),
             "args": vars(args), "target": target.config.to_dict(),
             "draft": draft.config.to_dict(), "cache_len": cache_len, "runs": []}
  print(f"target {args.target if args.pair != 'default' else 'default'}, draft "
        f"{draft.config.n_layers} layers, batch {args.batch}, cache {cache_len}", flush=True)
  timing_cache: dict = {}
  for t in args.temperatures:
    results["runs"].append(run_temperature(target, draft, prompts, t, args, cache_len,
                                           timing_cache))
  results["load_average_end"] = os.getloadavg()
  write_results(results, args.out)


if __name__ == "__main__":
  main()
