"""Tests for specjax.verify.sampling: warp (temperature, top-k, top-p, greedy) and sample.

The filters are checked against a float64 numpy reference that sorts (stable, descending),
so the bisection-based implementation is compared with the textbook definition.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
import scipy.stats

from specjax.verify.sampling import SamplerParams, make_sampler, sample, warp

warp_jit = jax.jit(warp)
sample_jit = jax.jit(sample)

# Compiles are the cost of this file (a few 0.1 s each on a loaded 2-core CPU), so most warp
# tests go through one compiled shape: rows are padded with -inf logits (probability 0, which
# cannot change the warp of the real tokens) to [ROWS, VOCAB].
ROWS, VOCAB = 32, 50


def warp_rows(logits_RV, sampler: SamplerParams) -> np.ndarray:
  """warp on up to ROWS rows of up to VOCAB logits each, through the shared compiled shape."""
  x = np.asarray(logits_RV, np.float32)
  R, V = x.shape
  padded = np.full((ROWS, VOCAB), -np.inf, np.float32)
  padded[:R, :V] = x
  padded[R:, 0] = 0.0  # unused rows need one finite logit
  return np.asarray(warp_jit(jnp.asarray(padded), sampler))[:R, :V]


def reference_warp(logits_V: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
  """Textbook warp in float64: sort, cut, renormalise. Ties: lower index ranks first."""
  x = np.asarray(logits_V, np.float64)
  V = x.shape[-1]
  if temperature == 0.0:
    return np.eye(V)[int(np.argmax(x))]
  s = (x - x.max()) / temperature
  order = np.argsort(-s, kind="stable")
  keep = np.zeros(V, bool)
  keep[order[: (V if top_k == 0 else min(top_k, V))]] = True
  p = np.where(keep, np.exp(s), 0.0)
  p /= p.sum()
  if top_p < 1.0:
    cum = np.cumsum(p[order])
    m = int(np.searchsorted(cum, top_p, side="left")) + 1  # smallest m with cum[m-1] >= top_p
    keep = np.zeros(V, bool)
    keep[order[: min(m, V)]] = True
    p = np.where(keep, p, 0.0)
    p /= p.sum()
  return p


def near_nucleus_boundary(logits_V, temperature, top_k, top_p, tol=1e-5) -> bool:
  """True if some cumulative mass is within tol of top_p (float32 vs float64 may differ)."""
  if top_p >= 1.0 or temperature == 0.0:
    return False
  p = reference_warp(logits_V, temperature, top_k, 1.0)
  cum = np.cumsum(np.sort(p)[::-1])
  return bool(np.any(np.abs(cum - top_p) < tol))


# ---------------------------------------------------------------------------------------------
# make_sampler
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_k=True), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
])
def test_make_sampler_rejects_bad_input(kwargs, name):
  with pytest.raises(ValueError, match=name) as err:
    make_sampler(**kwargs)
  assert repr(list(kwargs.values())[0]) in str(err.value)  # names the value too


def test_make_sampler_returns_strong_typed_arrays():
  s = make_sampler(0.7, 5, 0.9)
  assert isinstance(s, SamplerParams)
  assert s.temperature.dtype == jnp.float32 and s.top_k.dtype == jnp.int32
  assert s.top_p.dtype == jnp.float32
  assert not any(x.weak_type for x in (s.temperature, s.top_k, s.top_p))
  assert float(s.temperature) == pytest.approx(0.7) and int(s.top_k) == 5


# ---------------------------------------------------------------------------------------------
# warp
# ---------------------------------------------------------------------------------------------


def test_greedy_is_exact_one_hot_first_index_on_ties():
  logits = np.random.default_rng(0).integers(0, 3, size=(ROWS, VOCAB)).astype(np.float32)
  first = np.argmax(logits == logits.max(-1, keepdims=True), axis=-1)  # first maximal index
  for s in (make_sampler(0.0), make_sampler(0.0, top_k=3, top_p=0.5)):
    np.testing.assert_array_equal(warp_rows(logits, s), np.eye(VOCAB, dtype=np.float32)[first])
  # Any float dtype in, float32 out (bf16 holds these small integers exactly).
  p = warp_jit(jnp.asarray(logits, jnp.bfloat16), make_sampler(0.0))
  assert p.dtype == jnp.float32
  np.testing.assert_array_equal(p, np.eye(VOCAB, dtype=np.float32)[first])


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_matches_softmax(temperature):
  logits = np.random.default_rng(1).normal(size=(ROWS, VOCAB)) * 3.0
  p = warp_rows(logits, make_sampler(temperature))
  expected = scipy.special.softmax(np.float32(logits).astype(np.float64) / temperature, axis=-1)
  np.testing.assert_allclose(p, expected, rtol=2e-5, atol=1e-7)
  np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-6)


def test_tiny_temperature_is_finite_and_near_greedy():
  logits = np.random.default_rng(2).normal(size=(ROWS, VOCAB))
  p = warp_rows(logits, make_sampler(1e-30))
  assert np.all(np.isfinite(p))
  np.testing.assert_allclose(p, np.eye(VOCAB)[np.argmax(logits, -1)], atol=1e-6)


@pytest.mark.parametrize("k", [1, 2, 7, 49, 50, 1000])
def test_top_k_keeps_exactly_k_largest(k):
  rng = np.random.default_rng(k)
  V = VOCAB
  for logits in (rng.normal(size=(ROWS, V)), rng.integers(0, 4, size=(ROWS, V)).astype(float)):
    p = warp_rows(logits, make_sampler(1.0, top_k=k))
    np.testing.assert_array_equal((p > 0).sum(-1), min(k, V))  # exactly k, ties or not
    for row in range(ROWS):
      np.testing.assert_allclose(p[row], reference_warp(logits[row], 1.0, k, 1.0), rtol=1e-5,
                                 atol=1e-7)


def test_top_k_tie_rule_lower_index_first():
  logits = [[0.0, 2.0, 1.0, 2.0, 2.0, 1.0]]
  p = warp_rows(logits, make_sampler(1.0, top_k=2))[0]
  np.testing.assert_allclose(p, [0, 0.5, 0, 0.5, 0, 0], atol=1e-7)
  p = warp_rows(logits, make_sampler(1.0, top_k=4))[0]
  assert (p > 0).tolist() == [False, True, True, True, True, False]


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 0, 0.5), (1.0, 0, 0.9), (0.7, 0, 0.95), (1.5, 10, 0.8), (1.0, 3, 0.99), (2.0, 0, 0.05),
])
def test_top_p_keeps_minimal_nucleus(temperature, top_k, top_p):
  rng = np.random.default_rng(int(top_p * 1000) + top_k)
  logits = np.float32(rng.normal(size=(ROWS, VOCAB)) * 2.0)
  p = warp_rows(logits, make_sampler(temperature, top_k, top_p))
  checked = 0
  for row in range(ROWS):
    if near_nucleus_boundary(logits[row], temperature, top_k, top_p):
      continue
    ref = reference_warp(logits[row], temperature, top_k, top_p)
    np.testing.assert_array_equal(p[row] > 0, ref > 0)
    np.testing.assert_allclose(p[row], ref, rtol=1e-5, atol=1e-7)
    # Minimality: dropping the smallest kept token falls below top_p.
    kept = np.sort(ref[ref > 0])[::-1]
    base = reference_warp(logits[row], temperature, top_k, 1.0)
    kept_base = np.sort(base[ref > 0])[::-1]
    assert kept_base.sum() >= top_p - 1e-9
    assert len(kept) == 1 or kept_base[:-1].sum() < top_p
    checked += 1
  assert checked >= ROWS - 4


def test_top_p_ties_taken_in_index_order():
  logits = np.log([[0.1, 0.3, 0.3, 0.3]])
  p = warp_rows(logits, make_sampler(1.0, top_p=0.5))[0]  # needs 2 of the 3 tied
  np.testing.assert_allclose(p, [0, 0.5, 0.5, 0], atol=1e-6)
  p = warp_rows(logits, make_sampler(1.0, top_p=0.2))[0]  # the top token alone
  np.testing.assert_allclose(p, [0, 1, 0, 0], atol=1e-6)


def test_filters_off_is_plain_softmax_even_for_tiny_tail():
  logits = np.asarray([[0.0, -50.0, -60.0, -70.0, 5.0]], np.float32)
  plain = warp_rows(logits, make_sampler(1.0))
  np.testing.assert_allclose(plain, scipy.special.softmax(logits.astype(np.float64), -1),
                             rtol=1e-5)
  for s in (make_sampler(1.0, top_k=VOCAB), make_sampler(1.0, top_k=0, top_p=1.0)):
    np.testing.assert_array_equal(warp_rows(logits, s), plain)
  assert np.all(plain > 0)


def test_masked_tokens_get_zero_probability():
  logits = [[1.0, -np.inf, 0.5, -np.inf, 0.2]]
  for s in (make_sampler(1.0), make_sampler(0.5, top_k=4), make_sampler(1.0, top_p=0.999),
            make_sampler(0.0)):
    p = warp_rows(logits, s)[0]
    assert p[1] == 0.0 and p[3] == 0.0
    assert p.sum() == pytest.approx(1.0, abs=1e-6)


def test_large_vocabulary_matches_reference():
  """V = 50257 (GPT-2). With ~30k tokens in a nucleus, cumulative masses are spaced ~1e-5
  apart, so float32 may put the cut one token off the float64 reference: check that the cut
  is minimal up to 1e-5 of mass, and the kept probabilities match the reference."""
  logits = np.float32(np.random.default_rng(3).normal(size=(3, 50257)) * 2.0)
  for args in ((0.8, 50, 0.9), (1.0, 0, 0.9), (1.0, 1000, 1.0)):
    p = np.asarray(warp_jit(jnp.asarray(logits), make_sampler(*args)))
    for row in range(3):
      base = reference_warp(logits[row], args[0], args[1], 1.0)
      order = np.argsort(-logits[row], kind="stable")
      m = int((p[row] > 0).sum())
      np.testing.assert_array_equal(np.flatnonzero(p[row] > 0), np.sort(order[:m]))  # a prefix
      cum = np.cumsum(base[order])
      assert cum[m - 1] >= args[2] - 1e-5 and (m == 1 or cum[m - 2] < args[2] + 1e-5)
      ref = np.where(p[row] > 0, base, 0.0)
      np.testing.assert_allclose(p[row], ref / ref.sum(), rtol=1e-4, atol=1e-9)
    if args[1]:
      assert np.all((p > 0).sum(-1) <= args[1])


def test_no_recompilation_when_sampler_values_change():
  traces = []

  @jax.jit
  @chex.assert_max_traces(n=1)  # raises on a second trace
  def f(logits, sampler):
    traces.append(1)
    return warp(logits, sampler)

  logits = jnp.asarray(np.random.default_rng(4).normal(size=(ROWS, VOCAB)), jnp.float32)
  for s in (make_sampler(0.0), make_sampler(1.0), make_sampler(0.5, top_k=3),
            make_sampler(1.2, top_p=0.7), make_sampler(0.9, 5, 0.9)):
    f(logits, s).block_until_ready()
  assert len(traces) == 1


def test_vmap_over_per_row_samplers():
  """Per-row settings via vmap (the cond becomes a select) match one-sampler calls."""
  logits = np.float32(np.random.default_rng(5).normal(size=(3, VOCAB)) * 2.0)
  samplers = [make_sampler(0.0), make_sampler(0.7, top_k=4), make_sampler(1.3, top_p=0.6)]
  batched = jax.tree.map(lambda *xs: jnp.stack(xs), *samplers)
  p = np.asarray(jax.jit(jax.vmap(warp))(jnp.asarray(logits), batched))
  for row, s in enumerate(samplers):
    np.testing.assert_allclose(p[row], warp_rows(logits[row:row + 1], s)[0], rtol=1e-6,
                               atol=1e-8)


# ---------------------------------------------------------------------------------------------
# sample
# ---------------------------------------------------------------------------------------------


def test_sample_one_hot_is_exact():
  idx = jnp.arange(64) % 17
  probs = jax.nn.one_hot(idx, 17)
  for seed in range(5):
    np.testing.assert_array_equal(sample_jit(jax.random.key(seed), probs), idx)
  assert sample_jit(jax.random.key(0), probs).dtype == jnp.int32


def test_sample_never_returns_zero_probability_token():
  probs = jnp.asarray([1e-12, 0.0, 0.5, 0.0, 0.5 - 1e-12, 0.0], jnp.float32)
  x = np.asarray(sample_jit(jax.random.key(7), jnp.broadcast_to(probs, (200_000, 6))))
  assert set(np.unique(x)) <= {0, 2, 4}
  assert {2, 4} <= set(np.unique(x))


def test_sample_distribution_chi_square():
  """Sampled frequencies match p (χ² at false-alarm rate 1e-3; fixed seed)."""
  p = np.asarray([0.05, 0.3, 0.0, 0.15, 0.4, 0.1])
  n = 200_000  # the shape of the zero-probability test: one compile for both
  x = np.asarray(sample_jit(jax.random.key(8), jnp.broadcast_to(jnp.asarray(p, jnp.float32),
                                                                (n, 6))))
  counts = np.bincount(x, minlength=6)
  assert counts[2] == 0
  pval = scipy.stats.chisquare(counts[p > 0], n * p[p > 0]).pvalue
  assert pval > 1e-3
  # Negative control: the same test rejects a slightly wrong law (0.308 instead of 0.300).
  q = p.copy()
  q[1], q[4] = 0.308, 0.392
  assert scipy.stats.chisquare(counts[q > 0], n * q[q > 0]).pvalue < 1e-3


def test_sample_unnormalised_weights_and_leading_dims():
  w = jnp.asarray([[2.0, 0.0, 6.0]], jnp.float32)
  x = np.asarray(sample_jit(jax.random.key(9), jnp.broadcast_to(w, (4, 50_000, 3))))
  assert x.shape == (4, 50_000)
  frac = (x == 2).mean()
  assert abs(frac - 0.75) < 0.01 and not np.any(x == 1)


# ---------------------------------------------------------------------------------------------
# zero-probability tokens at realistic vocabularies (the draw's guarantee, docs/exactness.md)
# ---------------------------------------------------------------------------------------------


def _counting_inverse_cdf(u_N1, probs_NV):
  """The textbook draw `sum(c <= t)`, clamped to the last positive token: the sampler before
  the fix, kept as the negative control. A prefix sum that moves at a zero-weight token
  (XLA:CPU sums a long row blockwise) lets it return that token."""
  c_NV = jnp.cumsum(probs_NV, axis=-1)
  idx_N = jnp.sum(c_NV <= u_N1 * c_NV[..., -1:], axis=-1, dtype=jnp.int32)
  v = jnp.arange(probs_NV.shape[-1], dtype=jnp.int32)
  return jnp.minimum(idx_N, jnp.max(jnp.where(probs_NV > 0.0, v, 0), axis=-1))


# Realistic rows: GPT-2's and Llama-2's vocabularies with top-k / top-p cuts, and a
# Qwen2.5-sized row whose padding ids have logit -inf (mixed into one batch per V).
_ZERO_CASES = {
    32_000: [make_sampler(1.0, top_k=40), make_sampler(0.8, top_p=0.9)],
    50_257: [make_sampler(1.0, top_k=50), make_sampler(0.8, top_p=0.9)],
    152_064: [make_sampler(1.0, top_k=64)],
}


def _step_uniforms(p_V: np.ndarray, c_V: np.ndarray) -> np.ndarray:
  """Uniforms u at every step of the row's own prefix sums c: u = c[v] / c[V-1] and
  c[v-1] / c[V-1] for every v where c moves (positive tokens, and zero-weight tokens where
  blockwise summation moved it), each with its two float32 neighbours."""
  prev = np.concatenate([[np.float32(0)], c_V[:-1]])
  steps = np.nonzero(c_V != prev)[0]
  vals = np.concatenate([c_V[steps], prev[steps]]).astype(np.float32) / np.float32(c_V[-1])
  us = np.concatenate([vals, np.nextafter(vals, np.float32(0)), np.nextafter(vals, np.float32(1))])
  lo, hi = np.finfo(np.float32).tiny, np.nextafter(np.float32(1), np.float32(0))
  return np.unique(np.clip(us, lo, hi).astype(np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("V", sorted(_ZERO_CASES))
def test_draw_never_returns_zero_probability_token_at_realistic_vocabularies(V):
  """Guarantee: sample_from_uniforms never returns a token of warped probability 0, for
  uniforms placed at every step of the program's own prefix sums (where a non-monotone sum
  would let a removed token through), jitted and eager, rows of different laws in one batch.
  Deterministic: no false alarms; the negative control (the counting draw) returns a removed
  token on the same uniforms, so the uniforms do reach the failure."""
  from specjax.verify.sampling import sample_from_uniforms
  logits = jax.random.normal(jax.random.key(0), (len(_ZERO_CASES[V]), V)) * 3.0
  if V == 152_064:  # padding rows of an embedding larger than the tokenizer
    logits = logits.at[:, 151_936:].set(-jnp.inf)
  rows_p, rows_u = [], []
  cumsum = jax.jit(lambda p: jnp.cumsum(p, axis=-1))
  for i, s in enumerate(_ZERO_CASES[V]):
    p = warp_jit(logits[i:i + 1], s)
    u = _step_uniforms(np.asarray(p)[0], np.asarray(cumsum(p))[0])
    rows_p.append(jnp.broadcast_to(p, (len(u), V)))
    rows_u.append(u)
  P = jnp.concatenate(rows_p)
  U = jnp.asarray(np.concatenate(rows_u))[:, None]
  P_np = np.asarray(P)
  rows = np.arange(P.shape[0])
  control_hits = 0
  for name, draw in [("jit", jax.jit(sample_from_uniforms)), ("eager", sample_from_uniforms)]:
    x = np.asarray(draw(U, P))
    zero = P_np[rows, x] == 0.0
    assert not zero.any(), (f"{name}: {zero.sum()} of {len(x)} draws returned a token of "
                            f"probability 0, e.g. token {x[zero][0]} at u = {U[zero][0, 0]}")
    control_hits += int((P_np[rows, np.asarray(jax.jit(_counting_inverse_cdf)(U, P))]
                         == 0.0).sum())
  if V != 152_064:  # the -inf row's prefix sum is flat where it is cut: no control there
    assert control_hits > 0, "negative control: the counting draw should hit a removed token"


@pytest.mark.slow
def test_draw_law_at_realistic_vocabulary_stratified():
  """The law, not only the support, at V = 50,257 (top-p 0.9, T = 0.8): N stratified
  uniforms (i + 1/2) / N give every token a count within 1 + N·1e-5 of N·p (each token's
  interval has width p up to float32 rounding). Deterministic; negative control: the same
  bound fails for the law with two tokens' masses swapped."""
  from specjax.verify.sampling import sample_from_uniforms
  V, N, chunk = 50_257, 8_192, 1_024
  p = warp_jit(jax.random.normal(jax.random.key(1), (1, V)) * 3.0, make_sampler(0.8, top_p=0.9))
  draw = jax.jit(sample_from_uniforms)
  u = ((np.arange(N) + 0.5) / N).astype(np.float32)
  x = np.concatenate([np.asarray(draw(jnp.asarray(u[i:i + chunk])[:, None],
                                      jnp.broadcast_to(p, (chunk, V))))
                      for i in range(0, N, chunk)])
  p_np = np.asarray(p, np.float64)[0]
  counts = np.bincount(x, minlength=V)
  bound = 1.0 + N * 1e-5
  assert counts[p_np == 0].sum() == 0
  assert np.max(np.abs(counts - N * p_np)) <= bound
  order = np.argsort(-p_np)
  q = p_np.copy()
  q[order[0]], q[order[5]] = p_np[order[5]], p_np[order[0]]
  assert np.max(np.abs(counts - N * q)) > bound
