"""Tests for specjax.analysis.metrics (host-side α, τ, intervals, run lengths, autocorrelation, tree
summaries)."""

import json
import math

import numpy as np
import pytest
import scipy.stats

from specjax.analysis.metrics import (SpecStats, accept_flags_from_cycles, alpha_interval,
                                      lag1_autocorrelation, rank_probs_from_counts,
                                      run_length_histogram, summarize, summarize_tree, tau)


def test_alpha_interval_matches_scipy_wilson():
  for accepted, drafted in [(0, 10), (3, 10), (10, 10), (412, 500), (7, 7000)]:
    for conf in (0.9, 0.95, 0.99):
      a, lo, hi = alpha_interval(accepted, drafted, conf)
      ref = scipy.stats.binomtest(accepted, drafted).proportion_ci(conf, method="wilson")
      assert a == accepted / drafted
      assert lo == pytest.approx(ref.low, abs=1e-12) and hi == pytest.approx(ref.high, abs=1e-12)
      assert 0.0 <= lo <= a <= hi <= 1.0


def test_alpha_interval_known_value_and_width():
  a, lo, hi = alpha_interval(80, 100)
  assert a == 0.8
  assert lo == pytest.approx(0.7112, abs=1e-4) and hi == pytest.approx(0.8666, abs=1e-4)
  # Half-width ~ z sqrt(a(1-a)/n): 4x the samples halve it.
  _, lo4, hi4 = alpha_interval(3200, 4000)
  assert (hi4 - lo4) == pytest.approx((hi - lo) / math.sqrt(40), rel=0.05)


def test_alpha_interval_coverage():
  """Coverage of the 95% Wilson interval over 4000 binomial draws at several α."""
  rng = np.random.default_rng(0)
  for alpha_true in (0.3, 0.6, 0.85):
    for n in (50, 400):
      hits = 0
      draws = rng.binomial(n, alpha_true, size=4000)
      for x in draws:
        _, lo, hi = alpha_interval(int(x), n)
        hits += lo <= alpha_true <= hi
      assert 0.93 <= hits / 4000 <= 0.975, (alpha_true, n, hits / 4000)


def test_rho_widens_interval_by_effective_sample_size():
  _, lo, hi = alpha_interval(800, 1000)
  _, lo_r, hi_r = alpha_interval(800, 1000, rho=0.5)
  assert lo_r < lo and hi_r > hi
  # n_eff = n (1 - rho) / (1 + rho) = n / 3: the same interval as 800/3 of 1000/3 trials.
  ratio = (hi_r - lo_r) / (hi - lo)
  assert ratio == pytest.approx(math.sqrt(3), rel=0.02)
  # A negative rho never narrows it.
  assert alpha_interval(800, 1000, rho=-0.5) == alpha_interval(800, 1000)


def test_rho_corrected_interval_covers_markov_acceptance():
  """Bursty (Markov) accept flags: the raw Wilson interval under-covers, the ESS-widened one
  covers ~nominal. This is the correction's reason to exist (can fail without it)."""
  rng = np.random.default_rng(1)
  stay = 0.9  # P(flag repeats)
  n, reps, raw, ess = 400, 1000, 0, 0
  for _ in range(reps):
    flips = rng.random(n) > stay
    flags = np.bitwise_xor.accumulate(np.concatenate([[rng.random() < 0.5], flips[1:]]))
    x = int(flags.sum())
    _, lo, hi = alpha_interval(x, n)
    raw += lo <= 0.5 <= hi
    _, lo, hi = alpha_interval(x, n, rho=lag1_autocorrelation(flags))
    ess += lo <= 0.5 <= hi
  assert raw / reps < 0.8
  assert ess / reps > 0.9


@pytest.mark.parametrize("args, name", [
    ((-1, 10), "accepted"), ((11, 10), "accepted"), ((1, 2.5), "drafted"),
])
def test_alpha_interval_validation(args, name):
  with pytest.raises(ValueError, match=name):
    alpha_interval(*args)
  with pytest.raises(ValueError, match="confidence"):
    alpha_interval(1, 2, confidence=1.0)
  with pytest.raises(ValueError, match="rho"):
    alpha_interval(1, 2, rho=1.0)


def test_alpha_interval_no_data():
  a, lo, hi = alpha_interval(0, 0)
  assert math.isnan(a) and (lo, hi) == (0.0, 1.0)


def test_tau():
  assert tau(30, 10) == 3.0
  assert tau(np.array([5, 7]), np.array([5, 2])) == 12 / 7
  assert math.isnan(tau(0, 0))
  with pytest.raises(ValueError):
    tau(-1, 3)


