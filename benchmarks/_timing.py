"""What the benchmark scripts share: a median timing of a JAX callable, and writing results.

Imported by the scripts as `import _timing` (a script run as `python benchmarks/x.py` has
benchmarks/ first on its path).
"""

from __future__ import annotations

import json
import statistics
import time

import jax


def median_seconds(fn, repeats: int) -> float:
  """Median wall seconds of `repeats` calls of fn() (each until its result is ready), after
  one untimed call that compiles and warms up."""
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def write_results(results: dict, out: str | None) -> None:
  """Print `results` as JSON, and also write them to the file `out` when given."""
  print(json.dumps(results, indent=1))
  if out:
    with open(out, "w") as f:
      json.dump(results, f, indent=1)
