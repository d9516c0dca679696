"""Test-wide JAX settings.

- Strict rank promotion: an implicit broadcast between arrays of different rank raises, so
  shape bugs surface in tests instead of silently broadcasting.
- LLVM optimisation level 0 for XLA:CPU and, on jaxlib 0.10, its elemental emitters
  (compile time dominates tiny-model tests).
- float32 matmul precision: exactness tests (greedy identity, logits parity) compare
  results of differently shaped matmuls; TF32/bf16 passes on accelerators would add noise.
"""

import importlib.metadata
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
# At level 0, XLA:CPU's older elemental emitters compile faster than its MLIR fusion
# emitters: the suite ran in 9 min 49 s instead of 17 min 47 s (BUILD_NOTES.md, "Testing").
# XLA aborts the process on a flag it does not know, so this one is passed only to the
# jaxlib releases it was checked with. Real runs keep the fusion emitters: at the default
# level they compile and run faster.
_FLAGS = ["--xla_backend_optimization_level=0"]
if importlib.metadata.version("jaxlib").startswith("0.10."):
  _FLAGS.append("--xla_cpu_use_fusion_emitters=false")
for _flag in _FLAGS:
  if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "float32")

# Compiled programs are freed after each test module. XLA:CPU maps ~15 memory regions per
# compiled program and jit caches keep every program alive, so one process running the
# whole suite reached the kernel's limit of 65,530 mappings (vm.max_map_count) and crashed
# inside the next compile (SIGSEGV or abort in `backend_compile_and_load`). Clearing the
# caches unmaps them; a module's own programs stay cached while it runs.
import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs_after_each_module():
  yield
  jax.clear_caches()
  gc.collect()


@pytest.fixture
def umask():
  """Sets the process umask for a test (restored after): `umask(0o022)` inside a test."""
  old = os.umask(0o022)
  os.umask(old)
  yield os.umask
  os.umask(old)
