"""Timing on a shared machine and the standalone step costs a prediction is built from.

`alternate(fns, repeats)`, the one alternating-timing loop (drift and other load hit every
callable alike); `forward_seconds`, one jitted forward of T tokens per row at a fixed
context; `step_costs`, the standalone costs (t_1, v, c) of one speculative cycle, used when
no calibrated loop costs are given (docs/cost_model.md, "c as measured"); `hardware()`, this
machine's roofline, calibrated once per process.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from specjax.analysis import roofline
from specjax.calibration import timing
from specjax.verify import trees
from specjax.models.lm import LM
from specjax.models import cache as kv


@functools.lru_cache(maxsize=1)
def hardware() -> roofline.Hardware:
  """This machine's roofline, calibrated once per process (on CPU a 64 MiB stream and a
  1024² matmul, fastest of 3 calls each: a second or two with compilation; 1 GiB and 8192²
  on accelerators)."""
  return roofline.calibrate(repeats=3)


@dataclasses.dataclass(frozen=True)
class Timing:
  """Seconds of every timed call of one callable (in order) and what its last call gave."""

  times: tuple[float, ...]
  result: Any

  @property
  def median(self) -> float:
    return statistics.median(self.times)

  @property
  def fastest(self) -> float:
    """Other load on a shared machine only slows a call down: the fastest call is the one
    to use when a time is differenced with another."""
    return min(self.times)


def alternate(fns: Mapping[str, Callable[[], Any]], repeats: int) -> dict[str, Timing]:
  """{name: Timing} of each callable, alternated (`specjax.calibration.timing.alternate`: one
  warm-up call each, then every callable in turn, `repeats` times)."""
  times, last = timing.alternate(fns, repeats)
  return {name: Timing(tuple(times[name]), last[name]) for name in fns}


@functools.partial(jax.jit, donate_argnames="cache")
def _forward(lm, tokens, positions, cache):
  """One forward against the cache; the cache is donated and returned (lengths unchanged, so
  feeding it back keeps the context fixed) so the write updates it in place, as in the
  decoding loop, instead of copying the whole cache every call (an undonated cache
  argument costs a full copy per step; see docs/xla_notes.md, trap 1)."""
  logits, _, cache = lm(tokens, positions, cache)
  return logits[:, -1], cache


@functools.lru_cache(maxsize=None)
def forward_seconds(model, batch: int, t: int, context: int, cache_len: int, repeats: int,
                    min_sample_s: float = 0.02) -> float:
  """Median seconds of one forward of `t` tokens per row at `context` cached tokens.

  Tiny models run in well under a millisecond, where one timing is mostly noise: each sample
  is the mean over a burst of calls lasting at least `min_sample_s`; the median is over
  max(repeats, 5) samples. Cached per process (by model and shape): every point of a sweep
  that needs the same forward reuses one measurement.
  """
  lm = LM.of(model)
  cache = kv.set_lengths(kv.init(lm.config, batch, cache_len),
                         jnp.full((batch,), context, jnp.int32))
  toks = jnp.zeros((batch, t), jnp.int32)
  pos = context + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))
  out, cache = jax.block_until_ready(_forward(lm, toks, pos, cache))  # compile
  start = time.perf_counter()
  out, cache = jax.block_until_ready(_forward(lm, toks, pos, cache))
  once = max(time.perf_counter() - start, 1e-6)
  burst = max(1, min(1000, int(min_sample_s / once)))
  times = []
  for _ in range(max(repeats, 5)):
    start = time.perf_counter()
    for _ in range(burst):
      out, cache = _forward(lm, toks, pos, cache)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / burst)
  return statistics.median(times)


def draft_passes(tree) -> tuple[int, int]:
  """(D, W): draft passes per cycle and the rows each pass after the first feeds.

  One pass per tree level (a level's nodes share a pass), so D = the depth (k for a chain);
  the first pass feeds 2 tokens (the catch-up rule: the last committed token and the root),
  each later one a whole level, W = the widest level fed (1 for a chain).
  """
  if isinstance(tree, trees.DynamicTree):
    return tree.depth, tree.width
  depth = tree.max_depth
  return depth, int(max(tree.level_sizes[1:depth], default=1))


@dataclasses.dataclass(frozen=True)
class StepCosts:
  """Standalone forward timings of one cycle's parts, in seconds, at a fixed context:

  t1       one-token target step (one plain decode step);
  t_verify target forward of the N + 1 verified nodes;
  t_draft  one cycle's draft passes, d(2) + (D − 1)·d(W) (`draft_passes`); None for a
           drafter with no standalone forward (a head, whose cost only the loop shows);
  and in units of t1: v = t_verify / t1, c = t_draft / (D·t1) (the draft's cost per pass;
  None without t_draft), cycle = D·c + v (a whole cycle).
  """

  t1: float
  t_verify: float
  t_draft: float | None
  passes: int

  @property
  def v(self) -> float:
    return self.t_verify / self.t1

  @property
  def c(self) -> float | None:
    return None if self.t_draft is None else self.t_draft / (self.passes * self.t1)

  @property
  def cycle(self) -> float:
    return self.passes * self.c + self.v


def step_costs(target, draft, batch: int, tree, context: int, cache_len: int,
               repeats: int) -> StepCosts:
  """The costs every prediction here uses, timed standalone at `context` (module doc).
  draft None: a drafter with no standalone forward (a head): t_draft None."""
  passes, width = draft_passes(tree)
  t1 = forward_seconds(target, batch, 1, context, cache_len, repeats)
  t_verify = forward_seconds(target, batch, tree.n_nodes, context, cache_len, repeats)
  t_draft = None
  if draft is not None:
    t_draft = forward_seconds(draft, batch, 2, context, cache_len, repeats)
    if passes > 1:
      t_draft += (passes - 1) * forward_seconds(draft, batch, width, context, cache_len,
                                                repeats)
  return StepCosts(t1=t1, t_verify=t_verify, t_draft=t_draft, passes=passes)
