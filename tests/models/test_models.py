"""Transformer and KV cache: cached decoding equals cache-free scoring, both families."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.models import attention
from specjax.models import cache as kv
from specjax.models.presets import PRESETS, parse_config
from specjax.models.transformer import ModelConfig, Transformer, param_count, rope
from specjax.models.lm import LM
from specjax_testing import TINY, model


@jax.jit
def _fwd(lm, tokens, positions, cache=None, block_mask=None):
  return lm(tokens, positions, cache, block_mask)


def fwd(m, tokens, positions, cache=None, block_mask=None):
  """Jitted forward: op-by-op NNX dispatch is far slower than compiling these tiny graphs."""
  return _fwd(LM.of(m), tokens, positions, cache, block_mask)


def _tokens(b, t, vocab, seed=1):
  toks = jax.random.randint(jax.random.key(seed), (b, t), 0, vocab)
  return toks, jnp.broadcast_to(jnp.arange(t), (b, t))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_prefill_decode_verify_match_cache_free_logits(family):
  cfg = TINY[family]
  m = model(cfg)
  toks, pos = _tokens(3, 12, cfg.vocab_size)
  ref, ref_hidden, _ = fwd(m, toks, pos)
  c = kv.init(cfg, 3, 32)
  outs = []
  logits, _, c = fwd(m, toks[:, :5], pos[:, :5], c)  # prefill
  outs.append(logits)
  c = kv.commit(c, jnp.full((3,), 5))
  for i in range(5, 8):  # one-token decode
    logits, _, c = fwd(m, toks[:, i:i + 1], pos[:, i:i + 1], c)
    outs.append(logits)
    c = kv.commit(c, jnp.ones((3,), jnp.int32))
  logits, hidden, c = fwd(m, toks[:, 8:], pos[:, 8:], c)  # 4-token verification
  outs.append(logits)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), ref, atol=1e-5)
  np.testing.assert_allclose(hidden, ref_hidden[:, 8:], atol=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_ragged_rows_and_rollback(family):
  """Rows at different lengths write at their own offsets; junk beyond `lengths` (a rejected
  block) is invisible and later overwritten."""
  cfg = TINY[family]
  m = model(cfg)
  toks, pos = _tokens(2, 10, cfg.vocab_size, seed=3)
  ref, _, _ = fwd(m, toks, pos)
  c = kv.init(cfg, 2, 16)
  _, _, c = fwd(m, toks[:, :8], pos[:, :8], c)
  c = kv.set_lengths(c, jnp.array([4, 6]))  # row 0 keeps 4 tokens, row 1 keeps 6
  junk = (toks[:, :3] + 7) % cfg.vocab_size  # a rejected draft block
  lens = c.lengths
  _, _, c = fwd(m, junk, lens[:, None] + jnp.arange(3)[None], c)  # written, not committed
  nxt = jnp.stack([toks[0, 4:6], toks[1, 6:8]])
  logits, _, c = fwd(m, nxt, lens[:, None] + jnp.arange(2)[None], c)
  np.testing.assert_allclose(logits[0], ref[0, 4:6], atol=1e-5)
  np.testing.assert_allclose(logits[1], ref[1, 6:8], atol=1e-5)


def test_attention_mask_sees_prefix_and_block():
  block = jnp.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)  # node 2's parent is node 0
  mask = attention.attention_mask(jnp.array([2, 4]), 3, 8, block)
  expect0 = np.zeros((3, 8), bool)
  expect0[:, :2] = True
  expect0[:, 2:5] = np.asarray(block)
  np.testing.assert_array_equal(mask[0], expect0)
  assert mask[1, 2].tolist() == [True] * 4 + [True, False, True] + [False]
  causal = attention.attention_mask(jnp.array([1]), 2, 4, None)
  assert causal[0].tolist() == [[True, True, False, False], [True, True, True, False]]


def _windowed_reference(lengths, positions_BT, base_BTS, window):
  """Brute force: slot j < lengths[b] holds position j, block slot lengths[b] + c holds
  positions_BT[b, c]; a visible key stays visible iff p_query - p_key < window."""
  b, t, s = base_BTS.shape
  out = np.array(base_BTS)
  for r in range(b):
    key_pos = np.arange(s)
    key_pos[lengths[r]:lengths[r] + t] = positions_BT[r]
    out[r] &= (positions_BT[r][:, None] - key_pos[None, :]) < window
  return out


@pytest.mark.parametrize("window", [1, 2, 3, 5])
def test_sliding_window_mask_counts_positions_not_slots(window):
  """Causal blocks and token trees (whose nodes' slots are not their positions): the window
  keeps the keys within `window` positions of the query, transformers' kv > q - window."""
  lengths = np.array([4, 7])
  s = 16
  # tree: 0 root; 1, 2 children of 0; 3 child of 1; 4 child of 2; 5 child of 3
  parent = [-1, 0, 0, 1, 2, 3]
  depth = [0, 1, 1, 2, 2, 3]
  t = len(parent)
  anc = np.zeros((t, t), bool)
  for i in range(t):
    j = i
    while j >= 0:
      anc[i, j] = True
      j = parent[j]
  positions = lengths[:, None] + np.array(depth)[None]
  base = np.asarray(attention.attention_mask(jnp.asarray(lengths), t, s, jnp.asarray(anc)))
  got = np.asarray(attention.attention_mask(jnp.asarray(lengths), t, s, jnp.asarray(anc), window))
  np.testing.assert_array_equal(got, _windowed_reference(lengths, positions, base, window))
  per_row = np.broadcast_to(anc, (2, t, t))
  np.testing.assert_array_equal(np.asarray(attention.attention_mask(
      jnp.asarray(lengths), t, s, jnp.asarray(per_row), window)), got)
  causal_pos = lengths[:, None] + np.arange(3)[None]
  base = np.asarray(attention.attention_mask(jnp.asarray(lengths), 3, s, None))
  got = np.asarray(attention.attention_mask(jnp.asarray(lengths), 3, s, None, window))
  np.testing.assert_array_equal(got, _windowed_reference(lengths, causal_pos, base, window))
  assert got.sum() == 2 * 3 * window  # every query sees exactly `window` keys here
  # a mask wider than the block (R > T): earlier levels of a tree being drafted
  wide = np.zeros((2, 4), bool)
  wide[0, [0, 2]] = wide[1, [1, 3]] = True  # level-2 nodes over level-1 parents 0 and 1
  lv = np.asarray(attention.attention_mask(jnp.asarray(lengths), 2, s, jnp.asarray(wide), window))
  for r in range(2):  # slots lengths - 2 + i hold level-1 nodes (position lengths - 2)
    for i in range(2):
      p = lengths[r] - 1  # position of a level-2 node
      visible = [j for j in range(s) if lv[r, i, j]]
      expect = [j for j in range(lengths[r] - 2) if p - j < window]
      expect += [lengths[r] - 2 + i] if window > 1 else []
      expect += [lengths[r] + i]
      assert visible == sorted(expect), (r, i, visible, expect)


def test_sliding_window_cache_matches_cache_free_forward():
  """A windowed model decoding through the cache (prefill, then one token at a time, with a
  rejected block in between) gives the cache-free logits; the window changes them."""
  cfg = TINY["llama"].replace(sliding_window=3, window_first_layer=1)
  m = model(cfg)
  toks, pos = _tokens(2, 10, cfg.vocab_size, seed=4)
  ref, _, _ = fwd(m, toks, pos)
  full, _, _ = fwd(model(cfg.replace(sliding_window=None)), toks, pos)
  assert np.abs(np.asarray(ref) - np.asarray(full))[:, 4:].max() > 1e-3
  c = kv.init(cfg, 2, 16)
  logits, _, c = fwd(m, toks[:, :6], pos[:, :6], c)
  c = kv.commit(c, jnp.full((2,), 6))
  _, _, c = fwd(m, (toks[:, 6:9] + 1) % cfg.vocab_size, pos[:, 6:9], c)  # rejected
  out = [logits]
  for i in range(6, 10):
    step, _, c = fwd(m, toks[:, i:i + 1], pos[:, i:i + 1], c)
    c = kv.commit(c, jnp.ones((2,), jnp.int32))
    out.append(step)
  np.testing.assert_allclose(np.concatenate([np.asarray(o) for o in out], 1), ref, atol=1e-5)


def test_config_dicts_without_the_newer_fields_still_load():
  new = ("head_dim_override", "rope_scaling", "rope_factor", "rope_low_freq_factor",
         "rope_high_freq_factor", "rope_original_max_len", "qk_norm", "sliding_window",
         "window_first_layer")
  cfg = TINY["llama"]
  old = {k: v for k, v in cfg.to_dict().items() if k not in new}
  assert ModelConfig.from_dict(old) == cfg
  odd = cfg.replace(head_dim_override=6, qk_norm=True, sliding_window=4, window_first_layer=1,
                    rope_scaling="llama3", rope_factor=2.0, rope_original_max_len=64)
  assert ModelConfig.from_dict(odd.to_dict()) == odd and odd.head_dim == 6
  for bad, match in (({"rope_scaling": "yarn"}, "rope_scaling"),
                     ({"sliding_window": 0}, "sliding_window"),
                     ({"window_first_layer": 9}, "window_first_layer"),
                     ({"head_dim_override": 0}, "head_dim_override"),
                     ({"rope_scaling": "llama3", "rope_low_freq_factor": 4.0}, "low_freq")):
    with pytest.raises(ValueError, match=match):
      cfg.replace(**bad)


def test_rope_matches_hf_rotate_half():
  x = np.random.default_rng(0).normal(size=(1, 3, 2, 8)).astype(np.float32)
  pos = np.array([[0, 5, 17]])
  theta = 500.0
  inv = 1.0 / theta ** (np.arange(0, 8, 2) / 8)
  ang = pos[..., None] * inv
  emb = np.concatenate([ang, ang], -1)[:, :, None, :]
  rot = np.concatenate([-x[..., 4:], x[..., :4]], -1)  # HF rotate_half
  expect = x * np.cos(emb) + rot * np.sin(emb)
  np.testing.assert_allclose(rope(jnp.asarray(x), jnp.asarray(pos), theta), expect, atol=1e-5)


def test_gqa_equals_mha_with_repeated_kv_heads():
  gqa_cfg = TINY["llama"]
  mha_cfg = gqa_cfg.replace(n_kv_heads=gqa_cfg.n_heads)
  gqa = model(gqa_cfg)
  mha = model(mha_cfg, seed=5)
  g = gqa_cfg.n_heads // gqa_cfg.n_kv_heads
  hd = gqa_cfg.head_dim
  for src, dst in zip(gqa.blocks, mha.blocks):
    for name in ("q", "o"):
      getattr(dst.attn, name).kernel[...] = getattr(src.attn, name).kernel[...]
    for name in ("k", "v"):
      w = getattr(src.attn, name).kernel[...].reshape(gqa_cfg.d_model, -1, hd)
      getattr(dst.attn, name).kernel[...] = jnp.repeat(w, g, axis=1).reshape(gqa_cfg.d_model, -1)
    for name in ("up", "gate", "down"):
      getattr(dst.mlp, name).kernel[...] = getattr(src.mlp, name).kernel[...]
    dst.attn_norm.scale[...] = src.attn_norm.scale[...]
    dst.mlp_norm.scale[...] = src.mlp_norm.scale[...]
  mha.embed[...] = gqa.embed[...]
  mha.final_norm.scale[...] = gqa.final_norm.scale[...]
  mha.lm_head.kernel[...] = gqa.lm_head.kernel[...]
  toks, pos = _tokens(2, 7, gqa_cfg.vocab_size)
  a, _, _ = fwd(gqa, toks, pos)
  b, _, _ = fwd(mha, toks, pos)
  np.testing.assert_allclose(a, b, atol=1e-5)
  c1, c2 = kv.init(gqa_cfg, 2, 8), kv.init(mha_cfg, 2, 8)
  np.testing.assert_allclose(fwd(gqa, toks, pos, c1)[0], fwd(mha, toks, pos, c2)[0], atol=1e-5)


def test_full_size_shapes_with_eval_shape():
  """GPT-2 small has 124,439,808 parameters (tied head); checked without allocating."""
  assert param_count(PRESETS["gpt2-small"]) == 124_439_808
  cfg = PRESETS["llama-small"]
  out = jax.eval_shape(
      lambda: Transformer(cfg, rngs=nnx.Rngs(0))(jnp.zeros((2, 5), jnp.int32),
                                                 jnp.zeros((2, 5), jnp.int32),
                                                 kv.init(cfg, 2, 64)))
  assert out[0].shape == (2, 5, cfg.vocab_size) and out[1].shape == (2, 5, cfg.d_model)
  assert out[2].k[0].shape == (2 * cfg.n_kv_heads, cfg.head_dim, 64)


def test_bfloat16_runs_close_to_float32():
  cfg = TINY["llama"]
  m32 = model(cfg)
  m16 = Transformer(cfg.replace(dtype="bfloat16"), rngs=nnx.Rngs(1))
  nnx.update(m16, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(m32, nnx.Param)))
  assert m16.embed[...].dtype == jnp.bfloat16
  toks, pos = _tokens(2, 6, cfg.vocab_size)
  a, _, _ = fwd(m32, toks, pos)
  b, _, _ = fwd(m16, toks, pos, kv.init(m16.config, 2, 8))
  assert b.dtype == jnp.float32
  assert float(jnp.max(jnp.abs(a - b))) < 0.05


