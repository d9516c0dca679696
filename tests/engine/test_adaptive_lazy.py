"""Lazy drafter catch-up in the adaptive loop: k = 0 steps leave a lazy drafter behind (at
most P tokens) and one catch-up pass brings it up to date before it drafts again.

Exactness: greedy identity with plain decoding on a ragged batch with k = 0 runs shorter and
longer than P between speculative entries (the overflow path included); self-drafting at
T = 0 accepts every draft only if each catch-up leaves the draft cache exactly right; forced
k = 0 equals plain decoding token for token (T = 0 and 1) and runs no catch-up pass except
at overflow; no recompilation when the schedule changes. The χ² joint-law tests with
alternating shapes (and their planted-bug control) are in test_adaptive.py and run with the
lazy path. One compiled loop per drafter kind, tiny models.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.engine.adaptive import policy as adaptive, loop as adaptive_loop
from specjax.engine import decoding, loop
from specjax.verify import sampling, trees
from specjax.models.lm import LM
from specjax.drafters.eagle import EagleDrafter
from specjax.drafters.lookup import LookupDrafter
from specjax.drafters.medusa import MedusaDrafter, MedusaState
from specjax.drafters.model import ModelDrafter
from specjax.drafters.base import Context
from specjax_testing import RAGGED, TINY, FeatureProbe, model, perturbed

TREE = trees.branching((2, 1))
MENU = (0, 2, TREE)
P = 3  # lazy catch-up bound of these tests (static)
BUDGET = 20
# k = 0 runs of 5, 1, 2, 7 and 1 steps between speculative entries (P = 3: 5 and 7 overflow)
SCHEDULE = [0, 0, 0, 0, 0, 1, 0, 2, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 2, 0]


@pytest.fixture(scope="module")
def pair():
  target = model(TINY["llama"], seed=0, logit_scale=4.0)
  return target, perturbed(target, seed=1, noise=0.25)


def _medusa_params(cfg, heads: int = 2, seed: int = 1) -> dict:
  kw, kb = jax.random.split(jax.random.key(seed))
  d = cfg.d_model
  return {"w": 0.5 * jax.random.normal(kw, (heads, d, d)) / np.sqrt(d),
          "b": 0.5 * jax.random.normal(kb, (heads, d))}


def _run(target, drafter, forced, temperature=0.0, seed=0):
  """The adaptive loop with lazy catch-up (P slots) on the ragged batch; returns (new
  tokens per row, final state)."""
  slots = max(max(e.n_nodes, drafter.slots_needed(e)) for e in (trees.chain(1), *adaptive.menu(MENU)[1:]))
  batch = decoding.prepare_batch(RAGGED, vocab_size=target.config.vocab_size,
                                 max_len=target.config.max_len, max_new_tokens=BUDGET,
                                 slots=slots)
  policy = adaptive.AdaptivePolicy.create(MENU, [1.0, 1.2, 1.4], forced=forced)
  state = adaptive_loop.adaptive_jit(LM.of(target), drafter, policy, batch.prompt_BP,
                                     batch.prompt_len_B, batch.budget_B, jnp.asarray(-1),
                                     sampling.make_sampler(temperature), jax.random.key(seed),
                                     cache_len=batch.cache_len, lazy_slots=P)
  toks = np.asarray(state.tokens)
  lens = np.asarray(batch.prompt_len_B)
  return [toks[b, lens[b]:lens[b] + BUDGET].tolist() for b in range(len(RAGGED))], state


def _plain(target, temperature=0.0, seed=0):
  return decoding.generate(target, RAGGED, max_new_tokens=BUDGET,
                           sampler=sampling.make_sampler(temperature), seed=seed).tokens


def test_which_drafters_declare_lazy_catch_up(pair):
  """A separate model, lookup, EAGLE and Medusa heads catch up lazily (the heads from the
  features the loop keeps); a feature reader without `catch_up` (the probe) stays eager."""
  target, draft = pair
  assert ModelDrafter.of(draft).lazy_catch_up
  assert LookupDrafter().lazy_catch_up
  assert EagleDrafter.of(target, seed=3).lazy_catch_up
  assert MedusaDrafter.of(target, _medusa_params(target.config)).lazy_catch_up
  assert not FeatureProbe(lm=LM.of(draft), deterministic=True).lazy_catch_up


@pytest.mark.slow
def test_lazy_greedy_identity_self_drafting_and_no_recompile(pair):
  """Ragged batch, k = 0 runs of 1 to 7 steps (P = 3) between k = 2 and tree cycles: plain
  greedy tokens; with the target as its own draft every draft is accepted (each catch-up
  left the draft cache right); another schedule reuses the compiled loop."""
  target, draft = pair
  plain = _plain(target)
  tokens, state = _run(target, ModelDrafter.of(draft, deterministic=True), SCHEDULE)
  assert tokens == plain
  choices = np.asarray(state.adapt.choices)
  n = int(np.sum(choices >= 0))
  assert choices[:n].tolist() == [SCHEDULE[i % len(SCHEDULE)] for i in range(n)]
  assert int(state.adapt.catch_ups) > 0
  assert np.all(np.asarray(state.adapt.behind) <= P)
  accepted, drafted = int(state.stats.accepted.sum()), int(state.stats.drafted.sum())
  assert 0 < accepted < drafted

  before = loop.TRACE_COUNTS["adaptive"]
  shifted = SCHEDULE[7:] + SCHEDULE[:7]
  tokens, state = _run(target, ModelDrafter.of(target, deterministic=True), shifted)
  assert tokens == plain
  assert int(state.stats.cycles.min()) > 0
  np.testing.assert_array_equal(  # every cycle accepted a node at each depth it tried
      state.stats.depth_accepted, state.stats.depth_tried,
      err_msg="a self-draft was rejected: a lazy catch-up left the draft cache wrong")
  assert loop.TRACE_COUNTS["adaptive"] == before, "a new forced schedule recompiled"


@pytest.mark.slow  # compile-bound (5-18 s): the fast tier's 3 minutes
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_lazy_forced_plain_equals_plain_decoding_in_runs_and_catches_up_only_at_overflow(
    pair, temperature):
  target, draft = pair
  tokens, state = _run(target, ModelDrafter.of(draft, deterministic=True), [0] * len(SCHEDULE),
                       temperature, seed=5)
  assert tokens == _plain(target, temperature, seed=5)
  assert int(state.stats.cycles.sum()) == 0
  np.testing.assert_array_equal(state.adapt.plain_steps, BUDGET - 1)  # one token each
  # a k = 0 cycle is a run of up to P plain steps; a catch-up pass only when some row is
  # already P behind, i.e. before every run but the first
  cycles = int(np.sum(np.asarray(state.adapt.choices) >= 0))
  assert cycles == -(-(BUDGET - 1) // P)
  assert int(state.adapt.catch_ups) == cycles - 1


@pytest.mark.slow
def test_a_run_of_plain_steps_ends_in_a_choice_informed_by_its_catch_up(pair):
  """A prior that prices speculation out (α₀ = 0) starts with a k = 0 run of P steps; the
  catch-up that ends it observes a self-draft accepting every skipped token, and the very
  next choice is speculative (observing after choosing would repeat k = 0 once more, and
  with a short budget for ever)."""
  target, _ = pair
  slots = max(e.n_nodes for e in adaptive.menu(MENU)[1:]) + 1
  batch = decoding.prepare_batch(RAGGED, vocab_size=target.config.vocab_size,
                                 max_len=target.config.max_len, max_new_tokens=BUDGET,
                                 slots=slots)
  policy = adaptive.AdaptivePolicy.create(MENU, [1.0, 1.2, 1.4], prior_alpha=0.0)
  state = adaptive_loop.adaptive_jit(LM.of(target), ModelDrafter.of(target, deterministic=True),
                                     policy, batch.prompt_BP, batch.prompt_len_B, batch.budget_B,
                                     jnp.asarray(-1), sampling.make_sampler(0.0),
                                     jax.random.key(0), cache_len=batch.cache_len, lazy_slots=P)
  choices = np.asarray(state.adapt.choices)
  assert choices[0] == 0, "the prior α₀ = 0 should choose k = 0 first"
  assert choices[1] != 0, f"the catch-up's observations came too late: {choices[:4]}"
  toks, lens = np.asarray(state.tokens), np.asarray(batch.prompt_len_B)
  assert [toks[b, lens[b]:lens[b] + BUDGET].tolist() for b in range(len(RAGGED))] == (
      _plain(target))


@pytest.mark.slow
def test_lookup_drafter_lazy_greedy_identity(pair):
  """The lookup drafter (stateless) through the same schedule: plain greedy tokens, and its
  catch-up guesses feed the policy's estimate (the acceptance counts move)."""
  target, _ = pair
  tokens, state = _run(target, LookupDrafter(), SCHEDULE)
  assert tokens == _plain(target)
  assert int(state.adapt.catch_ups) > 0
  assert float(np.asarray(state.adapt.tried).sum()) > 0


