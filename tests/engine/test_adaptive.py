"""Adaptive speculation: the policy (analytic choice on synthetic costs, bad input) and the
adaptive loop (greedy identity and the χ² joint law with shapes alternating every cycle, k = 0
equal to plain decoding, the drafter's state across switches, no recompilation).

Statistical tests use a false-alarm rate of 1e-3 (p-value threshold), fixed seeds, and a
planted-bug negative control. Loop tests share one compiled loop (one menu, one drafter kind,
one batch shape) to keep compile time down.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from specjax.verify import acceptance, sampling, trees
from specjax.engine.adaptive import policy as adaptive, loop as adaptive_loop
from specjax.engine import decoding, loop
from specjax.analysis import theory
from specjax.models.lm import LM
from specjax.drafters.base import Context
from specjax.drafters.model import ModelDrafter
from specjax_testing import (FALSE_ALARM, JOINT_ROWS, PROMPT, RAGGED, TINY, VOCAB, FeatureProbe,
                             exact_joint, joint_pvalue, joint_target, model, perturbed)

TREE = trees.branching((2, 1))
MENU = (0, 1, 3, TREE)
BUDGET = 20
ALTERNATE = [1, 0, 3, 2]  # every cycle another shape, k = 0 in between speculative cycles


def _policy(forced=ALTERNATE, threshold=0.0, seconds=(1.0, 1.2, 1.5, 1.6)):
  return adaptive.AdaptivePolicy.create(MENU, list(seconds), forced=forced, threshold=threshold)


@pytest.fixture(scope="module")
def pair():
  target = model(TINY["llama"], seed=0, logit_scale=4.0)
  return target, perturbed(target, seed=1, noise=0.25)


def _run(target, draft_model, policy, **kw):
  """The shared compiled loop: a drafter reading target features (specjax_testing.FeatureProbe,
  deterministic top-k candidates), the ragged batch, budget BUDGET."""
  drafter = FeatureProbe(lm=LM.of(draft_model), deterministic=True)
  return decoding.speculative_generate(target, drafter, RAGGED, policy=policy,
                                       max_new_tokens=BUDGET, **kw)


# ----------------------------------------------------------------------------- the policy


def test_policy_picks_the_analytically_best_chain_on_synthetic_costs():
  ks = (0, 1, 2, 4, 6)
  for alpha, c in [(0.9, 0.05), (0.6, 0.1), (0.3, 0.3), (0.95, 0.0), (0.1, 0.5)]:
    pol = adaptive.AdaptivePolicy.from_model(ks, c=c)
    score = [1.0 / (1 + c) if k == 0 else theory.expected_tokens(alpha, k) / (1 + c * k)
             for k in ks]
    assert pol.names[pol.choose(alpha, 1)] == f"k={ks[int(np.argmax(score))]}", (alpha, c)


def test_policy_tree_expected_tokens_match_theory_and_batch_cost_moves_the_choice():
  pol = adaptive.AdaptivePolicy.create((0, 2, TREE), [[1.0, 1.3, 1.4], [1.0, 2.5, 2.9]],
                                       batches=(1, 64))
  a = 0.7
  rank_probs = [a, (1 - a) * a]  # rank r accepted after r rejections, each at rate a
  tau = np.asarray(pol.expected_tokens(jnp.full((1, pol.columns), a)))[0]
  assert tau[0] == pytest.approx(1.0)
  assert tau[1] == pytest.approx(theory.expected_tokens(a, 2), rel=1e-5)
  assert tau[2] == pytest.approx(theory.tree_expected_tokens(TREE.draft_parents, rank_probs),
                                 rel=1e-5)
  best1 = int(np.argmax(tau / np.asarray([1.0, 1.3, 1.4])))
  assert pol.choose(a, 1) == best1 != 0
  assert pol.choose(a, 64) == 0  # at batch 64 speculation costs more than it brings
  # between calibrated batches: linear in log batch
  mid = np.asarray(pol.cycle_seconds(8))
  np.testing.assert_allclose(mid[1], 1.3 + (2.5 - 1.3) * np.log(8) / np.log(64), rtol=1e-5)


def test_batch_objective_follows_the_row_that_finishes_last():
  """Two rows of one static batch, one accepting at 0.95 and one at 0.1, 40 tokens left
  each: by the rate tokens appear (the "tokens" objective) k = 4 wins on the fast row's
  account, but the batch is done when the slow row is, and for it k = 4 cycles cost more
  than they bring: the "batch" objective keeps plain steps. With equal rows both agree."""
  ks = (0, 1, 4)
  costs = [1.0, 1.3, 1.6]
  batch_pol = adaptive.AdaptivePolicy.create(ks, costs)
  token_pol = batch_pol.replace_runtime(objective="tokens")
  assert (batch_pol.objective, token_pol.objective) == ("batch", "tokens")
  cols = batch_pol.columns  # every rank and depth at the row's rate
  rates = jnp.repeat(jnp.asarray([[0.95], [0.1]]), cols, axis=1)
  active, left = jnp.asarray([True, True]), jnp.asarray([40, 40])
  pick = lambda pol, r, a: int(pol.pick(r, a, 2, jnp.asarray(0), left))  # noqa: E731
  assert pick(token_pol, rates, active) == 2
  assert pick(batch_pol, rates, active) == 0
  # the slow row done: the fast one alone sets the pace, speculation pays again
  assert pick(batch_pol, rates, jnp.asarray([True, False])) == 2
  same = jnp.full((2, cols), 0.8)
  assert pick(batch_pol, same, active) == pick(token_pol, same, active) == batch_pol.choose(
      0.8, 2)
  # a row about to finish cannot use a deep chain: min(E[τ], tokens left)
  one = lambda n: int(batch_pol.pick(jnp.full((1, cols), 0.95), jnp.asarray([True]), 1,  # noqa
                                     jnp.asarray(0), jnp.asarray([n])))
  assert one(40) == 2 and one(1) == 0


@pytest.mark.parametrize("make, match", [
    (lambda: adaptive.AdaptivePolicy.create((0, 1), [1.0, 1.2], objective="speed"),
     r"objective must be one of \('batch', 'tokens'\), got 'speed'"),
    (lambda: adaptive.menu([]), "empty menu"),
    (lambda: adaptive.menu([1, -2]), "menu\\[1\\]"),
    (lambda: adaptive.menu([trees.DynamicTree(width=2, depth=2, budget=3)]), "dynamic"),
    (lambda: adaptive.menu([2, trees.chain(2)]), "duplicate"),
    (lambda: _policy(threshold=float("nan")), "threshold"),
    (lambda: _policy(threshold=-0.1), "threshold"),
    (lambda: _policy(forced=[4]), "forced"),
    (lambda: _policy(seconds=(1.0, 0.0, 1.0, 1.0)), "seconds"),
    (lambda: adaptive.AdaptivePolicy.create((0, 1), [1.0, 1.1], decay=1.0), "decay"),
    (lambda: adaptive.AdaptivePolicy.from_model((0, 1), c=-1.0), "c must"),
])
def test_policy_bad_input(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_generate_bad_input_before_work(pair):
  target, draft = pair
  before = loop.TRACE_COUNTS.copy()
  big = adaptive.AdaptivePolicy.create((0, 100), [1.0, 2.0])  # 101 slots: over max_len 128
  cases = [
      (dict(policy=big), "exceeds"),
      (dict(k="auto", tree=TREE), "neither"),
      (dict(k=3, policy=_policy()), "neither"),
      (dict(k="fast"), "'auto'"),
      (dict(policy="adaptive"), "AdaptivePolicy"),
      (dict(policy=_policy().replace(menu=())), "empty menu"),  # built around `create`
      (dict(policy=_policy().replace(threshold=jnp.asarray(float("nan")))), "threshold"),
  ]
  for kw, match in cases:
    with pytest.raises(ValueError, match=match):
      decoding.speculative_generate(target, draft, RAGGED, max_new_tokens=BUDGET, **kw)
  assert loop.TRACE_COUNTS == before


# ----------------------------------------------------------------------------- the loop


@pytest.mark.slow
def test_greedy_identity_with_shapes_alternating_every_cycle(pair):
  """Ragged batch, the policy forced through k=1, k=0, tree, k=3 in turn: the tokens are
  plain greedy decoding's; the drafter's copy of the target's features (passed by every
  branch, k = 0 included) matches a cache-free forward."""
  target, draft = pair
  plain = decoding.generate(target, RAGGED, max_new_tokens=BUDGET)
  run = _run(target, draft, _policy())
  assert run.tokens == plain.tokens
  n = len(run.choices)
  assert list(run.choices) == [ALTERNATE[i % 4] for i in range(n)]
  assert 0 < run.summary().alpha < 1
  assert np.all(run.plain_steps > 0)


@pytest.mark.slow  # compile-heavy (fast-tier durations)
def test_drafter_state_survives_plain_steps_and_nothing_recompiles(pair):
  """Self-drafting at T = 0 accepts every draft only if the draft's cache is right after
  each plain step (the k = 0 branch's catch-up). Changing the forced schedule or the costs
  reuses the compiled loop (a positive threshold: test_draft_stopping_...)."""
  target, draft = pair
  _run(target, draft, _policy())  # compiled (shared with the test above)
  before = loop.TRACE_COUNTS["adaptive"]
  run = _run(target, target, _policy(forced=[1, 0, 2, 0]))  # k=1, 0, 3, 0
  assert run.summary().alpha == 1.0
  assert set(run.choices.tolist()) == {0, 1, 2}
  free = _run(target, draft, _policy(forced=[-1, -1, -1, -1], seconds=(1.0, 1.1, 1.2, 1.3)))
  assert free.tokens == decoding.generate(target, RAGGED, max_new_tokens=BUDGET).tokens
  assert loop.TRACE_COUNTS["adaptive"] == before, "a runtime policy value recompiled"


@pytest.mark.slow  # compile-bound (5-18 s): the fast tier's 3 minutes
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forced_plain_equals_plain_decoding_token_for_token(pair, temperature):
  target, draft = pair
  sampler = sampling.make_sampler(temperature)
  plain = decoding.generate(target, RAGGED, max_new_tokens=BUDGET, sampler=sampler, seed=5)
  run = _run(target, draft, _policy(forced=[0, 0, 0, 0]), sampler=sampler, seed=5)
  assert run.tokens == plain.tokens
  assert int(run.stats["cycles"].sum()) == 0


# ----------------------------------------------------------------------------- the joint law


def _adaptive_first_three(target, draft, sampler, seed, run=None, threshold=0.0,
                          forced=(1, 0, 2), drafter_cls=ModelDrafter):
  prompt = PROMPT
  batch = decoding.prepare_batch([prompt] * JOINT_ROWS, vocab_size=VOCAB, max_len=32,
                                 max_new_tokens=3, slots=3)
  # the first token comes from the prefill; default: cycle 0: k = 1, cycle 1: plain (rows that
  # got 1 token in cycle 0 take their third token from it). The model drafter catches up
  # lazily with P = 1: a plain step leaves it one token behind, and a following speculative
  # cycle catches it up before drafting (forced (0, 1, 2): plain, then k = 1).
  policy = adaptive.AdaptivePolicy.create((0, 1, 2), [1.0, 1.1, 1.2], forced=list(forced),
                                          threshold=threshold)
  run = run or adaptive_loop.adaptive_jit
  state = run(LM.of(target), drafter_cls.of(draft), policy, batch.prompt_BP, batch.prompt_len_B,
              batch.budget_B, jnp.asarray(-1), sampler, jax.random.key(seed),
              cache_len=batch.cache_len, lazy_slots=1)
  _adaptive_first_three.catch_ups = int(state.adapt.catch_ups)
  _adaptive_first_three.stopped = int(np.sum(state.adapt.stopped))
  _adaptive_first_three.skipped = int(np.sum(state.adapt.skipped))
  return np.asarray(state.tokens)[:, 3:6], prompt


@pytest.mark.slow
@pytest.mark.parametrize("threshold, forced", [(0.0, (1, 0, 2)), (1.0, (2, 0, 1)),
                                               (0.0, (0, 1, 2))],
                         ids=["no-stopping", "draft-stopping", "lazy-catch-up"])
def test_joint_distribution_of_first_three_tokens_with_alternating_shapes(threshold, forced):
  """χ² goodness of fit of 40,000 rows against the enumerated target joint over 8³ outcomes
  (sparse cells pooled), shapes alternating k=1, plain, k=2; false-alarm rate 1e-3 each.
  With draft stopping (threshold 1: the first cycle, a chain of 2, drafts node 1 only, node
  2 is a point-mass filler, and it emits at most 2 tokens) the output stays exact; with
  plain then k = 1 the drafter catches up lazily before it drafts."""
  target, draft = _joint_models()
  sampler = sampling.make_sampler(1.0)
  tokens, prompt = _adaptive_first_three(target, draft, sampler, seed=11, threshold=threshold,
                                         forced=forced)
  assert joint_pvalue(tokens, exact_joint(target, prompt, sampler)) > FALSE_ALARM
  if forced[0] == 0:
    assert _adaptive_first_three.catch_ups == 1
  if threshold > 0:
    assert _adaptive_first_three.stopped >= JOINT_ROWS, "every row's first cycle should stop"
    assert _adaptive_first_three.skipped == _adaptive_first_three.stopped
    before = loop.TRACE_COUNTS["adaptive"]
    _adaptive_first_three(target, draft, sampler, seed=12, threshold=0.5, forced=forced)
    assert loop.TRACE_COUNTS["adaptive"] == before, "another positive threshold recompiled"


@struct.dataclass
class _MisreportedFillers(ModelDrafter):
  """Planted bug: a stopped chain's fillers report the last drafted node's law instead of a
  point mass (the filler, that law's least likely token, is then accepted far too often).
  The extra static field keeps its compiled program apart (docs/xla_notes.md, trap 9)."""

  planted: bool = struct.field(pytree_node=False, default=True)

  def _levels_until_unsure(self, level, carry0, keys, root_logits_BV, root_q_BV, levels, m):
    cache, kids, q, finite, drafted = super()._levels_until_unsure(
        level, carry0, keys, root_logits_BV, root_q_BV, levels, m)
    skipped = (jnp.arange(levels)[:, None] >= drafted[None] - 1)[..., None, None]
    return cache, kids, jnp.where(skipped, root_q_BV[None, :, None], q), finite, drafted


@pytest.mark.slow
def test_joint_distribution_test_catches_misreported_fillers():
  """Negative control of the draft-stopping case: the same χ² test rejects fillers whose
  law is not the point mass they are."""
  target, draft = _joint_models()
  sampler = sampling.make_sampler(1.0)
  tokens, prompt = _adaptive_first_three(target, draft, sampler, seed=11, threshold=1.0,
                                         forced=(2, 0, 1), drafter_cls=_MisreportedFillers)
  assert _adaptive_first_three.stopped >= JOINT_ROWS
  assert joint_pvalue(tokens, exact_joint(target, prompt, sampler)) < FALSE_ALARM


@pytest.mark.slow
def test_draft_stopping_skips_the_levels_and_fills_point_masses(pair):
  """A chain of 4 with threshold 1 drafts node 1 only: the other nodes are the root law's
  least likely token (one-hot laws when sampled); threshold 0 drafts exactly what the
  drafter without stopping drafts (same key). The confidence is the draft's softmax at
  temperature 1, so a greedy (T = 0) or top-k chain stops as well."""
  target, draft = pair
  tree = trees.chain(4)
  batch = decoding.prepare_batch(RAGGED, vocab_size=draft.config.vocab_size, max_len=64,
                                 max_new_tokens=8, slots=5)

  ctx = Context(tokens=jnp.pad(batch.prompt_BP, ((0, 0), (0, 16))),
                length=batch.prompt_len_B - 1)
  # one jitted function: the sampler and the threshold are arrays (no recompile)
  fn = jax.jit(lambda d, s, sampler: d.propose(s, ctx, tree, sampler, jax.random.key(3))[0])

  def propose(drafter, temperature):
    state = drafter.init(batch.prompt_BP, batch.prompt_len_B, batch.cache_len, tree)
    return fn(drafter, state, sampling.make_sampler(temperature))

  for drafter, temperature in [(ModelDrafter.of(draft), 1.0), (ModelDrafter.of(draft), 0.0),
                               (ModelDrafter.of(draft, deterministic=True), 1.0)]:
    stopped = propose(drafter.with_stopping(1.0), temperature)
    reference = propose(drafter, temperature)
    assert np.all(np.asarray(stopped.drafted) == 1) and reference.drafted is None
    np.testing.assert_array_equal(np.asarray(stopped.tokens[:, 0]),
                                  np.asarray(reference.tokens[:, 0]))
    filler = np.asarray(stopped.tokens[:, 1])
    np.testing.assert_array_equal(np.asarray(stopped.tokens[:, 1:]),
                                  np.repeat(filler[:, None], 3, axis=1))
    if drafter.deterministic:
      assert stopped.q is None
    else:
      np.testing.assert_array_equal(np.asarray(stopped.q[:, 1:4]), np.asarray(
          jax.nn.one_hot(np.repeat(filler[:, None], 3, axis=1), stopped.q.shape[-1])))
      if temperature > 0:  # the root law's least likely token
        np.testing.assert_array_equal(filler, np.argmin(np.asarray(stopped.q[:, 0]), axis=-1))
    never = propose(drafter.with_stopping(0.0), temperature)
    assert np.all(np.asarray(never.drafted) == 4)
    np.testing.assert_array_equal(np.asarray(never.tokens), np.asarray(reference.tokens))
    if reference.q is not None:
      np.testing.assert_allclose(np.asarray(never.q), np.asarray(reference.q))


def test_a_stopping_drafter_in_the_fixed_shape_loop(pair):
  """A drafter with stopping passed to the fixed-shape loop (`speculative_generate(k=3)`):
  greedy output identical to plain decoding, and its stats count drafted nodes only
  (threshold 1: one per cycle, the fillers neither drafted nor rejected drafts)."""
  target, draft = pair
  plain = decoding.generate(target, RAGGED, max_new_tokens=BUDGET)
  run = decoding.speculative_generate(target, ModelDrafter.of(draft).with_stopping(1.0),
                                      RAGGED, k=3, max_new_tokens=BUDGET)
  assert run.tokens == plain.tokens
  np.testing.assert_array_equal(run.stats["drafted"], run.stats["cycles"])
  assert np.all(run.stats["accepted"] <= run.stats["cycles"])
  assert np.all(run.stats["depth_tried"][:, 1:] == 0)


@pytest.mark.slow
def test_joint_distribution_test_catches_a_planted_bug(monkeypatch):
  """Negative control: the same χ² test rejects an 'always accept' acceptance rule."""
  target, draft = _joint_models()

  def always_accept(key, drafts_BK, p_BKV1, q_BKV=None):
    b, k = drafts_BK.shape
    nxt = sampling.sample(key, p_BKV1[:, k])
    return acceptance.ChainResult(n_accepted=jnp.full((b,), k, jnp.int32), next_token=nxt,
                                  accepted=jnp.ones((b, k), bool))

  monkeypatch.setattr(acceptance, "accept_chain", always_accept)
  fresh = jax.jit(lambda *a, **kw: adaptive_loop.adaptive_loop(*a, **kw),
                  static_argnames=("cache_len", "lazy_slots"))
  sampler = sampling.make_sampler(1.0)
  tokens, prompt = _adaptive_first_three(target, draft, sampler, seed=11, run=fresh)
  assert joint_pvalue(tokens, exact_joint(target, prompt, sampler)) < FALSE_ALARM


def _joint_models():
  target = joint_target()
  return target, perturbed(target, seed=4, noise=0.7)


# ----------------------------------------------------------------------------- command line


def test_policy_prices_entries_from_the_calibration_fit_by_default():
  """A chain of 6 timed cheaper than a chain of 4 (one noisy calibration): priced by the fit
  over all five shapes (the default), each entry costs t_fixed + t_verify·(N+1) + t_draft·D
  and costs grow with k, so at α = 0.5-0.6 k = 4 wins; priced by each shape's own timing
  (cycles="measured") the noise makes k = 6 look best there."""
  from specjax.calibration import loop_costs as calibration
  costs = calibration.LoopCosts.from_timings(
      1.0, [(trees.chain(1), 1.30), (trees.chain(2), 1.42), (trees.chain(4), 1.66),
            (trees.chain(6), 1.50), (trees.branching((2, 1)), 1.75)])
  fit = costs.fitted
  pol = adaptive.AdaptivePolicy.from_costs((0, 1, 2, 4, 6), costs)
  raw = adaptive.AdaptivePolicy.from_costs((0, 1, 2, 4, 6), costs, cycles="measured")
  np.testing.assert_allclose(np.asarray(pol.seconds)[0, 1:],
                             [fit.seconds(e.size, e.max_depth) for e in pol.menu[1:]], rtol=1e-6)
  np.testing.assert_allclose(np.asarray(raw.seconds)[0, 1:], [1.30, 1.42, 1.66, 1.50], rtol=1e-6)
  assert np.all(np.diff(np.asarray(pol.seconds)[0, 1:]) > 0)
  for a in (0.5, 0.6):
    assert pol.names[pol.choose(a, 1)] == "k=4" and raw.names[raw.choose(a, 1)] == "k=6"
  # without a fit (chains only do not identify it) the shapes' own timings are used
  chains = calibration.LoopCosts.from_timings(1.0, [(trees.chain(1), 1.3), (trees.chain(4), 1.9)])
  assert chains.fitted is None
  np.testing.assert_allclose(
      np.asarray(adaptive.AdaptivePolicy.from_costs((0, 1, 4), chains).seconds)[0, 1:],
      [1.3, 1.9], rtol=1e-6)
  with pytest.raises(ValueError, match="cycles must be one of"):
    adaptive.AdaptivePolicy.from_costs((0, 1), costs, cycles="median")


def test_cli_theory_adaptive_from_a_calibration_file_and_bad_k(capsys, tmp_path):
  """`specjax theory adaptive` answers from a calibration file with the policy's host path;
  `specjax generate --k` takes an int or 'auto' only."""
  import json

  from specjax.calibration import loop_costs as calibration
  from specjax.cli import main

  costs = calibration.LoopCosts.from_timings(
      1.0, [(trees.chain(1), 1.3), (trees.chain(2), 1.5), (trees.chain(4), 1.9),
            (TREE, 1.8)], meta={"batch": 1, "temperature": 0.0})
  path = tmp_path / "cal.json"
  path.write_text(json.dumps(costs.to_dict()))
  assert main(["theory", "adaptive", "--calibration", str(path), "--menu", "0,1,2,4",
               "--alphas", "0.2,0.9", "--batches", "1", "--json"]) == 0
  doc = json.loads(capsys.readouterr().out)
  pol = adaptive.AdaptivePolicy.from_costs((0, 1, 2, 4), costs, lazy_slots=loop.LAZY_SLOTS)
  assert [r["choice"] for r in doc["rows"]] == [pol.names[pol.choose(a, 1)] for a in (0.2, 0.9)]
  assert doc["rows"][0]["choice"] == "k=0" and doc["rows"][1]["choice"] == "k=4"
  # k = 0 priced as the engine runs a lazy drafter (one catch-up pass per P plain steps) by
  # default, eagerly with --lazy-slots 0: a plain step costs more, so its speedup is lower
  eager = adaptive.AdaptivePolicy.from_costs((0, 1, 2, 4), costs)
  # the prior: 0.5 without a measured α, else the calibrations' mean α, unless given
  assert float(pol.prior_alpha) == 0.5
  measured = {b: dataclasses.replace(costs, meta={**costs.meta, "alpha": a})
              for b, a in ((1, 0.8), (8, 0.6))}
  assert float(adaptive.AdaptivePolicy.from_costs((0, 1), measured).prior_alpha) == (
      pytest.approx(0.7))
  assert float(adaptive.AdaptivePolicy.from_costs((0, 1), measured, prior_alpha=0.2)
               .prior_alpha) == pytest.approx(0.2)
  assert doc["rows"][0]["speedup"] == pytest.approx(pol.predicted_speedup(0.2, 1, 0))
  assert main(["theory", "adaptive", "--calibration", str(path), "--menu", "0,1,2,4",
               "--alphas", "0.2", "--batches", "1", "--lazy-slots", "0", "--json"]) == 0
  row = json.loads(capsys.readouterr().out)["rows"][0]
  assert row["speedup"] == pytest.approx(eager.predicted_speedup(0.2, 1, eager.choose(0.2, 1)))
  assert row["speedup"] < doc["rows"][0]["speedup"]
  assert main(["theory", "adaptive", "--lazy-slots", "-1"]) == 2
  assert "--lazy-slots must be an int >= 0, got -1" in capsys.readouterr().err
  with pytest.raises(SystemExit) as exc:  # argparse refuses it
    main(["generate", "--k", "fast", "--repeats", "1"])
  assert exc.value.code == 2
  assert "'auto'" in capsys.readouterr().err


def test_first_candidate_rates_per_depth_price_chains_and_trees():
  """E[τ] with the first candidate's acceptance per depth: a chain of k accepts
  1 + Σ_i Π_{d<=i} a0_d; a rank-1 sibling at depth d is reached with (1 − a0_d)·a_1. Equal
  rates at every depth give back the single-α law."""
  pol = adaptive.AdaptivePolicy.create((0, 3, TREE), [1.0, 1.5, 1.6])
  assert (pol.width, pol.depths, pol.columns) == (2, 3, 5)
  a1, a, (d1, d2, d3) = 0.6, 0.5, (0.9, 0.2, 0.8)
  tau = np.asarray(pol.expected_tokens(jnp.asarray([[a, a1, d1, d2, d3]])))[0]
  assert tau[1] == pytest.approx(1 + d1 + d1 * d2 + d1 * d2 * d3, rel=1e-6)
  # TREE = branching((2, 1)): two depth-1 siblings, each with one child (rank 0, depth 2)
  first, second = d1, (1 - d1) * a1
  assert tau[2] == pytest.approx(1 + (first + second) * (1 + d2), rel=1e-6)
  flat = np.asarray(pol.expected_tokens(jnp.full((1, pol.columns), 0.7)))[0]
  assert flat[1] == pytest.approx(theory.expected_tokens(0.7, 3), rel=1e-6)


def test_depth_prior_from_the_calibration_moves_the_choice():
  """Where the second draft is rarely accepted once the first was (the embedded draft at
  T = 0 on prose: 0.91 then 0.24), a chain of 2 buys little over a chain of 1: with the
  depth profile the policy keeps k = 1 where a single α would pick k = 2."""
  from specjax.calibration import loop_costs as calibration
  ks, secs = (0, 1, 2), [1.0, 1.3, 1.45]
  pol = adaptive.AdaptivePolicy.create(ks, secs, prior_alpha=0.8)
  assert pol.names[pol.choose(0.8, 1)] == "k=2"
  assert pol.names[pol.choose(0.8, 1, depth_rates=[0.8, 0.2])] == "k=1"
  costs = calibration.LoopCosts.from_timings(
      1.0, [(trees.chain(1), 1.3), (trees.chain(2), 1.45)],
      meta={"batch": 1, "alpha": 0.8, "depth_alpha": [0.8, 0.2]})
  cal = adaptive.AdaptivePolicy.from_costs(ks, costs, cycles="measured")
  np.testing.assert_allclose(np.asarray(cal.prior_depth), [0.8, 0.2], rtol=1e-6)
  start = lambda p: int(p.pick(p.rates(*p.init_state(1)), jnp.asarray([True]), 1,  # noqa
                                jnp.asarray(0), jnp.asarray([64])))
  assert cal.names[start(cal)] == "k=1"
  # without a measured profile (or with prior_alpha given) every depth starts at α₀
  flat = adaptive.AdaptivePolicy.from_costs(
      ks, dataclasses.replace(costs, meta={"batch": 1, "alpha": 0.8}), cycles="measured")
  assert flat.names[start(flat)] == "k=2"
  given = adaptive.AdaptivePolicy.from_costs(ks, costs, cycles="measured", prior_alpha=0.8)
  np.testing.assert_allclose(np.asarray(given.prior_depth), [0.8, 0.8], rtol=1e-6)
  # a short profile repeats its last value; a bad one is refused with the value
  deep = adaptive.AdaptivePolicy.create((0, 4), [1.0, 1.9], prior_depth=[0.9, 0.3])
  np.testing.assert_allclose(np.asarray(deep.prior_depth), [0.9, 0.3, 0.3, 0.3], rtol=1e-6)
  with pytest.raises(ValueError, match=r"prior_depth must be probabilities in \[0, 1\]"):
    adaptive.AdaptivePolicy.create((0, 1), [1.0, 1.3], prior_depth=[0.5, 1.5])


def test_calibration_depth_alpha_pools_chains_by_depth():
  """depth_alpha: Σ accepted ÷ Σ tried per depth over every chain run and row."""
  from specjax.calibration import loop_costs as calibration
  k1 = {"depth_tried": np.asarray([[6], [4]]), "depth_accepted": np.asarray([[5], [3]])}
  k2 = {"depth_tried": np.asarray([[10, 8]]), "depth_accepted": np.asarray([[8, 2]])}
  assert calibration.depth_alpha([k1, k2]) == pytest.approx([16 / 20, 2 / 8])
  assert calibration.depth_alpha([]) == []


def test_cycle_observation_counts_ranks_and_first_candidates_per_depth():
  """One cycle of TREE = branching((2, 1)) per row: row 0 accepted the rank-1 sibling then
  its child (first candidate of depth 1 tried and rejected, depth 2's accepted); row 1
  accepted the rank-0 node and rejected its child."""
  pol = adaptive.AdaptivePolicy.create((0, 1, TREE), [1.0, 1.3, 1.6])
  # TREE's nodes: 0 root, 1 / 2 the depth-1 siblings (ranks 0 / 1), 3 / 4 their children
  assert list(TREE.ranks) == [0, 0, 1, 0, 0] and list(TREE.parents[1:]) == [0, 0, 1, 2]
  result = acceptance.TreeResult(
      n_accepted=jnp.asarray([2, 1]), next_token=jnp.asarray([0, 0]),
      path=jnp.asarray([[0, 2, 4], [0, 1, 1]]),
      depth_tried=jnp.asarray([[True, True], [True, True]]),
      rank_tried=jnp.asarray([[2, 1], [2, 0]]), rank_accepted=jnp.asarray([[1, 1], [1, 0]]))
  acc, tried = (np.asarray(x) for x in pol.cycle_observation(TREE, result))
  # columns: ranks 0, 1 | depths 1, 2
  np.testing.assert_array_equal(tried, [[2, 1, 1, 1], [2, 0, 1, 1]])
  np.testing.assert_array_equal(acc, [[1, 1, 0, 1], [1, 0, 1, 0]])


def test_theory_adaptive_prints_the_first_choice_from_the_calibrated_depth_profile(
    tmp_path, capsys):
  """`specjax theory adaptive --calibration` also says where a fresh request starts: the
  prior α₀ and the calibration's per-depth profile, and the shape the first cycle picks."""
  import json

  from specjax.calibration import loop_costs as calibration
  from specjax.cli import main

  costs = calibration.LoopCosts.from_timings(
      1.0, [(trees.chain(1), 1.3), (trees.chain(2), 1.45)],
      meta={"batch": 1, "temperature": 0.0, "alpha": 0.8, "depth_alpha": [0.8, 0.2]})
  path = tmp_path / "cal.json"
  path.write_text(json.dumps(costs.to_dict()))
  args = ["theory", "adaptive", "--calibration", str(path), "--menu", "0,1,2", "--alphas",
          "0.8", "--batches", "1"]
  assert main(args + ["--json"]) == 0
  doc = json.loads(capsys.readouterr().out)
  assert doc["prior"]["alpha"] == pytest.approx(0.8)
  assert doc["prior"]["depth_alpha"] == pytest.approx([0.8, 0.2])
  assert doc["rows"][0]["choice"] == "k=2"  # every depth at 0.8
  assert doc["first_choice"] == {"1": "k=1"}  # depth 2 at 0.2: a chain of 2 does not pay
  assert main(args) == 0
  assert "first candidate per depth [0.80, 0.20]: first choice batch 1: k=1" in (
      capsys.readouterr().out)


@pytest.mark.slow
def test_deeper_priors_follow_the_rows_own_first_draft_rate():
  """A row's prior at depths >= 2 is the calibrated profile shifted in log-odds by the row's
  own depth-1 evidence: a row that rejects its first drafts is not credited with the deep
  acceptance that rows which loop showed; with no evidence it is the profile itself."""
  pol = adaptive.AdaptivePolicy.create((0, 3), [1.0, 1.8], prior_alpha=0.7,
                                       prior_depth=[0.7, 0.4, 0.9])
  r, w = pol.width, float(pol.prior_weight)
  acc, tried = (np.zeros((3, pol.columns), np.float32) for _ in range(2))
  tried[:, r] = 40.0  # depth 1 tried 40 times by every row; deeper depths never observed
  acc[:, r] = [4.0, 28.0, 40.0]  # rates: low, exactly the profile's 0.7, high
  rates = np.asarray(pol.rates(jnp.asarray(acc), jnp.asarray(tried)))
  deep = rates[:, r + 1:]
  np.testing.assert_allclose(deep[1], [0.4, 0.9], rtol=1e-5)
  assert np.all(deep[0] < deep[1]) and np.all(deep[2] > deep[1])
  first = rates[:, r]
  np.testing.assert_allclose(first, (acc[:, r] + w * 0.7) / (40 + w), rtol=1e-5)
  # log-odds shift: the same for every depth
  logit = lambda p: np.log(p) - np.log1p(-p)  # noqa: E731
  np.testing.assert_allclose(logit(deep[0]) - logit(np.asarray([0.4, 0.9])),
                             logit(first[0]) - logit(0.7), rtol=1e-4)
  # observations at a depth still move its rate from the row's prior
  acc2, tried2 = acc.copy(), tried.copy()
  tried2[0, r + 2], acc2[0, r + 2] = 30.0, 30.0
  assert float(pol.rates(jnp.asarray(acc2), jnp.asarray(tried2))[0, r + 2]) > deep[0, 1] + 0.3