def test_cache_memory_estimate_refuses_what_does_not_fit():
  cfg = PRESETS["gpt2-small"]
  per_token = 2 * 12 * 768 * 4
  assert kv.cache_bytes(cfg, 3, 100) == 3 * 100 * per_token
  with pytest.raises(ValueError, match="batch=4096"):
    kv.check_fits(cfg, 4096, 1024, available=8 * 2**30)
  assert kv.check_fits(cfg, 1, 1024, available=8 * 2**30) == per_token * 1024


@pytest.mark.parametrize("bad, match", [
    (dict(n_heads=5), "divisible"),
    (dict(n_kv_heads=3), "divisible"),
    (dict(norm="batchnorm"), "norm"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(dtype="float16"), "dtype"),
])
def test_model_config_validation(bad, match):
  with pytest.raises(ValueError, match=match):
    TINY["gpt2"].replace(**bad)


def test_parse_config_presets_and_overrides():
  cfg = parse_config("tiny-llama:n_layers=3,rope_theta=1e6")
  assert cfg.n_layers == 3 and math.isclose(cfg.rope_theta, 1e6)
  cfg = parse_config("tiny-llama:sliding_window=4,qk_norm=true,rope_scaling=llama3")
  assert (cfg.sliding_window, cfg.qk_norm, cfg.rope_scaling) == (4, True, "llama3")
  assert parse_config("tiny-llama:sliding_window=none").sliding_window is None
  assert parse_config('{"vocab_size": 10, "d_model": 8, "n_layers": 1, "n_heads": 2, '
                      '"n_kv_heads": 1, "d_ff": 16, "max_len": 32}').n_kv_heads == 1
  with pytest.raises(ValueError, match="tiny-gpt2"):
    parse_config("tiny-gtp2")
  with pytest.raises(ValueError, match="n_layerz"):
    parse_config("tiny-gpt2:n_layerz=3")


