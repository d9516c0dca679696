"""The speculation plan (specjax/engine/plan.py): one validated entry into speculation. `plan.of`
builds a plan from the host API's keywords (model-free checks), `plan.prepare` does every
check that needs the models, once, and hands a loop its arguments: what the host API runs
and what the studies that call the loop themselves (vmapped, planted bugs) run."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from specjax.engine.adaptive import policy as adaptive
from specjax.engine import decoding, loop, plan
from specjax.verify import trees
from specjax_testing import RAGGED, TINY, model, perturbed

BUDGET = 10


@pytest.fixture(scope="module")
def pair():
  target = model(TINY["gpt2"])
  return target, perturbed(target, seed=1, noise=0.25)


def test_of_builds_each_kind_of_plan():
  chain = plan.of(k=3)
  assert not chain.adaptive and chain.tree == trees.chain(3) and chain.k == 3
  tree = plan.of(tree=trees.branching((2, 1)))
  assert tree.k == 4 and tree.shapes() == [trees.branching((2, 1))]
  dynamic = plan.of(tree=trees.DynamicTree(6, 3, 2))
  assert dynamic.k == 6
  auto = plan.of(k="auto")
  assert auto.adaptive and auto.auto and auto.policy is None
  policy = adaptive.AdaptivePolicy.create((0, 2), [1.0, 1.3])
  adaptive_plan = plan.of(policy=policy)
  assert adaptive_plan.adaptive and adaptive_plan.k == 2
  assert adaptive_plan.shapes() == [trees.chain(1), trees.chain(2)]  # k = 0 drafts a chain(1)
  assert plan.of(plan=chain) is chain


@pytest.mark.parametrize("kwargs, match", [
    (dict(), "exactly one of k .* or tree .*got neither"),
    (dict(k=2, tree=trees.chain(2)), "got both k=2"),
    (dict(k=0), "k must be an int >= 1, got 0"),
    (dict(k=True), "k must be an int >= 1, got True"),
    (dict(k="fast"), "k must be an int >= 1 or 'auto', got 'fast'"),
    (dict(tree=(2, 1)), "tree must be a trees.TreeSpec or trees.DynamicTree"),
    (dict(k="auto", tree=trees.chain(2)), "pass neither k='auto' nor tree="),
    (dict(policy="adaptive"), "policy must be an adaptive.AdaptivePolicy"),
    (dict(plan="chain"), "plan must be a plan.SpeculationPlan"),
    (dict(plan=plan.of(k=2), k=2), "plan= is the whole speculation plan"),
])
def test_of_refuses_bad_keywords_naming_them(kwargs, match):
  with pytest.raises(ValueError, match=match):
    plan.of(**kwargs)


def test_prepare_hands_the_loop_what_the_host_api_runs(pair):
  """A study that calls the loop itself with `prepare`'s arguments gets the host API's
  tokens (batch 6, ragged, T = 0 and a seed); a refused run traces nothing."""
  target, draft = pair
  spec = plan.of(k=3)
  run = plan.prepare(target, draft, RAGGED, spec, max_new_tokens=BUDGET, eos_id=[5, 9])
  assert run.batch.prompt_BP.shape[0] == len(RAGGED) and run.loop_kwargs()["tree"] == spec.tree
  state = jax.block_until_ready(loop.speculative_jit(*run.loop_args(), **run.loop_kwargs()))
  host = decoding.speculative_generate(target, draft, RAGGED, plan=spec, max_new_tokens=BUDGET,
                                       eos_id=[5, 9])
  lengths = np.asarray(state.length)
  tokens = np.asarray(state.tokens)
  direct = [tokens[b, p:n + 1].tolist() for b, (p, n) in
            enumerate(zip(run.batch.prompt_len_B, lengths))]
  assert direct == host.tokens
  assert host.tokens == decoding.speculative_generate(target, draft, RAGGED, k=3,
                                                      max_new_tokens=BUDGET,
                                                      eos_id=[5, 9]).tokens
  before = loop.TRACE_COUNTS.copy()
  for bad, match in [(dict(max_new_tokens=500), "exceeds the cache/context length"),
                     (dict(max_new_tokens=BUDGET, eos_id=[61]), r"eos_id\[0\]")]:
    with pytest.raises(ValueError, match=match):
      plan.prepare(target, draft, RAGGED, spec, **bad)
  with pytest.raises(ValueError, match="plan must be a plan.SpeculationPlan"):
    plan.prepare(target, draft, RAGGED, 3, max_new_tokens=BUDGET)
  assert loop.TRACE_COUNTS == before


def test_prepare_resolves_auto_to_the_pairs_default_policy(pair):
  target, draft = pair
  run = plan.prepare(target, draft, RAGGED[:2], plan.of(k="auto"), max_new_tokens=BUDGET)
  assert run.plan.adaptive and not run.plan.auto
  assert run.plan.policy.names == decoding.default_policy(target, draft).names
  assert run.loop_args()[2] is run.plan.policy and "tree" not in run.loop_kwargs()
