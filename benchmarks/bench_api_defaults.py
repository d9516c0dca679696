"""The Python API at its defaults, as a new user runs it: the speedup of whole calls.

    python benchmarks/bench_api_defaults.py [--new-tokens 96] [--prompts 8] [--repeats 3]
                                            [--prompt-set between|quickstart]
                                            [--target-dtype D] [--out results.json]

`specjax.load()` (target "default", draft "eagle:default", k = 4; the target's weights as
stored, or in --target-dtype) and then whole calls of `decoding.generate` and
`decoding.speculative_generate`: batch 1, one prompt at a time, --new-tokens each, no EOS.
The prompts are held-out standard-library code, 64-token windows cut by the studies' rule
(`data.prompts.cut_prompts`): by default ("between") other windows than the quickstart's (2
x --prompts windows, the odd ones kept: they fall between the quickstart's); "quickstart":
the quickstart's own --prompts windows (run it with --new-tokens 64 to put its figures side
by side with `speedup_e2e` at batch 1). T = 0 and T = 1, the same seed per prompt.

Per temperature and repeat, plain and speculative calls alternate prompt by prompt (so a
change of machine load hits both) and their wall seconds are summed over the prompts; the
figures are medians over repeats. Speedup = plain seconds / speculative seconds of whole
calls (prefill, host preparation and the result's transfer included; compilation excluded by
one untimed call of each per prompt length). Also τ (emitted tokens per cycle) and, at
T = 0, whether the speculative tokens equal the plain ones (they must). JSON out: compare
with the quickstart's `speedup_e2e` at batch 1 (`specjax run configs/quickstart.gin`).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import _timing


PROMPT_SETS = ("between", "quickstart")


def _prompts(tokenizer, count: int, prompt_set: str = "between") -> list[list[int]]:
  from specjax.data.prompts import cut_prompts, held_out_texts
  if prompt_set == "quickstart":
    return cut_prompts(tokenizer, held_out_texts("code"), count, 64)
  return cut_prompts(tokenizer, held_out_texts("code"), 2 * count, 64)[1::2]


def run(new_tokens: int, prompts: int, repeats: int, target_dtype: str | None,
        prompt_set: str = "between") -> dict:
  import numpy as np

  import specjax
  from specjax.engine import decoding
  from specjax.verify import sampling

  loaded = specjax.load(target_dtype=target_dtype)
  ids = _prompts(loaded.tokenizer, prompts, prompt_set)
  results = {"new_tokens": new_tokens, "prompts": len(ids), "prompt_set": prompt_set,
             "repeats": repeats, "target_dtype": loaded.target.config.dtype,
             "shape": dict(loaded.shape),
             "machine": {"cpus": os.cpu_count(), "processor": platform.processor(),
                         "load_before": os.getloadavg()[0]}, "temperatures": {}}
  for temperature in (0.0, 1.0):
    sampler = sampling.make_sampler(temperature)
    common = dict(max_new_tokens=new_tokens, sampler=sampler)
    plain = lambda p, i: decoding.generate(loaded.target, [p], seed=i, **common)
    spec = lambda p, i: decoding.speculative_generate(loaded.target, loaded.drafter, [p],
                                                      seed=i, **loaded.shape, **common)
    plain(ids[0], 0), spec(ids[0], 0)  # compile (one prompt length: every window is 64)
    secs = {"plain": [], "spec": []}
    tokens, cycles, same = 0, 0, True
    for _ in range(repeats):
      total = {"plain": 0.0, "spec": 0.0}
      for i, p in enumerate(ids):
        for name, fn in (("plain", plain), ("spec", spec)):
          start = time.perf_counter()
          out = fn(p, i)
          total[name] += time.perf_counter() - start
          if name == "plain":
            want = out.tokens[0]
          else:
            tokens += len(out.tokens[0])
            cycles += int(np.sum(out.stats["cycles"]))
            same &= temperature > 0 or list(out.tokens[0]) == list(want)
      for name in total:
        secs[name].append(total[name])
    plain_s, spec_s = statistics.median(secs["plain"]), statistics.median(secs["spec"])
    results["temperatures"][str(temperature)] = {
        "plain_s": plain_s, "spec_s": spec_s, "speedup": plain_s / spec_s,
        "tau": tokens / max(cycles, 1), "plain_s_runs": secs["plain"],
        "spec_s_runs": secs["spec"], "identical_to_plain": same if temperature == 0 else None}
  results["machine"]["load_after"] = os.getloadavg()[0]
  return results


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--new-tokens", type=int, default=96)
  ap.add_argument("--prompts", type=int, default=8)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--prompt-set", choices=PROMPT_SETS, default="between")
  ap.add_argument("--target-dtype", choices=("float32", "bfloat16"), default=None,
                  help="serve the target in this dtype (default: as loaded, float32)")
  ap.add_argument("--out", default=None)
  a = ap.parse_args()
  for name in ("new_tokens", "prompts", "repeats"):
    if getattr(a, name) < 1:
      ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
  _timing.write_results(run(a.new_tokens, a.prompts, a.repeats, a.target_dtype,
                            a.prompt_set), a.out)


if __name__ == "__main__":
  main()