def test_one_row_bf16_padding_is_cpu_only_or_forced_and_changes_no_result(monkeypatch):
  """The padding (docs/xla_notes.md, trap 3) is on for XLA:CPU only by default, or forced
  by $SPECJAX_PAD_ONE_ROW_BF16; a bad value is refused naming the variable; padded and
  unpadded one-row bf16 products agree up to float32 accumulation order (as fp32's one-row
  and multi-row kernels do)."""
  from specjax.models import one_row_bf16 as tr
  w = jax.random.normal(jax.random.key(0), (64, 48)).astype(jnp.bfloat16)
  x = jax.random.normal(jax.random.key(1), (1, 1, 64))
  outs = {}
  for env in ("1", "0"):
    monkeypatch.setenv(tr.PAD_ENV, env)
    tr.pad_one_row_bf16.cache_clear()
    assert tr.padding_policy() == env and tr.pad_one_row_bf16() is (env == "1")
    outs[env] = np.asarray(tr.one_row_safe_matmul("...i,io->...o", x.astype(w.dtype), w))
  np.testing.assert_allclose(outs["1"], outs["0"], rtol=1e-5, atol=1e-6)
  monkeypatch.setenv(tr.PAD_ENV, "yes")
  tr.pad_one_row_bf16.cache_clear()
  with pytest.raises(ValueError, match=r"\$SPECJAX_PAD_ONE_ROW_BF16 must be 0 or 1"):
    tr.pad_one_row_bf16()
  monkeypatch.delenv(tr.PAD_ENV)
  tr.pad_one_row_bf16.cache_clear()
  assert tr.padding_policy() == "cpu"
  assert tr.pad_one_row_bf16() is (jax.default_backend() == "cpu")
  tr.pad_one_row_bf16.cache_clear()


