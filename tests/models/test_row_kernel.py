"""The few-row kernels (`row_kernel`, issue 43) at SmolLM2-135M's sizes: products and cache
attention equal to XLA's up to rounding, a row's result bit-identical whatever the number of
rows (the property plain decoding and verification share), used by decoding loops and only
there, and a clear error or a warned fallback when they cannot be used."""

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
from specjax.models import attention, row_kernel
from specjax.models import cache as kv
from specjax.models.fused import prefused
from specjax.models.lm import LM
from specjax.models.presets import PRESETS
from specjax.models.transformer import ModelConfig, Transformer

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
  for rows in (2, 3, 4, 5, 7, 8, 12, row_kernel.MAX_ROWS):
    np.testing.assert_array_equal(np.asarray(_matmul(x[:rows], w)), one[:rows])


def _attention_reference(q, k, v, mask):
  """float64 softmax attention of q [N, R, D] over keys [N, D, S], values [N, S, D] under
  mask [N, R, S]; a row that sees nothing: zeros."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  scores = np.where(mask, np.einsum("nrd,nds->nrs", q, k), -np.inf)
  top = scores.max(-1, keepdims=True)
  e = np.where(mask, np.exp(scores - np.where(np.isfinite(top), top, 0.0)), 0.0)
  total = e.sum(-1, keepdims=True)
  return np.einsum("nrs,nsd->nrd", e / np.where(total > 0, total, 1.0), v)


@pytest.mark.parametrize("n,rows,d,s", [(3, 3, 64, 1024), (6, 15, 64, 100), (2, 1, 32, 37),
                                        (4, 48, 64, 2050), (2, 5, 48, 200)])
def test_attention_kernel_matches_softmax_attention(n, rows, d, s):
  """Random visible sets (ragged ends, holes), S not a multiple of 16, head sizes with and
  without a register path (48), a row that sees nothing (zeros); each row alone gives the
  same bits as inside the R-row call."""
  rng = np.random.default_rng(rows)
  q = rng.standard_normal((n, rows, d), np.float32)
  k = rng.standard_normal((n, d, s), np.float32)
  v = rng.standard_normal((n, s, d), np.float32)
  ends = rng.integers(1, s + 1, size=(n, rows))
  mask = (np.arange(s) < ends[..., None]) & (rng.random((n, rows, s)) < 0.8)
  mask[:, :, 0] = True
  mask[0, 0] = False
  attend = jax.jit(row_kernel.attention)
  got = np.asarray(attend(q, k, v, mask))
  np.testing.assert_allclose(got, _attention_reference(q, k, v, mask), rtol=1e-5, atol=1e-5)
  assert not got[0, 0].any()
  for r in range(rows):
    alone = np.asarray(attend(q[:, r:r + 1], k, v, mask[:, r:r + 1]))
    np.testing.assert_array_equal(alone[:, 0], got[:, r])


def _loop_attend(cache, q, block, window):
  with row_kernel.packed([]):  # what `fused.prefused` opens around a decoding loop
    return attention.attend(cache, 0, q, block, window)


@pytest.mark.parametrize("mask", ["causal", "tree", "per-row", "window"])
@pytest.mark.parametrize("t", [1, 5])
def test_cache_attention_in_loops_matches_xla(mask, t):
  """`attention.attend` in a decoding loop (the kernel) against outside one (XLA's), GQA
  9/3 with SmolLM2's head size, batch 2 with ragged lengths, a 200-slot cache (buckets and
  a partial last block), causal, tree ([T, R] and per-row [B, T, R]) and windowed masks."""
  cfg = ModelConfig.llama(vocab_size=32, d_model=576, n_layers=1, n_heads=9, n_kv_heads=3,
                          d_ff=64, max_len=256)
  b, s, r = 2, 200, t + 2
  rng = np.random.default_rng(t)
  cache = kv.init(cfg, b, s)
  keys = jnp.asarray(rng.normal(size=(b, s, 3, 64)), jnp.float32)
  cache = kv.write(cache, 0, keys, keys * 0.5 + 1.0)
  cache = kv.set_lengths(cache, jnp.asarray([37, 150], jnp.int32))
  q = jnp.asarray(rng.normal(size=(b, t, 9, 64)), jnp.float32)
  tree = np.tril(rng.random((t, r)) < 0.6, k=r - t) | np.eye(t, r, k=r - t, dtype=bool)
  block = {"causal": None, "window": None, "tree": jnp.asarray(tree),
           "per-row": jnp.asarray(np.stack([tree, np.eye(t, r, k=r - t, dtype=bool)]))}[mask]
  window = 16 if mask == "window" else None
  looped = jax.jit(_loop_attend, static_argnums=3)
  assert "specjax_row_attention" in looped.lower(cache, q, block, window).as_text()
  got = np.asarray(looped(cache, q, block, window))
  want = np.asarray(jax.jit(attention.attend, static_argnums=(1, 4))(cache, 0, q, block,
                                                                    window))
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  if mask == "causal" and t > 1:  # the first verified row is the plain step's row
    one = np.asarray(looped(cache, q[:, :1], None, None))
    np.testing.assert_array_equal(one[:, 0], got[:, 0])


def _model():
  cfg = PRESETS["llama-small"].replace(dtype="float32", n_layers=2, vocab_size=32000)
  return Transformer(cfg, rngs=nnx.Rngs(0))


def _kernel_calls(fn, *args, target=row_kernel.TARGET) -> int:
  return jax.jit(fn).lower(*args).as_text().count(target)


def test_used_in_decoding_loops_only():
  """Inside `prefused` (the decoding loops) every product of a few rows and every cache
  attention of at most MAX_ATTENTION_ROWS query rows takes the kernels; outside it, with
  many rows, or suspended, XLA's run."""
  lm = LM.of(_model())
  toks = jnp.zeros((1, 4), jnp.int32)
  cache = kv.init(lm.config, 1, 32)

  def looped(lm, toks):
    with prefused([lm.module()]):
      return jax.lax.fori_loop(0, 2, lambda i, a: a + lm(toks, toks, cache)[0][0, 0, 0], 0.0)

  def bare(lm, toks):
    return lm(toks, toks, cache)[0]

  # 2 layers x (q|k|v, o, gate|up, down) + the untied head
  attend = dict(target=row_kernel.ATTENTION_TARGET)
  assert _kernel_calls(looped, lm, toks) == 9
  assert _kernel_calls(looped, lm, toks, **attend) == 2  # 4 tokens x 4 query heads a group
  assert _kernel_calls(bare, lm, toks) == _kernel_calls(bare, lm, toks, **attend) == 0
  wide = jnp.zeros((1, row_kernel.MAX_ROWS + 1), jnp.int32)  # 68 attention rows
  assert _kernel_calls(looped, lm, wide) == _kernel_calls(looped, lm, wide, **attend) == 0
  jax.clear_caches()  # a trace-time setting: not the cached trace
  with row_kernel.suspended():
    assert _kernel_calls(looped, lm, toks) == _kernel_calls(looped, lm, toks, **attend) == 0
  jax.clear_caches()


