"""Exact acceptance rules for speculative decoding (chains).

Notation (BACKGROUND.md §3): p = warped target distribution, q = warped draft distribution
at the same position, x ~ q the drafted token.

Single-candidate rule. Accept x with probability min(1, p(x)/q(x)); on rejection sample from
the residual r = max(0, p - q) / sum(max(0, p - q)). Then for every token y

  P(emit y) = P(draft y, accept) + P(reject) * r(y)
            = q(y) min(1, p(y)/q(y)) + [sum_x q(x) - min(p(x), q(x))] * r(y)
            = min(p(y), q(y))        + [sum_x max(0, p(x) - q(x))]     * r(y)
            = min(p(y), q(y)) + max(0, p(y) - q(y))
            = p(y),

using sum q = sum p = 1 (so sum(q - min(p, q)) = sum(p - min(p, q)) = sum max(0, p - q)).
This holds for any q, so q changes only the speed.

Deterministic drafts (q = None): the draft is a point mass at x, q = one_hot(x). The same rule
reads: accept with probability p(x); residual = max(0, p - one_hot(x)) = p with x zeroed,
renormalised. Greedy decoding (T = 0, p and q one-hot) falls out of the same rule: accept iff
the draft equals the target's argmax (p(x) = 1 > u*1), else the residual is the target's
one-hot, so the emitted tokens are exactly the greedy tokens.

Degenerate residual. sum max(0, p - q) = 0 means p <= q everywhere, i.e. p == q since both sum
to 1; then min(1, p(x)/q(x)) = 1 and a rejection has probability zero. It can still happen in
float32 rounding (p(x) a few ulps below q(x)), so the residual falls back to p; the extra
error is of the order of the rounding itself.

Chains. Position i (0-based, i < k) is accepted iff all positions <= i pass their own test:
accepted = cumprod(ok). With n accepted, the emitted token after them is drawn from the
residual at position n if n < k, else from p at position k (the bonus token). Conditional on
the accepted prefix the target distribution at each position is p_i, so the exactness
argument applies position by position (p at position i is the target's distribution given
the drafted prefix, which equals the emitted prefix when we reach position i).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from specjax.sampling import sample_from_uniforms, uniforms


@flax.struct.dataclass
class ChainResult:
  """Outcome of verifying one drafted chain per row.

  n_accepted: int32 [B], drafted tokens accepted (0..k).
  next_token: int32 [B], the target's token emitted after them: the correction sampled from
    the residual at the first rejected position, or the bonus token from p[:, k] after k.
  accepted: bool [B, k], True exactly on the accepted prefix.
  """

  n_accepted: jax.Array
  next_token: jax.Array
  accepted: jax.Array


# ---------------------------------------------------------------------------------------------
# Single-position building blocks (reused by tree verification later).
# ---------------------------------------------------------------------------------------------


def accept_test(u: jax.Array, p_x: jax.Array, q_x: jax.Array) -> jax.Array:
  """Accept iff u * q(x) < p(x), u ~ U(0, 1) (specjax.sampling.uniforms).

  For q(x) > 0 this is u < p(x)/q(x), i.e. acceptance with probability min(1, p(x)/q(x)),
  written without a division. q(x) = 1 gives the point-mass rule u < p(x). p(x) = 0 always
  rejects; q(x) = 0 (a draft token its own draft could not produce) accepts iff p(x) > 0.
  """
  return u * q_x < p_x


def acceptance_probability(p_V: jax.Array, q_V: jax.Array) -> jax.Array:
  """min(1, p/q) elementwise (1 where q == 0: such a token is never drafted)."""
  q_pos = q_V > 0.0
  return jnp.where(q_pos, jnp.minimum(1.0, p_V / jnp.where(q_pos, q_V, 1.0)), 1.0)


def residual(p_V: jax.Array, q_V: jax.Array) -> jax.Array:
  """Normalised residual max(0, p - q) / sum max(0, p - q) over the last axis.

  Falls back to p when the residual has no mass (p == q up to rounding; see module doc).
  """
  r_V = jnp.maximum(p_V - q_V, 0.0)
  mass = jnp.sum(r_V, axis=-1, keepdims=True)
  has_mass = mass > 0.0
  return jnp.where(has_mass, r_V / jnp.where(has_mass, mass, 1.0), p_V)


def residual_point(p_V: jax.Array, x: jax.Array) -> jax.Array:
  """Residual for a point-mass draft at token x: p with x zeroed, renormalised.

  Equals residual(p, one_hot(x)) since max(0, p(x) - 1) = 0 and max(0, p(y) - 0) = p(y).
  """
  return residual(p_V, jax.nn.one_hot(x, p_V.shape[-1], dtype=p_V.dtype))


def emitted_distribution(p_V: jax.Array, q_V: jax.Array) -> jax.Array:
  """Analytic law of the token emitted at one position by the rule, for x ~ q.

  P(emit y) = q(y) min(1, p(y)/q(y)) + P(reject) r(y),  P(reject) = sum_x q(x)(1 - a(x)).
  Equals p(y) when sum p = sum q (module doc). Shapes [..., V].
  """
  a_V = acceptance_probability(p_V, q_V)
  reject = jnp.sum(q_V * (1.0 - a_V), axis=-1, keepdims=True)
  return q_V * a_V + reject * residual(p_V, q_V)


def emitted_distribution_point(p_V: jax.Array, x: jax.Array) -> jax.Array:
  """Analytic law of the token emitted for a deterministic draft x (point mass).

  P(emit y) = [y == x] p(x) + (1 - p(x)) p(y) [y != x] / (1 - p(x)) = p(y).
  p_V [..., V], x int [...].
  """
  return emitted_distribution(p_V, jax.nn.one_hot(x, p_V.shape[-1], dtype=p_V.dtype))


# ---------------------------------------------------------------------------------------------
# Chains.
# ---------------------------------------------------------------------------------------------


class _Rule(NamedTuple):
  """The pieces of the rule, swappable so tests can plant bugs (negative controls)."""

  accept: Callable[[jax.Array, jax.Array, jax.Array], jax.Array] = accept_test
  residual: Callable[[jax.Array, jax.Array], jax.Array] = residual
  sample: Callable[[jax.Array, jax.Array], jax.Array] = sample_from_uniforms  # (u_NV, w_NV)


_EXACT = _Rule()


def _check_chain_shapes(draft_tokens_BK, p_BKV1, q_BKV) -> tuple[int, int, int]:
  if draft_tokens_BK.ndim != 2:
    raise ValueError(f"draft_tokens_BK must be [B, k], got shape {draft_tokens_BK.shape}")
  B, K = draft_tokens_BK.shape
  if p_BKV1.ndim != 3 or p_BKV1.shape[:2] != (B, K + 1):
    raise ValueError(f"p_BKV1 must be [B, k+1, V] = [{B}, {K + 1}, V], got shape {p_BKV1.shape}")
  V = p_BKV1.shape[2]
  if q_BKV is not None and q_BKV.shape != (B, K, V):
    raise ValueError(f"q_BKV must be [B, k, V] = [{B}, {K}, {V}] or None, got shape {q_BKV.shape}")
  return B, K, V


def _accept_chain(key: jax.Array, draft_tokens_BK: jax.Array, p_BKV1: jax.Array,
                  q_BKV: jax.Array | None, rule: _Rule) -> ChainResult:
  """accept_chain with the rule's pieces as parameters (see accept_chain)."""
  B, K, V = _check_chain_shapes(draft_tokens_BK, p_BKV1, q_BKV)
  # All randomness in one draw: K test uniforms and V uniforms for the emitted token's
  # Gumbel-max sample, per row, all independent.
  u_BW = uniforms(key, (B, K + V))  # W = k + V
  u_BK, u_BV = u_BW[:, :K], u_BW[:, K:]
  draft_BK = draft_tokens_BK.astype(jnp.int32)
  p_BKV1 = p_BKV1.astype(jnp.float32)
  if K == 0:  # Nothing drafted: the bonus token is plain target sampling.
    return ChainResult(n_accepted=jnp.zeros((B,), jnp.int32),
                       next_token=rule.sample(u_BV, p_BKV1[:, 0]),
                       accepted=jnp.zeros((B, 0), bool))

  # 1. Per-position test u_i * q_i(x_i) < p_i(x_i), independent u_i ~ U(0, 1).
  p_x_BK = jnp.take_along_axis(p_BKV1[:, :K], draft_BK[..., None], axis=-1)[..., 0]
  if q_BKV is None:
    q_x_BK = jnp.ones_like(p_x_BK)  # point mass: q(x) = 1
  else:
    q_x_BK = jnp.take_along_axis(q_BKV.astype(jnp.float32), draft_BK[..., None], axis=-1)[..., 0]
  ok_BK = rule.accept(u_BK, p_x_BK, q_x_BK)

  # 2. Keep the prefix up to the first failure: accepted_i = prod_{j<=i} ok_j.
  accepted_BK = jnp.cumprod(ok_BK.astype(jnp.int32), axis=1).astype(bool)
  n_B = jnp.sum(accepted_BK, axis=1, dtype=jnp.int32)

  # 3. The emitted token: residual at the first rejected position n (< k), or p_k (bonus).
  p_B1V = jnp.take_along_axis(p_BKV1, n_B[:, None, None], axis=1)  # p at position n
  at_B = jnp.minimum(n_B, K - 1)  # position of the rejection (clamped; unused if n == k)
  if q_BKV is None:
    x_B = jnp.take_along_axis(draft_BK, at_B[:, None], axis=1)[:, 0]
    q_BV = jax.nn.one_hot(x_B, V, dtype=jnp.float32)
  else:
    q_BV = jnp.take_along_axis(q_BKV.astype(jnp.float32), at_B[:, None, None], axis=1)[:, 0]
  p_BV = p_B1V[:, 0]
  rejected_B1 = (n_B < K)[:, None]
  dist_BV = jnp.where(rejected_B1, rule.residual(p_BV, q_BV), p_BV)
  next_B = rule.sample(u_BV, dist_BV)
  return ChainResult(n_accepted=n_B, next_token=next_B, accepted=accepted_BK)


