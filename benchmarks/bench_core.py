"""Core engine benchmark: verify-cost curve, loop overhead, memory floor, speculative efficiency.

    python benchmarks/bench_core.py [--dtype float32 bfloat16] [--out results.json]
    python benchmarks/bench_core.py --target llama3-8b --draft llama3-draft --dtype bfloat16 \
        --ts 1 4 8 16 32 64 --batch 1 8 --out scale.json     (the accelerator check's target)

A target of a named shape (`--target`, default GPT-2 small: 12 layers, d=768, vocab 50257;
random weights, initialised on the device in the model dtype), batch 1 unless `--batch`
lists more, this machine. Everything is timed in one process, variants alternated, medians over repeats:

1. target forward of T = 1, 2, 4, 8, 16 tokens (`--ts`) against a cache holding `--context` tokens,
   divided by the one-token forward (the verification-cost curve);
2. jitted `generate` tokens/s of the decode phase at each `--batch` (a call of n tokens minus a call of 1, the
   prefill alone) against 1 / (one decode forward) (loop overhead) and against
   the memory floor: bytes read per step (weights + the KV buffer the step reads) divided by
   the streaming bandwidth `roofline.calibrate` measures;
3. `speculative_generate` at T=0 with (a) a copy of the target as draft (every draft
   accepted) and (b) a 2-layer width-256 draft, against the prediction from the measured
   forward times: tok/s = τ / (d(2) + (k − 1)·d(1) + t_verify(k+1)), d(T) the draft's
   forward of T tokens (its first pass of a cycle feeds 2 tokens, the catch-up rule, the
   others 1); efficiency = measured / predicted.
4. the same weights through a bare chain of one-row matrix products (`matmul_chain_seconds`):
   plain decoding's tokens/s × that chain's seconds = the fraction of what the backend's own
   kernels allow (`fraction_of_matmul_chain`).
Forwards are timed inside a compiled loop (a loop of 5 minus a loop of 1), the cache donated
and fed back and the fused weights concatenated once, as the decoding loop does: no timing
includes a cache copy or a per-call weight copy.
Also checks the compiled decode step for cache-sized copies (XLA copying the whole KV cache
every step instead of updating it in place; docs/xla_notes.md, trap 1).
With `--out`, the results so far are rewritten after every stage, so a run stopped at its
time limit still leaves what it measured.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.engine import decoding
from specjax.analysis import roofline
from specjax.models.lm import LM
from specjax.models import attention
from specjax.models import cache as kv
from specjax.models.presets import PRESETS
from specjax.models.one_row_bf16 import one_row_safe_matmul
from specjax.models.transformer import Transformer

from _timing import median_seconds, write_results  # benchmarks/_timing.py

_START = time.perf_counter()


def _log(stage: str) -> None:
  """Progress on stderr (stdout carries the JSON): where a slow or stopped run got to."""
  print(f"bench_core [{time.perf_counter() - _START:7.1f} s] {stage}", file=sys.stderr,
        flush=True)


def _forward_rows(lm, tokens, positions, cache, mask=None):
  """Logits of the last row and the cache after a forward of `tokens` (mask: None causal,
  else the block mask of `lm`'s forward, e.g. a tree level's [T, R])."""
  logits, _, cache = lm(tokens, positions, cache, mask)
  return logits[:, -1], cache


_forward = jax.jit(_forward_rows, donate_argnums=(3,))


def looped_forward(lm: LM, t: int, context: int, cache_len: int, batch: int = 1,
                   window: int = 0):
  """fn(n): n forwards of T = t rows of each of `batch` sequences in one compiled loop
  (`lax.fori_loop`, n a runtime value: one compile) against a cache holding `context`
  tokens (causal; with `window` > 0 an all-true block mask of t + window columns, as a
  tree level of the drafters attends its window of earlier levels), the cache donated and fed
  back, and the fused products' weights concatenated once before the loop
  (`fused.prefused`), as the decoding loops do. A forward called on its own would
  concatenate them in every call: on XLA:CPU that copy cost SmolLM2-135M ~225 ms against a
  ~40 ms forward (docs/xla_notes.md, trap 12). Traced under the caller's settings at the
  first call (`one_row_bf16.split_rows`, precision)."""
  from specjax.models.fused import prefused
  toks = jnp.zeros((batch, t), jnp.int32)
  pos = jnp.broadcast_to(context + jnp.arange(t, dtype=jnp.int32), (batch, t))
  mask = None if window == 0 else jnp.ones((t, t + window), bool)
  state = {"cache": kv.set_lengths(kv.init(lm.config, batch, cache_len),
                                   jnp.full((batch,), context, jnp.int32))}

  @functools.partial(jax.jit, donate_argnums=(3,))
  def run(lm, toks, pos, cache, mask, n):
    with prefused([lm.module()]):
      def body(_, carry):
        cache, acc = carry
        # not the jitted `_forward`: a nested jit would hide the weights `prefused` made
        # (its arguments are new tracers), as it would in a decoding loop
        logits, cache = _forward_rows(lm, toks, pos, cache, mask)
        return cache, acc + logits[0, 0]  # a use of each forward's logits: none is skipped
      cache, acc = jax.lax.fori_loop(0, n, body, (cache, jnp.zeros((), jnp.float32)))
    return acc, cache

  def fn(n: int):
    out, state["cache"] = run(lm, toks, pos, state["cache"], mask, jnp.int32(n))
    return out
  return fn


def time_looped(fns: dict, repeats: int, lo: int = 1, hi: int = 5) -> dict:
  """Seconds of one forward of each `looped_forward` fn: per repeat, a loop of `hi`
  forwards minus a loop of `lo`, ÷ (hi − lo) (the call, the dispatch and the weights'
  concatenation cancel), every fn alternated in each repeat; medians over `repeats`."""
  for fn in fns.values():
    jax.block_until_ready(fn(lo))  # compiled (n is a runtime value: one program)
  samples = {key: [] for key in fns}
  for _ in range(repeats):  # alternate the variants: drift hits all of them alike
    for key, fn in fns.items():
      took = []
      for n in (lo, hi):
        start = time.perf_counter()
        jax.block_until_ready(fn(n))
        took.append(time.perf_counter() - start)
      samples[key].append((took[1] - took[0]) / (hi - lo))
  return {key: statistics.median(v) for key, v in samples.items()}


def forward_times(lm: LM, context: int, cache_len: int, ts, repeats: int) -> dict[int, float]:
  """Seconds of a forward of T rows (T in ts) over a cache holding `context` tokens, timed
  inside a compiled loop (`looped_forward`, `time_looped`)."""
  return time_looped({t: looped_forward(lm, t, context, cache_len) for t in ts}, repeats)


def matmul_chain_seconds(target, repeats: int) -> float:
  """One pass of a bare chain of the target's own weight matrices (every 2-D parameter: the
  attention and MLP kernels, then the embedding as LM head) applied to one row, products as
  the model runs them (model-dtype inputs, float32 accumulation): what the backend's matrix
  products allow for one decode step's weights, nothing else. Each product's input is the
  previous output folded to the next width, so none can be skipped or fused away."""
  leaves = jax.tree_util.tree_flatten_with_path(nnx.state(target, nnx.Param))[0]
  mats = [x for path, x in leaves if x.ndim == 2 and "embed" not in jax.tree_util.keystr(path)]
  head = target.lm_head.kernel[...] if target.lm_head is not None else target.embed[...].T
  mats = mats + [head]
  width = max(m.shape[0] for m in mats)

  @jax.jit
  def chain(x, mats):
    for m in mats:
      y = one_row_safe_matmul("...i,io->...o", x[:, :m.shape[0]].astype(m.dtype), m)
      x = jnp.resize(y, (1, width)) * 1e-3
    return x

  x0 = jnp.ones((1, width), jnp.float32)
  return median_seconds(lambda: chain(x0, mats), repeats)


def cache_copies(lm: LM, cache_len: int) -> list[str]:
  """Copies of cache-sized buffers in the compiled one-token decode step."""
  cache = kv.init(lm.config, 1, cache_len)
  toks = jnp.zeros((1, 1), jnp.int32)
  hlo = _forward.lower(lm, toks, toks, cache).compile().as_text()
  shape = f"{lm.config.head_dim},{cache_len}"
  return [line.strip()[:160] for line in hlo.splitlines()
          if re.search(r"\bcopy\(", line) and shape in line]


@functools.lru_cache(maxsize=None)
def _normal(shape: tuple, dtype) -> "jax.stages.Wrapped":
  return jax.jit(lambda key: (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype))


def random_model(cfg, seed: int) -> Transformer:
  """A Transformer of `cfg` with random weights made on the default device in the config's
  dtype: N(0, 0.02) matrices, unit norm scales, zero biases. One small jitted draw per
  distinct shape (a model has ~10): on an H200 a single jitted initialisation of an 8B model
  took 118 s to compile, and eager initialisation compiles every op separately."""
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  made = []
  for key, (path, leaf) in zip(keys, leaves):
    name = jax.tree_util.keystr(path)
    if "scale" in name:
      made.append(jnp.ones(leaf.shape, leaf.dtype))
    elif "bias" in name:
      made.append(jnp.zeros(leaf.shape, leaf.dtype))
    else:
      made.append(_normal(tuple(leaf.shape), leaf.dtype)(key))
  return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, made))


def copy_bandwidth(nbytes: int, repeats: int) -> float:
  """Bytes per second of a device-to-device copy (x · 1.0001 over `nbytes` of float32: read
  and write counted), the fastest of `repeats`: the accelerator check's roofline reference."""
  x = jnp.ones((nbytes // 4,), jnp.float32)
  f = jax.jit(lambda a: a * 1.0001)
  jax.block_until_ready(f(x))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(f(x))
    best = min(best, time.perf_counter() - start)
  return 2 * x.nbytes / best


def run(dtype: str, args, save=lambda: None) -> dict:
  cfg = PRESETS[args.target].replace(dtype=dtype)
  target = random_model(cfg, 0)
  lm = LM.of(target)
  draft_cfg = PRESETS[args.draft].replace(dtype=dtype)
  draft = random_model(draft_cfg, 1)
  cache_len = args.cache_len
  out = {"dtype": dtype, "target": args.target, "draft": args.draft, "context": args.context,
         "cache_len": cache_len}
  args.partial.append(out)

  n = args.new_tokens
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(target, nnx.Param)))
  read_slots = min(b for b in attention.prefix_buckets(cache_len) if b >= args.context + n)
  out["bandwidth_GBps"] = args.bandwidth / 1e9
  out["plain_by_batch"] = {}
  for batch in args.batch:
    _log(f"{dtype}: plain generation, batch {batch}")
    row, calls, call_s = plain_generation(target, batch, args, cache_len)
    if batch == args.batch[0]:
      plain, plain_s = calls, call_s
    # A step reads every weight once and each row's live KV prefix (the bucket attention reads).
    step_bytes = weight_bytes + kv.cache_bytes(cfg, batch, read_slots)
    row["step_bytes"] = step_bytes
    row["memory_floor_tok_s"] = batch * args.bandwidth / step_bytes
    row["fraction_of_floor"] = row["plain_tok_s"] / row["memory_floor_tok_s"]
    out["plain_by_batch"][batch] = row
    save()
  if args.plain_only:
    return out
  # Plain decoding first (the roofline figure), then the verification-cost curve.
  ts = tuple(sorted(set(args.ts) | {1, 2, args.k + 1}))
  _log(f"{dtype}: target forwards T = {ts}")
  fwd = forward_times(lm, args.context, cache_len, ts, args.repeats)
  out["forward_ms"] = {t: 1e3 * v for t, v in fwd.items()}
  out["verify_cost"] = {t: fwd[t] / fwd[1] for t in ts}
  _log(f"{dtype}: draft forwards")
  draft_fwd = forward_times(LM.of(draft), args.context, cache_len, (1, 2), args.repeats)
  out["draft_step_ms"] = 1e3 * draft_fwd[2]
  out["c"] = draft_fwd[2] / fwd[1]
  out["cache_copies_in_decode_step"] = cache_copies(lm, cache_len)
  save()

  first = out["plain_by_batch"][args.batch[0]]
  tok_s = first["plain_tok_s"]
  out.update({k: first[k] for k in ("plain_call_tok_s", "plain_tok_s", "step_bytes",
                                    "memory_floor_tok_s", "fraction_of_floor")})
  out["one_forward_tok_s"] = 1.0 / fwd[1]
  out["loop_overhead"] = 1.0 - tok_s / (1.0 / fwd[1]) if args.batch[0] == 1 else None
  save()
  # The same weights through a bare chain of one-row products, timed in this run: plain
  # decoding's tokens/s as a fraction of what the backend's own kernels allow.
  _log(f"{dtype}: bare matmul chain")
  chain_s = matmul_chain_seconds(target, args.repeats)
  out["matmul_chain_ms"] = 1e3 * chain_s
  out["fraction_of_matmul_chain"] = tok_s * chain_s

  save()
  _log(f"{dtype}: speculative generation")
  # Speculative generation at T=0, batch args.batch[0].
  k = args.k
  prompt = _prompts(args.batch[0], args.context)
  for name, d, d_fwd in (("self_draft", target, fwd), ("draft_2l", draft, draft_fwd)):
    runs = [decoding.speculative_generate(target, d, prompt, k=k, max_new_tokens=n,
                                          cache_len=cache_len) for _ in range(args.repeats + 1)]
    runs = runs[1:]
    assert all(r.tokens == plain[0].tokens for r in runs), "greedy identity broken"
    s = statistics.median(r.seconds for r in runs)
    summary = runs[0].summary()
    cycles = int(runs[0].stats["cycles"].sum())
    cycle_s = d_fwd[2] + (k - 1) * d_fwd[1] + fwd[k + 1]
    predicted = (n - 1) / cycles / cycle_s  # tokens from verification cycles per second
    measured = (n - 1) / s
    out[name] = {"tok_s": n / s, "alpha": summary.alpha, "tau": summary.tau,
                 "speedup_vs_plain": plain_s / s, "predicted_tok_s": predicted,
                 "efficiency": measured / predicted}
    save()
  return out


