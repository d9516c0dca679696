"""Fused products (`fused.project`, issue 43): q|k|v and gate|up as one product of
their concatenated weights on XLA:CPU. The same numbers as separate products (bit for bit at
one row), biases included; the policy's environment variable is checked."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.models import one_row_bf16
from specjax.models.fused import project
from specjax.models.transformer import Dense


def _denses(bias: bool):
  rngs = nnx.Rngs(0)
  layers = [Dense(64, n, bias=bias, dtype=jnp.float32, rngs=rngs) for n in (64, 32, 32)]
  if bias:
    for i, layer in enumerate(layers):
      layer.bias[...] = jnp.linspace(-1.0, 1.0, layer.bias.shape[0]) * (i + 1)
  return layers


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5])
def test_fused_equals_separate_products(monkeypatch, bias, rows):
  layers = _denses(bias)
  x = jax.random.normal(jax.random.key(1), (1, rows, 64))
  monkeypatch.setattr(one_row_bf16, "fuse_products", lambda: False)
  apart = [np.asarray(y) for y in jax.jit(lambda x: project(x, layers))(x)]
  monkeypatch.setattr(one_row_bf16, "fuse_products", lambda: True)
  fused = [np.asarray(y) for y in jax.jit(lambda x: project(x, layers))(x)]
  assert [f.shape for f in fused] == [(1, rows, 64), (1, rows, 32), (1, rows, 32)]
  for a, f in zip(apart, fused):
    if rows == 1:
      np.testing.assert_array_equal(f, a)
    else:
      np.testing.assert_allclose(f, a, rtol=1e-5, atol=1e-5)


def test_the_policy_is_cpu_by_default_and_the_variable_is_checked(monkeypatch):
  monkeypatch.delenv(one_row_bf16.FUSE_ENV, raising=False)
  assert one_row_bf16.fusion_policy() == "cpu"
  monkeypatch.setenv(one_row_bf16.FUSE_ENV, "yes")
  with pytest.raises(ValueError, match=r"\$SPECJAX_FUSE_PRODUCTS must be 0 or 1 .*'yes'"):
    one_row_bf16.fusion_policy()