def test_split_rows_makes_each_row_the_one_row_product(monkeypatch):
  """With `split_rows(limit)` a product of 2..limit rows is traced as that many one-row
  products (counted in the jaxpr; 1 product without it: the negative control), each row equal
  to the one-row product plain decoding computes; a tiny model's cached forward agrees with
  the unsplit one; bad limits are refused naming the setting."""
  from specjax.models import one_row_bf16 as tr
  w = jax.random.normal(jax.random.key(0), (64, 48))
  x = jax.random.normal(jax.random.key(1), (1, 3, 64))
  mm = lambda x: tr.one_row_safe_matmul("...i,io->...o", x, w)
  # a fresh function per trace: jax caches traces by function, not by the setting
  count = lambda: str(jax.make_jaxpr(lambda x: mm(x))(x)).count("dot_general")
  assert count() == 1
  with tr.split_rows(3):
    assert count() == 3
    y = np.asarray(jax.jit(lambda x: mm(x))(x))
  with tr.split_rows(2):
    assert count() == 1  # 3 rows > limit: one product
  for i in range(3):
    np.testing.assert_array_equal(y[:, i], np.asarray(jax.jit(lambda x: mm(x))(
        x[:, i:i + 1]))[:, 0])
  cfg = TINY["llama"]
  lm = LM.of(model(cfg))
  tokens, positions = _tokens(1, 4, cfg.vocab_size)[0], jnp.arange(4)[None] + 2
  cache = kv.set_lengths(kv.init(cfg, 1, 16), jnp.array([2], jnp.int32))
  plain = np.asarray(jax.jit(lambda lm, c: lm(tokens, positions, c)[0])(lm, cache))
  with tr.split_rows(8):
    split = np.asarray(jax.jit(lambda lm, c: lm(tokens, positions, c)[0])(lm, cache))
  np.testing.assert_allclose(split, plain, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="split_rows limit"):
    with tr.split_rows(-1):
      pass
  monkeypatch.setenv(tr.ROWS_ENV, "four")
  with pytest.raises(ValueError, match=r"\$SPECJAX_ROW_PRODUCTS must be"):
    tr.row_split_limit()
  monkeypatch.setenv(tr.ROWS_ENV, "4")
  assert tr.row_split_limit() == 4


