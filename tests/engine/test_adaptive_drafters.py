"""Every drafter kind under adaptive speculation: a menu of a plain step, chains of two depths
and a tree, the policy forced through all of them in turn.

- Greedy identity: the ragged batch's tokens equal plain greedy decoding's for the separate
  model, the target itself, the controlled-α oracle, prompt lookup, layer-skip (sharing the
  target's cache), Medusa heads and the EAGLE head (whose state must hold every entry's
  depth: `trees.cover`).
- The χ² joint law of the first three tokens at T = 1 (40,000 rows against the enumerated
  target law, false-alarm rate 1e-3 each) with the shapes alternating tree, plain, k = 1,
  k = 2, for every drafter that can draft at T > 0; negative control: an EAGLE head that
  reports a uniform law for the candidates it samples from its own law is rejected.

One compiled loop per drafter kind and test; tiny models only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from specjax.engine.adaptive import policy as adaptive, loop as adaptive_loop
from specjax.engine import decoding
from specjax.verify import sampling, trees
from specjax.models.lm import LM
from specjax.drafters.eagle import EagleDrafter
from specjax.drafters.layer_skip import LayerSkipDrafter
from specjax.drafters.lookup import LookupDrafter
from specjax.drafters.medusa import MedusaDrafter
from specjax.drafters.model import ModelDrafter
from specjax.drafters.oracle import OracleDrafter
from specjax_testing import (FALSE_ALARM, JOINT_ROWS, PROMPT, TINY, VOCAB, assert_greedy_identity,
                             exact_joint, joint_pvalue, joint_target, model, perturbed)

TREE = trees.branching((2, 1))
MENU = (0, 1, 3, TREE)
FORCED = [1, 3, 0, 2]  # k = 1, tree, plain, k = 3, ...
BUDGET = 20


def _medusa_heads(cfg, heads: int, seed: int) -> dict:
  kw, kb = jax.random.split(jax.random.key(seed))
  d = cfg.d_model
  return {"w": 0.5 * jax.random.normal(kw, (heads, d, d)) / np.sqrt(d),
          "b": 0.5 * jax.random.normal(kb, (heads, d))}


def _drafters(target, draft) -> dict:
  """Every drafter kind, built for `target` (draft: a separate draft model of it)."""
  return {
      "model": ModelDrafter.of(draft),
      "self": ModelDrafter.of(target),
      "oracle": OracleDrafter.of(target, 0.6),
      "lookup": LookupDrafter(),
      "layer-skip": LayerSkipDrafter.of(target, 1),
      "medusa": MedusaDrafter.of(target, _medusa_heads(target.config, 3, seed=1)),
      "eagle": EagleDrafter.of(target, seed=3),
      "eagle-topk": EagleDrafter.of(target, seed=3, deterministic=True),
  }


KINDS = ["model", "self", "oracle", "lookup", "layer-skip", "medusa", "eagle", "eagle-topk"]


@pytest.fixture(scope="module")
def pair():
  target = model(TINY["llama"], seed=0, logit_scale=4.0)
  return target, perturbed(target, seed=1, noise=0.25)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_every_drafter_is_greedy_identical_under_every_menu_entry(pair, kind):
  """Ragged batch, budgets and an EOS cutting cycles short: plain greedy tokens, with every
  menu entry (plain, k = 1, k = 3, a (2, 1) tree) run in turn."""
  target, draft = pair
  drafter = _drafters(target, draft)[kind]
  policy = adaptive.AdaptivePolicy.create(MENU, [1.0, 1.2, 1.5, 1.6], forced=FORCED)
  run, full = assert_greedy_identity(target, drafter, None, BUDGET, policy=policy,
                                     mixed_alpha=False)
  # a lazy drafter's plain step is a run that lasts until a row finishes: the cut budgets
  # of `run` bring it back to the speculative entries
  used = set(np.asarray(full.choices).tolist()) | set(np.asarray(run.choices).tolist())
  assert used == {0, 1, 2, 3}, f"every menu entry should have run, ran {sorted(used)}"
  if kind == "self":  # every cycle accepts its whole depth: 1, 2 (tree) or 3 drafts
    hist = full.summary().histogram
    assert hist[0] == 0, f"self-drafting rejected a draft at T = 0: {hist}"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle", "medusa", "layer-skip", "lookup", "model"])
def test_k_auto_through_the_default_policy(pair, kind):
  """`k='auto'` with the default policy (its default menu of chains) equals plain greedy
  decoding (the reported crash: EAGLE's state sized for one entry received another entry's
  path)."""
  target, draft = pair
  drafter = _drafters(target, draft)[kind]
  run = decoding.speculative_generate(target, drafter, [[1, 2, 3]], k="auto", max_new_tokens=8)
  assert run.tokens == decoding.generate(target, [[1, 2, 3]], max_new_tokens=8).tokens


# ----------------------------------------------------------------------------- the joint law


JOINT_MENU = (0, 1, 2, TREE)
JOINT_FORCED = [3, 0, 1, 2]  # tree (up to 3 tokens), plain, k = 1, k = 2
STOCHASTIC = ["model", "oracle", "layer-skip", "eagle", "eagle-topk", "lookup", "medusa"]


@struct.dataclass
class _ReportsUniformQ(EagleDrafter):
  """Planted bug: the EAGLE head samples its candidates from its own law but reports a
  uniform law to the acceptance rule (a separate static field keeps its program apart)."""

  planted: bool = struct.field(pytree_node=False, default=True)

  def propose(self, state, ctx, tree, sampler, key):
    proposal, state = super().propose(state, ctx, tree, sampler, key)
    if proposal.q is not None:
      proposal = proposal.replace(q=jnp.full_like(proposal.q, 1.0 / proposal.q.shape[-1]))
    return proposal, state


def _joint_first_three(target, drafter, seed: int) -> np.ndarray:
  """The first three tokens of JOINT_ROWS rows of the adaptive loop forced through
  JOINT_FORCED at T = 1."""
  policy = adaptive.AdaptivePolicy.create(JOINT_MENU, [1.0, 1.1, 1.2, 1.3],
                                          forced=JOINT_FORCED)
  shapes = [trees.chain(1)] + [e for e in policy.menu if e is not None]
  slots = max(max(e.n_nodes, drafter.slots_needed(e)) for e in shapes)
  batch = decoding.prepare_batch([PROMPT] * JOINT_ROWS, vocab_size=VOCAB, max_len=32,
                                 max_new_tokens=3, slots=slots)
  state = adaptive_loop.adaptive_jit(LM.of(target), drafter, policy, batch.prompt_BP,
                                     batch.prompt_len_B, batch.budget_B, jnp.asarray(-1),
                                     sampling.make_sampler(1.0), jax.random.key(seed),
                                     cache_len=batch.cache_len)
  n = len(PROMPT)
  return np.asarray(state.tokens)[:, n:n + 3]


@pytest.fixture(scope="module")
def joint_pair():
  target = joint_target()
  return target, perturbed(target, seed=4, noise=0.5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", STOCHASTIC)
def test_every_drafter_keeps_the_joint_law_under_alternating_shapes(joint_pair, kind):
  target, draft = joint_pair
  drafter = _drafters(target, draft)[kind]
  tokens = _joint_first_three(target, drafter, seed=21)
  exact = exact_joint(target, PROMPT, sampling.make_sampler(1.0))
  assert joint_pvalue(tokens, exact) > FALSE_ALARM


@pytest.mark.slow
def test_joint_law_test_catches_a_misreported_eagle_law(joint_pair):
  """Negative control: the same test rejects an EAGLE head that misreports q."""
  target, _ = joint_pair
  drafter = _ReportsUniformQ(**{f: getattr(EagleDrafter.of(target, seed=3), f)
                                for f in ("head", "target", "layers", "deterministic",
                                          "vocab", "lm", "stop_below")})
  tokens = _joint_first_three(target, drafter, seed=21)
  exact = exact_joint(target, PROMPT, sampling.make_sampler(1.0))
  assert joint_pvalue(tokens, exact) < FALSE_ALARM
