"""Tree shapes (specjax.verify.trees), the Sequoia optimiser, verify layouts, and the cache pieces
trees rely on: window attention masks and path compaction (specjax.models.cache)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.analysis import theory
from specjax.verify import trees
from specjax.models import attention
from specjax.models import cache as kv
from specjax.models.transformer import ModelConfig
from specjax.verify.trees import DynamicTree, TreeSpec

# root; 1, 2 under the root; 3, 4 under 1; 5 under 2; 6 under 3
EXAMPLE = TreeSpec((-1, 0, 0, 1, 1, 2, 3))


def test_derived_arrays():
  t = EXAMPLE
  assert (t.size, t.n_nodes, t.max_depth, t.max_width) == (6, 7, 3, 2)
  np.testing.assert_array_equal(t.depth, [0, 1, 1, 2, 2, 2, 3])
  np.testing.assert_array_equal(t.ranks, [0, 0, 1, 0, 1, 0, 0])
  np.testing.assert_array_equal(t.children, [[1, 2], [3, 4], [5, -1], [6, -1], [-1, -1],
                                             [-1, -1], [-1, -1]])
  np.testing.assert_array_equal(t.paths[6], [0, 1, 3, 6])
  np.testing.assert_array_equal(t.paths[5], [0, 2, 5, 5])
  np.testing.assert_array_equal(t.level_sizes, [1, 2, 3, 1])
  expected = np.zeros((7, 7), bool)
  for i, path in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 4], [0, 2, 5], [0, 1, 3, 6]]):
    expected[i, path] = True
  np.testing.assert_array_equal(t.ancestors, expected)
  assert t.draft_parents == (-1, -1, 0, 0, 1, 2)
  assert not t.is_chain and trees.chain(3).is_chain
  assert trees.chain(3).parents == (-1, 0, 1, 2)
  assert hash(t) == hash(TreeSpec([-1, 0, 0, 1, 1, 2, 3])) and t == TreeSpec((-1, 0, 0, 1, 1, 2, 3))
  with pytest.raises(ValueError):  # derived arrays are read-only constants
    t.depth[0] = 3
  # A topological but not breadth-first order: bfs_order sorts by (depth, index).
  u = TreeSpec((-1, 0, 1, 0))
  np.testing.assert_array_equal(u.bfs_order, [0, 1, 3, 2])
  np.testing.assert_array_equal(u.bfs_pos[u.bfs_order], np.arange(4))


def test_builders_and_pretty():
  b = trees.branching((3, 2, 2, 1))
  assert b.size == 3 + 6 + 12 + 12 and b.max_depth == 4
  np.testing.assert_array_equal(b.level_sizes, [1, 3, 6, 12, 12])
  assert np.all(b.n_children[b.depth == 1] == 2) and np.all(b.n_children[b.depth == 3] == 1)
  paths = [(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)]
  assert trees.from_paths(paths) == trees.branching((2, 2))
  f = trees.from_paths([(1,), (0, 0, 0), (0,), (0, 0), (1, 0), (0, 1)])  # any listing order
  assert f.parents == (-1, 0, 0, 1, 1, 2, 3)
  assert f == EXAMPLE
  assert trees.pretty(EXAMPLE).splitlines() == [
      "root", "├── 1", "│   ├── 3", "│   │   └── 6", "│   └── 4", "└── 2", "    └── 5"]
  assert "7 nodes" not in str(EXAMPLE) and "6 nodes, depth 3, width 2" in str(EXAMPLE)
  assert EXAMPLE.pretty(tokens=list("rabcdef")).splitlines()[1] == "├── 1: 'a'"
  d = DynamicTree(budget=10, depth=3, width=2)
  assert (d.size, d.n_nodes, d.max_depth, d.max_width, d.pool_size, d.region) == (10, 11, 3, 2,
                                                                                   10, 5)


# ----------------------------------------------------------------------------- optimiser


def _all_trees(n: int, max_width: int):
  """Every parent list with n drafted nodes (topological, root explicit), width-limited."""
  for rest in itertools.product(*[range(i) for i in range(1, n + 1)]):
    parents = (-1,) + rest
    if np.bincount(rest, minlength=1).max() <= max_width:
      yield parents


def test_optimal_matches_brute_force():
  rng = np.random.default_rng(0)
  for _ in range(12):
    probs = rng.dirichlet(np.ones(4))[:3]
    budget = int(rng.integers(1, 6))
    best = max(TreeSpec(p).expected_tokens(probs) for n in range(1, budget + 1)
               for p in _all_trees(n, 3))
    got = trees.optimal(budget, probs)
    assert got.size <= budget
    assert got.expected_tokens(probs) == pytest.approx(best, abs=1e-12)


def test_optimal_chain_when_only_rank_one_is_accepted_and_widens_with_rank_two():
  for budget in (1, 5, 16):
    assert trees.optimal(budget, (1.0, 0.0, 0.0)) == trees.chain(budget)
    assert trees.optimal(budget, (0.7, 0.0)) == trees.chain(budget)
  widths, leaves = [], []
  for p2 in (0.0, 0.05, 0.1, 0.2, 0.3):
    t = trees.optimal(16, (0.6, p2, p2 / 4))
    widths.append(int(t.n_children.sum() - (t.n_children > 0).sum()))  # extra siblings
    leaves.append(int((t.n_children == 0).sum()))
  assert widths[0] == 0 and leaves[0] == 1  # a chain
  assert all(a <= b for a, b in zip(widths, widths[1:])), widths
  assert widths[-1] > widths[1] > 0, widths
  # Per-depth rank probabilities: only depth 1 uncertain -> branch at the root only.
  t = trees.optimal(6, [[0.5, 0.4], [1.0, 0.0], [1.0, 0.0]])
  assert t.n_children[0] == 2 and t.max_depth <= 3 and np.all(t.n_children[1:] <= 1)


@pytest.mark.parametrize("probs", [(0.8, 0.1), (0.5, 0.2, 0.1), (0.3, 0.25, 0.2, 0.1)])
@pytest.mark.parametrize("budget", [8, 16])
def test_optimal_beats_chain_and_k_ary_trees_of_the_same_size(probs, budget):
  opt = trees.optimal(budget, probs)
  e_opt = opt.expected_tokens(probs)
  assert e_opt == pytest.approx(theory.tree_expected_tokens(opt.draft_parents, probs))
  rivals = [trees.chain(budget)]
  for width in range(2, len(probs) + 1):  # k-ary trees filled breadth first to `budget`
    parents = [-1]
    for i in range(1, budget + 1):
      parents.append((i - 1) // width)
    rivals.append(TreeSpec(tuple(parents)))
  for r in rivals:
    assert r.size == budget
    assert e_opt >= r.expected_tokens(probs) - 1e-12, (r.parents, opt.parents)
  # The model's E[τ] agrees with a simulation of the acceptance process.
  sim = theory.simulate_tree(opt.draft_parents, probs, samples=20_000, seed=1)
  assert abs(sim.tau - e_opt) < 5 * sim.tau_se


def test_verify_layouts_of_static_and_dynamic_trees_agree():
  """The constant layout of a TreeSpec and the in-graph layout a DynamicTree builds from a
  proposal's parents / depth give the same positions, ancestor mask and children table for
  the same shape (here a topological but not level-ordered one)."""
  tree = TreeSpec((-1, 0, 1, 0, 1, 3, 2, 2))
  static = tree.layout()
  assert static is tree.layout() and not static.is_chain
  assert (static.n_nodes, static.max_depth, static.max_width) == (8, 3, 2)
  np.testing.assert_array_equal(static.mask, tree.ancestors)
  np.testing.assert_array_equal(static.children, tree.children)

  class Proposal:  # the two fields DynamicTree.layout reads
    parents = jnp.broadcast_to(jnp.asarray(tree.parents, jnp.int32), (2, 8))
    depth = jnp.broadcast_to(jnp.asarray(tree.depth), (2, 8))

  dynamic = DynamicTree(budget=7, depth=tree.max_depth, width=tree.max_width).layout(Proposal)
  length = jnp.asarray([5, 9], jnp.int32)
  np.testing.assert_array_equal(dynamic.positions(length), static.positions(length))
  np.testing.assert_array_equal(static.positions(length)[1], 9 + tree.depth)
  np.testing.assert_array_equal(dynamic.mask, np.broadcast_to(tree.ancestors, (2, 8, 8)))
  np.testing.assert_array_equal(dynamic.children_for(2), static.children_for(2))
  chain = trees.chain(3).layout()
  assert chain.is_chain and chain.mask is None and chain.max_depth == 3


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("parents, match", [
    ((), "must not be empty"),
    ((-1,), "at least one drafted node"),
    ((-1, 2, 1), r"cycle through nodes \[1, 2\]"),
    ((-1, 1), r"cycle through nodes \[1\]"),
    ((-1, 0, 3, 1), r"topological order .*parents\[2\] = 3"),
    ((-1, 0, -1, 1), r"several roots \(-1 at nodes \[0, 2\]\)"),
    ((0, -1), r"parents\[0\] must be -1"),
    ((-1, 0, 7), r"parents\[2\] = 7 is out of range"),
    ((-1, -2), r"parents\[1\] = -2 is out of range"),
    ((-1, 0.0), r"parents\[1\] must be an int"),
    ("abc", "sequence of ints"),
    (None, "sequence of ints"),
])
def test_malformed_parents_raise_value_error_naming_parents(parents, match):
  with pytest.raises(ValueError, match="parents") as err:
    TreeSpec(parents)
  assert err.match(match)


@pytest.mark.parametrize("build, match", [
    (lambda: trees.chain(0), "k must be an int >= 1, got 0"),
    (lambda: trees.chain(2.0), "k must be an int"),
    (lambda: trees.branching(()), "widths must be a non-empty"),
    (lambda: trees.branching((2, 0)), r"widths\[1\] must be an int >= 1, got 0"),
    (lambda: trees.optimal(0, (0.5,)), "budget must be an int >= 1, got 0"),
    (lambda: trees.optimal(4, (0.7, 0.5)), "rank_probs must sum to at most 1"),
    (lambda: trees.optimal(4, (1.5,)), r"rank_probs must be in \[0, 1\]"),
    (lambda: trees.optimal(4, ()), "rank_probs must have shape"),
    (lambda: trees.optimal(4, (0.5,), max_depth=0), "max_depth must be an int >= 1"),
    (lambda: trees.optimal(4, [[0.5], [0.5]], max_depth=3), "max_depth"),
    (lambda: trees.from_paths([]), "paths must be a non-empty"),
    (lambda: trees.from_paths([(0,), (0, 1)]), r"not its elder sibling \(0, 0\)"),
    (lambda: trees.from_paths([(1,), (0,), (1, 0, 0)]), r"not its prefix \(1, 0\)"),
    (lambda: trees.from_paths([(0,), (0,)]), "more than once"),
    (lambda: trees.from_paths([(0,), (-1,)]), r"paths\[1\] must hold ints >= 0"),
    (lambda: DynamicTree(0, 2, 2), "budget must be an int >= 1, got 0"),
    (lambda: DynamicTree(4, 0, 2), "depth must be an int >= 1, got 0"),
    (lambda: DynamicTree(4, 2, 0), "width must be an int >= 1, got 0"),
    (lambda: DynamicTree(11, 2, 2), "budget must be <= width"),
    (lambda: DynamicTree(4, 2, 2, confidence=0.0), "confidence must be a finite number > 0"),
    (lambda: DynamicTree(4, 2, 2, confidence=float("nan")), "confidence must be a finite"),
    (lambda: DynamicTree(4, 2, 2, confidence="low"), r"confidence .* got 'low'"),
])
def test_bad_builder_arguments_raise_value_error(build, match):
  with pytest.raises(ValueError, match=match):
    build()


# ----------------------------------------------------------------------------- cache pieces


def test_window_mask_node_sees_prefix_and_ancestors_only():
  """A tree written at lengths L as one block: node i sees slots [0, L) and its ancestors."""
  t = EXAMPLE
  lengths = jnp.array([3, 5])
  mask = np.asarray(attention.attention_mask(lengths, t.n_nodes, 16, jnp.asarray(t.ancestors)))
  for b, L in enumerate([3, 5]):
    for i in range(t.n_nodes):
      visible = set(range(L)) | {L + j for j in np.flatnonzero(t.ancestors[i])}
      assert set(np.flatnonzero(mask[b, i])) == visible, (b, i)
  # Per-row masks [B, T, T] give the same answer.
  per_row = attention.attention_mask(lengths, t.n_nodes, 16,
                              jnp.broadcast_to(jnp.asarray(t.ancestors), (2, 7, 7)))
  np.testing.assert_array_equal(per_row, mask)
  # None is the causal block.
  causal = np.asarray(attention.attention_mask(lengths, 3, 16, None))
  np.testing.assert_array_equal(causal, np.asarray(
      attention.attention_mask(lengths, 3, 16, jnp.tril(jnp.ones((3, 3), bool)))))


def test_window_mask_looks_back_at_earlier_levels():
  """Block mask [T, R], R > T: the R - T columns before the block cover the slots just before
  lengths; slots before the window are committed (visible)."""
  window = jnp.array([[True, False, True, False], [False, True, False, True]])  # T=2, R=4
  mask = np.asarray(attention.attention_mask(jnp.array([6]), 2, 10, window))[0]
  # columns: slots 4, 5 (before lengths 6), then the new slots 6, 7.
  np.testing.assert_array_equal(mask[0], [1, 1, 1, 1, 1, 0, 1, 0, 0, 0])
  np.testing.assert_array_equal(mask[1], [1, 1, 1, 1, 0, 1, 0, 1, 0, 0])


def test_gather_block_moves_the_path_and_nothing_else():
  cfg = ModelConfig.llama(vocab_size=11, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1,
                          d_ff=16, max_len=32)
  c = kv.init(cfg, 2, 12)
  rng = np.random.default_rng(0)
  k = tuple(jnp.asarray(rng.normal(size=x.shape), jnp.float32) for x in c.k)
  v = tuple(jnp.asarray(rng.normal(size=x.shape), jnp.float32) for x in c.v)
  c = c.replace(k=k, v=v, lengths=jnp.array([2, 4], jnp.int32))
  path = jnp.array([[0, 2, 3, 3], [0, 1, 4, 5]])
  out = jax.jit(kv.gather_block, static_argnums=2)(c, path, 6)
  np.testing.assert_array_equal(out.lengths, c.lengths)
  for layer in range(2):
    for b, L in enumerate([2, 4]):
      src = L + np.asarray(path[b])
      want_k = np.asarray(c.k[layer][b]).copy()
      want_v = np.asarray(c.v[layer][b]).copy()
      want_k[:, L:L + 4] = np.asarray(c.k[layer][b])[:, src]
      want_v[L:L + 4] = np.asarray(c.v[layer][b])[src]
      np.testing.assert_array_equal(out.k[layer][b], want_k)
      np.testing.assert_array_equal(out.v[layer][b], want_v)


def test_validation_is_linear():
  """A cubic (or quadratic) validation takes minutes at 100,000 nodes; a linear one well
  under a second (the bound is generous so that a loaded machine does not fail it)."""
  import time
  start = time.perf_counter()
  tree = trees.chain(100_000)
  assert time.perf_counter() - start < 2.0 and tree.size == 100_000
  n = 100_000
  start = time.perf_counter()
  with pytest.raises(ValueError, match="cycle through nodes"):  # one cycle through every node
    trees.TreeSpec((-1, *range(2, n), 1))
  assert time.perf_counter() - start < 2.0


def test_cover_holds_every_shape_and_nothing_more():
  chain4, tree = trees.chain(4), trees.branching((2, 1))
  c = trees.cover([chain4, tree, trees.chain(1)])
  paths = set(trees.rank_paths(c))
  assert set(trees.rank_paths(chain4)) <= paths and set(trees.rank_paths(tree)) <= paths
  assert paths == set(trees.rank_paths(chain4)) | set(trees.rank_paths(tree))
  assert (c.n_nodes, c.max_depth, c.max_width) == (7, 4, 2)
  for t in [trees.chain(3), trees.branching((3, 2, 1))]:
    assert trees.from_paths(trees.rank_paths(t)).parents == t.parents
  with pytest.raises(ValueError, match="shapes"):
    trees.cover([])
