"""Closed forms of analysis/theory.py: lecture numbers, limits, Monte Carlo agreement,
validation."""

import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from specjax.analysis import theory

C_LECTURE = 0.15


# ----------------------------------------------------------------------------- lecture numbers

# The lecture's table (docs/cost_model.md): best speedup 1.51 / 1.75 / 2.11 / 2.78 at
# α = 0.6 / 0.7 / 0.8 / 0.9.
@pytest.mark.parametrize("alpha,lecture", [(0.6, 1.51), (0.7, 1.75), (0.8, 2.11), (0.9, 2.78)])
def test_lecture_best_speedup_row(alpha, lecture):
  _, best = theory.optimal_k(alpha, C_LECTURE)
  assert round(best, 2) == lecture


# The lecture's table says optimal k = 2 / 3 / 5 / 7. The formula says 2 / 3 / 5 / 8: at
# α = 0.9, k = 8 gives 2.7845 and k = 7 gives 2.7778 (both print as 2.78).
# See docs/cost_model.md, errata.
@pytest.mark.parametrize("alpha,k_formula", [(0.6, 2), (0.7, 3), (0.8, 5), (0.9, 8)])
def test_optimal_k_per_alpha_from_the_formula(alpha, k_formula):
  k, _ = theory.optimal_k(alpha, C_LECTURE)
  assert k == k_formula


def test_lecture_k7_at_alpha_09_is_not_the_optimum_but_within_a_quarter_percent():
  s7, s8 = theory.speedup(0.9, 7, C_LECTURE), theory.speedup(0.9, 8, C_LECTURE)
  assert s8 > s7
  assert s8 / s7 - 1 < 0.0025
  assert theory.optimal_k(0.9, C_LECTURE, k_max=7) == (7, pytest.approx(s7))


def test_lecture_speedup_at_alpha_08_k4_is_2_10():
  assert theory.expected_tokens(0.8, 4) == pytest.approx(3.3616)
  assert round(theory.speedup(0.8, 4, C_LECTURE), 2) == 2.10


# ----------------------------------------------------------------------------- closed forms


def test_expected_tokens_is_the_geometric_sum():
  for alpha in (0.0, 0.3, 0.8, 0.999, 1.0):
    for k in (0, 1, 4, 10):
      assert theory.expected_tokens(alpha, k) == pytest.approx(sum(alpha**i for i in range(k + 1)))


def test_limits():
  assert theory.expected_tokens(0.0, 7) == 1.0  # α → 0: only the target's own token
  assert theory.expected_tokens(1e-12, 7) == pytest.approx(1.0)
  assert theory.expected_tokens(1.0, 7) == 8.0  # α = 1: all k plus the bonus
  assert theory.expected_tokens(1 - 1e-12, 7) == pytest.approx(8.0)
  for alpha in (0.5, 0.8, 0.95):  # k → ∞: 1/(1 − α)
    assert theory.expected_tokens(alpha, 2000) == pytest.approx(1 / (1 - alpha))
  assert theory.speedup(0.7, 0, 0.3) == 1.0  # no drafts, no change
  # c = 0: speedup = E[τ], increasing in k, so the best k is the largest allowed.
  assert theory.speedup(0.7, 5, 0.0) == theory.expected_tokens(0.7, 5)
  assert theory.optimal_k(0.7, 0.0, k_max=12)[0] == 12
  # α = 0: every k loses; the honest search still answers within 1..k_max.
  assert theory.optimal_k(0.0, 0.15) == (1, pytest.approx(1 / 1.15))


def test_broadcasting_and_speedup_table():
  tab = theory.speedup_table([0.6, 0.9], 0.15, 8)
  assert tab.shape == (2, 8)
  assert tab[1, 7] == pytest.approx(theory.speedup(0.9, 8, 0.15))
  arr = theory.expected_tokens(np.array([0.5, 0.8]), np.array([[1], [4]]))
  assert arr.shape == (2, 2)
  assert isinstance(theory.expected_tokens(0.5, 3), float)