def test_policy_prices_a_lazy_plain_step_and_refuses_bad_lazy_slots(pair):
  """With lazy catch-up a k = 0 step pays the catch-up pass once every P steps."""
  _, draft = pair
  eager = adaptive.AdaptivePolicy.from_model((0, 1), c=0.4)
  lazy = adaptive.AdaptivePolicy.from_model((0, 1), c=0.4, lazy_slots=8)
  assert float(eager.seconds[0, 0]) == pytest.approx(1.4)
  assert float(lazy.seconds[0, 0]) == pytest.approx(1.05)
  assert decoding.lazy_slots_of(ModelDrafter.of(draft)) == loop.LAZY_SLOTS
  assert decoding.lazy_slots_of(FeatureProbe(lm=LM.of(draft))) == 0
  for bad in (-1, 2.5, True):
    with pytest.raises(ValueError, match="lazy_slots"):
      adaptive.AdaptivePolicy.from_model((0, 1), c=0.4, lazy_slots=bad)


def test_eagle_catch_up_leaves_the_state_eager_plain_steps_leave(pair):
  """From the same synced state, a catch-up over the features of m skipped positions (m = 4
  and 0 on ragged rows: two blocks of the head's D + 1 = 3 rows, and none) leaves the head
  drafting what it drafts after m eager k = 0 cycles (each a chain(1) proposal and a commit
  of the one-token pass's features, as the loop's eager branch does), and its guesses are
  the eager cycles' one-token drafts."""
  target, _ = pair
  cfg = target.config
  drafter = EagleDrafter.of(target, seed=3)
  lm = LM.of(target)
  tree, width, cache_len = trees.chain(2), 5, 64
  rng = np.random.default_rng(0)
  plen = np.array([6, 9], np.int32)
  behind = np.array([4, 0], np.int32)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, cache_len)), jnp.int32)
  prompt = tokens[:, :int(plen.max())]
  pos = jnp.broadcast_to(jnp.arange(cache_len, dtype=jnp.int32), (2, cache_len))
  feats = lm(tokens, pos, capture=drafter.feature_layers)[3]  # [B, S, C, D]: every position
  state0 = drafter.init(prompt, jnp.asarray(plen), cache_len, tree,
                        features=feats[:, :prompt.shape[1]])
  sampler = sampling.make_sampler(1.0)
  key = jax.random.key(7)
  rows = jnp.arange(2)

  eager, drafts = state0, []
  for i in range(int(behind.max())):
    length = jnp.asarray(plen + np.minimum(i, behind), jnp.int32)
    proposal, eager = drafter.propose(eager, Context(tokens, length), trees.chain(1), sampler,
                                      key)
    drafts.append(np.asarray(jnp.argmax(proposal.q[:, 0], axis=-1)))
    after = Context(tokens, length + jnp.asarray(i < behind, jnp.int32))
    f = feats[rows, length][:, None]
    eager = drafter.commit(eager, after, trees.chain(1), jnp.zeros((2, 2), jnp.int32),
                           jnp.zeros((2,), jnp.int32), features=jnp.concatenate([f, f], 1))
  ctx = Context(tokens, jnp.asarray(plen + behind, jnp.int32))
  j = np.minimum(plen[:, None] + np.arange(width)[None], cache_len - 1)
  skipped = feats[rows[:, None], jnp.asarray(j)]  # positions L - behind + j
  lazy, guess = drafter.catch_up(state0, ctx, jnp.asarray(behind), width, sampler,
                                 features=skipped)
  np.testing.assert_array_equal(lazy.start, ctx.length - 1)
  p_eager, _ = drafter.propose(eager, ctx, tree, sampler, key)
  p_lazy, _ = drafter.propose(lazy, ctx, tree, sampler, key)
  np.testing.assert_allclose(p_lazy.q, p_eager.q, atol=1e-5)
  np.testing.assert_array_equal(p_lazy.tokens, p_eager.tokens)
  g = np.asarray(jnp.argmax(guess.q, axis=-1))
  assert g[0, :4].tolist() == [int(d[0]) for d in drafts]
  assert bool(np.all(np.asarray(guess.finite)))


