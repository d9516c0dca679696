"""Few-row float32 products and cache attention on XLA:CPU by kernels of specjax's own
(`row_kernel.cc`).

Why. Decoding computes products of one row (plain decoding) or a few (verifying k + 1 drafted
tokens) against every weight: memory-bound work, where reading the weights once should serve
k + 1 rows about as cheaply as one. XLA:CPU's own kernels do not: one row takes Eigen's
matrix-vector kernel, two or more a GEMM (YNNPACK) that on a 2-core host ran five rows at
2.6x and eight at 3x one row, neither near the memory's speed (docs/xla_notes.md, trap 7b;
OpenBLAS reads the same). The kernel here streams each weight once in a packed layout
(`pack`: column panels of 16, row by row) with every row's sums held in registers, so R
rows cost one weight read plus R rows of arithmetic: SmolLM2-135M's chain of products at
T = 1 / 2 / 5 / 8 rows ran 34 / 38 / 43 / 58 ms against XLA's 43 / 77 / 111 / 127 in one
compiled loop on the host that measured it (docs/xla_notes.md, trap 13). Attention over the
cache had the same shape: YNNPACK's small products on one thread, over the whole bucket;
`attention` reads only up to the last visible slot, on the pool, by the same passes.

Where. `one_row_bf16.one_row_safe_matmul` (every model product) calls `matmul` for float32
products of at most `MAX_ROWS` rows whose weight has a packed copy in the current trace: the
packed copies are made once per model by `fused.packed_lm` (the host API's loops take them
as arguments), else once per call, before a decoding loop, by `fused.prefused`; products
outside a decoding loop (training, scoring, long prefills) keep XLA's kernels.
`attention.attend` calls `attention` for a float32 cache and at most `MAX_ATTENTION_ROWS`
query rows a KV head in the same traces (`in_loop`). Only on XLA:CPU, and only where the
kernels build: `enabled()` (policy `$SPECJAX_ROW_KERNEL`: unset or 1 = on XLA:CPU, 0 = off;
CPU kernels, never used on GPU/TPU).

Exactness. A row's sums run in the same order whatever the number of rows, so plain
decoding's one-row products and attention and verification's many-row ones give the same
numbers bit for bit (XLA's GEMM and matrix-vector kernel do not promise that). They round
differently from XLA's kernels (another summation order: ~1e-6 relative), as any kernel
change does.

Build. The first use compiles `row_kernel.cc` with the system's C++ compiler (`$CXX`, else
c++ / g++ / clang++; -O3 -march=native, against the XLA FFI headers jaxlib ships) into
`$SPECJAX_CACHE_DIR/kernels/` (keyed by the source, jaxlib's version and the CPU's flags;
about 10 s once) and registers it with `jax.ffi`. Without a compiler, or if the build fails,
`enabled()` is False with one warning and XLA's kernels run: slower, never wrong.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import warnings

import jax
import jax.numpy as jnp
import jaxlib

from specjax.files import cache_dir
from specjax.models import switches

Array = jax.Array

ENV = "SPECJAX_ROW_KERNEL"
PANEL = 16
MAX_ROWS = 16  # above, a product is compute-bound enough for XLA's GEMM
TARGET = "specjax_row_matmul"
ATTENTION_TARGET = "specjax_row_attention"
MAX_ATTENTION_ROWS = 64  # query rows per KV head (G·T) the attention kernel takes
_SOURCE = pathlib.Path(__file__).with_name("row_kernel.cc")


def policy() -> str:
  """"0" (off), "1" (on XLA:CPU) or "cpu" (unset, the default: on XLA:CPU) from
  $SPECJAX_ROW_KERNEL; a one-line ValueError for any other value."""
  return switches.cpu_default_policy(ENV, "the row kernel")


def _cpu_flags() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith(("flags", "Features")):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor()


def _compiler() -> str | None:
  for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
    if name and shutil.which(name):
      return shutil.which(name)
  return None


def library_path() -> pathlib.Path:
  """Where the built kernel for this source, jaxlib and CPU lives (built or not)."""
  key = hashlib.sha256(_SOURCE.read_bytes() + jaxlib.__version__.encode()
                       + _cpu_flags().encode() + platform.machine().encode()).hexdigest()[:16]
  return cache_dir() / "kernels" / f"row_kernel-{key}.so"


def build(path: pathlib.Path | None = None) -> pathlib.Path:
  """Compiles `row_kernel.cc` into `path` (default `library_path()`) unless it is there.
  RuntimeError naming the compiler and its message when it cannot be built."""
  path = library_path() if path is None else path
  if path.exists():
    return path
  cxx = _compiler()
  if cxx is None:
    raise RuntimeError("no C++ compiler found ($CXX, c++, g++, clang++)")
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  cmd = [cxx, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w",
         f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", str(tmp)]
  try:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  except (OSError, subprocess.TimeoutExpired) as e:
    raise RuntimeError(f"{cxx} failed: {e}") from None
  if done.returncode != 0:
    tmp.unlink(missing_ok=True)
    raise RuntimeError(f"{cxx} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
  os.replace(tmp, path)  # atomic: a concurrent build writes the same bytes
  return path


@functools.lru_cache(maxsize=None)
def _registered() -> bool:
  """Builds (once per machine) and registers the kernel; False, with one warning, when it
  cannot be built or loaded."""
  try:
    lib = ctypes.cdll.LoadLibrary(str(build()))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.SpecjaxRowMatmul),
                                platform="cpu")
    jax.ffi.register_ffi_target(ATTENTION_TARGET,
                                jax.ffi.pycapsule(lib.SpecjaxRowAttention), platform="cpu")
    return True
  except (RuntimeError, OSError, AttributeError) as e:
    warnings.warn(f"specjax: the few-row product kernel is unavailable, XLA's products "
                  f"run instead (slower on the CPU, same results up to rounding): {e}",
                  RuntimeWarning, stacklevel=2)
    return False


@functools.lru_cache(maxsize=None)
def enabled() -> bool:
  """Whether decoding loops use the kernel: on XLA:CPU unless $SPECJAX_ROW_KERNEL = 0, and
  only where it builds. Read once per process."""
  if policy() == "0" or jax.default_backend() != "cpu":
    return False
  return _registered()


def pack(w: Array, transposed: bool = False) -> Array:
  """The kernel's layout of a float32 weight: W [d, n] (or, `transposed`, W stored [n, d]
  as the tied embedding is) as panels [ceil(n / 16), d, 16] of W's columns, the last one
  padded with zeros."""
  wt = w.T if transposed else w  # [d, n]
  d, n = wt.shape
  pad = -n % PANEL
  if pad:
    wt = jnp.pad(wt, ((0, 0), (0, pad)))
  return wt.reshape(d, (n + pad) // PANEL, PANEL).transpose(1, 0, 2)


def packed_shape(w: Array, transposed: bool = False) -> tuple[int, int, int]:
  """The shape `pack` gives the weight: [panels, d, PANEL]."""
  d, n = w.shape[::-1] if transposed else w.shape
  return (-(-n // PANEL), d, PANEL)


def matmul(x: Array, packed: Array, n: int) -> Array:
  """x [..., d] (float32, at most MAX_ROWS rows in all) @ the weight `packed` holds ->
  [..., n] float32."""
  lead, d = x.shape[:-1], x.shape[-1]
  rows = 1
  for s in lead:
    rows *= s
  panels = packed.shape[0]
  call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((rows, PANEL * panels), jnp.float32),
                          vmap_method="sequential")
  y = call(x.reshape(rows, d).astype(jnp.float32), packed)
  return y[:, :n].reshape(*lead, n)


def attention(q_NRD: Array, k_NDS: Array, v_NSD: Array, mask_NRS: Array) -> Array:
  """Softmax attention of few query rows per buffer row n over a float32 cache: queries
  [N, R, D] (already scaled), keys [N, D, S], values [N, S, D], mask [N, R, S] (True:
  visible) -> float32 [N, R, D]. Reads only the slots below the last visible one; a row that
  sees no slot gets zeros. A row's result depends on its own query and visible slots only,
  bit for bit, whatever R is."""
  call = jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q_NRD.shape, jnp.float32),
                          vmap_method="sequential")
  return call(q_NRD.astype(jnp.float32), k_NDS, v_NSD, mask_NRS.astype(bool))


def in_loop() -> bool:
  """Whether this trace is inside `packed` (a decoding loop's `fused.prefused`) with the
  kernel `active()`: where few-row attention takes the kernel."""
  return _PACKED.get() is not None and active()


# packed weights of the current trace: {(id of the weight, transposed): (weight, packed)}
_PACKED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("row_kernel_packed",
                                                                      default=None)


_SUSPENDED: contextvars.ContextVar[bool] = contextvars.ContextVar("row_kernel_off",
                                                                  default=False)


@contextlib.contextmanager
def suspended():
  """Traces the enclosed decoding loops with XLA's products, as if `enabled()` were False
  (benchmarks time both in one process). A trace-time setting: give it its own `jax.jit`."""
  with switches.setting(_SUSPENDED, True):
    yield


def active() -> bool:
  """`enabled()` and not `suspended()` in this trace."""
  return not _SUSPENDED.get() and enabled()


@contextlib.contextmanager
def packed(weights, made=()):
  """Within the block, `packed_for` finds a packed copy of each (weight, transposed) pair
  of `weights`, made here once (before a decoding loop: loop-invariant, outside it), and of
  each (weight, transposed, copy) triple of `made` (copies made before the call)."""
  table = dict(_PACKED.get() or {})
  for w, transposed, copy in made:
    table[(id(w), transposed)] = (w, copy)
  for w, transposed in weights:
    key = (id(w), transposed)
    if key not in table:
      table[key] = (w, pack(w, transposed))
  with switches.setting(_PACKED, table):
    yield


def packed_for(w: Array, transposed: bool) -> Array | None:
  """The packed copy `packed` made of this very weight array, or None."""
  found = (_PACKED.get() or {}).get((id(w), transposed))
  if found is not None and found[0] is w:
    return found[1]
  return None