def test_optimal_k_searches_every_k():
  # A brute-force scan over 1..k_max agrees, for many (α, c) pairs.
  rng = np.random.default_rng(0)
  for alpha, c in rng.random((50, 2)) * [1.0, 0.5]:
    s = [theory.speedup(alpha, k, c) for k in range(1, 17)]
    k, best = theory.optimal_k(alpha, c)
    assert k == int(np.argmax(s)) + 1 and best == pytest.approx(max(s))


# ----------------------------------------------------------------------------- Monte Carlo


@pytest.mark.parametrize("alpha,k", [(0.6, 2), (0.8, 4), (0.95, 8), (0.3, 1)])
def test_independent_closed_form_matches_monte_carlo(alpha, k):
  sim = theory.simulate_chain(alpha, k, cycles=100_000, seed=1)
  assert abs(sim.tau - theory.expected_tokens(alpha, k)) < 3 * sim.tau_se
  assert abs(sim.alpha_hat - alpha) < 0.01


def test_monte_carlo_can_fail():
  # Negative control: the same simulation is far (>> 3 se) from a slightly wrong α.
  sim = theory.simulate_chain(0.8, 4, cycles=100_000, seed=1)
  assert abs(sim.tau - theory.expected_tokens(0.78, 4)) > 3 * sim.tau_se


@pytest.mark.parametrize("rho", [0.3, 0.6, 0.9])
def test_bursty_closed_form_matches_monte_carlo(rho):
  exact = theory.bursty_expected_tokens(0.8, 4, rho)
  sim = theory.simulate_chain(0.8, 4, cycles=200_000, seed=2, rho=rho)
  assert abs(sim.tau - exact) < 3 * sim.tau_se


def test_burstiness_lowers_tau_at_the_same_mean_alpha():
  taus = [theory.bursty_expected_tokens(0.8, 4, rho) for rho in (0.0, 0.3, 0.6, 0.9)]
  assert taus[0] == pytest.approx(theory.expected_tokens(0.8, 4))
  assert all(a > b for a, b in zip(taus, taus[1:]))
  # And below the i.i.d. prediction from the acceptance rate one would measure.
  sim = theory.simulate_chain(0.8, 4, cycles=200_000, seed=3, rho=0.6)
  assert sim.alpha_hat < 0.8
  assert sim.tau < theory.expected_tokens(sim.alpha_hat, 4) - 3 * sim.tau_se


# ----------------------------------------------------------------------------- trees


def test_sibling_ranks_and_depths():
  parents = (-1, -1, 0, 0, 1, 2, 0)
  assert theory.sibling_ranks(parents).tolist() == [0, 1, 0, 1, 0, 0, 2]
  assert theory.node_depths(parents).tolist() == [1, 1, 2, 2, 2, 3, 2]


@pytest.mark.parametrize("alpha,k", [(0.8, 4), (0.3, 1), (0.95, 12)])
def test_tree_of_a_chain_equals_expected_tokens(alpha, k):
  chain = tuple(range(-1, k - 1))
  assert theory.tree_expected_tokens(chain, [alpha]) == pytest.approx(
      theory.expected_tokens(alpha, k))
  assert theory.tree_expected_tokens(chain, [alpha, (1 - alpha) / 2]) == pytest.approx(
      theory.expected_tokens(alpha, k))  # unused ranks change nothing
  assert theory.chain_expected_tokens([alpha] * k) == pytest.approx(
      theory.expected_tokens(alpha, k))


def test_per_depth_models_agree():
  depth_probs = [0.9, 0.8, 0.6, 0.5]
  chain = (-1, 0, 1, 2)
  by_depth = np.array(depth_probs)[:, None]  # [D, 1]
  expected = 1 + 0.9 + 0.9 * 0.8 + 0.9 * 0.8 * 0.6 + 0.9 * 0.8 * 0.6 * 0.5
  assert theory.chain_expected_tokens(depth_probs) == pytest.approx(expected)
  assert theory.tree_expected_tokens(chain, by_depth) == pytest.approx(expected)


