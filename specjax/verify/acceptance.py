"""Exact acceptance rules for speculative decoding (chains and token trees).

Notation (docs/conventions.md; the exactness argument in full: docs/exactness.md): p = warped
target distribution, q = warped draft distribution at the same position, x ~ q the drafted
token.

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

Trees (recursive rejection sampling, SpecInfer / Sequoia). At an accepted node with target
law p and children c_1..c_m tried in a fixed order (rank order, never one that depends on the
drawn values): r <- p; for i = 1..m test c_i against r; on acceptance descend into c_i (its
own children are then tried against the target's p at c_i); on rejection update r; if every
child is rejected emit a sample of r (a leaf's r is p: the bonus token).
- Candidates sampled i.i.d. from q: accept c_i with probability min(1, r(c_i)/q(c_i)); on
  rejection r <- norm(max(0, r - q)). Each step is the single-candidate rule with target r
  and draft q, so "accept c_i, or fall through to the next step" emits a token ~ r; by
  induction over the siblings (backwards from the last, whose fall-through samples r), the
  token emitted at the node is ~ p, and given that it is c_i the cycle continues from c_i
  exactly as the target would.
- Deterministic distinct candidates (top-k of the draft, point masses): accept c_i with
  probability r(c_i); on rejection r <- norm(r with c_i zeroed). The point-mass rule, step
  by step. (A repeated candidate has r(c) = 0 after its first rejection: never accepted.)
Sloppy variants (residual not updated between siblings, a rejected point mass left in r, a
sibling order that depends on the drawn tokens) are not exact; tests/verify/test_tree_acceptance.py
plants each and shows the statistical test rejecting it.

Planted bugs (`exactness.planted_bugs`): named inexact variants of the whole rule (always
accept; residual = p) that a loop traced inside `planted_bugs.planted(...)` uses instead of
the exact one, through the one hook `_PLANTED` below. They are the negative controls of the
exactness tool (`specjax.exactness`); the override is read at trace time only, so the exact
path pays nothing for it.
"""

from __future__ import annotations