def accept_chain(key: jax.Array, draft_tokens_BK: jax.Array, p_BKV1: jax.Array,
                 q_BKV: jax.Array | None = None) -> ChainResult:
  """Exact speculative acceptance of one drafted chain per row.

  key: PRNG key; one draw of [B, k + V] uniforms (k for the tests, V for the emitted token).
  draft_tokens_BK: int [B, k] drafted tokens.
  p_BKV1: float32 [B, k+1, V] warped target probabilities at the k+1 verified positions
    (position i is the distribution of the token after the context + first i drafts).
  q_BKV: float32 [B, k, V] warped draft probabilities each draft was sampled from, or None for
    deterministic drafts (point masses: accept with probability p(x); on rejection sample p with
    x removed, renormalised).

  Pure, jittable, vmappable; no Python branching on values (only on k == 0 and q is None,
  which are static).
  """
  return _accept_chain(key, draft_tokens_BK, p_BKV1, q_BKV, _EXACT)


def accept_greedy(draft_tokens_BK: jax.Array, target_logits_BKV1: jax.Array) -> ChainResult:
  """Greedy verification: accept while draft == argmax(target); emit the argmax after them.

  next_token is argmax(target) at the first mismatch, or at position k (bonus) if all match.
  Token-identical to plain greedy decoding, and to accept_chain on T = 0 warped p and q.
  """
  B, K, _ = _check_chain_shapes(draft_tokens_BK, target_logits_BKV1, None)
  target_BK1 = jnp.argmax(target_logits_BKV1, axis=-1).astype(jnp.int32)
  ok_BK = draft_tokens_BK.astype(jnp.int32) == target_BK1[:, :K]
  accepted_BK = jnp.cumprod(ok_BK.astype(jnp.int32), axis=1).astype(bool)
  n_B = jnp.sum(accepted_BK, axis=1, dtype=jnp.int32)
  next_B = jnp.take_along_axis(target_BK1, n_B[:, None], axis=1)[:, 0]
  return ChainResult(n_accepted=n_B, next_token=next_B, accepted=accepted_BK)