def test_tree_by_hand():
  # Root candidates ranked 0, 1; node 0 has two children; node 1 one.
  parents, p = (-1, -1, 0, 0, 1), [0.6, 0.2]
  want = 1 + 0.6 + 0.2 + 0.6 * 0.6 + 0.6 * 0.2 + 0.2 * 0.6
  assert theory.tree_expected_tokens(parents, p) == pytest.approx(want)


@pytest.mark.parametrize("parents,probs", [
    ((-1, -1, 0, 0, 1, 2, 2, 5), [0.5, 0.25, 0.1]),
    ((-1, -1, -1, 0, 1, 3), [[0.5, 0.2, 0.1], [0.6, 0.3, 0.0], [0.7, 0.1, 0.1],
                             [0.4, 0.4, 0.1]]),
])
def test_tree_closed_form_matches_monte_carlo(parents, probs):
  sim = theory.simulate_tree(parents, probs, samples=100_000, seed=4)
  assert abs(sim.tau - theory.tree_expected_tokens(parents, probs)) < 3 * sim.tau_se


def test_large_tree_matches_a_naive_recursion():
  # 256 nodes, up to 3 children each: the O(N) pass equals a recursive path product.
  rng = np.random.default_rng(6)
  parents = [-1]
  for i in range(1, 256):
    while True:
      q = int(rng.integers(-1, i))
      if sum(1 for x in parents if x == q) < 3:
        break
    parents.append(q)
  probs = [0.5, 0.3, 0.1]

  def path_prob(i):
    rank = sum(1 for j in range(i) if parents[j] == parents[i])
    return probs[rank] * (1.0 if parents[i] < 0 else path_prob(parents[i]))

  want = 1 + sum(path_prob(i) for i in range(len(parents)))
  assert theory.tree_expected_tokens(tuple(parents), probs) == pytest.approx(want)


# ----------------------------------------------------------------------------- sample size


def test_alpha_sample_size_wald_and_autocorrelation():
  # n = z² α(1−α)/h² = 1.959964² · 0.16 / 1e-4 = 6146.6 → 6147.
  assert theory.alpha_sample_size(0.8, 0.01) == 6147
  # ρ = 0.5: n_eff = n/3, so the raw count triples.
  assert theory.alpha_sample_size(0.8, 0.01, rho=0.5) == math.ceil(6146.6 * 3 - 0.1)
  assert theory.effective_sample_size(18440, 0.5) == pytest.approx(18440 / 3)
  assert theory.alpha_sample_size(0.5, 0.05, confidence=0.99) > theory.alpha_sample_size(0.5, 0.05)
  assert theory.alpha_sample_size(1.0, 0.01) == 0  # Wald degenerates at the edges ...
  assert theory.alpha_sample_size(1.0, 0.01, method="wilson") > 0  # ... Wilson does not


