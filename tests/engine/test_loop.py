"""The compiled loops' own contract (specjax/engine/loop.py), called directly as the studies
call them: the final `LoopState` (tokens, lengths, done rows), the `Stats` counters and
their identities, and one compile per static configuration (runtime values, sampler,
budgets, EOS ids, seed, drafter weights, reuse the traced loop; a static one does not,
the negative control of the trace counter)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.engine import batching, loop, plan
from specjax.verify import sampling
from specjax_testing import RAGGED, TINY, model, perturbed

K, BUDGET = 3, 9


@pytest.fixture(scope="module")
def pair():
  target = model(TINY["gpt2"])
  return target, perturbed(target, seed=1, noise=0.25)


def _run(target, draft, **kw):
  return plan.prepare(target, draft, RAGGED, plan.of(k=K), max_new_tokens=BUDGET, **kw)


def _plain(run, **over):
  b = run.batch
  args = dict(budget_B=b.budget_B, eos=run.eos, sampler=run.sampler, key=run.key)
  args.update(over)
  return loop.generate_jit(run.target, b.prompt_BP, b.prompt_len_B, args["budget_B"],
                           args["eos"], args["sampler"], args["key"], cache_len=b.cache_len)


def _spec(run, drafter=None, cache_len=None, **over):
  args = list(run.loop_args())
  names = ["budget_B", "eos", "sampler", "key"]
  for name, value in over.items():
    args[4 + names.index(name)] = value  # after target, drafter, prompt_BP, prompt_len_B
  if drafter is not None:
    args[1] = drafter
  kwargs = run.loop_kwargs()
  if cache_len is not None:
    kwargs["cache_len"] = cache_len
  return loop.speculative_jit(*args, **kwargs)


def test_final_state_and_stats_of_a_greedy_run(pair):
  run = _run(*pair)
  state, plain = jax.block_until_ready((_spec(run), _plain(run)))
  prompt_len = np.asarray(run.batch.prompt_len_B)
  length, tokens = np.asarray(state.length), np.asarray(state.tokens)
  emitted = length + 1 - prompt_len
  assert np.asarray(state.done).all() and int(state.nonfinite) == 0
  assert (emitted == BUDGET).all()  # no EOS: every row runs to its budget
  for b, p in enumerate(RAGGED):
    assert tokens[b, :len(p)].tolist() == list(p)
  # greedy identity at the loop level: the same tokens as the plain loop, row by row
  assert (np.asarray(plain.length) == length).all() and plain.stats is None
  for b in range(len(RAGGED)):
    assert tokens[b, :length[b] + 1].tolist() == np.asarray(plain.tokens)[b, :length[b] + 1
                                                                          ].tolist()
  s = jax.tree.map(np.asarray, state.stats)
  assert (s.hist.sum(1) == s.cycles).all()
  assert (s.hist @ np.arange(K + 1) == s.accepted).all()
  assert (s.drafted == K * s.cycles).all() and (s.verified == K * s.cycles).all()
  for b in range(len(RAGGED)):
    log = s.cycle_log[b]
    assert (log[:s.cycles[b]] >= 0).all() and (log[s.cycles[b]:] == -1).all()
    assert log[:s.cycles[b]].sum() == s.accepted[b]
  # each cycle emits its accepted path and one more token, the last one cut by the budget
  assert (emitted - 1 <= s.accepted + s.cycles).all()
  assert (emitted - 1 > s.accepted + s.cycles - (K + 1)).all()
  assert (s.accepted < s.drafted).any()  # a perturbed draft: some drafts are rejected


def test_runtime_values_reuse_the_compiled_loops(pair):
  target, draft = pair
  run = _run(target, draft)
  jax.block_until_ready((_spec(run), _plain(run)))
  before = loop.TRACE_COUNTS.copy()
  changed = dict(budget_B=jnp.minimum(run.batch.budget_B, 4),
                 eos=batching.eos_ids([3, 7], TINY["gpt2"].vocab_size),
                 sampler=sampling.make_sampler(0.7, top_k=5, top_p=0.9),
                 key=jax.random.key(123))
  other = _run(target, perturbed(target, seed=2, noise=0.5)).drafter  # other weights
  state = jax.block_until_ready(_spec(run, drafter=other, **changed))
  jax.block_until_ready(_plain(run, **changed))
  assert loop.TRACE_COUNTS == before, "a runtime value recompiled a loop"
  emitted = np.asarray(state.length) + 1 - np.asarray(run.batch.prompt_len_B)
  assert (emitted <= 4).all()  # the new budgets were read
  # negative control: a static argument (the cache length) does compile again, once
  jax.block_until_ready(_spec(run, cache_len=run.batch.cache_len * 2))
  assert loop.TRACE_COUNTS["speculative"] == before["speculative"] + 1