# ----------------------------------------------------------------------------- validation
# Issue 29, item 5: every ModelConfig field is checked at construction (type, finiteness,
# range); a NaN in the logits during decoding surfaces as an error, never as a result.


def test_every_model_config_field_has_a_rule():
  """A new field cannot skip validation: __post_init__ checks every field by its rule."""
  import dataclasses

  from specjax.models import transformer as tr
  assert set(tr._FIELD_RULES) == {f.name for f in dataclasses.fields(ModelConfig)}


@pytest.mark.parametrize("field, value", [
    ("norm_eps", float("nan")), ("norm_eps", -1.0), ("norm_eps", 0.0), ("norm_eps", 2.0),
    ("norm_eps", "1e-5"), ("rope_theta", float("inf")), ("rope_theta", 0.0),
    ("rope_theta", "10000"), ("rope_factor", float("nan")), ("rope_factor", 0.5),
    ("rope_low_freq_factor", -1.0), ("rope_high_freq_factor", float("inf")),
    ("n_layers", 2.5), ("n_layers", True), ("n_layers", "2"), ("n_layers", np.int64(2)),
    ("vocab_size", 2**31), ("d_ff", 0), ("rope_original_max_len", 8192.0),
    ("tie_embeddings", "no"), ("tie_embeddings", 1), ("use_bias", "false"),
    ("qkv_bias", None), ("qk_norm", np.bool_(True)), ("sliding_window", 2.5),
    ("head_dim_override", 16.0), ("window_first_layer", -1), ("cache_dtype", "float16"),
    ("norm", None), ("dtype", ["float32"]),
])
def test_model_config_refuses_bad_field_values(field, value):
  with pytest.raises(ValueError, match=f"ModelConfig.{field} must be"):
    TINY["gpt2"].replace(**{field: value})