def _prompts(batch: int, context: int) -> list[list[int]]:
  return [[1 + (i + j) % 200 for j in range(context)] for i in range(batch)]


def plain_generation(target, batch: int, args, cache_len: int):
  """Plain generation's decode phase at `batch` rows: a call of n tokens minus a call of 1
  (the prefill alone), alternated, medians: what one decode step costs. Returns (figures,
  the n-token calls, their median seconds)."""
  prompt = _prompts(batch, args.context)
  n = args.new_tokens
  calls = {m: [] for m in (n, 1)}
  for _ in range(args.repeats + 1):
    for m in calls:
      calls[m].append(decoding.generate(target, prompt, max_new_tokens=m, cache_len=cache_len))
  plain_s = statistics.median(g.seconds for g in calls[n][1:])
  prefill_s = statistics.median(g.seconds for g in calls[1][1:])
  return {"plain_call_tok_s": batch * n / plain_s,  # the whole call, prefill included
          "plain_tok_s": batch * (n - 1) / (plain_s - prefill_s),
          "decode_step_ms": 1e3 * (plain_s - prefill_s) / (n - 1)}, calls[n][1:], plain_s


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
  p.add_argument("--target", default="gpt2-small", choices=sorted(PRESETS),
                 help="target shape (models/presets.py; default gpt2-small)")
  p.add_argument("--draft", default="gpt2-draft", choices=sorted(PRESETS),
                 help="the separate draft's shape (default gpt2-draft)")
  p.add_argument("--ts", type=int, nargs="+", default=[1, 2, 4, 5, 8, 16],
                 help="verification rows T timed against one row (default 1 2 4 5 8 16)")
  p.add_argument("--bandwidth-from", choices=("calibrate", "copy"), default="calibrate",
                 help="the floor's bandwidth: roofline.calibrate's streaming sum (default) or "
                 "a device copy (read + write; the accelerator check)")
  p.add_argument("--batch", type=int, nargs="+", default=[1],
                 help="batches of plain generation (the first is used for speculation)")
  p.add_argument("--context", type=int, default=64)
  p.add_argument("--cache-len", type=int, default=512)
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--k", type=int, default=4)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--plain-only", action="store_true",
                 help="plain decoding against the floor only (e.g. the same shape under "
                 "other XLA_FLAGS: device_check.sh's scale_flags phase)")
  p.add_argument("--out", default=None)
  args = p.parse_args()
  args.partial = []
  if args.bandwidth_from == "copy":
    _log(f"copy bandwidth ({jax.default_backend()})")
    args.bandwidth = copy_bandwidth(4 * 2**30 if jax.default_backend() != "cpu" else 2**28, 5)
    calibrated = {"bandwidth_GBps": args.bandwidth / 1e9, "from": "copy"}
  else:
    _log(f"calibrating the backend ({jax.default_backend()})")
    hw = roofline.calibrate(stream_bytes=512 * 2**20)
    args.bandwidth = hw.bandwidth
    calibrated = {"bandwidth_GBps": hw.bandwidth / 1e9, "flops_G": hw.flops / 1e9,
                  "from": "roofline.calibrate"}
  results = {"backend": jax.default_backend(), "devices": str(jax.devices()),
             "calibrated": calibrated, "runs": args.partial}

  def save():
    if args.out:
      with open(args.out, "w") as f:
        json.dump(results, f, indent=1)

  for d in args.dtype:
    run(d, args, save)
  write_results(results, args.out)


if __name__ == "__main__":
  main()
