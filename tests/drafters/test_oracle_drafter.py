"""The controlled-α drafter: Σ min(p, q) = α exactly, acceptance α in the loop, exact output.

Statistical checks: the accepted drafts of each α value are tested against Binomial(trials,
α) (two-sided, false alarm 1e-3 split over the α values); the planted bug "naive mixture
α·p + (1 − α)·δ_argmax" (acceptance α + (1 − α)·p_max > α) must be rejected by the same
check at p < 1e-9, so the check can fail.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct
from scipy import stats

import specjax_testing as st
from specjax.engine import decoding, loop
from specjax.verify import sampling, trees
from specjax.drafters import oracle
from specjax.drafters.oracle import OracleDrafter

ALPHAS = (0.2, 0.5, 0.8, 0.95)
ROWS_PER_ALPHA = 8
FALSE_ALARM = 1e-3


@pytest.fixture(scope="module")
def target():
  return st.model(st.TINY["llama"], seed=3, logit_scale=30.0)  # p_max ≈ 0.6 at T=1


def _prompts(n, length=6, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 61, size=length).tolist() for _ in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("alpha", [0.0, 0.05, 0.3, 0.77, 1.0])
@pytest.mark.parametrize("law", ["softmax", "top_k", "greedy"])
def test_controlled_law_hits_alpha_exactly(alpha, law):
  rng = np.random.default_rng(7)
  logits = jnp.asarray(rng.normal(size=(5, 3, 40)) * 2.0, jnp.float32)
  sampler = {"softmax": sampling.make_sampler(1.0),
             "top_k": sampling.make_sampler(0.8, top_k=5),
             "greedy": sampling.make_sampler(0.0)}[law]
  p = sampling.warp(logits, sampler)
  q = oracle.controlled_law(p, alpha)
  np.testing.assert_allclose(np.asarray(q.sum(-1)), 1.0, atol=1e-6)
  assert float(q.min()) >= 0.0
  overlap = np.asarray(jnp.minimum(p, q).sum(-1))
  expected = np.maximum(alpha, np.asarray(p.min(-1)))
  np.testing.assert_allclose(overlap, expected, atol=2e-6)
  np.testing.assert_allclose(np.asarray(oracle.achieved_alpha(p, alpha)), expected, atol=1e-7)
  if law != "softmax":  # p(y) = 0 there: every α is reachable
    np.testing.assert_allclose(overlap, alpha, atol=2e-6)


def test_per_row_alpha_broadcasts():
  p = sampling.warp(jnp.asarray(np.random.default_rng(0).normal(size=(3, 2, 9)), jnp.float32),
                    sampling.make_sampler(0.0))
  alpha = jnp.asarray([0.1, 0.5, 0.9])
  overlap = np.asarray(jnp.minimum(p, oracle.controlled_law(p, alpha)).sum(-1))
  np.testing.assert_allclose(overlap, np.repeat(np.asarray(alpha)[:, None], 2, 1), atol=1e-6)


@struct.dataclass
class _NaiveMixture(OracleDrafter):
  """Planted bug: q = α·p + (1 − α)·δ_argmax p, the naive mixture (no p(y) correction, point
  mass on the likeliest token): acceptance α + (1 − α)·p_max > α.

  The extra static field matters: jax 0.10 compares two dataclass pytree definitions of the
  same field names as equal even when their classes differ (only their hashes differ), so a
  subclass with identical fields can be served the parent's compiled program from a jit
  cache on a hash-bucket collision (seen once in CI).
  """

  planted: bool = struct.field(pytree_node=False, default=True)

  def draft_law(self, logits, sampler):
    p = sampling.warp(logits, sampler)
    a = oracle._alpha_like(self.alpha, p)[..., None]
    return a * p + (1 - a) * jax.nn.one_hot(jnp.argmax(p, -1), p.shape[-1])


def _alpha_pvalues(gen, k):
  """Two-sided binomial p-value of each α block's accepted drafts (α_trial counting)."""
  out = []
  for i, a in enumerate(ALPHAS):
    rows = slice(i * ROWS_PER_ALPHA, (i + 1) * ROWS_PER_ALPHA)
    acc = int(gen.stats["accepted"][rows].sum())
    log = gen.stats["cycle_log"][rows]
    rejections = int(((log >= 0) & (log < k)).sum())
    out.append((a, acc, acc + rejections,
                stats.binomtest(acc, acc + rejections, a).pvalue))
  return out


