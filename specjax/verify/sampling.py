"""Logit warping (temperature, top-k, top-p) and categorical sampling.

Speculative decoding is exact with respect to the *warped* target distribution
(docs/exactness.md): the acceptance rule compares warped probabilities p (target) and q
(draft). So `warp` returns float32 probabilities, not logits, and greedy decoding (T = 0)
is an exact one-hot, which makes the stochastic rule in `acceptance.py` degenerate to
token-for-token greedy identity.

All sampler settings are runtime arrays (`SamplerParams`): a jitted caller compiles one
program for every temperature / top-k / top-p value. Nothing here branches in Python on
array values.
"""

from __future__ import annotations

import math
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class SamplerParams:
  """Runtime sampler settings (scalars; vmap over them for per-row settings).

  temperature: f32 scalar, 0.0 = greedy (one-hot at the argmax).
  top_k: int32 scalar, keep the k most probable tokens; 0 = off (as is k >= V).
  top_p: f32 scalar in (0, 1], nucleus mass; 1.0 = off.
  """

  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array


def make_sampler(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> SamplerParams:
  """Validates the settings (Python boundary) and returns them as non-weak-typed arrays.

  Raises ValueError naming the argument, its value and the allowed range.
  """
  try:
    t = float(temperature)
  except (TypeError, ValueError):
    raise ValueError(f"temperature must be a finite float >= 0, got {temperature!r}") from None
  if not math.isfinite(t) or t < 0.0:
    raise ValueError(f"temperature must be a finite float >= 0 (0 = greedy), got {temperature!r}")
  try:
    k_ok = not isinstance(top_k, bool) and float(top_k).is_integer() and top_k >= 0
  except (TypeError, ValueError, OverflowError):
    k_ok = False
  if not k_ok:
    raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
  if top_k > jnp.iinfo(jnp.int32).max:
    raise ValueError(f"top_k must fit in int32, got {top_k!r}")
  try:
    p = float(top_p)
  except (TypeError, ValueError):
    raise ValueError(f"top_p must be in (0, 1], got {top_p!r}") from None
  if not (0.0 < p <= 1.0):  # also rejects NaN
    raise ValueError(f"top_p must be in (0, 1] (1.0 = off), got {top_p!r}")
  return SamplerParams(
      temperature=jnp.asarray(t, dtype=jnp.float32),
      top_k=jnp.asarray(int(top_k), dtype=jnp.int32),
      top_p=jnp.asarray(p, dtype=jnp.float32),
  )


def _order_key(s_NV: jax.Array) -> jax.Array:
  """float32 -> uint32 with the same order (-0.0 and 0.0 map to one key; no NaNs expected).

  Non-negative floats keep their bits; negative floats have their 31 low bits flipped (a
  larger magnitude is a smaller number); the sign bit is then flipped so unsigned order is
  float order.
  """
  s_NV = jnp.where(s_NV == 0.0, 0.0, s_NV)
  i_NV = jax.lax.bitcast_convert_type(s_NV, jnp.int32)
  i_NV = jnp.where(i_NV < 0, i_NV ^ jnp.int32(0x7FFFFFFF), i_NV)
  return jax.lax.bitcast_convert_type(i_NV, jnp.uint32) ^ jnp.uint32(0x80000000)


def _largest_threshold(key_NV: jax.Array, holds: Callable[[jax.Array], jax.Array]) -> jax.Array:
  """Per row, the largest t (uint32) with holds(key >= t) true; holds must be monotone.

  Bisection over the 32-bit key space: invariant holds(lo) and not holds(hi) (hi = 2^32 - 1
  is above every float key), 32 halvings leave hi = lo + 1. Exact, O(32 V) per row, no sort.
  """
  # Derived from key_NV (not fresh constants) so the carry has the same sharding/varying type
  # as the data inside jax.shard_map.
  lo_N1 = jnp.zeros_like(key_NV[..., :1])
  hi_N1 = lo_N1 + jnp.uint32(0xFFFFFFFF)

  def halve(_, bounds):
    lo_N1, hi_N1 = bounds
    mid_N1 = lo_N1 + (hi_N1 - lo_N1) // 2
    ok_N1 = holds(key_NV >= mid_N1)
    return jnp.where(ok_N1, mid_N1, lo_N1), jnp.where(ok_N1, hi_N1, mid_N1)

  lo_N1, _ = jax.lax.fori_loop(0, 32, halve, (lo_N1, hi_N1))
  return lo_N1


def _first_tied(tied_NV: jax.Array, n_N1: jax.Array) -> jax.Array:
  """The first n tokens of each row's tied set, in index order (n >= 1).

  The prefix count needs a cumsum over V (~0.5 ms per 50k row on CPU), so it runs only when
  some row has more tied tokens than it may keep; with float32 logits there is usually a
  single token at the threshold.
  """
  fits = jnp.all(jnp.sum(tied_NV, -1, keepdims=True, dtype=jnp.int32) <= n_N1)
  return jax.lax.cond(fits, lambda t, n: t,
                      lambda t, n: t & (jnp.cumsum(t, -1, dtype=jnp.int32) <= n), tied_NV, n_N1)


def _top_k_mask(key_NV: jax.Array, k: jax.Array) -> jax.Array:
  """The k highest-ranked tokens: all above the k-th value t, then ties at t by index."""
  t_N1 = _largest_threshold(key_NV, lambda m: jnp.sum(m, -1, keepdims=True, dtype=jnp.int32) >= k)
  above_NV = key_NV > t_N1
  n_above_N1 = jnp.sum(above_NV, -1, keepdims=True, dtype=jnp.int32)
  return above_NV | _first_tied(key_NV == t_N1, k - n_above_N1)


def _top_p_mask(s_NV: jax.Array, key_NV: jax.Array, keep_NV: jax.Array,
                top_p: jax.Array) -> jax.Array:
  """The nucleus of softmax(s) restricted to keep: the smallest rank prefix with mass >= top_p.

  t = the largest value whose tokens-at-or-above carry mass >= top_p; keep the tokens above t,
  then tied tokens at t (equal probability p_t each) in index order until the mass is reached.
  """
  p_NV = jax.nn.softmax(jnp.where(keep_NV, s_NV, -jnp.inf), axis=-1)
  mass_from = lambda m: jnp.sum(jnp.where(m, p_NV, 0.0), -1, keepdims=True)
  t_N1 = _largest_threshold(key_NV, lambda m: mass_from(m) >= top_p)
  above_NV, tied_NV = (key_NV > t_N1) & keep_NV, (key_NV == t_N1) & keep_NV
  need_N1 = top_p - mass_from(above_NV)  # mass still missing after the tokens above t
  p_tied_N1 = jnp.max(jnp.where(tied_NV, p_NV, 0.0), -1, keepdims=True)  # all tied p are equal
  n_tied_N1 = jnp.ceil(need_N1 / jnp.where(p_tied_N1 > 0.0, p_tied_N1, 1.0))
  return above_NV | _first_tied(tied_NV, jnp.maximum(n_tied_N1, 1.0).astype(jnp.int32))


def _filter_top_k_top_p(s_NV: jax.Array, k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Sets every token outside the top-k-then-nucleus set to -inf (k in [1, V]).

  Order: tokens ranked by scaled logit, descending; ties broken by lower token index first.
  top-k keeps the first k ranks, exactly k tokens even with ties. top-p then works on the
  top-k renormalised probabilities p_(1) >= p_(2) >= ...: it keeps the smallest prefix of
  ranks whose mass reaches top_p, sum_{i<=m} p_(i) >= top_p (rank 1 is always kept).

  No sort (a 50k-token sort costs ~20-40 ms per row on CPU): each cut is a value threshold t
  found by bisection (top-k: largest t with #{s >= t} >= k; top-p: largest t with
  mass{s >= t} >= top_p), plus the tokens tied at t taken in index order until the count
  (top-k) or the mass (top-p) is reached. Masses are float32 sums, so "reaches top_p" is
  decided up to float32 rounding of the cumulative mass. Each filter is skipped at run time
  (lax.cond) when it is off.
  """
  V = s_NV.shape[-1]
  key_NV = _order_key(s_NV)
  keep_NV = jax.lax.cond(k < V, _top_k_mask, lambda key, k: jnp.ones(key.shape, bool), key_NV, k)
  return jnp.where(
      jax.lax.cond(top_p < 1.0, _top_p_mask, lambda s, key, keep, p: keep, s_NV, key_NV, keep_NV,
                   top_p), s_NV, -jnp.inf)


def warp(logits_NV: jax.Array, sampler: SamplerParams) -> jax.Array:
  """Logits [..., V] (any float dtype) -> float32 probabilities [..., V] of the warped law.

  T > 0:  s = (logits - max logits) / T            (softmax(s) == softmax(logits / T))
          s -> -inf outside top-k (if on), then outside the nucleus (if on)
          probs = softmax(s)                        (renormalised over the kept set)
  T == 0: probs = one_hot(argmax(logits))           (first index on ties, as jnp.argmax)

  T == 0 and the top-k / top-p cuts (a bisection each, see _filter_top_k_top_p) run under
  `lax.cond`, so a jitted caller skips the softmax when greedy and a filter that is off at
  run time (with both off, the common case, warp is a plain softmax); under vmap with a
  batched sampler the conds become selects and every branch runs (still exact).
  Assumes at least one finite logit per row. Tokens with logit -inf get probability 0.
  """
  V = logits_NV.shape[-1]
  t = jnp.asarray(sampler.temperature, jnp.float32)
  top_k = jnp.asarray(sampler.top_k, jnp.int32)
  top_p = jnp.asarray(sampler.top_p, jnp.float32)
  greedy = t <= 0.0

  def sampled(logits):
    x_NV = logits.astype(jnp.float32)
    # Subtracting the max first keeps s finite for tiny T (no overflow to inf - inf).
    s_NV = (x_NV - jnp.max(x_NV, axis=-1, keepdims=True)) / jnp.where(greedy, 1.0, t)
    k_eff = jnp.where((top_k <= 0) | (top_k >= V), V, top_k)
    filtering = (k_eff < V) | (top_p < 1.0)
    s_NV = jax.lax.cond(filtering, _filter_top_k_top_p, lambda s, k, p: s, s_NV, k_eff, top_p)
    return jax.nn.softmax(s_NV, axis=-1)

  def point_mass(logits):
    return jax.nn.one_hot(jnp.argmax(logits, axis=-1), V, dtype=jnp.float32)

  # Greedy skips the softmax over V (a runtime branch: T stays a traced value).
  return jax.lax.cond(greedy, point_mass, sampled, logits_NV)


def uniforms(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """float32 U(tiny, 1) noise: what sample_from_uniforms and the acceptance test consume.

  The lower end is the smallest normal float32 (1.2e-38), not 0. As a stand-in for U[0, 1)
  this shifts any probability by at most 1.2e-38.
  """
  return jax.random.uniform(key, shape, jnp.float32, minval=jnp.finfo(jnp.float32).tiny,
                            maxval=1.0)


def point_masses(probs_NV: jax.Array) -> jax.Array:
  """True iff every row of probs [..., V] has exactly one positive entry (a T = 0 law)."""
  return jnp.all(jnp.sum(probs_NV > 0.0, axis=-1) == 1)


def _argmax(probs_NV: jax.Array) -> jax.Array:
  return jnp.argmax(probs_NV, axis=-1).astype(jnp.int32)


def _inverse_cdf(u_N1: jax.Array, probs_NV: jax.Array) -> jax.Array:
  """The first token v of positive weight with c[v] > u·c[V-1], c = cumsum(w) (w = probs,
  unnormalised ok); the last positive token if rounding leaves none. A row of zeros returns 0.

  Never a token of weight 0, on any backend: the candidates are the positive tokens only.
  Counting `c <= t` (the textbook form) relies on c being monotone and flat at zero-weight
  tokens; XLA:CPU computes a long row's prefix sum blockwise, its sums move at zero-weight
  tokens and step backwards by an ulp or so, and the count then lands on a removed token
  (~1e-7-6e-6 per draw at V = 32k-50k with top-k or top-p; docs/exactness.md).

  Law: the i-th positive token v_i is returned iff t = u·c[V-1] lies in
  [M_{i-1}, max(M_{i-1}, c[v_i])), M_i = max_{j<=i} c[v_j] -- disjoint intervals tiling
  [0, M_last) whose widths are w_{v_i} up to float32 rounding of the prefix sums (resolution
  ~1e-7 relative to the row's mass), whatever order the backend sums in.
  """
  p_NV = probs_NV.astype(jnp.float32)
  V = p_NV.shape[-1]
  c_NV = jnp.cumsum(p_NV, axis=-1)
  t_N1 = u_N1.astype(jnp.float32) * c_NV[..., -1:]
  positive_NV = p_NV > 0.0
  v = jnp.arange(V, dtype=jnp.int32)
  first_N = jnp.min(jnp.where(positive_NV & (c_NV > t_N1), v, V), axis=-1)
  last_N = jnp.max(jnp.where(positive_NV, v, 0), axis=-1)  # last positive token (0 if none)
  return jnp.where(first_N < V, first_N, last_N)


def sample_from_uniforms(u_N1: jax.Array, probs_NV: jax.Array) -> jax.Array:
  """Categorical sample [...] from probabilities [..., V] given one U(0, 1) per row [..., 1].

  Inverse CDF (`_inverse_cdf`): one uniform and one prefix sum per row, where Gumbel-max
  needed V uniforms and two logarithms over V (a threefry kernel over V per draw cost
  ~0.06 ms at V = 2048 on CPU, several times a cycle). Unnormalised weights are fine;
  zero-probability tokens are never returned, so a one-hot returns exactly its hot index.
  Only u[..., 0] is read (a wider noise array is accepted). Taking the noise as an argument
  lets a caller draw all its randomness in one call (one threefry kernel to compile).

  When every row is a point mass (greedy decoding), the result is the argmax whatever the
  noise: a `lax.cond` skips the prefix sum. Same result either way; under vmap with a
  batched predicate both branches run.
  """
  u_N1 = u_N1[..., :1]
  return jax.lax.cond(point_masses(probs_NV), lambda u, p: _argmax(p), _inverse_cdf, u_N1,
                      probs_NV)


def sample(key: jax.Array, probs_NV: jax.Array) -> jax.Array:
  """Categorical sample from probabilities [..., V] -> int32 tokens [...].

  Exact argmax for a one-hot; never a zero-probability token (see sample_from_uniforms).
  One uniform per row (inverse CDF); when every row is a point mass no noise is drawn
  (`lax.cond`): greedy decoding skips the threefry kernel and the prefix sum.
  """
  return jax.lax.cond(point_masses(probs_NV), lambda k, p: _argmax(p),
                      lambda k, p: _inverse_cdf(uniforms(k, p.shape[:-1] + (1,)), p),
                      key, probs_NV)


def uniforms_for(key: jax.Array, shape: tuple[int, ...], probs: jax.Array) -> jax.Array:
  """`uniforms(key, shape)`, or a constant 0.5 when every row of `probs` is a point mass.

  For the acceptance rules: with a point-mass target law every test u·q(x) < p(x) (p(x) in
  {0, 1}, residuals renormalised) and every sample of a point mass has the same outcome
  for any u in (0, 1), so greedy decoding skips the threefry kernel and stays
  bit-identical.
  """
  return jax.lax.cond(point_masses(probs), lambda k: jnp.full(shape, 0.5, jnp.float32),
                      lambda k: uniforms(k, shape), key)
