"""Layer-skip self-speculation: shared weights, the truncated forward, greedy identity with
plain decoding (chain, static and dynamic trees), the joint law at T > 0 with top-k / top-p
(with a planted-bug negative control), the CLI, bad input.

The χ² tests use a false-alarm rate of 1e-3 and fixed seeds (deterministic suite); the
negative control shows the same test rejecting a drafter that reports the wrong q.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from specjax.engine.adaptive import policy as adaptive
from specjax.engine import decoding
from specjax.verify import sampling, trees
from specjax.cli import main
from specjax.drafters import LayerSkipDrafter
from specjax.models.lm import LM
from specjax.drafters.base import Context
from specjax.models import cache as kv
from specjax_testing import TINY, model
from specjax_testing import FALSE_ALARM, PROMPT, exact_joint, first_three, joint_pvalue
from specjax_testing import joint_target as _joint_target

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12], [7], [9, 8]]


@pytest.fixture(scope="module")
def target():
  # mix=3: the first layer predicts the second's output often, not always (0 < α < 1).
  return model(TINY["llama"], logit_scale=4.0, mix=3.0)


def test_draft_shares_the_targets_arrays_and_runs_its_first_layers(target):
  drafter = LayerSkipDrafter.of(target, 1)
  assert drafter.layers == 1 and drafter.config.n_layers == 1
  full = LM.of(target).params
  view = drafter.lm.params
  assert view["embed"][...] is full["embed"][...]  # the same buffer, not a copy
  q_kernel = lambda params: params["blocks"][0]["attn"]["q"]["kernel"][...]
  assert q_kernel(view) is q_kernel(full)
  assert view["lm_head"]["kernel"][...] is full["lm_head"]["kernel"][...]
  assert len(jax.tree.leaves(view)) < len(jax.tree.leaves(full))  # block 1 is not carried
  # The truncated forward, written out from the target module's own parts.
  tokens = jnp.asarray([[3, 1, 4, 1, 5]])
  pos = jnp.arange(5)[None]
  module = LM.of(target).module()
  x = jnp.take(module.embed[...], tokens, axis=0).astype(jnp.float32)
  x, _ = module.blocks[0](x, pos, None, 0, None)
  expected = module.logits(module.final_norm(x))
  got, _, _ = drafter.lm(tokens, pos)
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("share_cache", [True, False], ids=["target-cache", "own-cache"])
@pytest.mark.parametrize("shape", [dict(k=3), dict(tree=trees.branching((2, 2, 1))),
                                   dict(tree=trees.DynamicTree(budget=6, depth=3, width=2))],
                         ids=["chain", "static-tree", "dynamic-tree"])
def test_ragged_batch_greedy_output_is_identical_to_plain_decoding(target, shape, share_cache):
  plain = decoding.generate(target, PROMPTS, max_new_tokens=16)
  drafter = LayerSkipDrafter.of(target, 1, share_cache=share_cache)
  assert drafter.shares_target_cache == share_cache
  run = decoding.speculative_generate(target, drafter, PROMPTS, max_new_tokens=16, **shape)
  assert run.tokens == plain.tokens
  assert 1.0 < run.summary().tau < 1.0 + run.tree.max_depth  # some, not all, accepted


@pytest.mark.parametrize("tree", [trees.chain(3), trees.branching((2, 2, 1))],
                         ids=["chain", "static-tree"])
def test_drafting_in_the_targets_cache_writes_only_its_layers_at_slots_from_L(target, tree):
  """The shared-cache draft writes the target's first m layers at slots >= L only: the
  committed prefix of every layer and every slot of the layers above m are bit for bit the
  target's, so the verify pass reads what it would read without a draft."""
  drafter = LayerSkipDrafter.of(target, 1)
  lm = LM.of(target)
  batch = decoding.prepare_batch(PROMPTS, vocab_size=lm.config.vocab_size, max_len=64,
                                 max_new_tokens=8, slots=tree.n_nodes)
  cache0 = kv.init(lm.config, len(PROMPTS), batch.cache_len)
  _, cache0 = lm.prefill(cache0, batch.prompt_BP, batch.prompt_len_B)
  length = batch.prompt_len_B - 1  # the last prompt token is the pending one
  cache0 = kv.set_lengths(cache0, length)
  ctx = Context(tokens=jnp.pad(batch.prompt_BP, ((0, 0), (0, 16))), length=length)

  @jax.jit
  def cycle(cache):
    state = drafter.borrow_cache(drafter.init(batch.prompt_BP, batch.prompt_len_B,
                                              batch.cache_len, tree), cache)
    _, state = drafter.propose(state, ctx, tree, sampling.make_sampler(1.0), jax.random.key(0))
    return drafter.return_cache(state, cache)

  state, cache = cycle(cache0)
  assert state.cache is None
  np.testing.assert_array_equal(np.asarray(cache.lengths), np.asarray(length))
  slot = np.arange(batch.cache_len)
  heads = lm.config.n_kv_heads
  before = np.repeat(slot[None] < np.asarray(length)[:, None], heads, axis=0)  # [B·H, S]
  for layer in range(lm.config.n_layers):
    k0, k1 = np.asarray(cache0.k[layer]), np.asarray(cache.k[layer])
    v0, v1 = np.asarray(cache0.v[layer]), np.asarray(cache.v[layer])
    if layer >= drafter.layers:
      np.testing.assert_array_equal(k1, k0)
      np.testing.assert_array_equal(v1, v0)
      continue
    np.testing.assert_array_equal(np.where(before[:, None], k1, 0),
                                  np.where(before[:, None], k0, 0))
    np.testing.assert_array_equal(np.where(before[..., None], v1, 0),
                                  np.where(before[..., None], v0, 0))
    assert not np.array_equal(v1, v0)  # it drafted in them, from slot L on


