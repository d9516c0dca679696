"""One-row bf16 products padded to two rows where that is faster (docs/xla_notes.md, trap 3).

On some CPUs and shapes a single-row bf16 matmul takes a much slower XLA:CPU path than two
rows. `one_row_safe_matmul` (the model's dense layers) pads such a row and drops the
duplicate; whether to pad is decided per product shape (`pad_one_row_bf16`: measured once per
process, never on GPU/TPU) or forced by $SPECJAX_PAD_ONE_ROW_BF16 (`padding_policy`,
recorded by calibrations and run directories).
"""

from __future__ import annotations

import functools
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


PAD_ENV = "SPECJAX_PAD_ONE_ROW_BF16"


def padding_policy() -> str:
  """"1" / "0" when $SPECJAX_PAD_ONE_ROW_BF16 forces the one-row bf16 padding on / off,
  "measured" when `pad_one_row_bf16` measures it per product shape (the default)."""
  env = os.environ.get(PAD_ENV)
  if env is None:
    return "measured"
  if env not in ("0", "1"):
    raise ValueError(f"${PAD_ENV} must be 0 or 1 (or unset: measured), got {env!r}")
  return env


@functools.lru_cache(maxsize=None)
def pad_one_row_bf16(spec: str, x_ndim: int, d: int, w_shape: tuple[int, ...]) -> bool:
  """Whether a one-row bf16 product `einsum(spec, x, w)` (x of rank x_ndim, last axis d) is
  padded to two rows (docs/xla_notes.md, trap 3). Forced by $SPECJAX_PAD_ONE_ROW_BF16 = 1 or
  0 (read once per process and shape, like the measurement); never on
  GPU/TPU; on XLA:CPU measured once per process and product shape, because CPUs disagree
  and so do shapes: on the first host a one-row bf16 product ran ~10x slower than two
  rows; on this one (AMX) a [1, 256] x [256, 1024] product takes 10.6 us against 31-39 us
  for two rows, while a [1, 1024] x [1024, 1024] one takes 110-139 us against 75-87 us.
  Padded when one row takes more than 1.5x two rows."""
  policy = padding_policy()
  if policy != "measured":
    return policy == "1"
  if jax.default_backend() != "cpu":
    return False
  with jax.ensure_compile_time_eval():
    return _one_row_bf16_is_slow(spec, x_ndim, d, w_shape)


def _one_row_bf16_is_slow(spec: str, x_ndim: int, d: int, w_shape: tuple[int, ...],
                          n: int = 16, repeats: int = 5) -> bool:
  """Times n one-row and n two-row bf16 products of this spec and weight shape (float32
  accumulation; fastest of `repeats`; ~0.2 s with its two compiles)."""
  w = jnp.asarray(np.random.default_rng(0).standard_normal(w_shape), jnp.bfloat16)

  def run(x, w):
    body = lambda i, acc: acc + jnp.sum(jnp.einsum(
        spec, (x * (1.0 + i * 1e-3)).astype(jnp.bfloat16), w,
        preferred_element_type=jnp.float32))
    return jax.lax.fori_loop(0, n, body, jnp.zeros((), jnp.float32))

  f = jax.jit(run)
  best = {}
  for rows in (1, 2):
    x = jnp.ones((1,) * (x_ndim - 2) + (rows, d), jnp.float32)
    f(x, w).block_until_ready()
    times = []
    for _ in range(repeats):
      t = time.perf_counter()
      f(x, w).block_until_ready()
      times.append(time.perf_counter() - t)
    best[rows] = min(times)
  return best[1] > 1.5 * best[2]


def one_row_safe_matmul(spec: str, x: Array, w: Array) -> Array:
  """einsum with f32 accumulation; a single bf16 row is padded to two where that is faster
  for this shape (`pad_one_row_bf16`: on some CPUs and shapes a one-row bf16 product takes
  a much slower path, docs/xla_notes.md, trap 3); the duplicate row is dropped."""
  if (w.dtype == jnp.bfloat16 and x.ndim >= 2 and math.prod(x.shape[:-1]) == 1
      and pad_one_row_bf16(spec, x.ndim, x.shape[-1], tuple(w.shape))):
    y = jnp.einsum(spec, jnp.concatenate([x, x], axis=-2), w,
                   preferred_element_type=jnp.float32)
    return y[..., :1, :]
  return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