def test_model_config_accepts_its_ranges_edges():
  cfg = TINY["llama"]
  assert cfg.replace(norm_eps=1.0, rope_theta=10000).rope_theta == 10000  # ints are reals
  assert cfg.replace(rope_factor=1.0, window_first_layer=cfg.n_layers).rope_factor == 1.0
  assert cfg.replace(vocab_size=2**31 - 1).vocab_size == 2**31 - 1  # a description only


@pytest.mark.parametrize("spec, match", [
    ("tiny-gpt2:norm_eps=nan", r"norm_eps must be a finite number in \(0, 1\], got nan"),
    ("tiny-gpt2:norm_eps=-1", r"norm_eps must be a finite number in \(0, 1\], got -1.0"),
    ("tiny-gpt2:n_layers=2.5", "n_layers must be an int, got '2.5'"),
    ("tiny-gpt2:tie_embeddings=no", "tie_embeddings must be true or false, got 'no'"),
    ("tiny-llama:rope_theta=inf", "rope_theta must be a finite number"),
    ('{"vocab_size": 10, "d_model": 8, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, '
     '"d_ff": 16, "max_len": 32, "use_bias": "false"}', "use_bias must be true or false"),
    ('{"vocab_size": 10, "d_model": 8, "n_layers": 2.5, "n_heads": 2, "n_kv_heads": 1, '
     '"d_ff": 16, "max_len": 32}', "n_layers must be an int"),
])
def test_parse_config_refuses_bad_values(spec, match):
  with pytest.raises(ValueError, match=match):
    parse_config(spec)


# ----------------------------------------------------------------------------- size vs memory
# Issue 29, item 6: one helper (`check_params_fit`) refuses, before anything is built, a
# config whose parameters exceed this machine's memory; `param_count` is closed form.


@pytest.mark.parametrize("cfg", [
    TINY["gpt2"], TINY["llama"], TINY["gpt2"].replace(tie_embeddings=False, use_bias=False),
    TINY["llama"].replace(qkv_bias=True, tie_embeddings=True),  # Qwen2
    TINY["llama"].replace(qk_norm=True, head_dim_override=12, sliding_window=4),  # Qwen3
    TINY["gpt2"].replace(norm="rmsnorm", positions="rope", mlp="swiglu", n_kv_heads=2),
], ids=["gpt2", "llama", "untied-no-bias", "qwen2", "qwen3", "mixed"])
def test_param_count_closed_form_equals_the_abstract_model(cfg):
  from specjax.models.transformer import abstract_model
  leaves = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_model(cfg)[1]))
  assert param_count(cfg) == leaves


def test_models_that_cannot_fit_are_refused_before_anything_is_built():
  import time

  from specjax.models.transformer import abstract_model, check_params_fit, param_bytes
  huge = PRESETS["tiny-gpt2"].replace(n_layers=10**9)  # a valid description
  start = time.perf_counter()
  assert param_count(huge) > 4 * 10**13  # closed form: instant at any size
  for build in (lambda: Transformer(huge, rngs=nnx.Rngs(0)), lambda: abstract_model(huge)):
    with pytest.raises(ValueError, match=r"n_layers=1000000000.*more than this machine's "
                       r".* GB .*lower n_layers"):
      build()
  assert time.perf_counter() - start < 5
  small = PRESETS["tiny-gpt2"]
  assert check_params_fit(small) == param_bytes(small) == 4 * param_count(small)
  assert param_bytes(small.replace(dtype="bfloat16")) == 2 * param_count(small)
  with pytest.raises(ValueError, match="target: .* more than this machine's 0.0001 GB "
                     r"\(the given limit\)"):
    check_params_fit(small, what="target", limit=10**5)


# ----------------------------------------------------------------------------- NaN logits