import contextvars
from typing import Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from specjax.verify.sampling import sample_from_uniforms, uniforms_for
from specjax.verify.layout import VerifyLayout


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
  """Accept iff u * q(x) < p(x), u ~ U(0, 1) (specjax.verify.sampling.uniforms).

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


class ChainRule(NamedTuple):
  """The pieces of the rule, swappable so tests can plant bugs (negative controls)."""

  accept: Callable[[jax.Array, jax.Array, jax.Array], jax.Array] = accept_test
  residual: Callable[[jax.Array, jax.Array], jax.Array] = residual
  sample: Callable[[jax.Array, jax.Array], jax.Array] = sample_from_uniforms  # (u_N1, w_NV)


EXACT = ChainRule()


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
                  q_BKV: jax.Array | None, rule: ChainRule) -> ChainResult:
  """accept_chain with the rule's pieces as parameters (see accept_chain)."""
  B, K, V = _check_chain_shapes(draft_tokens_BK, p_BKV1, q_BKV)
  # All randomness in one draw: K test uniforms and one uniform for the emitted token's
  # inverse-CDF sample, per row, all independent.
  u_BW = uniforms_for(key, (B, K + 1), p_BKV1)  # W = k + 1 (constant when p is greedy)
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

  key: PRNG key; one draw of [B, k + 1] uniforms (k for the tests, 1 for the emitted token).
  draft_tokens_BK: int [B, k] drafted tokens.
  p_BKV1: float32 [B, k+1, V] warped target probabilities at the k+1 verified positions
    (position i is the distribution of the token after the context + first i drafts).
  q_BKV: float32 [B, k, V] warped draft probabilities each draft was sampled from, or None for
    deterministic drafts (point masses: accept with probability p(x); on rejection sample p with
    x removed, renormalised).

  Pure, jittable, vmappable; no Python branching on values (only on k == 0 and q is None,
  which are static).
  """
  return _accept_chain(key, draft_tokens_BK, p_BKV1, q_BKV, EXACT)


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


# ---------------------------------------------------------------------------------------------
# Trees.
# ---------------------------------------------------------------------------------------------


@flax.struct.dataclass
class TreeResult:
  """Outcome of verifying one token tree per row (T = N + 1 nodes, D = max depth, W = width).

  n_accepted: int32 [B], length of the accepted root-to-node path (drafted nodes accepted).
  next_token: int32 [B], the target's token after the path (correction or bonus).
  path: int32 [B, D+1], node indices of the path: path[:, 0] = 0 (root), path[:, d] the
    accepted node at depth d for d <= n, then the deepest accepted node repeated.
  depth_tried: bool [B, D], depth_tried[:, d-1]: a depth-d candidate was tried (the path
    reached depth d-1 and that node has children).
  rank_tried, rank_accepted: int32 [B, W], candidates of each sibling rank tried / accepted
    in this cycle (at most one accepted per depth).
  """

  n_accepted: jax.Array
  next_token: jax.Array
  path: jax.Array
  depth_tried: jax.Array
  rank_tried: jax.Array
  rank_accepted: jax.Array


class TreeRule(NamedTuple):
  """The tree rule's pieces, swappable so tests can plant bugs (negative controls).

  update(r, q, last) -> r after a rejected sampled candidate (last: no sibling follows).
  update_point(r, x, last) -> r after a rejected point-mass candidate x.
  order(tokens_BW, valid_BW) -> the sibling slots in the order they are tried [B, W]
    (None: rank order, the exact rule).
  """

  accept: Callable = accept_test
  update: Callable = lambda r, q, last: residual(r, q)
  update_point: Callable = lambda r, x, last: residual_point(r, x)
  order: Callable | None = None
  sample: Callable = sample_from_uniforms


EXACT_TREE = TreeRule()


def _chain_as_tree(res: ChainResult, k: int) -> TreeResult:
  n_B1 = res.n_accepted[:, None]
  path = jnp.minimum(jnp.arange(k + 1, dtype=jnp.int32)[None], n_B1)
  depth_tried = jnp.arange(k, dtype=jnp.int32)[None] <= n_B1  # depth d+1 tried iff n >= d
  return TreeResult(n_accepted=res.n_accepted, next_token=res.next_token, path=path,
                    depth_tried=depth_tried,
                    rank_tried=jnp.minimum(n_B1 + 1, k).astype(jnp.int32),
                    rank_accepted=n_B1.astype(jnp.int32))


def _accept_tree(key, layout: VerifyLayout, tokens_BT, p_BTV, q_BTV,
                 rule: TreeRule) -> TreeResult:
  """accept_tree with the rule's pieces as parameters (see accept_tree)."""
  B, T, V = p_BTV.shape
  children_BTW = layout.children_for(B)
  D, W = layout.max_depth, layout.max_width
  u_BX = uniforms_for(key, (B, D * W + 1), p_BTV)  # D·W tests, then 1 for the emitted token
  tokens_BT = tokens_BT.astype(jnp.int32)
  p_BTV = p_BTV.astype(jnp.float32)
  stochastic = q_BTV is not None
  rows = jnp.arange(B)

  def level(d, carry):
    cur, alive, r_BV, n, path, depth_tried, rank_tried, rank_acc = carry
    kids_BW = children_BTW[rows, cur]  # children of the current node, rank order
    valid_BW = kids_BW >= 0
    x_BW = jnp.take_along_axis(tokens_BT, jnp.maximum(kids_BW, 0), axis=1)
    slot_BW = jnp.broadcast_to(jnp.arange(W, dtype=jnp.int32), (B, W))
    if rule.order is not None:  # (negative controls only: a value-dependent order)
      slot_BW = rule.order(x_BW, valid_BW)
      kids_BW = jnp.take_along_axis(kids_BW, slot_BW, axis=1)
      valid_BW = jnp.take_along_axis(valid_BW, slot_BW, axis=1)
      x_BW = jnp.take_along_axis(x_BW, slot_BW, axis=1)
    q_BV = q_BTV[rows, cur].astype(jnp.float32) if stochastic else None
    u_BW = jax.lax.dynamic_slice_in_dim(u_BX, d * W, W, axis=1)
    chosen = jnp.zeros_like(cur)
    found = jnp.zeros_like(alive)
    for i in range(W):  # siblings in a fixed order: rank 0 first
      x = x_BW[:, i]
      trying = alive & ~found & valid_BW[:, i]
      r_x = jnp.take_along_axis(r_BV, x[:, None], axis=1)[:, 0]
      q_x = jnp.take_along_axis(q_BV, x[:, None], axis=1)[:, 0] if stochastic else 1.0
      ok = rule.accept(u_BW[:, i], r_x, q_x)  # u q(x) < r(x): prob min(1, r(x)/q(x))
      last = (~valid_BW[:, i + 1] if i + 1 < W else jnp.ones_like(trying))[:, None]
      rejected = (trying & ~ok)[:, None]
      if stochastic:  # r <- norm(max(0, r - q))
        r_BV = jnp.where(rejected, rule.update(r_BV, q_BV, last), r_BV)
      else:  # r <- norm(r with x zeroed)
        r_BV = jnp.where(rejected, rule.update_point(r_BV, x, last), r_BV)
      took = trying & ok
      chosen = jnp.where(took, kids_BW[:, i], chosen)
      found = found | took
      rank = slot_BW[:, i:i + 1] == jnp.arange(W)[None]  # [B, W] one-hot of the rank tried
      rank_tried = rank_tried + (rank & trying[:, None]).astype(jnp.int32)
      rank_acc = rank_acc + (rank & took[:, None]).astype(jnp.int32)
    depth_tried = depth_tried.at[:, d].set(alive & jnp.any(valid_BW, axis=1))
    # Descend into the accepted child: its children are tested against the target's p there.
    cur = jnp.where(found, chosen, cur)
    r_BV = jnp.where(found[:, None], p_BTV[rows, cur], r_BV)
    n = n + found.astype(jnp.int32)
    path = path.at[:, d + 1].set(cur)
    return cur, found, r_BV, n, path, depth_tried, rank_tried, rank_acc

  zeros = jnp.zeros((B,), jnp.int32)
  init = (zeros, jnp.ones((B,), bool), p_BTV[:, 0], zeros, jnp.zeros((B, D + 1), jnp.int32),
          jnp.zeros((B, D), bool), jnp.zeros((B, W), jnp.int32), jnp.zeros((B, W), jnp.int32))
  _, _, r_BV, n, path, depth_tried, rank_tried, rank_acc = jax.lax.fori_loop(0, D, level, init)
  # r: the residual after the stopping node's rejected children, or p there (bonus token).
  next_token = rule.sample(u_BX[:, D * W:], r_BV)
  return TreeResult(n_accepted=n, next_token=next_token, path=path, depth_tried=depth_tried,
                    rank_tried=rank_tried, rank_accepted=rank_acc)