def test_run_length_histogram():
  log = np.array([[0, 2, 2, 1, -1, -1], [3, 3, 0, -1, -1, -1]])
  h = run_length_histogram(log, 3)
  assert h.tolist() == [2, 1, 2, 2]
  assert h.sum() == (log >= 0).sum()
  with pytest.raises(ValueError, match="n_accepted_per_cycle"):
    run_length_histogram([4], 3)


def test_accept_flags_from_cycles():
  flags = accept_flags_from_cycles([2, 0, 3, -1], 3)
  # 2 accepts + rejection; a rejection at once; 3 accepts (no rejection: all k accepted).
  assert flags.tolist() == [True, True, False, False, True, True, True]
  assert accept_flags_from_cycles([], 3).size == 0
  with pytest.raises(ValueError):
    accept_flags_from_cycles(np.zeros((2, 2), int), 3)


def test_lag1_autocorrelation():
  alternating = np.arange(1000) % 2
  assert lag1_autocorrelation(alternating) == pytest.approx(-1.0, abs=1e-9)
  blocks = np.repeat(np.arange(40) % 2, 25)
  assert lag1_autocorrelation(blocks) > 0.9
  iid = np.random.default_rng(2).random(20_000) < 0.7
  assert abs(lag1_autocorrelation(iid)) < 0.03
  assert lag1_autocorrelation(np.ones(50)) == 0.0  # constant: defined as 0
  assert lag1_autocorrelation([]) == 0.0
  assert lag1_autocorrelation([1]) == 0.0


def test_lag1_autocorrelation_does_not_cross_rows():
  # Rows of different α: relative to the pooled mean every within-row pair agrees (+1; the
  # between-row heterogeneity is real burstiness for a pooled α). Concatenating would add the
  # cross-row pair (1, 0) and give 17/19 instead.
  rows = [np.ones(10, bool), np.zeros(10, bool)]
  assert lag1_autocorrelation(rows) == pytest.approx(1.0)
  assert lag1_autocorrelation(np.stack(rows)) == pytest.approx(1.0)  # 2-D: rows
  assert lag1_autocorrelation(np.concatenate(rows)) == pytest.approx(17 / 19)
  # Rows of alternating flags whose ends would make a pair [.., 1] + [1, ..] if concatenated.
  rows = [np.array([0, 1, 0, 1]), np.array([1, 0, 1, 0])]
  assert lag1_autocorrelation(rows) == pytest.approx(-1.0)
  assert lag1_autocorrelation(np.concatenate(rows)) > -1.0


def test_summarize_and_json():
  k = 3
  log = np.array([[3, 0, 1, -1], [2, 3, -1, -1]])
  cycles = np.array([3, 2])
  accepted = np.array([4, 5])
  drafted = cycles * k
  emitted = accepted + cycles
  s = summarize(cycles, drafted, accepted, emitted, log, k)
  assert isinstance(s, SpecStats)
  assert s.alpha == 9 / 15
  # Trials: row 0: 3 (no rejection) + 1 (rejection) + 2 (1 accept, 1 rejection) = 6 ...
  assert s.trials == 9 + 3  # accepted + cycles with n < k
  assert s.alpha_trial == 9 / 12
  assert s.tau == 14 / 5
  assert s.histogram == (1, 1, 1, 2)
  assert s.log_complete
  assert s.alpha_ci[0] < s.alpha < s.alpha_ci[1]
  assert s.alpha_rows == (4 / 9, 5 / 6)
  d = s.to_dict()
  back = json.loads(json.dumps(d, allow_nan=False))
  assert back["alpha"] == 0.6 and back["histogram"] == [1, 1, 1, 2]
  assert isinstance(back["alpha_ci"], list)


def test_summarize_nan_and_validation():
  s = summarize([0], [0], [0], [0], [[-1, -1]], 4)
  d = s.to_dict()
  assert d["alpha"] is None and d["tau"] is None
  json.dumps(d, allow_nan=False)
  with pytest.raises(ValueError, match="cycle_log"):
    summarize([1], [4], [2], [3], [2], 4)
  with pytest.raises(ValueError, match="accepted"):
    summarize([1], [4], [5], [3], [[2]], 4)
  with pytest.raises(ValueError, match="drafted"):
    summarize([1, 2], [4], [2, 2], [3, 3], [[2], [1]], 4)