def test_wald_sample_size_gives_the_promised_coverage():
  # Simulate: with n drafted tokens the ±h interval around α̂ covers α ~95% of the time.
  n = theory.alpha_sample_size(0.8, 0.02)
  rng = np.random.default_rng(5)
  hat = rng.binomial(n, 0.8, size=20_000) / n
  coverage = np.mean(np.abs(hat - 0.8) <= 0.02)
  assert 0.94 < coverage < 0.96


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("call,name", [
    (lambda: theory.expected_tokens(1.5, 4), "alpha"),
    (lambda: theory.expected_tokens(-0.1, 4), "alpha"),
    (lambda: theory.expected_tokens(float("nan"), 4), "alpha"),
    (lambda: theory.expected_tokens(0.5, -1), "k"),
    (lambda: theory.expected_tokens(0.5, 2.5), "k"),
    (lambda: theory.expected_tokens(0.5, float("inf")), "k"),
    (lambda: theory.speedup(0.5, 2, -0.1), "c"),
    (lambda: theory.speedup(0.5, 2, float("inf")), "c"),
    (lambda: theory.optimal_k(0.5, 0.1, k_max=0), "k_max"),
    (lambda: theory.optimal_k(2.0, 0.1), "alpha"),
    (lambda: theory.alpha_sample_size(0.8, 0.0), "half_width"),
    (lambda: theory.alpha_sample_size(0.8, 0.01, confidence=1.0), "confidence"),
    (lambda: theory.alpha_sample_size(0.8, 0.01, rho=1.0), "rho"),
    (lambda: theory.alpha_sample_size(0.8, 0.01, method="exact"), "method"),
    (lambda: theory.tree_expected_tokens((0, -1), [0.5]), "parents"),
    (lambda: theory.tree_expected_tokens((-1, -1), [0.5]), "rank_probs"),
    (lambda: theory.tree_expected_tokens((-1,), [0.7, 0.6]), "rank_probs"),
    (lambda: theory.tree_expected_tokens((-1, 0, 1), [[0.5], [0.5]]), "rank_probs"),
    (lambda: theory.bursty_expected_tokens(0.8, 4, 1.0), "rho"),
    (lambda: theory.simulate_chain(0.8, 4, cycles=0), "cycles"),
])
def test_bad_input_raises_naming_the_argument(call, name):
  with pytest.raises(ValueError, match=name):
    call()


def test_theory_imports_without_jax():
  code = ("import sys, specjax.analysis.theory; "
          "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)")
  root = pathlib.Path(__file__).resolve().parents[2]
  subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


# ----------------------------------------------------------------------------- size limits
# Issue 29, item 6: work sizes are refused before anything is allocated, naming the value
# and the limit (were: hangs and MemoryError at k_max 10^8, samples 10^13).


@pytest.mark.parametrize("call, match", [
    (lambda: theory.optimal_k(0.8, 0.1, 10**8), r"k_max = 100,000,000 exceeds the limit of "
     r"1,000,000"),
    (lambda: theory.speedup_table([0.8], 0.1, 10**8), "k_max = 100,000,000"),
    (lambda: theory.speedup_table([0.5] * 20, 0.1, 10**6), r"len\(alphas\) × k_max"),
    (lambda: theory.bursty_expected_tokens(0.8, 10**9, 0.5), "k = 1,000,000,000"),
    (lambda: theory.simulate_chain(0.8, 4, cycles=10**13), "cycles × k"),
    (lambda: theory.simulate_chain(0.8, 0, cycles=10**13), "cycles × k"),
    (lambda: theory.simulate_chain(0.8, 4, cycles=10**13, rho=0.5), "streams ×"),
    (lambda: theory.simulate_chain(0.8, 4, cycles=10**4, rho=0.5, streams=10**9), "streams ×"),
    (lambda: theory.simulate_tree([-1, 0], [0.5], samples=10**13), "samples × depth"),
    (lambda: theory.alpha_sample_size(0.5, 1e-300, method="wilson"), r"half_width must be in "
     r"\[1e-09, 0.5\]"),
])
def test_work_sizes_beyond_the_limits_are_refused(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_work_at_the_limits_still_runs():
  assert theory.optimal_k(1.0, 0.0, theory.MAX_K)[0] == theory.MAX_K  # α = 1, c = 0: deepest
  assert theory.speedup_table([0.8] * 10, 0.1, theory.MAX_K).shape == (10, theory.MAX_K)
  assert theory.chain_draws(10**5, 4) == 4 * 10**5
  assert theory.chain_draws(10**5, 4, rho=0.5) == 1000 * (20 + 100) * 5
  n = theory.alpha_sample_size(0.5, theory.MIN_HALF_WIDTH, method="wilson")
  assert 9e16 < n < 1e18 and n == pytest.approx(theory.alpha_sample_size(
      0.5, theory.MIN_HALF_WIDTH), rel=1e-6)
