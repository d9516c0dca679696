"""Token trees through the generation loop: greedy identity (static, optimised and dynamic
shapes, ragged batch), KV compaction (both caches equal plain prefill of the same tokens), the
draft's tree proposals against cache-free scoring, compile counts, bad input.

Each loop test compiles one tree shape (~10-20 s on a loaded 2-core CPU); the tests are
independent so pytest-xdist can spread them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import logsumexp

from specjax.engine import decoding, loop
from specjax.analysis import metrics
from specjax.verify import sampling, trees
from specjax.models.lm import LM
from specjax.drafters.base import Context
from specjax.drafters.model import ModelDrafter
from specjax.models import cache as kv
from specjax.verify.trees import DynamicTree, TreeSpec
from specjax_testing import RAGGED, TINY, model, perturbed

CACHE_LEN = 64
BUDGET = 20
GREEDY = sampling.make_sampler(0.0)

SHAPES = {
    # (tree, deterministic drafter)
    "branching-3-2-1-topk": (trees.branching((3, 2, 1)), True),
    "optimal-8-sampled": (trees.optimal(8, (0.6, 0.2, 0.1)), False),
    "dynamic-10-depth4-width3": (DynamicTree(budget=10, depth=4, width=3), True),
}


@pytest.fixture(scope="module")
def pair():
  target = model(TINY["llama"], logit_scale=4.0)
  return target, perturbed(target, seed=1, noise=0.25)


@pytest.fixture(scope="module")
def plain(pair):
  return decoding.generate(pair[0], RAGGED, max_new_tokens=BUDGET, cache_len=CACHE_LEN)


def run_loop(target, drafter, tree, sampler=GREEDY, seed=0):
  """The loop exactly as speculative_generate calls it (same compiled program), returning the
  final LoopState."""
  cfg = target.config
  slots = max(tree.n_nodes, drafter.slots_needed(tree))
  batch = decoding.prepare_batch(RAGGED, vocab_size=cfg.vocab_size, max_len=cfg.max_len,
                                 max_new_tokens=BUDGET, slots=slots, cache_len=CACHE_LEN,
                                 positions_limited=False)
  state = loop.speculative_jit(LM.of(target), drafter, batch.prompt_BP, batch.prompt_len_B,
                               batch.budget_B, decoding.eos_ids(None, cfg.vocab_size), sampler,
                               decoding.key_of(seed), tree=tree, cache_len=CACHE_LEN)
  return jax.block_until_ready(state), batch


@jax.jit
def _prefill(lm, cache, tokens_BP, lengths_B):
  return lm.prefill(cache, tokens_BP, lengths_B)[1]


def _prefilled(m, tokens_BS, lengths_B):
  """A fresh cache holding tokens[b, :lengths[b]] (plain causal prefill)."""
  cache = kv.init(m.config, tokens_BS.shape[0], CACHE_LEN)
  return _prefill(LM.of(m), cache, jnp.asarray(tokens_BS), jnp.asarray(lengths_B, jnp.int32))


def assert_cache_prefix_equal(got: kv.KVCache, want: kv.KVCache, lengths):
  h = got.n_kv_heads
  for layer in range(len(got.k)):
    for b, n in enumerate(lengths):
      rows = slice(b * h, (b + 1) * h)
      np.testing.assert_allclose(got.k[layer][rows, :, :n], want.k[layer][rows, :, :n],
                                 atol=2e-5, rtol=1e-4)
      np.testing.assert_allclose(got.v[layer][rows, :n], want.v[layer][rows, :n],
                                 atol=2e-5, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SHAPES))
def test_greedy_tree_equals_plain_greedy_and_caches_are_compacted(pair, plain, name):
  tree, deterministic = SHAPES[name]
  target, weak = pair
  state, batch = run_loop(target, ModelDrafter.of(weak, deterministic), tree)
  tokens, length = np.asarray(state.tokens), np.asarray(state.length)
  emitted = [tokens[b, p:l + 1].tolist() for b, (p, l) in
             enumerate(zip(batch.prompt_len_B, length))]
  assert emitted == plain.tokens
  assert all(len(t) == BUDGET for t in emitted)

  # Statistics: the same counters as chains, plus the tree's.
  st = {f: np.asarray(getattr(state.stats, f)) for f in ("cycles", "drafted", "accepted", "hist",
                                                         "cycle_log", "verified", "depth_tried",
                                                         "depth_accepted", "rank_tried",
                                                         "rank_accepted")}
  np.testing.assert_array_equal(st["verified"], tree.size * st["cycles"])
  np.testing.assert_array_equal(st["drafted"], st["verified"])
  np.testing.assert_array_equal(st["hist"].sum(1), st["cycles"])
  np.testing.assert_array_equal(st["rank_accepted"].sum(1), st["accepted"])
  np.testing.assert_array_equal(st["depth_accepted"].sum(1), st["accepted"])
  log = st["cycle_log"].astype(np.int64)
  np.testing.assert_array_equal(np.where(log >= 0, log, 0).sum(1), st["accepted"])
  summary = metrics.summarize_tree(st, np.asarray([len(t) - 1 for t in emitted]))
  assert summary.tau > 1.5, summary
  assert 0 < summary.utilisation < 1
  if deterministic:  # the greedy target sometimes takes a non-first candidate
    assert summary.rank_accepted[1] > 0, summary

  # Compaction: the committed entries of both caches equal plain prefill of the same tokens.
  # Target: tokens [0, L); draft: tokens [0, L - 1) (see drafters/model.py).
  want = _prefilled(target, tokens, length)
  assert_cache_prefix_equal(state.cache, want, length)
  np.testing.assert_array_equal(state.cache.lengths, length)
  draft_want = _prefilled(weak, tokens, length - 1)
  assert_cache_prefix_equal(state.draft.cache, draft_want, length - 1)
  np.testing.assert_array_equal(state.draft.cache.lengths, length - 1)

  # The public API gives the same tokens, and one compiled loop serves it with new runtime
  # values (temperature, top-p, budgets, EOS, seed): no recompilation. (Its loop is another
  # program than the direct call's where the row kernels take weights packed once per model,
  # `fused.packed_lm`.) Generation carries the tree and its metrics.
  drafter = ModelDrafter.of(weak, deterministic)
  g = decoding.speculative_generate(target, drafter, RAGGED, tree=tree, max_new_tokens=BUDGET,
                                    cache_len=CACHE_LEN)
  before = loop.TRACE_COUNTS["speculative"]
  hot = decoding.speculative_generate(target, drafter, RAGGED, tree=tree, max_new_tokens=7,
                                      sampler=sampling.make_sampler(0.7, 0, 0.9), seed=3,
                                      eos_id=5, cache_len=CACHE_LEN)
  assert loop.TRACE_COUNTS["speculative"] == before
  assert g.tokens == plain.tokens and g.tree == tree and g.k == tree.size
  assert all(len(t) <= 7 for t in hot.tokens)
  s, ts = g.summary(), g.tree_summary()
  assert ts.tau == pytest.approx(s.tau) and ts.tau == pytest.approx(summary.tau)
  assert ts.utilisation == pytest.approx(s.alpha)  # α over nodes = node utilisation
  assert len(ts.depth_acceptance) == tree.max_depth and len(ts.rank_acceptance) == tree.max_width


def test_bad_tree_arguments(pair):
  target, weak = pair
  with pytest.raises(ValueError, match="exactly one of k .* or tree .*got neither"):
    decoding.speculative_generate(target, weak, [[1]], max_new_tokens=3)
  with pytest.raises(ValueError, match="got both k=2"):
    decoding.speculative_generate(target, weak, [[1]], k=2, tree=trees.chain(2),
                                  max_new_tokens=3)
  with pytest.raises(ValueError, match="tree must be a trees.TreeSpec"):
    decoding.speculative_generate(target, weak, [[1]], tree=(-1, 0), max_new_tokens=3)
  wide = TreeSpec((-1,) + (0,) * 62)  # 62 candidates under the root, vocabulary 61
  with pytest.raises(ValueError, match="tree has a node with 62 candidates .* width must be"):
    decoding.speculative_generate(target, weak, [[1]], tree=wide, max_new_tokens=3)
  with pytest.raises(ValueError, match="tree has a node with 64"):
    decoding.speculative_generate(target, weak, [[1]], tree=DynamicTree(64, 1, 64),
                                  max_new_tokens=3)
  with pytest.raises(ValueError, match="exceeds the cache/context length"):
    decoding.speculative_generate(target, weak, [[1]], tree=trees.branching((4, 4, 4)),
                                  max_new_tokens=3, cache_len=64)


# ----------------------------------------------------------------------------- proposals


PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]
PENDING = [6, 9, 16]  # x_L, the tree's root
# Topological but not level order (node 3 at depth 1 comes after node 2 at depth 2).
ODD = TreeSpec((-1, 0, 1, 0, 1, 3, 2, 2))


@pytest.fixture(scope="module")
def proposal_setup():
  draft = model(TINY["gpt2"], seed=3, logit_scale=2.0)  # learned positions
  lm = LM.of(draft)
  batch = decoding.prepare_batch(PROMPTS, vocab_size=61, max_len=128, max_new_tokens=4, slots=17,
                                 cache_len=CACHE_LEN)
  tokens = np.zeros((3, CACHE_LEN), np.int32)
  for b, (p, x) in enumerate(zip(PROMPTS, PENDING)):
    tokens[b, :len(p)] = p
    tokens[b, len(p)] = x
  ctx = Context(tokens=jnp.asarray(tokens), length=jnp.asarray(batch.prompt_len_B))

  @jax.jit
  def score(lm, seqs):  # cache-free logits of [64, 32] right-padded sequences
    pos = jnp.broadcast_to(jnp.arange(seqs.shape[1]), seqs.shape)
    return lm(seqs, pos)[0]

  def logits_after(seqs):
    """Logits of the token after each sequence, by plain causal scoring (one compile)."""
    out = []
    for i in range(0, len(seqs), 64):
      chunk = seqs[i:i + 64]
      arr = np.zeros((64, 32), np.int32)
      for j, s in enumerate(chunk):
        arr[j, :len(s)] = s
      lg = np.asarray(score(lm, jnp.asarray(arr)))
      out += [lg[j, len(s) - 1] for j, s in enumerate(chunk)]
    return np.asarray(out, np.float64)

  def propose(drafter, tree, sampler):
    state = drafter.init(batch.prompt_BP, batch.prompt_len_B, CACHE_LEN, tree)
    return drafter.propose(state, ctx, tree, sampler, jax.random.key(0))[0]

  return lm, jax.jit(propose, static_argnums=1), logits_after


def _node_paths(parents, tokens_N):
  """Token path (root excluded) of every node of one row."""
  toks = [None] + list(tokens_N)
  paths = [()]
  for i in range(1, len(parents)):
    paths.append(paths[parents[i]] + (int(toks[i]),))
  return paths


def test_static_tree_proposals_match_cache_free_scoring(proposal_setup):
  """Children are the top-k of the draft at their parent's path (deterministic), or sampled
  with q = the warped draft law there (sampled): the draft's level-by-level cache writes and
  window masks give every node the context prefix + its own ancestors."""
  lm, propose, logits_after = proposal_setup
  sampler = sampling.make_sampler(0.9, 0, 0.95)
  det = propose(ModelDrafter(lm, deterministic=True), ODD, sampler)
  smp = propose(ModelDrafter(lm, deterministic=False), ODD, sampler)
  internal = [i for i in range(ODD.n_nodes) if ODD.n_children[i] > 0]
  for prop, deterministic in ((det, True), (smp, False)):
    tokens = np.asarray(prop.tokens)
    seqs, where = [], []
    for b in range(3):
      paths = _node_paths(ODD.parents, tokens[b])
      for i in internal:
        seqs.append(PROMPTS[b] + [PENDING[b]] + list(paths[i]))
        where.append((b, i))
    ref = logits_after(seqs)
    q_refs = np.asarray(jax.jit(sampling.warp)(jnp.asarray(ref, jnp.float32), sampler))
    for (b, i), lg, q_ref in zip(where, ref, q_refs):
      kids = np.asarray([c for c in ODD.children[i] if c >= 0])
      if deterministic:
        top = np.argsort(-lg, kind="stable")[:len(kids)]
        np.testing.assert_array_equal(tokens[b, kids - 1], top)
      else:
        np.testing.assert_allclose(np.asarray(prop.q[b, i]), q_ref, atol=1e-5)
        assert np.all(q_ref[tokens[b, kids - 1]] > 0)
  assert det.q is None and smp.q.shape == (3, ODD.n_nodes, 61)


@pytest.mark.parametrize("confidence", [1.0, 0.3])
def test_dynamic_tree_proposal_matches_reference_expansion(proposal_setup, confidence):
  """EAGLE-2 selection re-done in numpy from cache-free draft log-probabilities (of the
  draft softmax at the tree's scoring temperature `confidence`)."""
  lm, propose, logits_after = proposal_setup
  tree = DynamicTree(budget=8, depth=3, width=2, confidence=confidence)  # some at depth 3
  prop = propose(ModelDrafter(lm, deterministic=True), tree, GREEDY)
  parents, depth = np.asarray(prop.parents), np.asarray(prop.depth)
  K = tree.width

  def logp(seqs):
    lg = logits_after(seqs) / confidence
    return lg - logsumexp(lg, axis=1, keepdims=True)

  for b in range(3):
    base = PROMPTS[b] + [PENDING[b]]
    pool = [((), 0.0)]  # (path, cumulative log-probability)
    lp = logp([base])[0]
    level = []
    for t in np.argsort(-lp, kind="stable")[:K]:
      pool.append(((int(t),), lp[t]))
      level.append(len(pool) - 1)
    for _ in range(1, tree.depth):
      frontier = sorted(level, key=lambda i: (-pool[i][1], i))[:K]
      lps = logp([base + list(pool[f][0]) for f in frontier])
      level = []
      for f, lp in zip(frontier, lps):
        for t in np.argsort(-lp, kind="stable")[:K]:
          pool.append((pool[f][0] + (int(t),), pool[f][1] + lp[t]))
          level.append(len(pool) - 1)
    chosen = sorted(sorted(range(1, len(pool)), key=lambda i: (-pool[i][1], i))[:tree.budget])
    want = [pool[i][0] for i in chosen]
    got = _node_paths(parents[b], np.asarray(prop.tokens[b]))[1:]
    assert got == want, b
    np.testing.assert_array_equal(depth[b, 1:], [len(p) for p in got])
    assert parents[b, 0] == -1 and np.all(parents[b, 1:] < np.arange(1, tree.n_nodes))
  assert depth.max() == tree.depth  # the expansion went all the way down somewhere
