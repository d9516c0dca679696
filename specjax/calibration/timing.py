"""Alternated timing of compiled calls, and the decode phase as a difference of two calls.

What the calibration (`specjax.calibration`) and the studies' side-by-side measurements
(`experiments/measure.py`) share: `alternate` (one warm-up call each, then every callable in
turn, so drift on a shared machine hits all alike), `decode_seconds` (an M-token call minus a
1-token call, robust to a difference lost in noise).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Mapping, Sequence

import jax


STATISTICS = ("median", "fastest")


def alternate(fns: Mapping[str, Callable[[], Any]], repeats: int,
              timer: Callable[[], float] = time.perf_counter, *, warmup: bool = True
              ) -> tuple[dict[str, list[float]], dict[str, Any]]:
  """The one alternating-timing loop (the experiments' `measure.alternate` wraps it): one
  warm-up call each (compilation excluded; a callable's `warm_up` attribute instead when it
  has one, e.g. `decoding.in_batches`'s; warmup=False: none, for callables already run),
  then every callable in turn, `repeats` times, so drift and other load hit all of them
  alike. Returns ({name: seconds of each call}, {name: last result})."""
  last = ({name: jax.block_until_ready(getattr(fn, "warm_up", fn)()) for name, fn in fns.items()}
          if warmup else {})
  times: dict[str, list[float]] = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = timer()
      last[name] = jax.block_until_ready(fn())
      times[name].append(timer() - start)
  return times, last


REMEASURE_ROUNDS = 2  # extra rounds (2x, then 4x the repeats) for a difference lost in noise


def decode_seconds(fns: Mapping[str, Callable[[], Any]], names: Sequence[str], repeats: int,
                    timer: Callable[[], float], statistic: str
                    ) -> tuple[dict[str, float], dict[str, Any], dict[str, Any]]:
  """Seconds of the decode phase of each of `names` (fns holds "<name>/M" and "<name>/1"):
  the median (or fastest) M-token call minus the 1-token call (the prefill alone), and each
  call's last result.

  A timing fluctuation never fails a calibration: where a difference is not positive (a
  sub-millisecond decode phase under load), only those calls are alternated again,
  REMEASURE_ROUNDS times with 2x, 4x the repeats, their times pooled. If one is still not
  positive, every name is timed by its whole M-token call instead (prefill included, for
  all alike so the cycle-to-step ratios stay comparable). The third value records what
  happened: {"remeasured": rounds, "prefill_differenced": bool, "not_differenced": [names
  whose difference stayed <= 0]}."""
  times, last = alternate(fns, repeats, timer)
  pick = statistics.median if statistic == "median" else min
  diff = lambda n: pick(times[f"{n}/M"]) - pick(times[f"{n}/1"])  # noqa: E731
  rounds = 0
  while rounds < REMEASURE_ROUNDS and (bad := [n for n in names if not diff(n) > 0]):
    rounds += 1
    more, _ = alternate({f"{n}/{tag}": fns[f"{n}/{tag}"] for n in bad for tag in "M1"},
                        repeats * 2**rounds, timer, warmup=False)
    for key, extra in more.items():
      times[key].extend(extra)
  bad = [n for n in names if not diff(n) > 0]
  seconds = {n: pick(times[f"{n}/M"]) if bad else diff(n) for n in names}
  return seconds, last, {"remeasured": rounds, "prefill_differenced": not bad,
                         "not_differenced": bad}


def decode_phase(plain_tokens: int, spec_tokens: int, plain_s: float, spec_s: float):
  """Decode-phase tokens/s of both and their ratio; None where a call of n tokens minus a
  call of 1 is not positive (a decode phase lost in timing noise: more tokens or repeats)."""
  if not (plain_s > 0 and spec_s > 0 and plain_tokens > 0):
    return None
  return {"plain_tokens_per_s": plain_tokens / plain_s,
          "speculative_tokens_per_s": spec_tokens / spec_s, "speedup": plain_s / spec_s}
