"""The few-row product kernel (`row_kernel`, issue 43) at SmolLM2-135M's sizes: the same
products as XLA's up to rounding, a row's result bit-identical whatever the number of rows
(the property plain decoding and verification share), used by decoding loops and only there,
and a clear error or a warned fallback when it cannot be used."""

import contextlib
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.drafters.lookup import LookupDrafter
from specjax.engine import decoding
from specjax.models import row_kernel
from specjax.models.fused import prefused
from specjax.models.lm import LM
from specjax.models.presets import PRESETS
from specjax.models.transformer import Transformer

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu" or not row_kernel.enabled(),
                                reason="the row kernel runs on XLA:CPU where it builds")


def _matmul(x, w, transposed=False):
  n = w.shape[0] if transposed else w.shape[1]
  return jax.jit(lambda x, w: row_kernel.matmul(x, row_kernel.pack(w, transposed), n))(x, w)


@pytest.mark.parametrize("shape", [(576, 3072), (1536, 576), (576, 960), (100, 37)])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 13, 16])
def test_matches_xla_products(shape, rows):
  d, n = shape
  k1, k2 = jax.random.split(jax.random.key(rows))
  x = jax.random.normal(k1, (rows, d))
  w = jax.random.normal(k2, (d, n)) * 0.05
  got = np.asarray(_matmul(x, w))
  want = np.asarray(jnp.dot(x, w, precision="highest"))
  assert got.shape == (rows, n)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def test_tied_head_at_a_real_vocabulary():
  """The LM head over a 49,152-id embedding stored [V, d] (SmolLM2's), batch 2 x 3 rows."""
  k1, k2 = jax.random.split(jax.random.key(0))
  x = jax.random.normal(k1, (2, 3, 576))
  emb = jax.random.normal(k2, (49152, 576)) * 0.05
  got = np.asarray(_matmul(x, emb, transposed=True))
  want = np.asarray(jnp.einsum("btd,vd->btv", x, emb, precision="highest"))
  assert got.shape == (2, 3, 49152)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
  assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.99


def test_a_row_is_bit_identical_whatever_the_rows():
  """Row r of an R-row product equals the one-row product of that row, bit for bit, for
  every R up to MAX_ROWS: verification's rows are plain decoding's numbers."""
  k1, k2 = jax.random.split(jax.random.key(3))
  x = jax.random.normal(k1, (row_kernel.MAX_ROWS, 576))
  w = jax.random.normal(k2, (576, 1000)) * 0.05
  one = np.concatenate([np.asarray(_matmul(x[i:i + 1], w)) for i in range(x.shape[0])])
  for rows in (2, 5, 7, 8, 12, row_kernel.MAX_ROWS):
    np.testing.assert_array_equal(np.asarray(_matmul(x[:rows], w)), one[:rows])


def _model():
  cfg = PRESETS["llama-small"].replace(dtype="float32", n_layers=2, vocab_size=32000)
  return Transformer(cfg, rngs=nnx.Rngs(0))


def _kernel_calls(fn, *args) -> int:
  return jax.jit(fn).lower(*args).as_text().count("specjax_row_matmul")


def test_used_in_decoding_loops_only():
  """Inside `prefused` (the decoding loops) every product of a few rows takes the kernel;
  outside it, with many rows, or suspended, XLA's products run."""
  lm = LM.of(_model())
  toks = jnp.zeros((1, 4), jnp.int32)

  def looped(lm, toks):
    with prefused([lm.module()]):
      return jax.lax.fori_loop(0, 2, lambda i, a: a + lm(toks, toks)[0][0, 0, 0], 0.0)

  def bare(lm, toks):
    return lm(toks, toks)[0]

  # 2 layers x (q|k|v, o, gate|up, down) + the untied head
  assert _kernel_calls(looped, lm, toks) == 9
  assert _kernel_calls(bare, lm, toks) == 0
  wide = jnp.zeros((1, row_kernel.MAX_ROWS + 1), jnp.int32)
  assert _kernel_calls(looped, lm, wide) == 0
  jax.clear_caches()  # a trace-time setting: not the cached trace
  with row_kernel.suspended():
    assert _kernel_calls(looped, lm, toks) == 0
  jax.clear_caches()


def test_greedy_decoding_matches_xla_products(monkeypatch):
  """Plain and speculative (prompt lookup) decoding through the kernel give XLA's tokens on
  a float32 model with a 32,000-id vocabulary, batch 2."""
  model = _model()
  prompts = [[5, 9, 5, 9, 5, 9, 17], [3, 4, 5, 3, 4]]
  traced = []
  matmul = row_kernel.matmul
  monkeypatch.setattr(row_kernel, "matmul", lambda *a: traced.append(1) or matmul(*a))
  runs, calls = {}, {}
  for name, off in (("kernel", False), ("xla", True)):
    jax.clear_caches()  # a trace-time setting: new traces, not the cached programs
    traced.clear()
    with row_kernel.suspended() if off else contextlib.nullcontext():
      runs[name] = [decoding.generate(model, prompts, max_new_tokens=12),
                    decoding.speculative_generate(model, LookupDrafter(), prompts, k=4,
                                                  max_new_tokens=12)]
    calls[name] = len(traced)
  assert calls["kernel"] > 0 and calls["xla"] == 0, calls
  jax.clear_caches()
  tokens = {name: [np.asarray(g.tokens) for g in gens] for name, gens in runs.items()}
  for got, want in zip(tokens["kernel"] + tokens["kernel"][::-1], tokens["xla"] * 2):
    np.testing.assert_array_equal(got, want)


def _python(code: str, **env) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        env={**os.environ, **env}, timeout=600)


def test_bad_policy_value_is_named():
  done = _python("from specjax.models import row_kernel; row_kernel.enabled()",
                 SPECJAX_ROW_KERNEL="yes")
  assert done.returncode != 0
  assert "$SPECJAX_ROW_KERNEL must be 0 or 1" in done.stderr and "'yes'" in done.stderr


def test_policy_off_and_failed_build_fall_back(tmp_path):
  off = _python("from specjax.models import row_kernel; print(row_kernel.enabled())",
                SPECJAX_ROW_KERNEL="0")
  assert off.returncode == 0 and off.stdout.strip() == "False"
  # a compiler that fails, in an empty cache: one warning, XLA's products, no error
  broken = _python("import warnings; warnings.simplefilter('always')\n"
                   "from specjax.models import row_kernel; print(row_kernel.enabled())",
                   SPECJAX_CACHE_DIR=str(tmp_path), CXX="false")
  assert broken.returncode == 0, broken.stderr
  assert broken.stdout.strip() == "False"
  assert "few-row product kernel is unavailable" in broken.stderr
  assert not list(tmp_path.glob("kernels/*.so"))
