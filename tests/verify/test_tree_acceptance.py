"""Exactness of token-tree acceptance (specjax.verify.acceptance.accept_tree / _accept_tree).

Design (docs/exactness.md, how the tests prove it):
- A first-order Markov "language" over V = 5 tokens: the target's law of the next token after
  token c is P[c] (warped target logits, row c), the draft's Q[c]. One cycle verifies the tree
  TREE (root with 3 children, a depth-1 node with 2, two with 1: depth 2, width 3) drafted
  from START: sampled candidates are i.i.d. draws of Q[parent token]; deterministic
  candidates are the top-m of the draft logits at the parent (distinct). The cycle emits its
  accepted path and the target's token (1 to 3 tokens); the rest of the 3-token window is
  completed by exact sampling from P. The joint law of the 3 tokens must then be the Markov
  law P[START, y1] P[y1, y2] P[y2, y3] (125 cells): this checks where a cycle stops as well as
  what it emits.
- Two independent implementations: the vectorised JAX rule (B = 100,000 rows, one jitted
  simulation) and a numpy reference that enumerates every candidate draw and acceptance
  branch and gives the exact law of the rule, of each planted bug too.
- χ² goodness of fit (zero-probability cells excluded and required empty, cells with expected
  count < 5 pooled), false-alarm rate 1e-3 per test family, Bonferroni-split over its cases.
  Temperature, top-k and top-p are active in every case.
- Negative controls (planted through the rule's swappable pieces, selected by a runtime id so
  one compiled simulation serves all): the residual not updated between siblings; a rejected
  deterministic candidate left in the residual; siblings tried in an order that depends on
  their sampled values (ascending token id). Each must be rejected by the same test at the
  same N and threshold; its power, from the noncentral χ² with the exact law of the bug, is
  asserted >= 0.99.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from specjax.verify import acceptance, trees, layout as verify_layout
from specjax.verify.acceptance import _accept_tree, TreeRule, accept_tree, residual, residual_point
from specjax.verify.sampling import make_sampler, warp

V = 5
START = 0
N_ROWS = 100_000
TREE = trees.TreeSpec((-1, 0, 0, 0, 1, 1, 2, 3))
D = TREE.max_depth
FAMILY_ALPHA = 1e-3
MIN_POWER = 0.99
warp_jit = jax.jit(warp)

BUGS = {"residual_not_updated": 1, "rejected_point_kept": 2, "value_dependent_order": 3}
EXACT = 0


# ----------------------------------------------------------------------------- χ²


def chi2_pvalue(counts, probs) -> tuple[float, int]:
  """(p-value, hits in zero-probability cells) of counts against probs."""
  counts, probs = np.asarray(counts, np.float64).ravel(), np.asarray(probs, np.float64).ravel()
  probs = probs / probs.sum()
  support = probs > 0
  n = counts.sum()
  obs, exp = counts[support], n * probs[support]
  small = exp < 5
  if small.any():
    obs = np.append(obs[~small], obs[small].sum())
    exp = np.append(exp[~small], exp[small].sum())
  return float(scipy.stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue), \
      int(counts[~support].sum())


def chi2_power(null, alt, n: int, alpha: float) -> float:
  """Power of chi2_pvalue at level alpha when counts follow alt (noncentral χ², same pooling),
  combined with the chance of a hit in a zero-probability cell of null."""
  null, alt = np.asarray(null, np.float64).ravel(), np.asarray(alt, np.float64).ravel()
  support = null > 0
  e0, e1 = null[support], alt[support]
  small = n * e0 < 5
  if small.any():
    e0 = np.append(e0[~small], e0[small].sum())
    e1 = np.append(e1[~small], e1[small].sum())
  lam = n * float(np.sum((e1 - e0) ** 2 / e0))
  dof = e0.size - 1
  power = float(scipy.stats.ncx2.sf(scipy.stats.chi2.isf(alpha, dof), dof, lam))
  p_zero = -np.expm1(n * np.log1p(-min(float(alt[~support].sum()), 1 - 1e-16)))
  return 1.0 - (1.0 - power) * (1.0 - p_zero)


# ----------------------------------------------------------------------------- the reference


def _np_residual(r, q):
  w = np.maximum(r - q, 0.0)
  return w / w.sum() if w.sum() > 0 else r


def reference_law(P, Q, draft_logits, deterministic: bool, bug: str | None = None):
  """Exact law [V]*(D+1) of the 3-token window under the rule (or a planted bug), by
  enumerating every candidate draw and acceptance branch of TREE (float64)."""
  mass = {l: np.zeros((V,) * l) for l in range(1, D + 2)}  # mass of emitted prefixes

  def visit(node: int, ctx: int, prefix: tuple, prob: float):
    kids = [int(c) for c in TREE.children[node] if c >= 0]
    p, q = P[ctx], Q[ctx]
    if not kids:  # a leaf: the bonus token ~ p
      mass[len(prefix) + 1][prefix] += prob * p
      return
    m = len(kids)
    if deterministic:
      top = np.argsort(-draft_logits[ctx], kind="stable")[:m]
      draws = [(tuple(int(x) for x in top), 1.0)]
    else:
      draws = [(xs, float(np.prod(q[list(xs)]))) for xs in itertools.product(range(V), repeat=m)]
    for xs, w in draws:
      if w == 0.0:
        continue
      order = range(m)
      if bug == "value_dependent_order":
        order = sorted(range(m), key=lambda j: (xs[j], j))
      r, rest = p.copy(), prob * w
      for pos, j in enumerate(order):
        x = xs[j]
        a = r[x] if deterministic else (min(1.0, r[x] / q[x]) if q[x] > 0 else float(r[x] > 0))
        if a > 0:
          visit(kids[j], x, prefix + (x,), rest * a)
        rest *= 1.0 - a
        last = pos == m - 1
        if deterministic:
          if bug != "rejected_point_kept":
            r = _np_residual(r, np.eye(V)[x])
        elif not (bug == "residual_not_updated" and not last):
          r = _np_residual(r, q)
      mass[len(prefix) + 1][prefix] += rest * r  # every candidate rejected: sample r

  visit(0, START, (), 1.0)
  for l in range(1, D + 1):  # complete the window by exact target sampling
    mass[l + 1] += mass[l][..., None] * P.reshape((1,) * (l - 1) + (V, V))
  return mass[D + 1]


def markov_law(P):
  return P[START][:, None, None] * P[:, :, None] * P[None, :, :]


# ----------------------------------------------------------------------------- the simulation


def switch_rule(bug_id) -> TreeRule:
  """The rule's pieces with a planted bug chosen at run time (EXACT = the library's pieces)."""

  def update(r, q, last):  # bug 1: residual left at r until the last sibling
    return jnp.where((bug_id == 1) & ~last, r, residual(r, q))

  def update_point(r, x, last):  # bug 2: the rejected point mass stays in r
    return jnp.where(bug_id == 2, r, residual_point(r, x))

  def order(x_BW, valid_BW):  # bug 3: siblings tried by ascending token id
    w = x_BW.shape[1]
    by_value = jnp.argsort(jnp.where(valid_BW, x_BW, V + 1), axis=1, stable=True)
    return jnp.where(bug_id == 3, by_value, jnp.arange(w)[None]).astype(jnp.int32)

  return TreeRule(update=update, update_point=update_point, order=order)


@functools.partial(jax.jit, static_argnames=("deterministic",))
def simulate(key, P_VV, Q_VV, draft_logits_VV, bug_id, deterministic: bool):
  """Counts of the 3-token window over N_ROWS independent cycles (see module doc), and
  per-row checks of the statistics fields."""
  k_draft, k_accept, k_tail = jax.random.split(key, 3)
  T = TREE.n_nodes
  tokens = [jnp.full((N_ROWS,), START, jnp.int32)]
  draft_keys = jax.random.split(k_draft, T)
  ranked_VV = jnp.argsort(-draft_logits_VV, axis=1, stable=True)  # draft's ranking per context
  for i in range(1, T):
    ctx = tokens[TREE.parents[i]]
    if deterministic:
      tokens.append(ranked_VV[ctx, TREE.ranks[i]].astype(jnp.int32))
    else:
      tokens.append(jax.random.categorical(draft_keys[i], jnp.log(Q_VV[ctx])).astype(jnp.int32))
  tokens_BT = jnp.stack(tokens, axis=1)
  p_BTV = P_VV[tokens_BT]
  q_BTV = None if deterministic else Q_VV[tokens_BT]
  res = _accept_tree(k_accept, TREE.layout(), tokens_BT, p_BTV, q_BTV, switch_rule(bug_id))
  n = res.n_accepted
  path_tok = jnp.take_along_axis(tokens_BT, res.path[:, 1:], axis=1)  # [B, D]
  tail_u = jax.random.uniform(k_tail, (N_ROWS, D + 1))
  ys = []
  for j in range(D + 1):  # emitted path, then the target's token, then exact completion
    prev = ys[-1] if ys else jnp.full((N_ROWS,), START, jnp.int32)
    cdf = jnp.cumsum(P_VV[prev], axis=1)
    fresh = jnp.minimum(jnp.sum(cdf <= tail_u[:, j:j + 1], axis=1), V - 1).astype(jnp.int32)
    y = jnp.where(j < n, path_tok[:, min(j, D - 1)], jnp.where(j == n, res.next_token, fresh))
    ys.append(y)
  code = (ys[0] * V + ys[1]) * V + ys[2]
  counts = jnp.bincount(code, length=V ** 3)
  checks = dict(
      rank_sum_is_n=jnp.all(jnp.sum(res.rank_accepted, 1) == n),
      depth_tried_root=jnp.all(res.depth_tried[:, 0]),
      ranks_tried_in_order=jnp.all(res.rank_tried[:, :-1] >= res.rank_tried[:, 1:]),
      path_is_a_path=jnp.all(jnp.asarray(TREE.parents)[res.path[:, 1:]] ==
                             jnp.where(jnp.arange(D)[None] < n[:, None], res.path[:, :-1],
                                       jnp.asarray(TREE.parents)[res.path[:, 1:]])),
      mean_n=jnp.mean(n.astype(jnp.float32)))
  return counts, checks


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  seed: int
  target_warp: tuple  # (temperature, top_k, top_p)
  draft_warp: tuple
  deterministic: bool


CASES = [
    Case("sampled_T0.8_topp0.9", 1, (0.8, 0, 0.9), (0.8, 0, 0.9), False),
    Case("sampled_T1.3_topk3_topp0.95_draft_T1", 2, (1.3, 3, 0.95), (1.0, 0, 1.0), False),
    Case("top3_T1.2_topp0.85", 3, (1.2, 0, 0.85), (1.2, 0, 0.85), True),
    Case("top3_T0.7_topk4", 4, (0.7, 4, 1.0), (0.7, 4, 1.0), True),
]
CASE_ALPHA = FAMILY_ALPHA / len(CASES)


def case_inputs(case: Case):
  rng = np.random.default_rng(case.seed)
  target = np.log(rng.dirichlet(np.full(V, 0.8), size=V))
  draft = target + rng.normal(scale=1.0, size=target.shape)  # a decent draft
  P = warp_jit(jnp.asarray(target, jnp.float32), make_sampler(*case.target_warp))
  Q = warp_jit(jnp.asarray(draft, jnp.float32), make_sampler(*case.draft_warp))
  return P, Q, jnp.asarray(draft, jnp.float32)


def run(case: Case, bug: str | None):
  P, Q, draft = case_inputs(case)
  counts, checks = simulate(jax.random.key(100 + case.seed), P, Q, draft,
                            jnp.int32(BUGS.get(bug, EXACT)), case.deterministic)
  as64 = lambda a: np.asarray(a, np.float64)
  return np.asarray(counts), {k: np.asarray(v) for k, v in checks.items()}, (as64(P), as64(Q),
                                                                            as64(draft))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_rule_is_exact(case):
  """The enumerated law of the rule equals the Markov target law (to float64 rounding)."""
  P, Q, draft = (np.asarray(a, np.float64) for a in case_inputs(case))
  P, Q = P / P.sum(1, keepdims=True), Q / Q.sum(1, keepdims=True)
  np.testing.assert_allclose(reference_law(P, Q, draft, case.deterministic), markov_law(P),
                             atol=1e-12)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_tree_cycle_joint_law_matches_target(case):
  """χ² of 100,000 cycles against the Markov law, level 1e-3 / 4 (Bonferroni over 4 cases)."""
  counts, checks, (P, _, _) = run(case, None)
  assert counts.sum() == N_ROWS
  p, zero_hits = chi2_pvalue(counts, markov_law(P))
  assert zero_hits == 0
  assert p > CASE_ALPHA, p
  for name in ("rank_sum_is_n", "depth_tried_root", "ranks_tried_in_order", "path_is_a_path"):
    assert checks[name], name
  assert 0.3 < checks["mean_n"] < 1.9  # both shallow and deep paths are exercised


CONTROLS = [("residual_not_updated", CASES[0]), ("rejected_point_kept", CASES[2]),
            ("value_dependent_order", CASES[0]), ("value_dependent_order", CASES[1])]


@pytest.mark.parametrize("bug, case", CONTROLS, ids=[f"{b}-{c.name}" for b, c in CONTROLS])
def test_negative_controls_are_rejected(bug, case):
  counts, _, (P, Q, draft) = run(case, bug)
  P, Q = P / P.sum(1, keepdims=True), Q / Q.sum(1, keepdims=True)
  alt = reference_law(P, Q, draft, case.deterministic, bug)
  null = markov_law(P)
  assert chi2_power(null, alt, N_ROWS, CASE_ALPHA) >= MIN_POWER
  # The counts follow the bug's own law (the rejection is for the planted reason) ...
  p_alt, _ = chi2_pvalue(counts, alt)
  assert p_alt > CASE_ALPHA, p_alt
  # ... and the test rejects them.
  p, zero_hits = chi2_pvalue(counts, null)
  assert zero_hits > 0 or p < CASE_ALPHA, p


def test_deterministic_order_does_not_matter_for_distinct_candidates():
  """Trying distinct point masses in a value-dependent order stays exact (the order is fixed
  given the draft): the order control is meaningful for sampled candidates only."""
  P, Q, draft = (np.asarray(a, np.float64) for a in case_inputs(CASES[2]))
  P = P / P.sum(1, keepdims=True)
  np.testing.assert_allclose(reference_law(P, Q, draft, True, "value_dependent_order"),
                             markov_law(P), atol=1e-12)


# ----------------------------------------------------------------------------- structure


def _greedy_walk(tree, tokens, target_argmax):
  node, path = 0, [0]
  while True:
    kids = [c for c in tree.children[node] if c >= 0 and tokens[c] == target_argmax[node]]
    if not kids:
      return path, target_argmax[node]
    node = kids[0]
    path.append(node)


def test_greedy_acceptance_is_the_greedy_walk_static_and_per_row():
  """At T = 0 (one-hot p) the tree rule follows the target's argmax through the tree, for
  point-mass and sampled (one-hot q) candidates, and a per-row layout (children [B, T, W], as
  dynamic trees build) gives the same results as the static TreeSpec's constant layout."""
  tree = trees.branching((3, 2))
  B, T, Vg = 256, tree.n_nodes, 7
  rng = np.random.default_rng(0)
  logits = rng.integers(0, 3, size=(B, T, Vg)).astype(np.float32)  # ties included
  argmax = logits.argmax(-1)
  tokens = np.where(rng.random((B, T)) < 0.6, argmax[np.arange(B)[:, None], tree.parents],
                    rng.integers(0, Vg, (B, T)))
  p = warp_jit(jnp.asarray(logits), make_sampler(0.0))
  q = jax.nn.one_hot(jnp.asarray(argmax), Vg)  # any q works at T = 0
  children = jnp.broadcast_to(jnp.asarray(tree.children), (B,) + tree.children.shape)
  static = tree.layout()

  @jax.jit  # one compiled program for the three variants
  def three(tokens, p, q, children):
    per_row = verify_layout.VerifyLayout(depth=None, mask=None, children=children,
                                 max_depth=tree.max_depth)
    return (accept_tree(jax.random.key(1), static, tokens, p, None),
            accept_tree(jax.random.key(2), static, tokens, p, q),
            accept_tree(jax.random.key(1), per_row, tokens, p, None))

  outs = three(jnp.asarray(tokens), p, q, children)
  ns = []
  for b in range(B):
    path, nxt = _greedy_walk(tree, tokens[b], argmax[b])
    ns.append(len(path) - 1)
    for res in outs:
      assert int(res.n_accepted[b]) == len(path) - 1
      assert int(res.next_token[b]) == nxt
      got = np.asarray(res.path[b])
      np.testing.assert_array_equal(got[:len(path)], path)
      assert np.all(got[len(path):] == path[-1])
  assert min(ns) == 0 and max(ns) == tree.max_depth
  for field in ("n_accepted", "next_token", "path", "depth_tried", "rank_tried",
                "rank_accepted"):
    np.testing.assert_array_equal(getattr(outs[0], field), getattr(outs[2], field))