def _nan_model(cfg, seed=0):
  """A model whose final norm holds one NaN: every logit it produces is NaN."""
  m = model(cfg, seed)
  m.final_norm.scale[...] = m.final_norm.scale[...].at[1].set(jnp.nan)
  return m


@pytest.mark.slow
def test_loops_count_non_finite_logits_and_the_host_api_refuses_them():
  """The loops count the passes with NaN/inf logits in the loop state (no host sync);
  generate / speculative_generate raise NonFiniteLogitsError (a ValueError) instead of
  returning NaN-driven tokens, the run attached; finite runs count 0 and return."""
  from specjax.engine.adaptive import policy as adaptive
  from specjax.engine import decoding, loop
  from specjax.verify import sampling, trees
  from specjax.drafters.medusa import MedusaDrafter
  cfg = TINY["gpt2"]
  good, draft = model(cfg), model(cfg.replace(n_layers=1), seed=1)
  plain_only = adaptive.AdaptivePolicy.create((0, 1), [1.0, 1.2], forced=[0])  # k = 0 only
  bad = _nan_model(cfg)
  d = cfg.d_model
  prompts = [[1, 2, 3], [4, 5]]
  batch = decoding.prepare_batch(prompts, vocab_size=cfg.vocab_size, max_len=cfg.max_len,
                                 max_new_tokens=5)
  args = (batch.prompt_BP, batch.prompt_len_B, batch.budget_B, jnp.asarray(-1, jnp.int32),
          sampling.make_sampler(0.0), jax.random.key(0))
  for m, want in ((good, 0), (bad, 4)):  # 5 tokens: prefill's, then 4 decoding passes
    state = loop.generate_jit(LM.of(m), *args, cache_len=batch.cache_len)
    assert int(state.nonfinite) == want
  assert len(decoding.generate(good, prompts, max_new_tokens=5).tokens[0]) == 5
  t1 = sampling.make_sampler(1.0)
  calls = {
      "plain": lambda: decoding.generate(bad, prompts, max_new_tokens=5),
      "chain": lambda: decoding.speculative_generate(bad, draft, prompts, k=2, max_new_tokens=5),
      "tree-T1": lambda: decoding.speculative_generate(
          bad, draft, prompts, tree=trees.branching((2, 1)), max_new_tokens=5,
          sampler=t1),
      # the adaptive loop's plain steps (eager and lazy) and cycles count them as well
      "auto": lambda: decoding.speculative_generate(bad, draft, prompts, k="auto",
                                                    max_new_tokens=5),
      "auto-plain-eager": lambda: decoding.speculative_generate(  # Medusa: no lazy catch-up
          bad, MedusaDrafter.of(bad, {"w": jnp.zeros((2, d, d)), "b": jnp.zeros((2, d))}),
          prompts, policy=plain_only, max_new_tokens=5),
      "auto-plain-lazy": lambda: decoding.speculative_generate(
          bad, draft, prompts, policy=plain_only, max_new_tokens=5),
      # a NaN draft at T > 0 would corrupt the acceptance rule: its q is counted too
      "draft-T1": lambda: decoding.speculative_generate(good, _nan_model(cfg, 1), prompts, k=2,
                                                        max_new_tokens=5, sampler=t1),
  }
  for name, call in calls.items():
    with pytest.raises(decoding.NonFiniteLogitsError, match="NaN or infinite") as e:
      call()
    assert isinstance(e.value, ValueError) and e.value.passes >= 1, name
    assert len(e.value.generation.tokens) == 2, name


@pytest.mark.slow
def test_generate_command_reports_nan_logits_as_one_line_exit_2(tmp_path, capsys):
  """`specjax generate` on a checkpoint whose weights hold a NaN: exit 2, one line
  (was: eight "\\x00" tokens, α = 1.000 and "identical to plain: True", exit 0)."""
  from specjax import cli
  from specjax.checkpoints import save_model
  cfg = TINY["gpt2"].replace(vocab_size=300)  # the byte tokenizer's 259 ids fit
  save_model(tmp_path / "ck", _nan_model(cfg))
  code = cli.main(["generate", "--target", str(tmp_path / "ck"), "--draft-config", "self",
                   "--max-new-tokens", "4", "--repeats", "1"])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1, err
  assert err[0].startswith("specjax: error: ") and "NaN or infinite" in err[0]
