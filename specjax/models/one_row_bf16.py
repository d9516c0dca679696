"""One-row bf16 products padded to two rows on XLA:CPU (docs/xla_notes.md, trap 3).

XLA:CPU takes a costly path for a single-row bf16 matmul (a ~10x slower kernel on one host,
a float32 copy of the weight per call on another). `one_row_safe_matmul` (the model's dense
layers) pads such a row and drops the duplicate, on the CPU only (`pad_one_row_bf16`), or
as $SPECJAX_PAD_ONE_ROW_BF16 forces (`padding_policy`, recorded by calibrations and run
directories).

Also here: whether products sharing an input are fused (`fuse_products`, on XLA:CPU by
default, $SPECJAX_FUSE_PRODUCTS), and, off by default, a product of 2..limit rows computed
as that many one-row products (`split_rows`, $SPECJAX_ROW_PRODUCTS), the experiment of docs/xla_notes.md, trap 7b: on
XLA:CPU one row takes Eigen's matrix-vector kernel, two or more a GEMM (YNNPACK) that reads
the weights at about half its speed; split rows re-read a weight from cache. Each split row
computes exactly the one-row product plain decoding computes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os

import jax
import jax.numpy as jnp

from specjax.models import row_kernel, switches

Array = jax.Array


PAD_ENV = "SPECJAX_PAD_ONE_ROW_BF16"
ROWS_ENV = "SPECJAX_ROW_PRODUCTS"
_ROW_LIMIT: contextvars.ContextVar = contextvars.ContextVar("row_products", default=None)


def row_split_limit() -> int:
  """Products of 2..limit rows are split into one-row products (0: never, the default).
  `split_rows` (at trace time) wins over $SPECJAX_ROW_PRODUCTS."""
  limit = _ROW_LIMIT.get()
  if limit is not None:
    return limit
  env = os.environ.get(ROWS_ENV, "0")
  if not env.isdigit():
    raise ValueError(f"${ROWS_ENV} must be a non-negative int (rows up to which a product "
                     f"is split into one-row products; 0: never), got {env!r}")
  return int(env)


@contextlib.contextmanager
def split_rows(limit: int):
  """Traces the enclosed model calls with products of 2..limit rows split into one-row
  products (0: never). A trace-time setting: give each setting its own `jax.jit`."""
  if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
    raise ValueError(f"split_rows limit must be a non-negative int, got {limit!r}")
  with switches.setting(_ROW_LIMIT, limit):
    yield


def padding_policy() -> str:
  """"1" / "0" when $SPECJAX_PAD_ONE_ROW_BF16 forces the one-row bf16 padding on / off,
  "cpu" (the default) when it pads on XLA:CPU only (`pad_one_row_bf16`)."""
  return switches.cpu_default_policy(PAD_ENV, "padded")


@functools.lru_cache(maxsize=None)
def pad_one_row_bf16() -> bool:
  """Whether one-row bf16 products are padded to two rows (docs/xla_notes.md, trap 3): on
  XLA:CPU yes, unless $SPECJAX_PAD_ONE_ROW_BF16 = 0 (= 1 forces it anywhere); never on
  GPU/TPU. Read once per process.

  Why always on the CPU: XLA:CPU computes an unpadded one-row bf16 product from a float32
  copy of the weight, and a decoding loop makes those copies once per call, before it starts
  (loop-invariant code motion). On the shipped target that is 13 ms per call (ten plain
  steps) for the same per-step time: a plain `generate` call of one token took 21 ms
  unpadded and 7.6 ms padded, 64 tokens 97-103 ms and 85 ms. Timing single products in a
  loop (how this was once decided per shape) hides the copy: there one row looked as fast
  or faster. On the first host a one-row bf16 product ran ~10x slower than two rows."""
  return switches.on(padding_policy())


FUSE_ENV = "SPECJAX_FUSE_PRODUCTS"


def fusion_policy() -> str:
  """"1" / "0" when $SPECJAX_FUSE_PRODUCTS forces fused products (`fuse_products`) on / off,
  "cpu" (the default) when they are fused on XLA:CPU only."""
  return switches.cpu_default_policy(FUSE_ENV, "fused")


@functools.lru_cache(maxsize=None)
def fuse_products() -> bool:
  """Whether the products that share an input (q|k|v, gate|up) are computed as one product
  of their concatenated weights (`fused.project`): on XLA:CPU yes, unless
  $SPECJAX_FUSE_PRODUCTS = 0 (= 1 forces it anywhere). Read once per process.

  Why on the CPU: there a one-row product of a small weight streams it at about half the
  bandwidth the 113 MB LM head reaches; four wider products a layer instead of seven make
  SmolLM2-135M's one-row step 10-13% faster (docs/xla_notes.md, trap 7b). The
  concatenation is loop-invariant: inside a decoding loop XLA computes it once per call,
  before the loop. Unmeasured on GPU (where it would also hold a fused copy of those weights
  for the call), so off there."""
  return switches.on(fusion_policy())


def product_policies() -> dict:
  """How this process computes products, as what a timing depends on: the one-row bf16
  padding and fusion policies, and the few-row kernels' build (source, jaxlib, CPU) where
  the decoding loops use them (`row_kernel.active()`), else None."""
  return {"pad_one_row_bf16": padding_policy(), "fuse_products": fusion_policy(),
          "row_kernel": row_kernel.library_path().name if row_kernel.active() else None}


# the products the row kernel computes: einsum spec -> whether the weight is stored [n, d]
_ROW_KERNEL_SPECS = {"...i,io->...o": False, "btd,vd->btv": True}


def one_row_safe_matmul(spec: str, x: Array, w: Array) -> Array:
  """einsum with f32 accumulation. A float32 product of at most `row_kernel.MAX_ROWS` rows
  whose weight `row_kernel.packed` packed (in a decoding loop on XLA:CPU) is the row
  kernel's. A single bf16 row is padded to two on XLA:CPU
  (`pad_one_row_bf16`: there a one-row bf16 product takes a costly path, docs/xla_notes.md,
  trap 3); the duplicate row is dropped. x's rows are its axis -2 (the output's too); with
  `row_split_limit()` >= n > 1 rows (and every other leading axis 1) each row is its own
  one-row product."""
  n = x.shape[-2] if x.ndim >= 2 else 1
  if w.dtype == jnp.float32 and spec in _ROW_KERNEL_SPECS and (
      math.prod(x.shape[:-1]) <= row_kernel.MAX_ROWS):
    packed = row_kernel.packed_for(w, _ROW_KERNEL_SPECS[spec])
    if packed is not None:  # inside a decoding loop (`fused.prefused` packed it)
      return row_kernel.matmul(x, packed, w.shape[0 if _ROW_KERNEL_SPECS[spec] else 1])
  if 1 < n <= row_split_limit() and math.prod(x.shape[:-2]) == 1:
    return jnp.concatenate([one_row_safe_matmul(spec, x[..., i:i + 1, :], w)
                            for i in range(n)], axis=-2)
  if (w.dtype == jnp.bfloat16 and x.ndim >= 2 and math.prod(x.shape[:-1]) == 1
      and pad_one_row_bf16()):
    y = jnp.einsum(spec, jnp.concatenate([x, x], axis=-2), w,
                   preferred_element_type=jnp.float32)
    return y[..., :1, :]
  return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