def test_chain_tree_goes_through_accept_chain():
  tree = trees.chain(3)
  rng = np.random.default_rng(1)
  p = warp_jit(jnp.asarray(rng.normal(size=(64, 4, 6)), jnp.float32), make_sampler(1.0))
  q = warp_jit(jnp.asarray(rng.normal(size=(64, 4, 6)), jnp.float32), make_sampler(1.0))
  tokens = jnp.asarray(rng.integers(0, 6, (64, 4)), jnp.int32)
  assert tree.layout().is_chain and tree.layout().mask is None
  res = jax.jit(accept_tree)(jax.random.key(3), tree.layout(), tokens, p, q)
  ref = jax.jit(acceptance.accept_chain)(jax.random.key(3), tokens[:, 1:], p, q[:, :3])
  np.testing.assert_array_equal(res.n_accepted, ref.n_accepted)
  np.testing.assert_array_equal(res.next_token, ref.next_token)
  n = np.asarray(ref.n_accepted)
  np.testing.assert_array_equal(res.path, np.minimum(np.arange(4)[None], n[:, None]))
  np.testing.assert_array_equal(res.depth_tried, np.arange(3)[None] <= n[:, None])
  np.testing.assert_array_equal(res.rank_tried[:, 0], np.minimum(n + 1, 3))
  with pytest.raises(ValueError, match="must have 4 nodes"):
    accept_tree(jax.random.key(0), tree.layout(), tokens[:, :3], p[:, :3], None)