def test_greedy_decoding_matches_xla_products(monkeypatch):
  """Plain and speculative (prompt lookup) decoding through the kernel give XLA's tokens on
  a float32 model with a 32,000-id vocabulary, batch 2."""
  model = _model()
  prompts = [[5, 9, 5, 9, 5, 9, 17], [3, 4, 5, 3, 4]]
  traced = []
  matmul, attend = row_kernel.matmul, row_kernel.attention
  monkeypatch.setattr(row_kernel, "matmul", lambda *a: traced.append(1) or matmul(*a))
  monkeypatch.setattr(row_kernel, "attention", lambda *a: traced.append(2) or attend(*a))
  runs, calls = {}, {}
  for name, off in (("kernel", False), ("xla", True)):
    jax.clear_caches()  # a trace-time setting: new traces, not the cached programs
    traced.clear()
    with row_kernel.suspended() if off else contextlib.nullcontext():
      runs[name] = [decoding.generate(model, prompts, max_new_tokens=12),
                    decoding.speculative_generate(model, LookupDrafter(), prompts, k=4,
                                                  max_new_tokens=12)]
    calls[name] = sorted(set(traced))
  assert calls["kernel"] == [1, 2] and calls["xla"] == [], calls
  jax.clear_caches()
  tokens = {name: [np.asarray(g.tokens) for g in gens] for name, gens in runs.items()}
  for got, want in zip(tokens["kernel"] + tokens["kernel"][::-1], tokens["xla"] * 2):
    np.testing.assert_array_equal(got, want)


def test_host_api_packs_once_per_model(monkeypatch):
  """The host API's loops take the packed weights made once per model (`fused.packed_lm`):
  a new trace of the same model packs nothing, a model with other weights gets its own
  copies, and a model's copies go with its weights. Control: a loop called directly with a
  bare LM packs every weight in its own program. Tokens equal the in-program packing's."""
  import gc

  from specjax.engine import loop
  from specjax.models import fused

  lm = LM.of(_model())
  prompts = [[5, 9, 5, 9, 5, 9, 17], [3, 4, 5, 3, 4]]
  packs = []
  pack = row_kernel.pack
  monkeypatch.setattr(row_kernel, "pack", lambda *a: packs.append(1) or pack(*a))
  jax.clear_caches()
  fused._PACKS.clear()
  first = decoding.generate(lm, prompts, max_new_tokens=6)
  assert len(packs) == 9  # 2 layers x (q|k|v, o, gate|up, down) + the head, once
  again = decoding.generate(lm, prompts, max_new_tokens=6, cache_len=64)  # a new trace
  spec = decoding.speculative_generate(lm, LookupDrafter(), prompts, k=3, max_new_tokens=6)
  assert len(packs) == 9 and len(fused._PACKS) == 1
  assert fused.packed_lm(lm).packs is fused.packed_lm(LM.of(lm.module())).packs
  np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(first.tokens))
  np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(first.tokens))
  # control: the loop called with the bare LM packs in its program, to the same tokens
  batch = decoding.prepare_batch(prompts, vocab_size=lm.config.vocab_size,
                                 max_len=lm.config.max_len, max_new_tokens=6)
  state = loop.generate_jit(lm, batch.prompt_BP, batch.prompt_len_B, batch.budget_B,
                            jnp.asarray(-1), decoding.sampling.make_sampler(0.0),
                            jax.random.key(0), cache_len=batch.cache_len)
  assert len(packs) == 18
  direct = [np.asarray(state.tokens)[b, len(row):len(row) + 6] for b, row in enumerate(prompts)]
  np.testing.assert_array_equal(np.stack(direct), np.asarray(first.tokens)[:, :6])
  # other weights, other copies; a model's copies are dropped with its weights
  other = lm.replace(params=jax.tree.map(lambda x: x * 1.01, lm.params))
  assert fused.packed_lm(other).packs is not fused.packed_lm(lm).packs
  assert len(fused._PACKS) == 2
  del other
  gc.collect()
  assert len(fused._PACKS) == 1
  with pytest.raises(ValueError, match="packs: 9 packed copies do not match"):
    small = LM.of(Transformer(lm.config.replace(n_layers=1), rngs=nnx.Rngs(1)))
    with fused.prefused([small.module()], [fused.packed_lm(lm).packs]):
      pass
  jax.clear_caches()


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