def _row_alphas():
  return np.repeat(np.asarray(ALPHAS, np.float32), ROWS_PER_ALPHA)


@pytest.mark.slow
def test_chain_acceptance_is_alpha_and_planted_bug_fails(target):
  k = 4
  prompts = _prompts(len(ALPHAS) * ROWS_PER_ALPHA)
  drafter = OracleDrafter.of(target, _row_alphas())
  gen = decoding.speculative_generate(target, drafter, prompts, k=k, max_new_tokens=48,
                                      sampler=sampling.make_sampler(1.0), seed=11)
  for a, acc, trials, pv in _alpha_pvalues(gen, k):
    assert trials > 150, (a, trials)
    assert pv > FALSE_ALARM / len(ALPHAS), (a, acc / trials, pv)
  bug = _NaiveMixture(lm=drafter.lm, deterministic=False, alpha=drafter.alpha)
  gen_bug = decoding.speculative_generate(target, bug, prompts, k=k, max_new_tokens=48,
                                          sampler=sampling.make_sampler(1.0), seed=11)
  worst = min(pv for *_, pv in _alpha_pvalues(gen_bug, k))
  assert worst < 1e-9, _alpha_pvalues(gen_bug, k)


@pytest.mark.slow  # compile-bound (5-18 s): the fast tier's 3 minutes
def test_greedy_output_unchanged_and_alpha_is_a_runtime_value(target):
  prompts = _prompts(len(ALPHAS) * ROWS_PER_ALPHA, seed=1)
  plain = decoding.generate(target, prompts, max_new_tokens=40)
  drafter = OracleDrafter.of(target, _row_alphas())
  gen = decoding.speculative_generate(target, drafter, prompts, k=4, max_new_tokens=40)
  assert gen.tokens == plain.tokens
  for a, acc, trials, pv in _alpha_pvalues(gen, 4):
    assert pv > FALSE_ALARM / len(ALPHAS), (a, acc / trials, pv)
  before = loop.TRACE_COUNTS["speculative"]
  again = decoding.speculative_generate(target, drafter.with_alpha(_row_alphas()[::-1].copy()),
                                        prompts, k=4, max_new_tokens=40,
                                        sampler=sampling.make_sampler(0.7, top_p=0.9))
  assert loop.TRACE_COUNTS["speculative"] == before, "changing α or the sampler recompiled"
  assert again.stats["accepted"][:ROWS_PER_ALPHA].sum() > gen.stats["accepted"][
      :ROWS_PER_ALPHA].sum()  # the first rows now run at α = 0.95 instead of 0.2


@pytest.mark.slow
def test_tree_first_candidates_accepted_with_alpha(target):
  tree = trees.branching((2, 2, 1))
  alpha = 0.6
  gen = decoding.speculative_generate(target, OracleDrafter.of(target, alpha), _prompts(24),
                                      tree=tree, max_new_tokens=40,
                                      sampler=sampling.make_sampler(1.0), seed=5)
  tried, acc = int(gen.stats["rank_tried"][:, 0].sum()), int(gen.stats["rank_accepted"][:, 0].sum())
  assert tried > 300
  assert stats.binomtest(acc, tried, alpha).pvalue > FALSE_ALARM, acc / tried


def test_bad_alpha_and_unsupported_tree(target):
  for bad in (1.5, -0.1, float("nan"), [[0.5]], "high", True):
    with pytest.raises(ValueError, match="alpha"):
      OracleDrafter.of(target, bad)
  with pytest.raises(ValueError, match="alpha has 3 values for a batch of 2"):
    decoding.speculative_generate(target, OracleDrafter.of(target, [0.1, 0.2, 0.3]),
                                  _prompts(2), k=2, max_new_tokens=4)
  with pytest.raises(ValueError, match="dynamic trees"):
    decoding.speculative_generate(target, OracleDrafter.of(target, 0.5), _prompts(1),
                                  tree=trees.DynamicTree(budget=4, depth=2, width=2),
                                  max_new_tokens=4)
