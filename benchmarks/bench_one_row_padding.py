"""Plain decoding of the shipped bf16 target with one-row products padded or not, per call.

    python benchmarks/bench_one_row_padding.py [--prompts 4] [--new-tokens 64] [--repeats 5]

XLA:CPU computes an unpadded one-row bf16 product from a float32 copy of the weight, and a
decoding loop makes those copies once per call, before it starts (docs/xla_notes.md, trap
3). This measures what that costs: for $SPECJAX_PAD_ONE_ROW_BF16 = 0 (unpadded) and 1
(padded, the XLA:CPU default), each in its own process (the choice is read once per process
and fixed at trace time), alternated `--repeats` times, the median seconds of a plain
`generate` call of 1 token and of `--new-tokens` tokens over the first `--prompts` held-out
quickstart prompts, one at a time at batch 1 (each process: the median of 5 calls). Per call: the 1-token call; per step: (n-token
call − 1-token call) ÷ (n − 1). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CALLS = 5  # timed calls per process and length (their median)


def _child(prompts: int, new_tokens: int) -> dict:
  import time

  import jax

  from specjax.engine import decoding
  from specjax.verify import sampling
  from specjax.models.lm import LM
  from specjax.experiments import measure, references

  target, tok, texts = measure.target_model("default", "bfloat16")
  target = LM.of(target)
  ids = references.batched_workload("default", tok, texts, "code", 8, 1, 64).ids[:prompts]
  common = dict(sampler=sampling.make_sampler(0.0), seed=0, cache_len=256)
  out = {}
  for n in (1, new_tokens):
    call = decoding.in_batches(
        lambda x, n=n: decoding.generate(target, x, max_new_tokens=n, **common), ids, 1)
    call()  # compile
    times = []
    for _ in range(CALLS):
      start = time.perf_counter()
      jax.block_until_ready(call())
      times.append(time.perf_counter() - start)
    out[n] = sorted(times)[CALLS // 2]
  return {"call_1": out[1] / prompts, "call_n": out[new_tokens] / prompts}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--prompts", type=int, default=4)
  ap.add_argument("--new-tokens", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  a = ap.parse_args()
  if a.child:
    print(json.dumps(_child(a.prompts, a.new_tokens)))
    return
  runs: dict[str, list[dict]] = {"0": [], "1": []}
  for _ in range(a.repeats):
    for pad in runs:
      env = {**os.environ, "SPECJAX_PAD_ONE_ROW_BF16": pad}
      done = subprocess.run([sys.executable, __file__, "--child", "--prompts", str(a.prompts),
                             "--new-tokens", str(a.new_tokens)], env=env, check=True,
                            capture_output=True, text=True)
      runs[pad].append(json.loads(done.stdout.strip().splitlines()[-1]))
  result = {"prompts": a.prompts, "new_tokens": a.new_tokens, "repeats": a.repeats}
  for pad, name in (("0", "unpadded"), ("1", "padded")):
    call_1 = statistics.median(r["call_1"] for r in runs[pad])
    call_n = statistics.median(r["call_n"] for r in runs[pad])
    result[name] = {"call_1_ms": 1e3 * call_1, "call_n_ms": 1e3 * call_n,
                    "step_ms": 1e3 * (call_n - call_1) / (a.new_tokens - 1)}
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