def test_summarize_trial_alpha_recovers_iid_acceptance():
  """Simulated i.i.d. acceptance a = 0.8, k = 4: alpha_trial ~ a; alpha = E[n]/k is lower;
  τ ~ (1 - a^(k+1)) / (1 - a)."""
  rng = np.random.default_rng(3)
  a, k, B, C = 0.8, 4, 50, 200
  ok = rng.random((B, C, k)) < a
  n = np.cumprod(ok, axis=2).sum(axis=2)
  s = summarize(np.full(B, C), np.full(B, C * k), n.sum(1), n.sum(1) + C, n, k)
  assert abs(s.alpha_trial - a) < 0.01
  assert s.alpha_trial_ci[0] < a < s.alpha_trial_ci[1]
  assert abs(s.alpha - (a + a**2 + a**3 + a**4) / k) < 0.01
  assert abs(s.tau - (1 - a ** (k + 1)) / (1 - a)) < 0.03
  assert abs(s.rho) < 0.05


def test_rank_probs_from_counts_and_tree_summary():
  # a_0 = 0.5, a_1 = 0.5 -> p_0 = 0.5, p_1 = 0.25; an untried rank has p = 0.
  np.testing.assert_allclose(rank_probs_from_counts([100, 50, 0], [50, 25, 0]),
                             [0.5, 0.25, 0.0])
  stats = dict(cycles=np.array([4, 2]), verified=np.array([24, 12]), accepted=np.array([6, 1]),
               hist=np.array([[1, 1, 1, 1], [1, 1, 0, 0]]),
               depth_tried=np.array([[4, 3, 2], [2, 1, 0]]),
               depth_accepted=np.array([[3, 2, 1], [1, 0, 0]]),
               rank_tried=np.array([[6, 3], [3, 2]]), rank_accepted=np.array([[4, 2], [1, 0]]))
  s = summarize_tree(stats, emitted=np.array([10, 3]))
  assert s.tau == pytest.approx(13 / 6) and s.utilisation == pytest.approx(7 / 36)
  assert s.depth_acceptance == pytest.approx((4 / 6, 2 / 4, 1 / 2))
  assert s.depth_reach == pytest.approx((4 / 6, 2 / 6, 1 / 6))
  assert s.rank_acceptance == pytest.approx((5 / 9, 2 / 5))
  assert s.rank_probs == pytest.approx((5 / 9, 4 / 9 * 2 / 5))
  assert s.histogram == (2, 2, 1, 1)
  assert s.to_dict()["rank_tried"] == [9, 5]
  with pytest.raises(ValueError, match="stats lacks"):
    summarize_tree({"cycles": [1]}, [1])


def test_loop_flags_fraction_and_tail():
  from specjax.analysis import metrics
  # period 2 repeated: the third repetition's last token and everything after continue it
  row = [1, 2, 1, 2, 1, 2, 1, 2, 5, 6, 7]
  flags = metrics.loop_flags(row)
  assert flags.tolist() == [False] * 5 + [True] * 3 + [False] * 3
  assert metrics.loop_fraction([row]) == 3 / 11
  assert metrics.loop_fraction([list(range(100))]) == 0.0  # no repetition
  assert metrics.loop_fraction([[7] * 10]) == 8 / 10       # period 1: from the third on
  # a period-9 cycle is not a loop by the definition (period <= 8)
  assert metrics.loop_fraction([list(range(9)) * 5]) == 0.0
  assert metrics.loop_fraction([list(range(8)) * 5]) == 17 / 40  # from index 23 = 3*8 - 1
  assert metrics.ends_in_loop([3, 4] * 20) and not metrics.ends_in_loop(list(range(40)))
  assert not metrics.ends_in_loop([1] * 31)                 # shorter than the window
  assert metrics.ends_in_loop(list(range(50)) + [5, 6, 7] * 11)


@pytest.mark.slow
def test_divergences_name_the_first_differing_position_and_its_logit_gap():
  import jax.numpy as jnp
  from flax import nnx
  from specjax.experiments import measure
  from specjax.engine import decoding
  from specjax.models.presets import PRESETS
  from specjax.models.transformer import Transformer
  target = Transformer(PRESETS["tiny-llama"], rngs=nnx.Rngs(0))
  prompt = [[5, 6, 7, 8]]
  plain = decoding.generate(target, prompt, max_new_tokens=6).tokens
  seq = prompt[0] + plain[0][:3]
  logits = np.asarray(target(jnp.asarray([seq]), jnp.arange(len(seq))[None], None)[0][0, -1])
  second = int(np.argsort(-logits)[1])
  spec = [plain[0][:3] + [second] + plain[0][4:]]
  assert measure.divergences(target, prompt, plain, plain) == []
  (d,) = measure.divergences(target, prompt, plain, spec)
  assert (d["row"], d["position"], d["plain"], d["spec"]) == (0, 3, plain[0][3], second)
  np.testing.assert_allclose(d["logit_gap"], logits[plain[0][3]] - logits[second], rtol=1e-5)
  assert d["ulps"] > 0
