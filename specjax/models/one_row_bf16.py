"""One-row bf16 products padded to two rows on XLA:CPU (docs/xla_notes.md, trap 3).

XLA:CPU takes a costly path for a single-row bf16 matmul (a ~10x slower kernel on one host,
a float32 copy of the weight per call on another). `one_row_safe_matmul` (the model's dense
layers) pads such a row and drops the duplicate, on the CPU only (`pad_one_row_bf16`), or
as $SPECJAX_PAD_ONE_ROW_BF16 forces (`padding_policy`, recorded by calibrations and run
directories).
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp

Array = jax.Array


PAD_ENV = "SPECJAX_PAD_ONE_ROW_BF16"


def padding_policy() -> str:
  """"1" / "0" when $SPECJAX_PAD_ONE_ROW_BF16 forces the one-row bf16 padding on / off,
  "cpu" (the default) when it pads on XLA:CPU only (`pad_one_row_bf16`)."""
  env = os.environ.get(PAD_ENV)
  if env is None:
    return "cpu"
  if env not in ("0", "1"):
    raise ValueError(f"${PAD_ENV} must be 0 or 1 (or unset: padded on XLA:CPU only), "
                     f"got {env!r}")
  return env


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
  policy = padding_policy()
  if policy != "cpu":
    return policy == "1"
  return jax.default_backend() == "cpu"


def one_row_safe_matmul(spec: str, x: Array, w: Array) -> Array:
  """einsum with f32 accumulation; a single bf16 row is padded to two on XLA:CPU
  (`pad_one_row_bf16`: there a one-row bf16 product takes a costly path, docs/xla_notes.md,
  trap 3); the duplicate row is dropped."""
  if (w.dtype == jnp.bfloat16 and x.ndim >= 2 and math.prod(x.shape[:-1]) == 1
      and pad_one_row_bf16()):
    y = jnp.einsum(spec, jnp.concatenate([x, x], axis=-2), w,
                   preferred_element_type=jnp.float32)
    return y[..., :1, :]
  return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
