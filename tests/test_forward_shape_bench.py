"""The forward-timing harness of benchmarks/bench_core.py and bench_forward_shape.py: a
forward is timed inside a compiled loop (the fused weights concatenated once, as the
decoding loop does), and the loop really runs n forwards on the model's own logits. Figures
are never asserted (benchmarks measure, tests check the plumbing)."""

import json
import math
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_core  # noqa: E402
from specjax.models import cache as kv, row_kernel  # noqa: E402
from specjax.models.lm import LM  # noqa: E402
from specjax.models.presets import PRESETS  # noqa: E402


@pytest.fixture(scope="module")
def lm():
  return LM.of(bench_core.random_model(PRESETS["tiny-llama"], seed=3))


@pytest.mark.parametrize("t,batch,window", [(1, 1, 0), (3, 1, 0), (3, 2, 4)])
def test_the_looped_forward_runs_n_forwards_of_the_model(lm, t, batch, window):
  """acc(n) = n × the standalone forward's first logit: the loop runs n forwards (a loop
  that ran one, or skipped its body, fails), each on the same rows and cache slots; with a
  batch and a tree level's window mask (bench_trees), the same rows under the same mask."""
  context, cache_len = 20, 64
  cache = kv.set_lengths(kv.init(lm.config, batch, cache_len),
                         jnp.full((batch,), context, jnp.int32))
  toks = jnp.zeros((batch, t), jnp.int32)
  pos = jnp.broadcast_to(context + jnp.arange(t, dtype=jnp.int32), (batch, t))
  mask = None if window == 0 else jnp.ones((t, t + window), bool)
  logits, _ = bench_core._forward(lm, toks, pos, cache, mask)
  one = float(logits[0, 0])
  assert one != 0.0
  if window:  # the mask reaches the model: the causal forward differs
    causal, _ = bench_core._forward(lm, toks, pos, kv.set_lengths(
        kv.init(lm.config, batch, cache_len), jnp.full((batch,), context, jnp.int32)))
    assert float(causal[0, 0]) != pytest.approx(one, rel=1e-6)
  fn = bench_core.looped_forward(lm, t, context, cache_len, batch=batch, window=window)
  for n in (1, 2, 5):
    np.testing.assert_allclose(float(fn(n)), n * one, rtol=1e-5)


def test_time_looped_alternates_and_differences(monkeypatch):
  """On a fake clock where a loop of n forwards of variant `key` takes 0.5 + n × cost[key]
  seconds: each repeat runs every variant's short then long loop in turn, and the result is
  exactly cost[key] (the fixed 0.5 s of a call cancels in the difference)."""
  clock, calls, cost = [0.0], [], {"a": 0.03, "b": 0.07}
  monkeypatch.setattr(bench_core.time, "perf_counter", lambda: clock[0])

  def fake(key):
    def fn(n):
      calls.append((key, n))
      clock[0] += 0.5 + n * cost[key]
      return np.float32(0)
    return fn
  seconds = bench_core.time_looped({k: fake(k) for k in cost}, repeats=3, lo=1, hi=5)
  assert seconds == pytest.approx(cost, abs=1e-12)
  assert calls == [("a", 1), ("b", 1)] + [("a", 1), ("a", 5), ("b", 1), ("b", 5)] * 3


@pytest.mark.slow
def test_the_forward_shape_benchmark_runs_on_a_tiny_shape(tmp_path):
  out = tmp_path / "shape.json"
  proc = subprocess.run(
      [sys.executable, "benchmarks/bench_forward_shape.py", "--shape", "tiny-llama",
       "--contexts", "64", "--ts", "1", "2", "3", "--split-rows", "3", "--dtypes", "float32",
       "--repeats", "2", "--new-tokens", "4", "--xla-products", "--out", str(out)],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  run, = json.loads(out.read_text())["runs"]
  assert set(run["forward_ms"]["64"]) == {"1", "2", "3"}
  assert run["verify_cost"]["64"]["1"] == 1.0
  assert set(run["split_rows"]["forward_ms"]["64"]) == {"2", "3"}
  if row_kernel.enabled():  # XLA's products beside the row kernel's
    assert set(run["xla_products"]["forward_ms"]["64"]) == {"1", "2", "3"}
  plain = run["plain"]
  for key in ("memory_floor_ms", "matmul_chain_ms"):  # a byte count, a direct timing
    assert plain[key] > 0, key
  # differences of two calls: on a tiny model noise can make them negative (figures are
  # never asserted), so only present and finite
  for key in ("plain_tok_s", "decode_step_ms", "fraction_of_floor", "fraction_of_matmul_chain"):
    assert math.isfinite(plain[key]), key
  assert run["kernels"]["total"] > 0
