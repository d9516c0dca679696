"""The matmul-precision policy: under which precision the target computes p.

Exactness compares two computations of the same target: plain decoding (one row a step) and
the verify pass (N + 1 rows a cycle). Greedy identity holds token for token only if both
compute their logits under the same arithmetic. On CPUs float32 products are float32
whatever is asked; on accelerators the backend's *default* for float32 products may be
faster and coarser (TF32 tensor cores on NVIDIA GPUs, bfloat16 passes on TPUs), and a
one-row and a multi-row product can then round differently enough to flip an argmax on a
near-tie. So both loops run under one named policy:

- "highest" (the default): float32 products in full float32 (`precision=HIGHEST` on every
  dot). Use it for exactness work; it is the setting under which greedy identity is tested.
- "high": about float32 quality from cheaper passes (TF32 with error correction / bf16x3).
- "default": the backend's fastest (TF32 or a single bf16 pass). Faster on accelerators;
  speculative and plain decoding still compute p under the same setting, so the output law
  is still the target's *under that arithmetic*, but greedy identity may break on
  near-ties (see docs/exactness.md, "Numerics").

Weights stored in bfloat16 (`ModelConfig.dtype`) are a separate choice: their products take
bf16 inputs with float32 accumulation under every policy.

The loops (`specjax.engine.loop`) take the policy as a static `precision` argument, "highest" by
default, and trace every product under it, so a direct call and the host API's compile the
same program; changing the policy compiles the loop once more.
"""

from __future__ import annotations

import contextlib

import jax

PRECISIONS = ("highest", "high", "default")
DEFAULT_PRECISION = "highest"


def check_precision(value) -> str:
  """The policy name, or ValueError naming the argument and the allowed values."""
  if not isinstance(value, str) or value not in PRECISIONS:
    raise ValueError(f"precision must be one of {PRECISIONS}, got {value!r}")
  return value


@contextlib.contextmanager
def matmul_precision(name: str):
  """Runs (traces) the enclosed JAX computations under the named policy."""
  with jax.default_matmul_precision(check_precision(name)):
    yield
