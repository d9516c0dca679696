"""The accelerator check's figures, scaled down to this CPU: a memory-bound target against
its own kernels' floor, and speculation against the calibrated prediction.

    python benchmarks/bench_scaled_cpu.py [--target gpt2-medium] [--alpha 0.8] [--k 4] \
        [--new-tokens 128] [--repeats 3] [--out scaled.json]

A target of a named shape (default GPT-2 medium: 24 layers, d 1024, vocab 50,257, 355M
parameters, float32; random weights), batch 1, this machine, one process:

1. plain decoding's decode phase (a call of n tokens minus a call of 1, alternated,
   medians) against the bare chain of the same weight matrices as one-row products
   (`bench_core.matmul_chain_seconds`): `fraction_of_matmul_chain` = plain tokens/s × the
   chain's seconds (goal >= 0.9: the loop adds little to what the backend's kernels allow);
2. speculative decoding with the controlled-α drafter (`OracleDrafter`, every draft accepted
   with probability α; its drafts run the target, so c = 1) on a chain of k at T = 0:
   - the calibration (`specjax.calibration.calibrate`, measured afresh on other prompts and
     another seed, not cached) gives the cycle's cost in target steps and the prediction
     E[τ](α, k) ÷ cycle_steps;
   - the measurement: plain and speculative decode phases alternated on the benchmark
     prompts, their ratio the measured speedup;
   - `efficiency` = measured ÷ predicted (goal within [0.9, 1.1]), and the same at the
     run's own τ (`efficiency_at_run_tau`: the timing model alone, without the sampling
     noise of τ over a few dozen cycles).
Greedy identity (speculative tokens = plain tokens) is checked on the way.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import jax

from specjax.calibration import loop_costs as calibration, timing
from specjax.engine import decoding
from specjax.verify import sampling, trees
from specjax.analysis import theory
from specjax.drafters.oracle import OracleDrafter
from specjax.models.presets import PRESETS
from specjax.models.transformer import param_count

import bench_core  # benchmarks/bench_core.py
from _timing import write_results

_START = time.perf_counter()


def _log(stage: str) -> None:
  print(f"[{time.perf_counter() - _START:7.1f} s] {stage}", file=sys.stderr, flush=True)


def _prompt(seed: int, context: int, vocab: int) -> list[list[int]]:
  return [[1 + (seed * 7919 + 31 * j) % (vocab - 1) for j in range(context)]]


def run(args) -> dict:
  cfg = PRESETS[args.target].replace(dtype=args.dtype)
  target = bench_core.random_model(cfg, 0)
  n, k = args.new_tokens, args.k
  out = {"target": args.target, "dtype": args.dtype, "parameters": param_count(cfg),
         "alpha": args.alpha, "k": k, "new_tokens": n, "context": args.context,
         "cache_len": args.cache_len, "repeats": args.repeats,
         "load_average_start": os.getloadavg()}

  _log("plain decoding, decode phase")
  prompt = _prompt(1, args.context, cfg.vocab_size)
  greedy = sampling.make_sampler(0.0)
  oracle = OracleDrafter.of(target, args.alpha)
  common = dict(sampler=greedy, cache_len=args.cache_len, seed=args.seed)
  fns = {"plain/M": lambda: decoding.generate(target, prompt, max_new_tokens=n, **common),
         "plain/1": lambda: decoding.generate(target, prompt, max_new_tokens=1, **common),
         "spec/M": lambda: decoding.speculative_generate(target, oracle, prompt, k=k,
                                                         max_new_tokens=n, **common),
         "spec/1": lambda: decoding.speculative_generate(target, oracle, prompt, k=k,
                                                         max_new_tokens=1, **common)}
  seconds, last, record = timing.decode_seconds(fns, ["plain", "spec"], args.repeats,
                                                time.perf_counter, "median")
  if last["spec/M"].tokens != last["plain/M"].tokens:
    raise AssertionError("greedy identity broken: speculative tokens differ from plain")
  plain_tok_s = (n - 1) / seconds["plain"]
  out["timing"] = record
  out["plain_decode_step_ms"] = 1e3 * seconds["plain"] / (n - 1)
  out["plain_tok_s"] = plain_tok_s

  _log("bare matmul chain")
  chain_s = bench_core.matmul_chain_seconds(target, max(5, args.repeats))
  out["matmul_chain_ms"] = 1e3 * chain_s
  out["fraction_of_matmul_chain"] = plain_tok_s * chain_s

  summary = last["spec/M"].summary()
  cycles = int(last["spec/M"].stats["cycles"].sum())
  run_tau = (n - 1) / cycles  # tokens per cycle of the decode phase
  out["measured"] = {"speedup": seconds["plain"] / seconds["spec"],
                     "alpha_trial": summary.alpha_trial, "tau": summary.tau,
                     "tokens_per_cycle": run_tau, "cycles": cycles}

  _log("calibration (other prompts, other seed, not cached)")
  with tempfile.TemporaryDirectory() as cache_dir:
    costs = calibration.calibrate(
        target, oracle, _prompt(2, args.context, cfg.vocab_size), [trees.chain(k)],
        max_new_tokens=n, repeats=args.repeats, temperature=0.0, seed=args.seed + 1,
        cache_len=args.cache_len, cache_dir=cache_dir)
  tau = theory.expected_tokens(args.alpha, k)
  steps = costs.cycle_steps(trees.chain(k))
  predicted = costs.predicted_speedup(trees.chain(k), tau)
  out["calibrated"] = {"t_step_ms": 1e3 * costs.t_step, "cycle_steps": steps,
                       "expected_tau": tau, "predicted_speedup": predicted}
  out["efficiency"] = out["measured"]["speedup"] / predicted
  out["efficiency_at_run_tau"] = out["measured"]["speedup"] / (run_tau / steps)
  out["load_average_end"] = os.getloadavg()
  out["goals"] = {"fraction_of_matmul_chain >= 0.9": out["fraction_of_matmul_chain"] >= 0.9,
                  "efficiency in [0.9, 1.1]": 0.9 <= out["efficiency"] <= 1.1}
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--target", default="gpt2-medium", choices=sorted(PRESETS))
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--alpha", type=float, default=0.8)
  p.add_argument("--k", type=int, default=4)
  p.add_argument("--context", type=int, default=64)
  p.add_argument("--cache-len", type=int, default=256)
  p.add_argument("--new-tokens", type=int, default=128)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=None)
  args = p.parse_args()
  if args.context + args.new_tokens + args.k + 1 > args.cache_len:
    p.error(f"--cache-len {args.cache_len} must hold --context + --new-tokens + --k + 1 "
            f"= {args.context + args.new_tokens + args.k + 1}")
  write_results({"backend": jax.default_backend(), "devices": str(jax.devices()),
                 "run": run(args)}, args.out)


if __name__ == "__main__":
  main()
