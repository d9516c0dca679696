"""Prompt lookup (n-gram) drafter: what it proposes on hand-built contexts, greedy identity
with plain decoding, the joint law at T > 0 (with a planted-bug negative control), the CLI,
bad input.

The χ² test uses a false-alarm rate of 1e-3 and fixed seeds (deterministic suite); the
negative control shows the same test rejecting a sloppy point-mass rule.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.verify import acceptance, sampling, trees
from specjax.engine import decoding, loop
from specjax.cli import main
from specjax.drafters import LookupDrafter
from specjax.drafters.base import Context
from specjax_testing import TINY, model
from specjax_testing import FALSE_ALARM, exact_joint, first_three, joint_pvalue
from specjax_testing import joint_target as _joint_target

JUNK = 13  # buffer filler beyond L: must never be read as context


def _ctx(rows, slots=24):
  tokens = np.full((len(rows), slots), JUNK, np.int32)
  for i, r in enumerate(rows):
    tokens[i, :len(r)] = r
  return Context(tokens=jnp.asarray(tokens), length=jnp.asarray([len(r) - 1 for r in rows],
                                                                jnp.int32))


def _propose(rows, tree, **kw):
  drafter = LookupDrafter(**kw)
  proposal, _ = jax.jit(lambda ctx: drafter.propose(None, ctx, tree, None, None))(_ctx(rows))
  assert proposal.q is None  # deterministic candidates: the point-mass rule
  return np.asarray(proposal.tokens).tolist()


def test_chain_proposes_the_continuation_of_the_longest_then_most_recent_match():
  rows = [
      [1, 2, 3, 9, 8, 5, 3, 7, 6, 1, 2, 3],  # "1 2 3" (older, n=3) beats "3" (recent, n=1)
      [4, 5, 1, 0, 4, 5, 2, 6, 4, 5],  # "4 5" twice: the most recent wins
      [1, 2, 3, 4],  # no match: repeat the pending token
      [5, 6, 5, 6, 5],  # a match overlapping the suffix: continue its period
      [7, 7, 7],  # a run of one token
      [2, 8, 13, 2],  # JUNK beyond L must not extend the match: "2" -> 8, 13, 2, 8
  ]
  assert _propose(rows, trees.chain(4)) == [[9, 8, 5, 3], [2, 6, 4, 5], [4, 4, 4, 4],
                                            [6, 5, 6, 5], [7, 7, 7, 7], [8, 13, 2, 8]]


def test_ngram_bounds_decide_which_matches_count():
  rows = [[1, 2, 3, 9, 8, 5, 3, 7, 6, 1, 2, 3], [4, 5, 1, 9, 5]]
  # max_ngram=1: only the last token is matched, so recency decides.
  assert _propose(rows, trees.chain(2), max_ngram=1) == [[7, 6], [1, 9]]
  # min_ngram=2: a single shared token is not a match (row 1 then falls back to x_L).
  assert _propose(rows, trees.chain(2), max_ngram=3, min_ngram=2) == [[9, 8], [5, 5]]


def test_tree_branches_on_distinct_matches_ranked_by_length_then_recency():
  # "7 8" occurs followed by 1 (older) and by 2 (more recent); "8" alone also by 3 (older).
  row = [8, 3, 4, 7, 8, 1, 5, 7, 8, 2, 6, 7, 8]
  tree = trees.branching((4, 2))  # root: 4 children, each with 2 children
  tokens = _propose([row], tree)[0]
  nodes = dict(zip(range(1, tree.n_nodes), tokens))
  root_kids = [int(c) for c in tree.children[0]]
  assert [nodes[c] for c in root_kids] == [2, 1, 3, 8]  # n=2 recent, n=2 old, n=1, filler x_L
  # Each child's rank-0 child follows its own match's continuation; rank 1 has no other
  # consistent match, so it is the filler x_L = 8.
  grand = [[nodes[int(g)] for g in tree.children[c] if g >= 0] for c in root_kids]
  assert grand == [[6, 8], [5, 8], [4, 8], [8, 8]]


@pytest.mark.slow  # compile-bound (5-18 s): the fast tier's 3 minutes
def test_ragged_batch_greedy_output_is_identical_to_plain_decoding():
  target = model(TINY["llama"], logit_scale=4.0)
  prompts = [[1, 2, 3, 1, 2], [4, 5, 6, 7, 8, 9, 10, 11, 12], [7], [9, 8]]
  plain = decoding.generate(target, prompts, max_new_tokens=16)
  drafter = LookupDrafter(max_ngram=3, min_ngram=1)
  for shape in (dict(k=3), dict(tree=trees.branching((2, 2, 1)))):
    run = decoding.speculative_generate(target, drafter, prompts, max_new_tokens=16, **shape)
    assert run.tokens == plain.tokens, shape
    # The tiny target's greedy output repeats itself: the lookup finds real continuations
    # (τ: tokens per verification, 1 = no gain).
    assert run.summary().tau > 1.5, shape


# ----------------------------------------------------------------------------- exactness

PROMPT = [1, 5, 2, 1, 5]  # repetition, so that matches (and mismatches) both occur


@pytest.fixture(scope="module")
def joint_target():
  return _joint_target()


def _first_three(target, tree, sampler, seed, run=None):
  return first_three(target, LookupDrafter(max_ngram=2), tree, sampler, seed, prompt=PROMPT,
                     slots=tree.n_nodes, run=run)


@pytest.mark.slow
@pytest.mark.parametrize("tree, sampler_args", [
    (trees.chain(2), (0.8, 5, 0.9)),
    (trees.branching((2, 1)), (1.0, 0, 1.0)),
], ids=["chain-T0.8-topk5-topp0.9", "tree-T1"])
def test_joint_law_of_first_three_tokens_matches_the_target(joint_target, tree, sampler_args):
  """χ² goodness of fit of 40,000 independent rows against the enumerated target joint over
  8³ outcomes (sparse cells pooled); false-alarm rate 1e-3."""
  sampler = sampling.make_sampler(*sampler_args)
  tokens = _first_three(joint_target, tree, sampler, seed=11)
  assert joint_pvalue(tokens, exact_joint(joint_target, PROMPT, sampler)) > FALSE_ALARM


def test_joint_law_test_catches_a_rejected_point_mass_left_in_the_residual(joint_target,
                                                                           monkeypatch):
  """Negative control: after rejecting a lookup candidate x the rule must sample p with x
  removed; a planted rule that samples p itself over-emits x and the test must see it."""
  sloppy = acceptance.ChainRule(residual=lambda p, q: p)
  monkeypatch.setattr(acceptance, "accept_chain",
                      lambda key, d, p, q=None: acceptance._accept_chain(key, d, p, q, sloppy))
  fresh = jax.jit(lambda *a, **kw: loop.speculative_loop(*a, **kw),
                  static_argnames=("tree", "cache_len"))  # new function: a fresh trace
  sampler = sampling.make_sampler(1.0)
  tokens = _first_three(joint_target, trees.chain(2), sampler, seed=11, run=fresh)
  assert joint_pvalue(tokens, exact_joint(joint_target, PROMPT, sampler)) < FALSE_ALARM


# ----------------------------------------------------------------------------- CLI, bad input


@pytest.mark.slow
def test_cli_generate_with_lookup_draft(capsys):
  code = main(["generate", "--target-config", "tiny-llama", "--draft", "lookup",
               "--ngram-max", "2", "--max-new-tokens", "12", "--k", "3", "--repeats", "1",
               "--json", "--prompt", "abcabcabc"])
  assert code == 0
  report = json.loads(capsys.readouterr().out)
  assert report["drafter"] == "lookup" and report["identical_to_plain"] is True
  assert main(["generate", "--draft", "lookup", "--ngram-min", "3", "--ngram-max", "2"]) == 2
  assert "min_ngram (3) must be <= max_ngram (2)" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_ngram=0), r"max_ngram must be an int >= 1 .*, got 0"),
    (dict(min_ngram=0), r"min_ngram must be an int >= 1 .*, got 0"),
    (dict(max_ngram=2.0), r"max_ngram must be an int >= 1 .*, got 2.0"),
    (dict(min_ngram=True), r"min_ngram must be an int >= 1 .*, got True"),
    (dict(max_ngram=2, min_ngram=3), r"min_ngram \(3\) must be <= max_ngram \(2\)"),
])
def test_bad_ngram_sizes_are_refused(kwargs, match):
  with pytest.raises(ValueError, match=match):
    LookupDrafter(**kwargs)


def test_dynamic_tree_is_refused_before_any_work():
  target = model(TINY["gpt2"])
  with pytest.raises(ValueError, match="lookup drafter drafts chains and static trees"):
    decoding.speculative_generate(target, LookupDrafter(), [[1, 2]], max_new_tokens=4,
                                  tree=trees.DynamicTree(4, 2, 2))
