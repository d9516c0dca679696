"""The shape of a target's forward on this backend: T rows against one, plain decoding against
its floors, kernels per layer (issue 43).

    python benchmarks/bench_forward_shape.py --model HF_OR_SPECJAX_DIR --out shape.json
    python benchmarks/bench_forward_shape.py                  (a random llama-small shape)
    python benchmarks/bench_forward_shape.py --contexts 512 --ts 1 5 8 --dtypes float32

One process, batch 1. For each weight dtype (`--dtypes`, default float32 and bfloat16; a
float32 checkpoint is cast with `transformer.with_dtype`):

1. forward of T = `--ts` rows (default 1 2 4 5 8 16 32) against a KV cache holding
   `--contexts` tokens (default 64 512 2048), the T variants of one context alternated in
   one loop, medians (`forward_curves`: timed inside a compiled loop, a loop of 5 forwards
   minus a loop of 1, the cache donated and fed back and the fused weights concatenated
   once, as the decoding loop does);
   `verify_cost[T]` = forward(T) / forward(1); with `--split-rows N` also T = 2..N computed
   as T one-row products (`one_row_bf16.split_rows`), in the same loop; with
   `--xla-products` also every T with XLA's products instead of specjax's row kernel
   (`row_kernel.suspended`; `xla_products` in the JSON), in the same loop;
2. plain decoding inside the compiled loop (`decoding.generate`: a call of n tokens minus a
   call of 1, alternated, medians) at `--decode-context` (within the model's max_len),
   against the memory floor (weight bytes + the live KV prefix attention reads, over the
   streaming bandwidth `roofline.calibrate` measures in this run, or `--bandwidth-gbps`)
   and against the bare chain of its matrix products (`bench_core.matmul_chain_seconds`:
   what the backend's own kernels allow);
3. the kernels of one compiled decode step (T = 1, a 128-slot cache: one attention path):
   every top-level instruction that becomes a kernel (fusions, dots, custom calls, copies,
   ...), in all and per layer.

The model: `--model` (a Hugging Face or specjax directory, loaded as `specjax.load` does),
else a random model of the `--shape` preset (default llama-small), so it runs on a fresh
machine. With `--out`, the JSON is rewritten after every stage.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import statistics
import sys
import time
import types

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.analysis import roofline
from specjax.models.lm import LM
from specjax.models import attention, one_row_bf16, row_kernel
from specjax.models import cache as kv
from specjax.models.presets import PRESETS
from specjax.models.transformer import with_dtype

from bench_core import (_forward, looped_forward, matmul_chain_seconds, plain_generation,
                        random_model, time_looped)
from _timing import write_results

_START = time.perf_counter()
_NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}


def _log(stage: str) -> None:
  print(f"bench_forward_shape [{time.perf_counter() - _START:7.1f} s] {stage}",
        file=sys.stderr, flush=True)


def _cache_len(context: int, extra: int) -> int:
  """The smallest power of two holding `context` + `extra` slots (at least 128)."""
  n = 128
  while n < context + extra:
    n *= 2
  return n


def forward_curves(lm: LM, context: int, cache_len: int, ts, split: int,
                   repeats: int, xla: bool = False, hi: int = 5) -> dict[str, dict[int, float]]:
  """Seconds of a forward of T rows (T in ts) over a cache holding `context` tokens, timed
  inside a compiled loop as the decoding loop runs it (`bench_core.looped_forward`: the
  cache donated and fed back, the fused weights concatenated and packed once), medians of
  `repeats` with every variant alternated: "default", with `split` > 1 also "split" (T in
  2..split as T one-row products, `one_row_bf16.split_rows`, read at trace time), with
  `xla` also "xla" (XLA's products where the row kernel would run, `row_kernel.suspended`).
  Each timing is a loop of `hi` forwards minus a loop of 1."""
  variants = ([("default", t, 0) for t in ts]
              + [("split", t, split) for t in ts if 1 < t <= split]
              + ([("xla", t, 0) for t in ts] if xla and row_kernel.enabled() else []))
  fns = {}
  for name, t, limit in variants:
    fn = looped_forward(lm, t, context, cache_len)
    with one_row_bf16.split_rows(limit), (row_kernel.suspended() if name == "xla"
                                          else contextlib.nullcontext()):
      jax.block_until_ready(fn(1))  # traced and compiled under its setting
    fns[(name, t)] = fn
  curves: dict[str, dict[int, float]] = {}
  for (name, t), seconds in time_looped(fns, repeats, hi=hi).items():
    curves.setdefault(name, {})[t] = seconds
  return curves


def kernel_count(lm: LM) -> dict:
  """Kernels of one compiled decode step (T = 1, 128 slots: attention takes one path):
  top-level instructions of the non-fused computations, by opcode."""
  cache = kv.init(lm.config, 1, 128)
  toks = jnp.zeros((1, 1), jnp.int32)
  hlo = _forward.lower(lm, toks, toks, cache).compile().as_text()
  fused = set(re.findall(r"calls=%([\w.\-]+)", hlo))
  ops: collections.Counter = collections.Counter()
  inside = None
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY )?%([\w.\-]+) .*\{$", line)
    if head:
      inside = head.group(1)
      continue
    if line.startswith("}"):
      inside = None
      continue
    op = re.search(r"=\s*\S+\s+([a-z][\w\-]*)\(", line)
    if inside is None or inside in fused or not op or op.group(1) in _NOT_KERNELS:
      continue
    kind = op.group(1)
    if kind == "fusion":
      kind = "ynn_fusion" if "__ynn_fusion" in line else "fusion"
    ops[kind] += 1
  total = sum(ops.values())
  return {"total": total, "per_layer": total / lm.config.n_layers, "by_op": dict(ops)}


def run(target, dtype: str, args, results: dict, save) -> None:
  model = with_dtype(target, dtype)
  lm = LM.of(model)
  cfg = model.config
  out = {"dtype": dtype, "forward_ms": {}, "verify_cost": {}}
  if args.split_rows > 1:
    out["split_rows"] = {"limit": args.split_rows, "forward_ms": {}, "verify_cost": {}}
  results["runs"].append(out)
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  out["weight_bytes"] = weight_bytes
  for context in args.contexts:
    _log(f"{dtype}: forwards T = {args.ts} at context {context}")
    curves = forward_curves(lm, context, _cache_len(context, max(args.ts)), args.ts,
                            args.split_rows, args.repeats, args.xla_products, args.loop)
    fwd = curves["default"]
    out["forward_ms"][context] = {t: 1e3 * s for t, s in fwd.items()}
    out["verify_cost"][context] = {t: s / fwd[1] for t, s in fwd.items()}
    if "xla" in curves:  # XLA's own products, each T against its own one-row forward
      xla = out.setdefault("xla_products", {"forward_ms": {}, "verify_cost": {}})
      xla["forward_ms"][context] = {t: 1e3 * s for t, s in curves["xla"].items()}
      xla["verify_cost"][context] = {t: s / curves["xla"][1] for t, s in curves["xla"].items()}
    if "split" in curves:  # against the same one-row forward
      out["split_rows"]["forward_ms"][context] = {t: 1e3 * s for t, s in curves["split"].items()}
      out["split_rows"]["verify_cost"][context] = {t: s / fwd[1]
                                                   for t, s in curves["split"].items()}
    save()
  # within the model's trained length (generate refuses to decode past it)
  context = min(args.decode_context, cfg.max_len - args.new_tokens - 1)
  _log(f"{dtype}: plain decoding at context {context}")
  cache_len = _cache_len(context, args.new_tokens)
  gen_args = types.SimpleNamespace(context=context, new_tokens=args.new_tokens,
                                   repeats=args.repeats)
  row, _, _ = plain_generation(model, 1, gen_args, cache_len)
  read = min(b for b in attention.prefix_buckets(cache_len)
             if b >= context + args.new_tokens)
  step_bytes = weight_bytes + kv.cache_bytes(cfg, 1, read)
  floor_s = step_bytes / args.bandwidth
  step_s = row["decode_step_ms"] / 1e3
  _log(f"{dtype}: bare matmul chain")
  chain_s = matmul_chain_seconds(model, args.repeats)
  out["plain"] = {**row, "context": context, "step_bytes": step_bytes,
                  "memory_floor_ms": 1e3 * floor_s, "fraction_of_floor": floor_s / step_s,
                  "matmul_chain_ms": 1e3 * chain_s,
                  "fraction_of_matmul_chain": chain_s / step_s}
  save()
  _log(f"{dtype}: kernels of one decode step")
  out["kernels"] = kernel_count(lm)
  save()


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", default=None, help="a Hugging Face or specjax model directory "
                 "(default: random weights of --shape)")
  p.add_argument("--shape", default="llama-small", choices=sorted(PRESETS),
                 help="the random model's shape when no --model (default llama-small)")
  p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                 choices=["float32", "bfloat16"])
  p.add_argument("--ts", type=int, nargs="+", default=[1, 2, 4, 5, 8, 16, 32])
  p.add_argument("--contexts", type=int, nargs="+", default=[64, 512, 2048])
  p.add_argument("--split-rows", type=int, default=0,
                 help="also time T = 2..N as N one-row products (one_row_bf16.split_rows), "
                 "alternated with the default forwards (default 0: not timed)")
  p.add_argument("--xla-products", action="store_true",
                 help="also time every T with XLA's products where the row kernel runs "
                 "(row_kernel.suspended), alternated with the default forwards")
  p.add_argument("--loop", type=int, default=5,
                 help="forwards per timed loop (minus a loop of 1; default 5)")
  p.add_argument("--decode-context", type=int, default=512)
  p.add_argument("--new-tokens", type=int, default=32)
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--bandwidth-gbps", type=float, default=None,
                 help="the floor's bandwidth in GB/s (default: roofline.calibrate in this "
                 "run; give an idle machine's figure when the machine is loaded)")
  p.add_argument("--out", default=None)
  args = p.parse_args()
  for name in ("ts", "contexts"):
    bad = [v for v in getattr(args, name) if v < 1]
    if bad:
      p.error(f"--{name.replace('_', '-')} must be positive ints, got {bad}")
  if 1 not in args.ts:
    args.ts = [1] + args.ts
  if args.bandwidth_gbps is not None and not args.bandwidth_gbps > 0:
    p.error(f"--bandwidth-gbps must be a positive number, got {args.bandwidth_gbps}")
  if args.split_rows < 0:
    p.error(f"--split-rows must be a non-negative int, got {args.split_rows}")
  if args.loop < 2:
    p.error(f"--loop must be at least 2 (a loop of n forwards minus a loop of 1), got {args.loop}")
  for name in ("decode_context", "new_tokens", "repeats"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be a positive int, got {getattr(args, name)}")
  if args.new_tokens < 2:
    p.error(f"--new-tokens must be at least 2 (a call of n tokens minus a call of 1), "
            f"got {args.new_tokens}")

  _log("calibrating the backend")
  hw = roofline.calibrate(stream_bytes=512 * 2**20)
  args.bandwidth = hw.bandwidth if args.bandwidth_gbps is None else args.bandwidth_gbps * 1e9
  if args.model:
    from specjax.resolve import load_target
    try:
      target, _ = load_target(args.model, flag="--model")
    except (ValueError, OSError) as e:
      p.error(str(e))
    name = args.model.rstrip("/").split("/")[-1]
  else:
    target = random_model(PRESETS[args.shape].replace(dtype="float32"), 0)
    name = f"random {args.shape}"
  results = {"backend": jax.default_backend(), "devices": str(jax.devices()),
             "model": name, "config": target.config.to_dict(),
             "calibrated": {"bandwidth_GBps": hw.bandwidth / 1e9, "flops_G": hw.flops / 1e9},
             "floor_bandwidth_GBps": args.bandwidth / 1e9,
             "args": {k: v for k, v in vars(args).items() if k != "bandwidth"}, "runs": []}

  def save():
    if args.out:
      with open(args.out, "w") as f:
        json.dump(results, f, indent=1)

  for dtype in args.dtypes:
    run(target, dtype, args, results, save)
  write_results(results, args.out)


if __name__ == "__main__":
  main()
