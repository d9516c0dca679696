"""Exactness tests for chain acceptance (specjax.verify.acceptance).

Statistical design (docs/exactness.md, how the tests prove it):
- Each statistical test is a χ² goodness-of-fit test of emitted-token counts against the exact
  (warped) target law, from B = 100,000 rows simulated in one jitted call with a fixed seed.
  Cells of zero target probability are excluded from χ² and must have zero counts (a single
  hit rejects); cells with expected count < 5 are pooled.
- False-alarm rate: FAMILY_ALPHA = 1e-3 per test function, Bonferroni-split over its
  sub-cases (each sub-case rejects at 1e-3 / n_subcases). So a correct rule fails the suite's
  two statistical families with probability <= 2e-3 over the choice of seeds; with the fixed
  seeds the outcome is deterministic.
- Power: four planted bugs (negative controls) are simulated through the SAME test function
  at the SAME sample size and threshold on three sub-cases each and must reject (observed
  p-values < 1e-22). For each the test also computes the power from the noncentral χ²
  (λ = N Σ (p_bug - p)² / p over the pooled cells, plus the chance of a hit in a
  zero-probability cell) and asserts it is >= MIN_POWER = 0.99, so a control cannot pass by
  luck; analytically, the power against every bug on every sub-case is > 0.999999
  (test_negative_control_power_is_high). At power 0.99 the marginal test (15 dof, level
  1.67e-4) detects any effect of Cohen's w >= 0.025; the planted bugs move the law by a total
  variation of 0.047-0.76.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax.verify.acceptance import (ChainResult, _accept_chain, ChainRule, accept_chain,
                                       accept_greedy, accept_test, emitted_distribution,
                                       emitted_distribution_point, residual)
from specjax.verify.sampling import (make_sampler, sample, sample_from_uniforms,
                                     uniforms, warp)

N_SAMPLES = 100_000
K = 2
warp_jit = jax.jit(warp)
sample_jit = jax.jit(sample)
FAMILY_ALPHA = 1e-3
MIN_POWER = 0.99

# ---------------------------------------------------------------------------------------------
# χ² goodness of fit and its power.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Gof:
  stat: float
  dof: int
  pvalue: float
  zero_cell_hits: int

  def rejects(self, alpha: float) -> bool:
    return self.zero_cell_hits > 0 or self.pvalue < alpha


def _pooling(probs: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
  """Cell groups for χ²: positive cells with expected >= 5 alone, the rest pooled together.

  Returns (support mask, group id per support cell)."""
  support = probs > 0
  e = n * probs[support]
  group = np.arange(e.size)
  small = e < 5
  if small.any():
    group[small] = e.size  # one pooled cell
    if e[small].sum() < 5 and (~small).any():  # still too small: merge into the smallest cell
      group[small] = group[~small][np.argmin(e[~small])]
    _, group = np.unique(group, return_inverse=True)
  return support, group


def chi2_gof(counts: np.ndarray, probs: np.ndarray) -> Gof:
  """χ² test of multinomial counts against probs (any shape; flattened)."""
  counts = np.asarray(counts, np.int64).ravel()
  probs = np.asarray(probs, np.float64).ravel()
  probs = probs / probs.sum()
  n = int(counts.sum())
  support, group = _pooling(probs, n)
  obs = np.bincount(group, weights=counts[support])
  exp = np.bincount(group, weights=n * probs[support])
  exp *= obs.sum() / exp.sum()  # float rounding only
  stat, pvalue = scipy.stats.chisquare(obs, exp)
  return Gof(float(stat), obs.size - 1, float(pvalue), int(counts[~support].sum()))


def chi2_power(probs_null: np.ndarray, probs_alt: np.ndarray, n: int, alpha: float) -> float:
  """Power of chi2_gof at level alpha when the counts really follow probs_alt.

  Noncentral χ² approximation, λ = n Σ_cells (alt - null)² / null over the pooled cells,
  combined with the probability of at least one hit in a zero-probability cell
  (1 - (1 - m0)^n, m0 = alt's mass there) as if independent.
  """
  null = np.asarray(probs_null, np.float64).ravel()
  alt = np.asarray(probs_alt, np.float64).ravel()
  null, alt = null / null.sum(), alt / alt.sum()
  support, group = _pooling(null, n)
  g0 = np.bincount(group, weights=null[support])
  g1 = np.bincount(group, weights=alt[support])
  lam = n * float(np.sum((g1 - g0) ** 2 / g0))
  dof = g0.size - 1
  p_chi2 = float(scipy.stats.ncx2.sf(scipy.stats.chi2.isf(alpha, dof), dof, lam)) if dof else 0.0
  m0 = float(alt[~support].sum())
  p_zero = -np.expm1(n * np.log1p(-min(m0, 1.0 - 1e-16)))
  return 1.0 - (1.0 - p_chi2) * (1.0 - p_zero)


def test_chi2_helpers_sanity():
  rng = np.random.default_rng(0)
  p = rng.dirichlet(np.ones(8))
  p[3] = 0.0
  p /= p.sum()
  counts = rng.multinomial(N_SAMPLES, p)
  assert not chi2_gof(counts, p).rejects(1e-3)
  bad = counts.copy()
  bad[3] = 1  # one impossible token
  assert chi2_gof(bad, p).rejects(1e-3)
  assert chi2_power(p, p, N_SAMPLES, 1e-3) == pytest.approx(1e-3, rel=0.05)
  assert chi2_power(p, np.roll(p, 1), N_SAMPLES, 1e-3) > 0.999


# ---------------------------------------------------------------------------------------------
# Planted bugs (negative controls): the rule's pieces swapped for wrong ones.
# ---------------------------------------------------------------------------------------------


def _inverse_cdf_sample(u_NV, w_NV):
  """Inverse-CDF sampling that assumes sum(w) == 1: the first index whose cumulative weight
  exceeds u (never a zero-weight token, whose cumsum equals its predecessor's). The mass
  missing from an unnormalised w lands on the last token (u >= cumsum[-1] -> index V,
  clipped to V - 1): the planted bug. Exact for normalised w (the joint test's drafts)."""
  u_N1 = u_NV[..., :1]
  idx = jnp.sum(jnp.cumsum(w_NV, axis=-1) <= u_N1, axis=-1)
  return jnp.minimum(idx, w_NV.shape[-1] - 1).astype(jnp.int32)


BUG_IDS = {
    # Accept every draft: emits q instead of p.
    "always_accept": 1,
    # Resample from p on rejection instead of the residual max(0, p - q).
    "residual_is_p": 2,
    # Forget to renormalise the residual, with a sampler that needs normalised weights.
    "residual_unnormalised": 3,
    # Treat a sampled draft as a point mass: accept with p(x) instead of min(1, p(x)/q(x)).
    "accept_with_p_ignoring_q": 4,
}
EXACT_ID = 0


def switch_rule(bug_id: jax.Array) -> ChainRule:
  """The rule's pieces, with the planted bug chosen by a runtime id (0 = the exact pieces from
  specjax.verify.acceptance), so one compiled simulation serves the exact rule and every control."""

  def accept(u, p_x, q_x):
    return jnp.select([bug_id == 1, bug_id == 4], [jnp.ones_like(u, dtype=bool), u < p_x],
                      accept_test(u, p_x, q_x))

  def resid(p, q):
    return jnp.select([bug_id == 2, bug_id == 3], [p, jnp.maximum(p - q, 0.0)], residual(p, q))

  def samp(u, w):
    return jnp.where(bug_id == 3, _inverse_cdf_sample(u, w), sample_from_uniforms(u, w))

  return ChainRule(accept=accept, residual=resid, sample=samp)


def analytic_first_token(p: np.ndarray, q: np.ndarray | None, bug: str | None) -> np.ndarray:
  """Exact law (float64) of the first emitted token under the exact rule or a bug, x ~ q
  (a point-mass q = one_hot(x) for a deterministic draft)."""
  p = np.asarray(p, np.float64)
  V = p.size
  q = np.asarray(q, np.float64)
  acc = np.where(q > 0, np.minimum(1.0, p / np.where(q > 0, q, 1.0)), 1.0)
  if bug == "always_accept":
    acc = np.ones(V)
  if bug == "accept_with_p_ignoring_q":
    acc = p.copy()
  w = np.maximum(p - q, 0.0)
  r = w / w.sum() if w.sum() > 0 else p
  if bug == "residual_is_p":
    r = p
  if bug == "residual_unnormalised":
    r = w.copy()
    r[-1] += 1.0 - w.sum()
  return q * acc + np.sum(q * (1.0 - acc)) * r


# ---------------------------------------------------------------------------------------------
# First emitted token, stochastic and deterministic drafts, warps active.
# ---------------------------------------------------------------------------------------------

V_FIRST = 16


@dataclasses.dataclass(frozen=True)
class FirstCase:
  name: str
  seed: int
  target: tuple  # (temperature, top_k, top_p) for the target's warp
  draft: tuple  # the draft's warp
  deterministic: bool
  draft_kind: str  # "independent" (low α) or "close" (target logits + noise, high α)
  masked: int = 0  # target tokens with logit -inf (banned), drafts may still propose them


FIRST_CASES = [
    FirstCase("stoch_plain", 1, (1.0, 0, 1.0), (1.0, 0, 1.0), False, "independent"),
    FirstCase("stoch_topk_close", 2, (0.7, 6, 1.0), (0.7, 6, 1.0), False, "close"),
    FirstCase("stoch_topp_masked", 3, (1.5, 0, 0.8), (1.5, 0, 0.8), False, "independent", 2),
    FirstCase("stoch_topk_topp_other_draft_warp", 4, (1.0, 10, 0.9), (1.3, 0, 1.0), False,
              "close"),
    FirstCase("det_plain", 5, (1.0, 0, 1.0), (1.0, 0, 1.0), True, "independent"),
    FirstCase("det_topk_topp", 6, (0.8, 5, 0.9), (0.8, 5, 0.9), True, "close"),
]
FIRST_ALPHA = FAMILY_ALPHA / len(FIRST_CASES)


def case_logits(seed: int, V: int, draft_kind: str, masked: int = 0):
  """Target log-probabilities from Dirichlet(1); the draft's independent or nearby."""
  rng = np.random.default_rng(seed)
  target = np.log(rng.dirichlet(np.ones(V)))
  if draft_kind == "close":
    draft = target + rng.normal(scale=0.7, size=target.shape)
  else:
    draft = np.log(rng.dirichlet(np.ones(V), size=target.shape[:-1]).reshape(target.shape))
  if masked:
    target[rng.choice(V, masked, replace=False)] = -np.inf
  return jnp.asarray(target, jnp.float32), jnp.asarray(draft, jnp.float32)


def deterministic_weights(p_V: np.ndarray, q_V: np.ndarray) -> np.ndarray:
  """Frequencies of the fixed drafts used for point-mass cases: half the rows propose the
  draft's argmax (an argmax drafter), the other half x = floor(V u^2), u evenly spaced (every
  token, with decreasing frequency). Not uniform on purpose: averaged over uniformly spread
  point-mass drafts, the residual_is_p bug cancels exactly (mean_x [p(x) e_x + (1 - p(x)) p]
  = p), so a uniform spread would blind the marginal test to it."""
  V = p_V.size
  half = N_SAMPLES // 2
  spread = np.floor(V * ((np.arange(half) + 0.5) / half) ** 2).astype(int)
  w = np.bincount(spread, minlength=V) / N_SAMPLES
  w[int(np.argmax(q_V))] += half / N_SAMPLES
  return w


@functools.partial(jax.jit, static_argnames=("deterministic",))
def first_token_counts(key, p_V, q_V, bug_id, deterministic: bool):
  """Counts of the first emitted token over N_SAMPLES independent k=2 chains.

  Each row: draft x_1, x_2 (~ q, or fixed: see deterministic_weights), verify against p at
  every position, emit x_1 if accepted, else the correction. p and q are warped outside, so
  one compiled warp serves every case."""
  V = p_V.shape[-1]
  key_draft, key_accept = key[0], key[1]
  p_BKV1 = jnp.broadcast_to(p_V, (N_SAMPLES, K + 1, V))
  if deterministic:
    half = N_SAMPLES // 2
    frac = (jnp.arange(half, dtype=jnp.float32) + 0.5) / half
    spread = jnp.floor(V * frac * frac).astype(jnp.int32)
    x_B = jnp.concatenate([jnp.full((N_SAMPLES - half,), jnp.argmax(q_V), jnp.int32), spread])
    draft_BK = jnp.stack([x_B, (x_B + 1) % V], axis=1)
    q_BKV = None
  else:
    q_BKV = jnp.broadcast_to(q_V, (N_SAMPLES, K, V))
    # Inverse-CDF draws from the one shared q (jax.random.choice): exact like Gumbel-max, and
    # 50x cheaper here than V uniforms per draft.
    draft_BK = jax.random.choice(key_draft, V, (N_SAMPLES, K), p=q_V).astype(jnp.int32)
  res = _accept_chain(key_accept, draft_BK, p_BKV1, q_BKV, switch_rule(bug_id))
  first_B = jnp.where(res.n_accepted > 0, draft_BK[:, 0], res.next_token)
  return jnp.bincount(first_B, length=V)


def case_probs(case: FirstCase):
  target, draft = case_logits(case.seed, V_FIRST, case.draft_kind, case.masked)
  return warp_jit(target, make_sampler(*case.target)), warp_jit(draft, make_sampler(*case.draft))


def run_first(case: FirstCase, bug_id: int):
  p, q = case_probs(case)
  keys = jax.random.split(jax.random.key(1000 + case.seed), 2)  # (draft, accept)
  counts = first_token_counts(keys, p, q, jnp.int32(bug_id), case.deterministic)
  return np.asarray(counts), np.asarray(p, np.float64), np.asarray(q, np.float64)


def analytic_case(p, q, case: FirstCase, bug: str | None) -> np.ndarray:
  if not case.deterministic:
    return analytic_first_token(p, q, bug)
  V = p.size
  w = deterministic_weights(p, q)
  return sum(w[x] * analytic_first_token(p, np.eye(V)[x], bug) for x in range(V))


@pytest.mark.parametrize("case", FIRST_CASES, ids=lambda c: c.name)
def test_first_token_matches_target(case):
  """First emitted token ~ warped target p. χ² at 1e-3/6 (Bonferroni over 6 sub-cases)."""
  counts, p, q = run_first(case, EXACT_ID)
  assert counts.sum() == N_SAMPLES
  gof = chi2_gof(counts, p)
  assert gof.zero_cell_hits == 0
  assert not gof.rejects(FIRST_ALPHA), gof
  # The analytic law of the exact rule is p (the simulation and the analysis agree).
  np.testing.assert_allclose(analytic_case(p, q, case, None), p / p.sum(), atol=1e-6)


# Every bug on every applicable sub-case for the analytic power; simulated on three sub-cases
# (plain; filters with a nearby draft, the smallest effects; point-mass drafts with filters).
CONTROL_CASES = [(bug, case) for bug in BUG_IDS for case in FIRST_CASES
                 if not (bug == "accept_with_p_ignoring_q" and case.deterministic)]
SIMULATED_CONTROLS = [(bug, case) for bug, case in CONTROL_CASES
                      if case.name in ("stoch_plain", "stoch_topk_topp_other_draft_warp",
                                       "det_topk_topp")]


@pytest.mark.parametrize("bug, case", SIMULATED_CONTROLS,
                         ids=[f"{b}-{c.name}" for b, c in SIMULATED_CONTROLS])
def test_first_token_negative_control_rejects(bug, case):
  """The same χ² test, same N and threshold, rejects each planted bug; power >= 0.99."""
  counts, p, q = run_first(case, BUG_IDS[bug])
  alt = analytic_case(p, q, case, bug)
  power = chi2_power(p, alt, N_SAMPLES, FIRST_ALPHA)
  assert power >= MIN_POWER, f"{bug} on {case.name}: power {power:.4f}"
  # The counts follow the bug's analytic law (so the rejection is for the planted reason).
  assert not chi2_gof(counts, alt).rejects(FIRST_ALPHA)
  assert chi2_gof(counts, p).rejects(FIRST_ALPHA)


def test_negative_control_power_is_high():
  """Documents the smallest power over all controls (analytic, no simulation)."""
  powers = {}
  for bug, case in CONTROL_CASES:
    p, q = (np.asarray(a, np.float64) for a in case_probs(case))
    alt = analytic_case(p, q, case, bug)
    powers[(bug, case.name)] = chi2_power(p, alt, N_SAMPLES, FIRST_ALPHA)
  assert min(powers.values()) > 0.999999, min(powers.items(), key=lambda kv: kv[1])


# ---------------------------------------------------------------------------------------------
# Joint law of the first three emitted tokens over several k=2 cycles.
# ---------------------------------------------------------------------------------------------

V_JOINT = 5
START = 0
N_EMIT = 3


@dataclasses.dataclass(frozen=True)
class JointCase:
  name: str
  seed: int
  sampler: tuple  # warp of both target and draft
  deterministic: bool  # argmax drafter


JOINT_CASES = [
    JointCase("stoch_plain", 11, (1.0, 0, 1.0), False),
    JointCase("stoch_topk_topp", 12, (0.8, 3, 0.9), False),
    JointCase("det_argmax_topp", 13, (1.2, 0, 0.85), True),
]
JOINT_ALPHA = FAMILY_ALPHA / len(JOINT_CASES)


@functools.partial(jax.jit, static_argnames=("deterministic",))
def joint_counts(keys, P_VV, Q_VV, bug_id, deterministic: bool):
  """A first-order Markov 'language': the target's next-token law after token c is
  P[c] (warped target logits, row c), the draft's Q[c]. Runs N_EMIT cycles of k=2 speculative
  decoding from START (each emits >= 1 token) and counts the first N_EMIT tokens.

  p at draft position 2 is P[x_1], so it depends on the drafted token, and the bonus after
  two accepts uses P[x_2]. Deterministic drafts: x_1 = argmax Q[c], x_2 = argmax Q[x_1]."""
  V = P_VV.shape[-1]
  width = N_EMIT * (K + 1) + 1
  out_BW = jnp.zeros((N_SAMPLES, width), jnp.int32)
  length_B = jnp.zeros((N_SAMPLES,), jnp.int32)
  ctx_B = jnp.full((N_SAMPLES,), START, jnp.int32)
  rows_B1 = jnp.arange(N_SAMPLES)[:, None]
  slot_1K1 = jnp.arange(K + 1)[None, :]

  def cycle(c, state):
    out_BW, length_B, ctx_B = state
    k_draft, k_acc = keys[c, 0], keys[c, 1]
    if deterministic:
      x1_B = jnp.argmax(Q_VV[ctx_B], -1).astype(jnp.int32)
      x2_B = jnp.argmax(Q_VV[x1_B], -1).astype(jnp.int32)
      q_BKV = None
    else:
      u_B2 = uniforms(k_draft, (N_SAMPLES, 2))  # inverse-CDF draws (normalised Q: exact)
      x1_B = _inverse_cdf_sample(u_B2[:, 0:1], Q_VV[ctx_B])
      x2_B = _inverse_cdf_sample(u_B2[:, 1:2], Q_VV[x1_B])
      q_BKV = jnp.stack([Q_VV[ctx_B], Q_VV[x1_B]], axis=1)
    draft_BK = jnp.stack([x1_B, x2_B], axis=1)
    p_BKV1 = jnp.stack([P_VV[ctx_B], P_VV[x1_B], P_VV[x2_B]], axis=1)
    res = _accept_chain(k_acc, draft_BK, p_BKV1, q_BKV, switch_rule(bug_id))
    n_B1 = res.n_accepted[:, None]
    new_BK1 = jnp.where(slot_1K1 < n_B1, jnp.pad(draft_BK, ((0, 0), (0, 1))),
                        res.next_token[:, None])
    dest_BK1 = jnp.where(slot_1K1 <= n_B1, length_B[:, None] + slot_1K1, width)  # width: drop
    out_BW = out_BW.at[rows_B1, dest_BK1].set(new_BK1, mode="drop")
    return out_BW, length_B + res.n_accepted + 1, res.next_token

  out_BW, length_B, _ = jax.lax.fori_loop(0, N_EMIT, cycle, (out_BW, length_B, ctx_B))
  y_BN = out_BW[:, :N_EMIT]
  code_B = (y_BN[:, 0] * V + y_BN[:, 1]) * V + y_BN[:, 2]
  return jnp.bincount(code_B, length=V ** N_EMIT), jnp.min(length_B)


def run_joint(case: JointCase, bug_id: int):
  rng = np.random.default_rng(case.seed)
  target = np.log(rng.dirichlet(np.ones(V_JOINT) * 0.8, size=V_JOINT))
  draft = target + rng.normal(scale=1.0, size=target.shape)  # a decent draft: α ~ 0.6-0.8
  sampler = make_sampler(*case.sampler)
  P = warp_jit(jnp.asarray(target, jnp.float32), sampler)
  Q = warp_jit(jnp.asarray(draft, jnp.float32), sampler)
  keys = jax.random.split(jax.random.key(2000 + case.seed), (N_EMIT, 2))  # (draft, accept)
  counts, min_len = joint_counts(keys, P, Q, jnp.int32(bug_id), case.deterministic)
  assert int(min_len) >= N_EMIT
  P = np.asarray(P, np.float64)
  exact = P[START][:, None, None] * P[:, :, None] * P[None, :, :]  # p(y1) p(y2|y1) p(y3|y2)
  return np.asarray(counts), exact.ravel()


@pytest.mark.parametrize("case", JOINT_CASES, ids=lambda c: c.name)
def test_joint_first_three_tokens_match_target(case):
  """Joint law of (y1, y2, y3) = p(y1) p(y2|y1) p(y3|y2): 125 cells, χ² at 1e-3/3."""
  counts, exact = run_joint(case, EXACT_ID)
  gof = chi2_gof(counts, exact)
  assert gof.zero_cell_hits == 0
  assert not gof.rejects(JOINT_ALPHA), gof


@pytest.mark.parametrize("bug", ["always_accept", "residual_is_p"])
def test_joint_negative_control_rejects(bug):
  counts, exact = run_joint(JOINT_CASES[0], BUG_IDS[bug])
  assert chi2_gof(counts, exact).rejects(JOINT_ALPHA)


# ---------------------------------------------------------------------------------------------
# Property tests of the analytic law.
# ---------------------------------------------------------------------------------------------

V_PROP = 32  # vocabularies of size 2..32 padded with -inf logits to one compiled shape


@jax.jit
def _analytic_vs_target(target_V, draft_V, sampler_p, sampler_q):
  p_V, q_V = warp(target_V, sampler_p), warp(draft_V, sampler_q)
  stochastic = emitted_distribution(p_V, q_V)
  point = emitted_distribution_point(jnp.broadcast_to(p_V, (V_PROP, V_PROP)),
                                     jnp.arange(V_PROP))
  buggy = q_V * jnp.minimum(1.0, p_V / jnp.maximum(q_V, 1e-30)) + (
      jnp.sum(jnp.maximum(q_V - p_V, 0.0)) * p_V)  # residual_is_p
  return p_V, q_V, stochastic, point, buggy


sampler_args = st.tuples(
    st.sampled_from([0.0, 0.25, 0.7, 1.0, 1.6, 3.0]),
    st.integers(0, V_PROP + 2),
    st.one_of(st.just(1.0), st.floats(0.05, 1.0)),
)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2 ** 31 - 1), V=st.integers(2, V_PROP),
       concentration=st.sampled_from([0.1, 0.5, 1.0, 5.0]),
       draft_kind=st.sampled_from(["independent", "close", "same"]),
       target_warp=sampler_args, draft_warp=st.one_of(st.none(), sampler_args))
def test_analytic_emitted_law_is_warped_target(seed, V, concentration, draft_kind, target_warp,
                                               draft_warp):
  """min(p, q) + P(reject) * residual == p to 1e-6, stochastic and point-mass drafts."""
  rng = np.random.default_rng(seed)
  target = np.full(V_PROP, -np.inf)
  draft = np.full(V_PROP, -np.inf)
  target[:V] = np.log(rng.dirichlet(np.full(V, concentration)) + 1e-30)
  if draft_kind == "independent":
    draft[:V] = np.log(rng.dirichlet(np.full(V, concentration)) + 1e-30)
  elif draft_kind == "close":
    draft[:V] = target[:V] + rng.normal(scale=0.5, size=V)
  else:
    draft[:V] = target[:V]
  sp = make_sampler(*target_warp)
  sq = sp if draft_warp is None else make_sampler(*draft_warp)
  p, q, stochastic, point, _ = (np.asarray(a, np.float64) for a in _analytic_vs_target(
      jnp.asarray(target, jnp.float32), jnp.asarray(draft, jnp.float32), sp, sq))
  assert abs(p.sum() - 1.0) < 1e-5 and np.all(p[V:] == 0.0)
  np.testing.assert_allclose(stochastic, p, rtol=0, atol=1e-6)
  np.testing.assert_allclose(point, np.broadcast_to(p, point.shape), rtol=0, atol=1e-6)


def test_analytic_property_can_fail():
  """The property's check notices a wrong residual (negative control for the property)."""
  target = jnp.asarray(np.log([0.5, 0.3, 0.2] + [1e-30] * (V_PROP - 3)), jnp.float32)
  draft = jnp.asarray(np.log([0.1, 0.2, 0.7] + [1e-30] * (V_PROP - 3)), jnp.float32)
  s = make_sampler(1.0)
  p, _, stochastic, _, buggy = (np.asarray(a) for a in _analytic_vs_target(target, draft, s, s))
  np.testing.assert_allclose(stochastic, p, atol=1e-6)
  assert np.max(np.abs(buggy - p)) > 0.05


def test_residual_degenerate_case_falls_back_to_p():
  p = jnp.asarray([[0.25, 0.25, 0.5], [0.2, 0.3, 0.5]], jnp.float32)
  q = jnp.asarray([[0.25, 0.25, 0.5], [0.3, 0.2, 0.5]], jnp.float32)
  r, e = jax.jit(lambda p, q: (residual(p, q), emitted_distribution(p, q)))(p, q)
  np.testing.assert_array_equal(r[0], p[0])  # p == q: no residual mass, falls back to p
  np.testing.assert_allclose(r[1], [0, 1, 0])
  np.testing.assert_allclose(e, p, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Greedy identity and structure.
# ---------------------------------------------------------------------------------------------

B_G, K_G, V_G = 256, 4, 24
greedy_chain = jax.jit(accept_chain)
greedy_rule = jax.jit(accept_greedy)


def greedy_inputs(seed: int, dtype=jnp.float32):
  """Target logits with many ties; drafts equal to the target's argmax 75% of the time."""
  rng = np.random.default_rng(seed)
  target = rng.integers(0, 4, size=(B_G, K_G + 1, V_G)).astype(np.float32)
  argmax = target.argmax(-1)[:, :K_G]
  draft = np.where(rng.random((B_G, K_G)) < 0.75, argmax, rng.integers(0, V_G, (B_G, K_G)))
  draft_logits = 5.0 * np.eye(V_G)[draft] + rng.normal(scale=0.1, size=(B_G, K_G, V_G))
  draft_logits = np.concatenate([draft_logits, target[:, K_G:]], axis=1)  # [B, k+1, V]: shares
  # the target's compiled warp; the last position is dropped after warping
  return (jnp.asarray(draft, jnp.int32), jnp.asarray(target, dtype),
          jnp.asarray(draft_logits, jnp.float32))


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_rule_is_stochastic_rule_at_temperature_zero(seed):
  draft, target, draft_logits = greedy_inputs(seed)
  greedy = make_sampler(0.0)
  p, q = warp_jit(target, greedy), warp_jit(draft_logits, greedy)[:, :K_G]
  expected = greedy_rule(draft, target)
  ns = np.asarray(expected.n_accepted)
  assert ns.min() == 0 and ns.max() == K_G  # both corrections and bonuses are exercised
  for key in range(3):
    for q_arg in (q, None):  # stochastic rule with one-hot q, and deterministic drafts
      got = greedy_chain(jax.random.key(key), draft, p, q_arg)
      for field in ("n_accepted", "next_token", "accepted"):
        np.testing.assert_array_equal(getattr(got, field), getattr(expected, field))


def test_accept_greedy_is_plain_greedy():
  draft, target, _ = greedy_inputs(3)
  res = greedy_rule(draft, target)
  argmax = np.asarray(target).argmax(-1)
  for b in range(B_G):
    n = 0
    while n < K_G and draft[b, n] == argmax[b, n]:
      n += 1
    assert res.n_accepted[b] == n and res.next_token[b] == argmax[b, n]
    assert np.asarray(res.accepted[b]).tolist() == [i < n for i in range(K_G)]


def test_accept_greedy_bfloat16_logits():
  draft, target, _ = greedy_inputs(4)
  a = greedy_rule(draft, target)
  b = greedy_rule(draft, target.astype(jnp.bfloat16))  # small integers: exact in bf16
  np.testing.assert_array_equal(a.next_token, b.next_token)
  np.testing.assert_array_equal(a.n_accepted, b.n_accepted)


def test_chain_structure_and_self_speculation():
  """accepted is a prefix; n counts it; p == q accepts everything (self-speculation)."""
  rng = np.random.default_rng(5)
  logits = rng.normal(size=(B_G, K_G + 1, V_G)) * 2
  p = warp_jit(jnp.asarray(logits, jnp.float32), make_sampler(0.9, 8, 0.95))
  q = p[:, :K_G]
  draft = sample_jit(jax.random.key(0), q)
  res = greedy_chain(jax.random.key(1), draft, p, q)
  assert np.all(np.asarray(res.n_accepted) == K_G)
  np.testing.assert_array_equal(res.accepted, True)
  q2 = warp_jit(jnp.asarray(rng.normal(size=(B_G, K_G + 1, V_G)) * 2, jnp.float32),
                make_sampler(1.0))[:, :K_G]
  draft2 = sample_jit(jax.random.key(2), q2)
  res2 = greedy_chain(jax.random.key(3), draft2, p, q2)
  acc, n = np.asarray(res2.accepted), np.asarray(res2.n_accepted)
  assert res2.next_token.dtype == jnp.int32 and res2.n_accepted.dtype == jnp.int32
  assert acc.dtype == bool and acc.shape == (B_G, K_G)
  np.testing.assert_array_equal(acc, np.arange(K_G)[None, :] < n[:, None])
  assert 0 < n.mean() < K_G
  # The emitted token always has positive probability under the law it came from.
  p_np = np.asarray(p)
  p_next = p_np[np.arange(B_G), n, np.asarray(res2.next_token)]
  assert np.all(p_next > 0)
  # Same key, same result.
  again = greedy_chain(jax.random.key(3), draft2, p, q2)
  np.testing.assert_array_equal(again.next_token, res2.next_token)


def test_chain_vmaps_and_handles_k_zero():
  rng = np.random.default_rng(6)
  p = jnp.asarray(rng.dirichlet(np.ones(7), size=(3, 4, 2)), jnp.float32)  # [G, B, k+1, V]
  q = p[:, :, :1]
  draft = jnp.zeros((3, 4, 1), jnp.int32)
  res = jax.jit(jax.vmap(accept_chain, in_axes=(None, 0, 0, 0)))(jax.random.key(1), draft, p, q)
  assert isinstance(res, ChainResult) and res.accepted.shape == (3, 4, 1)
  res0 = jax.jit(accept_chain)(jax.random.key(2), jnp.zeros((4, 0), jnp.int32), p[0, :, :1])
  assert res0.accepted.shape == (4, 0) and np.all(np.asarray(res0.n_accepted) == 0)


def test_chain_shape_errors():
  p = jnp.full((2, 3, 5), 0.2)
  with pytest.raises(ValueError, match="p_BKV1"):
    accept_chain(jax.random.key(0), jnp.zeros((2, 3), jnp.int32), p)
  with pytest.raises(ValueError, match="q_BKV"):
    accept_chain(jax.random.key(0), jnp.zeros((2, 2), jnp.int32), p, jnp.full((2, 2, 4), 0.25))


def test_switch_rule_exact_id_is_accept_chain():
  """The statistical harness's rule with bug id 0 is bit-identical to accept_chain.

  (q given; the q = None path goes through the same three pieces.)"""
  rng = np.random.default_rng(9)
  p = warp_jit(jnp.asarray(rng.normal(size=(B_G, K_G + 1, V_G)), jnp.float32), make_sampler(1.0))
  q = warp_jit(jnp.asarray(rng.normal(size=(B_G, K_G + 1, V_G)), jnp.float32),
               make_sampler(1.0))[:, :K_G]
  draft = sample_jit(jax.random.key(0), q)  # shapes shared with the tests above: no compiles
  switched = jax.jit(lambda key, d, p, q: _accept_chain(key, d, p, q, switch_rule(jnp.int32(0))))
  a = switched(jax.random.key(1), draft, p, q)
  b = greedy_chain(jax.random.key(1), draft, p, q)
  for field in ("n_accepted", "next_token", "accepted"):
    np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
  assert 0 < np.asarray(a.n_accepted).mean() < K_G