@pytest.mark.slow
def test_shared_cache_drafter_in_the_adaptive_loop_greedy_identity(target):
  """The adaptive loop with shapes alternating (plain steps catch the shared drafter up
  eagerly): identical to plain decoding at T = 0; no draft cache in the memory check."""
  plain = decoding.generate(target, PROMPTS, max_new_tokens=16)
  policy = adaptive.AdaptivePolicy.create((0, 1, 3), [1.0, 1.1, 1.2], forced=[2, 0, 1])
  drafter = LayerSkipDrafter.of(target, 1)
  assert not drafter.lazy_catch_up
  run = decoding.speculative_generate(target, drafter, PROMPTS, max_new_tokens=16,
                                      policy=policy)
  assert run.tokens == plain.tokens
  assert run.summary().alpha > 0
  assert decoding._draft_cache_bytes(drafter, 4, 64) == 0
  assert decoding._draft_cache_bytes(LayerSkipDrafter.of(target, 1, share_cache=False), 4,
                                     64) > 0


@pytest.mark.slow
def test_learned_positions_tied_head_and_deterministic_drafting_greedy_identity():
  gpt2 = model(TINY["gpt2"], logit_scale=4.0, mix=6.0)
  plain = decoding.generate(gpt2, PROMPTS, max_new_tokens=16)
  drafter = LayerSkipDrafter.of(gpt2, 1, deterministic=True)  # top-k candidates, q = None
  run = decoding.speculative_generate(gpt2, drafter, PROMPTS, k=3, max_new_tokens=16)
  assert run.tokens == plain.tokens


# ----------------------------------------------------------------------------- exactness

@pytest.fixture(scope="module")
def joint_target():
  return _joint_target()


@pytest.mark.slow
@pytest.mark.parametrize("tree, sampler_args, share_cache", [
    (trees.chain(2), (0.8, 5, 0.9), True),
    (trees.branching((2, 1)), (1.0, 0, 1.0), True),
    (trees.chain(2), (0.8, 5, 0.9), False),
], ids=["chain-T0.8-topk5-topp0.9", "tree-T1", "own-cache-chain"])
def test_joint_law_of_first_three_tokens_matches_the_target(joint_target, tree, sampler_args,
                                                            share_cache):
  """Sampled drafting (q = the warped law of the first layer): χ² goodness of fit of 40,000
  independent rows against the enumerated target joint over 8³ outcomes (sparse cells
  pooled); false-alarm rate 1e-3."""
  sampler = sampling.make_sampler(*sampler_args)
  drafter = LayerSkipDrafter.of(joint_target, 1, share_cache=share_cache)
  tokens = first_three(joint_target, drafter, tree, sampler, seed=11)
  assert joint_pvalue(tokens, exact_joint(joint_target, PROMPT, sampler)) > FALSE_ALARM


@struct.dataclass
class _ReportsUniformQ(LayerSkipDrafter):
  """Planted bug: samples its candidates from q but tells the rule q is uniform. The extra
  static field keeps its compiled program apart from its parent's (docs/xla_notes.md,
  trap 9)."""

  planted: bool = struct.field(pytree_node=False, default=True)

  def propose(self, state, ctx, tree, sampler, key):
    proposal, state = super().propose(state, ctx, tree, sampler, key)
    return proposal.replace(q=jnp.full_like(proposal.q, 1.0 / proposal.q.shape[-1])), state


@pytest.mark.slow
def test_joint_law_test_catches_a_drafter_that_reports_the_wrong_q(joint_target):
  """Negative control: the same test must reject the planted drafter's output."""
  sampler = sampling.make_sampler(0.8, 5, 0.9)
  drafter = _ReportsUniformQ(lm=LayerSkipDrafter.of(joint_target, 1).lm)
  tokens = first_three(joint_target, drafter, trees.chain(2), sampler, seed=11)
  assert joint_pvalue(tokens, exact_joint(joint_target, PROMPT, sampler)) < FALSE_ALARM


# ----------------------------------------------------------------------------- CLI, bad input


def test_cli_generate_with_layer_skip_draft(capsys):
  code = main(["generate", "--target-config", "tiny-llama", "--draft", "layer-skip:1",
               "--max-new-tokens", "8", "--k", "3", "--repeats", "1", "--json",
               "--prompt", "def f(x):"])
  assert code == 0
  report = json.loads(capsys.readouterr().out)
  assert report["drafter"] == "layer-skip:1" and report["identical_to_plain"] is True
  for bad, message in (("layer-skip:2", "layers must be an int in [1, 1]"),
                       ("layer-skip:x", "write layer-skip:M with M an int >= 1"),
                       ("layer-skip", "write layer-skip:M")):
    assert main(["generate", "--target-config", "tiny-llama", "--draft", bad]) == 2
    assert message in capsys.readouterr().err, bad


@pytest.mark.parametrize("layers", [0, 2, 5, -1, 1.0, True, "1"])
def test_bad_layer_count_is_refused_naming_the_argument(target, layers):
  with pytest.raises(ValueError, match=r"layers must be an int in \[1, 1\] .* got"):
    LayerSkipDrafter.of(target, layers)
