"""The KV cache's storage dtype and length-bucketed attention: attention reads only the
live prefix of a long cache (a bucket chosen at run time, one compile), with results equal
to reading every slot; a bf16 cache halves the bytes and keeps greedy identity."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.engine import decoding, loop
from specjax.verify import sampling, trees
from specjax.models.lm import LM
from specjax.drafters.model import ModelDrafter
from specjax.models import attention
from specjax.models import cache as kv
from specjax.models.transformer import ModelConfig
from specjax_testing import TINY, model, perturbed


def test_prefix_buckets_halve_down_to_the_minimum():
  assert attention.prefix_buckets(128) == (128,)
  assert attention.prefix_buckets(256) == (128, 256)
  assert attention.prefix_buckets(1024) == (128, 256, 512, 1024)
  assert attention.prefix_buckets(8192) == (1024, 2048, 4096, 8192)
  assert attention.prefix_buckets(1000) == (250, 500, 1000)  # odd halves end the split
  assert attention.prefix_buckets(1000 + 1) == (1001,)


@pytest.mark.parametrize("mask", ["causal", "tree"])
def test_bucketed_attention_equals_reading_every_slot(monkeypatch, mask):
  cfg = ModelConfig.llama(vocab_size=32, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                          d_ff=64, max_len=256)
  b, t, s = 3, 3, 64
  rng = np.random.default_rng(0)
  cache = kv.init(cfg, b, s)
  k = jnp.asarray(rng.normal(size=(b, s, 2, cfg.head_dim)), jnp.float32)
  cache = kv.write(cache, 0, k, k * 0.5 + 1)
  q = jnp.asarray(rng.normal(size=(b, t, 4, cfg.head_dim)), jnp.float32)
  block = None if mask == "causal" else jnp.asarray([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)
  for lengths in ([3, 10, 7], [3, 20, 7], [40, 5, 61]):  # buckets 16, 32, 64 with minimum 8
    c = kv.set_lengths(cache, jnp.asarray(lengths, jnp.int32))
    monkeypatch.setattr(attention, "BUCKET_MIN", 10**9)
    full = jax.jit(lambda c, q: attention.attend(c, 0, q, block))(c, q)
    monkeypatch.setattr(attention, "BUCKET_MIN", 8)
    assert attention.prefix_buckets(s) == (8, 16, 32, 64)
    bucketed = jax.jit(lambda c, q: attention.attend(c, 0, q, block))(c, q)
    np.testing.assert_allclose(bucketed, full, rtol=1e-6, atol=1e-6)
    text = jax.jit(lambda c, q: attention.attend(c, 0, q, block)).lower(c, q).as_text()
    assert "case" in text  # the run-time choice is in the program, not a retrace


@pytest.mark.slow
def test_long_cache_generation_is_unchanged_by_buckets(monkeypatch):
  """Greedy plain and speculative decoding (chain and tree) over a 512-slot cache whose
  buckets (64..512) are crossed during the run (64 -> 128) give the same tokens as one full path.
  BUCKET_MIN is read at trace time: each run traces a fresh jit of the loop."""
  target = model(TINY["llama"], seed=0, logit_scale=4.0)
  drafter = ModelDrafter.of(perturbed(target, seed=1, noise=0.25))
  prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
  batch = decoding.prepare_batch(prompts, vocab_size=target.config.vocab_size,
                                 max_len=target.config.max_len, max_new_tokens=80, slots=4,
                                 cache_len=512)
  args = (batch.prompt_BP, batch.prompt_len_B, batch.budget_B, jnp.asarray(-1),
          sampling.make_sampler(0.0), jax.random.key(0))
  lm = LM.of(target)

  def plain():
    run = jax.jit(lambda *a: loop.generate_loop(lm, *a, cache_len=512))
    return np.asarray(run(*args).tokens)

  def spec(tree):
    run = jax.jit(lambda *a: loop.speculative_loop(lm, drafter, *a, tree=tree, cache_len=512))
    return np.asarray(run(*args).tokens)

  monkeypatch.setattr(attention, "BUCKET_MIN", 10**9)
  ref = plain()
  monkeypatch.setattr(attention, "BUCKET_MIN", 64)
  np.testing.assert_array_equal(plain(), ref)
  for tree in (trees.chain(3), trees.branching((2, 1))):
    np.testing.assert_array_equal(spec(tree), ref)
  assert int(np.max(batch.prompt_len_B)) + 80 > 64  # the run crosses the 64-slot bucket


@pytest.mark.slow
def test_bf16_cache_halves_the_bytes_and_keeps_greedy_identity():
  cfg = TINY["llama"].replace(cache_dtype="bfloat16")
  assert kv.cache_bytes(cfg, 2, 64) * 2 == kv.cache_bytes(TINY["llama"], 2, 64)
  assert kv.init(cfg, 2, 64).k[0].dtype == jnp.bfloat16
  target = model(cfg, seed=0, logit_scale=4.0)
  draft = perturbed(target, seed=1, noise=0.25)
  prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
  kw = dict(max_new_tokens=12, sampler=sampling.make_sampler(0.0))
  plain = decoding.generate(target, prompts, **kw).tokens
  spec = decoding.speculative_generate(target, draft, prompts, k=3, **kw).tokens
  np.testing.assert_array_equal(spec, plain)
  with pytest.raises(ValueError, match="cache_dtype"):
    TINY["llama"].replace(cache_dtype="float16")