def accept_tree(key: jax.Array, layout: VerifyLayout, tokens_BT: jax.Array, p_BTV: jax.Array,
                q_BTV: jax.Array | None = None) -> TreeResult:
  """Exact speculative acceptance of one token tree per row (recursive rejection sampling).

  key: PRNG key; one draw of [B, D·W + 1] uniforms (D = max depth, W = max width).
  layout: the verify layout (`tree.layout(proposal)`, verify_layout.VerifyLayout): the children
    table (rank order, -1 padded; [T, W] shared by all rows or [B, T, W] per row) and the
    depth bound D are what the rule reads.
  tokens_BT: int [B, T] node tokens (node 0, the root, is ignored).
  p_BTV: float32 [B, T, V] warped target law of the token after each node's path.
  q_BTV: float32 [B, T, V], row i = the draft law node i's children were sampled from,
    i.i.d. (rows of leaves are ignored); or None for deterministic distinct candidates.

  A chain layout goes through `accept_chain` (the same rule, vectorised with cumprod).
  Pure, jittable, vmappable; static shapes.
  """
  T = layout.n_nodes
  if tokens_BT.shape[1:] != (T,) or p_BTV.shape[1] != T:
    raise ValueError(f"tokens_BT and p_BTV must have {T} nodes for this tree, got shapes "
                     f"{tokens_BT.shape} and {p_BTV.shape}")
  bug = _PLANTED.get()  # None outside `planted` (read at trace time; nothing at run time)
  if layout.is_chain:
    k = T - 1
    q_BKV = None if q_BTV is None else q_BTV[:, :k]
    res = (accept_chain(key, tokens_BT[:, 1:], p_BTV, q_BKV) if bug is None else
           _accept_chain(key, tokens_BT[:, 1:], p_BTV, q_BKV, bug.chain))
    return _chain_as_tree(res, k)
  return _accept_tree(key, layout, tokens_BT, p_BTV, q_BTV,
                      EXACT_TREE if bug is None else bug.tree)


# The one hook of the negative controls (`exactness.planted_bugs`): while a rule is set here (a
# `.chain` ChainRule and a `.tree` TreeRule), `accept_tree` *traced* uses its pieces instead of
# the exact ones. Read at trace time only, so the exact path pays nothing for it.
_PLANTED: contextvars.ContextVar = contextvars.ContextVar("specjax_planted_bug", default=None)
