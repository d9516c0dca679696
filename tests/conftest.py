"""Test-wide JAX settings.

- Strict rank promotion: an implicit broadcast between arrays of different rank raises, so
  shape bugs surface in tests instead of silently broadcasting.
- LLVM optimisation level 0 for XLA:CPU (compile time dominates tiny-model tests).
- float32 matmul precision: exactness tests (greedy identity, logits parity) compare
  results of differently shaped matmuls; TF32/bf16 passes on accelerators would add noise.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# `specjax run` keeps a persistent XLA cache in the user cache dir; tests must not write there.
os.environ.setdefault("SPECJAX_NO_COMPILATION_CACHE", "1")
# Nor anything else (trained models, loop calibrations): one throwaway cache dir per session,
# unless the caller named one.
if "SPECJAX_CACHE_DIR" not in os.environ:
  import atexit
  import shutil
  import tempfile
  os.environ["SPECJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="specjax-tests-")
  atexit.register(shutil.rmtree, os.environ["SPECJAX_CACHE_DIR"], ignore_errors=True)
# Tests compile many small programs and run each briefly: LLVM optimisation level 0 halves
# XLA:CPU compile time. Benchmarks and real runs keep the default level.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "float32")

# Garbage collection only between tests, in the main thread, and no tqdm monitor thread:
# freed compiled programs are destroyed at a known point instead of whenever any thread
# allocates (a guard added while chasing worker crashes inside XLA:CPU compilation, which
# it did not cure; see BUILD_NOTES.md, "Known limits").
# Collecting every few tests keeps memory bounded.
import gc  # noqa: E402

import pytest  # noqa: E402
import tqdm  # noqa: E402

gc.disable()
tqdm.tqdm.monitor_interval = 0  # no monitor thread
_tests_since_collect = [0]


@pytest.fixture(autouse=True)
def _collect_garbage_between_tests():
  yield
  _tests_since_collect[0] += 1
  if _tests_since_collect[0] >= 8:
    _tests_since_collect[0] = 0
    gc.collect()
