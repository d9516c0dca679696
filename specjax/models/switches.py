"""How the models' products are switched: environment policies that default to "on XLA:CPU
only" (`cpu_default_policy`, `on`) and trace-time settings held in context variables
(`setting`). Shared by `one_row_bf16` (padding, fusion, split rows) and `row_kernel`."""

from __future__ import annotations

import contextlib
import contextvars
import os

import jax


def cpu_default_policy(name: str, what: str) -> str:
  """$name as "0" / "1", or "cpu" when unset (the default: on XLA:CPU only); one-line
  ValueError for any other value, naming the variable and what it switches."""
  env = os.environ.get(name)
  if env is None:
    return "cpu"
  if env not in ("0", "1"):
    raise ValueError(f"${name} must be 0 or 1 (or unset: {what} on XLA:CPU only), "
                     f"got {env!r}")
  return env


def on(policy: str) -> bool:
  """A `cpu_default_policy` value as a switch: forced on / off, or on XLA:CPU only."""
  return policy == "1" if policy != "cpu" else jax.default_backend() == "cpu"


@contextlib.contextmanager
def setting(var: contextvars.ContextVar, value):
  """`var` holds `value` within the block (a trace-time setting: give it its own jit)."""
  token = var.set(value)
  try:
    yield
  finally:
    var.reset(token)