def test_medusa_catch_up_keeps_the_last_features_and_guesses_with_head_0(pair):
  """Medusa's catch-up over m skipped positions (m = 3 and 0, ragged) keeps position
  L - 1's features, as m one-token commits do, and guesses each skipped token with head 0
  from the state before it: the one-token drafts of m eager k = 0 steps."""
  target, _ = pair
  cfg = target.config
  drafter = MedusaDrafter.of(target, _medusa_params(cfg))
  lm = LM.of(target)
  rng = np.random.default_rng(2)
  plen, behind, width, size = np.array([5, 8], np.int32), np.array([3, 0], np.int32), 4, 32
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, size)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), (2, size))
  hidden = lm(tokens, pos, capture=drafter.feature_layers)[3]  # [B, S, 1, D]
  rows = jnp.arange(2)
  state = MedusaState(hidden=hidden[rows, plen - 1, 0], length=jnp.asarray(plen))
  eager, drafts = state, []
  for i in range(int(behind.max())):
    length = jnp.asarray(plen + np.minimum(i, behind), jnp.int32)
    proposal, eager = drafter.propose(eager, Context(tokens, length), trees.chain(1), None,
                                      None)
    drafts.append(np.asarray(proposal.tokens[:, 0]))
    after = Context(tokens, length + jnp.asarray(i < behind, jnp.int32))
    f = hidden[rows, length][:, None]
    eager = drafter.commit(eager, after, trees.chain(1), jnp.zeros((2, 2), jnp.int32),
                           jnp.zeros((2,), jnp.int32), features=jnp.concatenate([f, f], 1))
  j = np.minimum(plen[:, None] + np.arange(width)[None], size - 1)
  lazy, guess = drafter.catch_up(state, Context(tokens, jnp.asarray(plen + behind)),
                                 jnp.asarray(behind), width, None,
                                 features=hidden[rows[:, None], jnp.asarray(j)])
  np.testing.assert_allclose(lazy.hidden, eager.hidden, rtol=0, atol=0)
  np.testing.assert_array_equal(lazy.length, eager.length)
  assert np.asarray(guess.tokens)[0, :3].tolist() == [int(d[0]) for d in drafts]
