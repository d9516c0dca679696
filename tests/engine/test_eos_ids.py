"""Several EOS ids: a row stops at the first of any of them, in the plain, speculative (chain
and tree) and adaptive loops; the ids are a runtime array of a fixed width, so other ids
reuse the compiled loop; bad ids are refused naming the argument."""

from __future__ import annotations

import pytest

from specjax.engine import batching, decoding, loop
from specjax.verify import trees
from specjax_testing import RAGGED, TINY, model, perturbed

BUDGET = 24


@pytest.fixture(scope="module")
def pair():
  target = model(TINY["gpt2"])
  return target, perturbed(target, seed=1, noise=0.25)


def _cut(tokens, eos_ids, budget=BUDGET):
  """A row as the host API should return it: up to the budget, then up to the first EOS."""
  tokens = tokens[:budget]
  hits = [i for i, t in enumerate(tokens) if t in eos_ids]
  return tokens if not hits else tokens[:hits[0] + 1]


def _two_ids(full):
  """Two ids whose first hits fall in different rows, each before the other id's in its row:
  a run that stops on one of them alone cuts some row elsewhere."""
  a = full[0][3]
  for row in full[1:]:
    head = row[:BUDGET - 2]
    for i, t in enumerate(head):
      if t != a and a not in head[:i + 1] and t not in full[0][:4]:
        return a, t
  raise AssertionError("no second id in the plain run")


def _expected(target):
  full = decoding.generate(target, RAGGED, max_new_tokens=BUDGET).tokens
  ids = _two_ids(full)
  want = [_cut(row, ids) for row in full]
  assert want != [_cut(row, ids[:1]) for row in full]  # the second id matters
  return ids, want


@pytest.mark.slow  # compile-bound (5-18 s): the fast tier's 3 minutes
def test_a_row_stops_at_the_first_of_several_eos_ids(pair):
  """batch 6, T = 0: plain and speculative runs equal the plain run without EOS cut at each
  row's first hit of either id; with one id alone (negative control) some row is cut
  elsewhere."""
  target, draft = pair
  ids, want = _expected(target)
  plain = decoding.generate(target, RAGGED, max_new_tokens=BUDGET, eos_id=list(ids))
  chain = decoding.speculative_generate(target, draft, RAGGED, k=3, max_new_tokens=BUDGET,
                                        eos_id=ids)
  assert plain.tokens == want and chain.tokens == want
  one = decoding.speculative_generate(target, draft, RAGGED, k=3, max_new_tokens=BUDGET,
                                      eos_id=ids[0])
  assert one.tokens != want  # negative control: the loop does read the second id


@pytest.mark.slow
def test_tree_and_adaptive_loops_stop_at_several_eos_ids(pair):
  target, draft = pair
  ids, want = _expected(target)
  tree = decoding.speculative_generate(target, draft, RAGGED, tree=trees.branching((2, 1)),
                                       max_new_tokens=BUDGET, eos_id=ids)
  auto = decoding.speculative_generate(target, draft, RAGGED, k="auto", max_new_tokens=BUDGET,
                                       eos_id=ids)
  assert tree.tokens == want
  assert auto.tokens == want


def test_other_eos_ids_reuse_the_compiled_loop(pair):
  target, draft = pair
  prompts = RAGGED[:2]
  for ids in ([5, 7], [11, 13]):
    decoding.generate(target, prompts, max_new_tokens=6, eos_id=ids)
    decoding.speculative_generate(target, draft, prompts, k=2, max_new_tokens=6, eos_id=ids)
  before = loop.TRACE_COUNTS.copy()
  for ids in ([17, 19], [3], None, 23, list(range(batching.EOS_SLOTS))):
    decoding.generate(target, prompts, max_new_tokens=6, eos_id=ids)
    decoding.speculative_generate(target, draft, prompts, k=2, max_new_tokens=6, eos_id=ids)
  assert loop.TRACE_COUNTS == before


@pytest.mark.parametrize("eos_id, match", [
    ([1, 61], r"eos_id\[1\] must be an int in \[0, 61\), got 61"),
    ([1, True], r"eos_id\[1\] must be an int in \[0, 61\), got True"),
    ((2, -1), r"eos_id\[1\] must be an int in \[0, 61\), got -1"),
    ("3", "eos_id must be None, an int in \\[0, 61\\) or a sequence of them, got '3'"),
    (2.0, "eos_id must be None, an int"),
    (61, r"eos_id must be in \[0, 61\), got 61"),
])
def test_bad_eos_ids_are_refused_naming_the_argument(pair, eos_id, match):
  target, draft = pair
  with pytest.raises(ValueError, match=match):
    decoding.speculative_generate(target, draft, [[1, 2]], k=2, max_new_tokens=3,
                                  eos_id=eos_id)
  with pytest.raises(ValueError, match=match):
    decoding.generate(target, [[1, 2]], max_new_tokens=3, eos_id=eos_id)


def test_eos_ids_are_padded_to_a_fixed_width():
  assert batching.eos_ids(None, 10).tolist() == [-1] * batching.EOS_SLOTS
  assert batching.eos_ids([4, 2], 10).tolist()[:3] == [4, 2, -1]
  n = batching.EOS_SLOTS
  many = batching.eos_ids(list(range(n + 1)), 100)  # one more: the next power of two
  assert many.shape == (2 * n,) and many.tolist()[n:n + 2] == [n, -1]
