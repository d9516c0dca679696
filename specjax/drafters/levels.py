"""Level-by-level drafting of chains, static token trees and dynamic (EAGLE-2 style) trees:
`LevelDrafter`, the machinery of every drafter that scores a tree one level at a time (the
separate draft model `model.ModelDrafter`, and through it the oracle and layer-skip drafters;
the EAGLE head's `eagle.EagleDrafter`), and the per-tree-type plans it runs (`_plan`).

Tree drafting, level by level. With L the index of the pending token (the tree's root), the
tree occupies the draft cache from slot L (the root) in breadth-first order: level d's nodes
are contiguous. Level d (1 <= d < depth) is one forward pass of its nodes (padded to the
widest level, so every level has one shape and one compiled step inside a `lax.scan`)
written at L + start_d with `lengths = L + start_d` and a window mask
(`attention.attention_mask`): each node sees the committed prefix and, among the earlier
levels, its own ancestors. Children are the top-k of the draft's logits at their parent
(deterministic, distinct) or i.i.d. samples of the warped draft law q there. The deepest
level is never fed. A chain is the same with one node a level and a causal mask. A plan's
`compact` moves the accepted path to slots [L, L + n] after the cycle
(`cache.gather_block`), for drafters that keep their tree entries.

Dynamic trees (EAGLE-2): the root's top-`width` tokens form level 1; each later level feeds
the `width` newest candidates with the highest cumulative draft log-probability (log q
summed along the path, q the draft's softmax at temperature `DynamicTree.confidence`, 1 by
default: a confidence, independent of the sampler) and scores their top-`width` children.
The `budget` best candidates overall are verified, ancestors first (a child's score never
exceeds its parent's, ties go to the older node), numbered in creation order (topological).

Hooks. `LevelDrafter` is written against two: `_root` (open the cycle, score the root's
children) and `_step` (score one level from its node tokens and each parent's carried
state). `ModelDrafter` carries nothing; the EAGLE head carries its hidden state and sits its
root one slot earlier (`root_offset`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.verify import sampling
from specjax.drafters.base import Context, Drafter, Proposal, finite_rows
from specjax.models import cache as kv
from specjax.verify.trees import DynamicTree, TreeSpec

Array = jax.Array


# ----------------------------------------------------------------------------- plans
#
# A plan is what drafting one kind of tree needs: `_plan(tree)` is the single place that
# dispatches on the tree's type; the drafter's methods call the plan's.


@dataclasses.dataclass(frozen=True)
class _StaticPlan:
  """Numpy tables for drafting a static TreeSpec level by level (see module doc)."""

  tree: TreeSpec
  depth: int  # D
  width: int  # W: rows fed per level step (the widest fed level 1..D-1), 0 if D == 1
  gen_width: int  # M: children produced per generation (the widest level 1..D)
  child_width: int  # top-k width needed for deterministic children (max children)
  lookback: int  # Rb: window columns before the fed block
  starts: np.ndarray  # [D+1] breadth-first start of each level
  masks: np.ndarray | None  # [D-1, W, Rb+W] window masks of levels 1..D-1 (None: chain)
  gen_parent_row: np.ndarray  # [D, M] parent's row in the fed block of level g
  gen_rank: np.ndarray  # [D, M] child's rank
  node_gen: np.ndarray  # [N] generation (= depth - 1) of nodes 1..N
  node_slot: np.ndarray  # [N] slot within its generation
  q_row: np.ndarray  # [T] row of node i's q in [root, level-1 rows, ...] (leaves: 0)
  extent: int  # draft-cache slots written from L

  def node_slots(self, batch: int) -> None:
    del batch  # static shapes: a node's slot is bfs_pos, a constant
    return None

  def propose(self, drafter: "LevelDrafter", state, ctx, sampler, key):
    return drafter._propose_static(state, ctx, self.tree, sampler, key)

  def compact(self, state, path_BP: Array) -> kv.KVCache:
    """The cache with the accepted path moved to slots [L, L + n] (a chain's is in place)."""
    if self.tree.is_chain:
      return state.cache
    slots = jnp.take(jnp.asarray(self.tree.bfs_pos), path_BP)
    return kv.gather_block(state.cache, slots, self.tree.n_nodes)


@dataclasses.dataclass(frozen=True)
class _DynamicPlan:
  """Drafting a DynamicTree: the shape is chosen in-graph each cycle (see module doc)."""

  tree: DynamicTree

  @property
  def extent(self) -> int:
    return max(self.tree.n_nodes, self.tree.region)

  def node_slots(self, batch: int) -> Array:
    return jnp.zeros((batch, self.tree.n_nodes), jnp.int32)

  def propose(self, drafter: "LevelDrafter", state, ctx, sampler, key):
    del sampler  # deterministic top-k candidates
    return drafter._propose_dynamic(state, ctx, self.tree, key)

  def compact(self, state, path_BP: Array) -> kv.KVCache:
    """The cache with the accepted path moved to slots [L, L + n]; unfed nodes have slot -1
    (never needed: clipped)."""
    slots = jnp.maximum(jnp.take_along_axis(state.node_slots, path_BP, axis=1), 0)
    return kv.gather_block(state.cache, slots, self.tree.region)


class _Pool(NamedTuple):
  """The dynamic tree's candidate pool [B, P] (index 0 the root): token, cumulative log
  probability, parent pool index, depth, and region slot (-1 until it is expanded)."""
  tok: Array
  score: Array
  parent: Array
  depth: Array
  slot: Array


class _Search(NamedTuple):
  """What one level of the dynamic search carries to the next: the draft cache, the pool,
  the region's ancestor matrix [B, R, R] and hidden states [B, R, ...], and the candidates
  of the next level (pool indices and scores [B, K*K]), and whether every level so far had
  finite logits (finite [B], `Proposal.finite`)."""
  cache: Any
  pool: _Pool
  anc: Array
  h: Array
  cand_idx: Array
  cand_score: Array
  finite: Array


@functools.singledispatch
def _plan(tree):
  raise ValueError(f"tree must be a trees.TreeSpec or trees.DynamicTree, got {tree!r}")


@_plan.register(DynamicTree)
def _(tree: DynamicTree) -> _DynamicPlan:
  return _DynamicPlan(tree)


@_plan.register(TreeSpec)
@functools.lru_cache(maxsize=64)
def _static_plan(tree: TreeSpec) -> _StaticPlan:
  D, T = tree.max_depth, tree.n_nodes
  sizes = tree.level_sizes
  starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
  W = int(sizes[1:D].max()) if D > 1 else 0
  M = int(sizes[1:].max())
  bfs, pos = tree.bfs_order, tree.bfs_pos
  lookback = int(starts[D - 1]) if D > 1 else 0
  masks = None
  if not tree.is_chain and D > 1:
    masks = np.zeros((D - 1, W, lookback + W), bool)
    for d in range(1, D):
      for w in range(W):
        for c in range(lookback + W):
          ri = c - lookback + starts[d]
          if ri < 0:
            masks[d - 1, w, c] = True
          elif w < sizes[d]:
            masks[d - 1, w, c] = ri < T and tree.ancestors[bfs[starts[d] + w], bfs[ri]]
          else:
            masks[d - 1, w, c] = ri == starts[d] + w  # padding row: prefix and itself
  gen_parent_row = np.zeros((D, M), np.int32)
  gen_rank = np.zeros((D, M), np.int32)
  for g in range(D):
    for j in range(int(sizes[g + 1])):
      node = bfs[starts[g + 1] + j]
      gen_parent_row[g, j] = pos[tree.parents[node]] - starts[g]
      gen_rank[g, j] = tree.ranks[node]
  nodes = np.arange(1, T)
  node_gen = tree.depth[nodes] - 1
  node_slot = pos[nodes] - starts[tree.depth[nodes]]
  q_row = np.zeros(T, np.int32)
  for i in range(T):
    d = tree.depth[i]
    if 0 < d < D:
      q_row[i] = 1 + (d - 1) * W + pos[i] - starts[d]
  extent = max(T, max((int(starts[d]) + W for d in range(1, D)), default=0))
  return _StaticPlan(tree=tree, depth=D, width=W, gen_width=M, child_width=tree.max_width,
                     lookback=lookback, starts=starts, masks=masks,
                     gen_parent_row=gen_parent_row, gen_rank=gen_rank,
                     node_gen=node_gen.astype(np.int32), node_slot=node_slot.astype(np.int32),
                     q_row=q_row, extent=extent)


def _gather_rows(x_BRX: Array, rows: np.ndarray) -> Array:
  """x[:, rows] for a static index table (no gather when it is the identity)."""
  rows = np.asarray(rows)
  if rows.ndim == 1 and rows.shape[0] == x_BRX.shape[1] and np.all(rows == np.arange(len(rows))):
    return x_BRX
  return jnp.take(x_BRX, jnp.asarray(rows), axis=1)


class LevelDrafter(Drafter):
  """Drafting chains, static trees and dynamic trees level by level (module doc), from a
  one-step function that subclasses supply. Shared by the separate draft model
  (`model.ModelDrafter`) and the EAGLE head (`eagle.EagleDrafter`).

  The root's row sits at draft-cache slot and position L + `root_offset` (static: 0 for a
  draft model, which feeds the root token itself; -1 for a head that feeds position t with
  the next token t + 1); level d's nodes sit at positions L + root_offset + d and, in
  breadth-first order, at slots from L + root_offset + start_d. A subclass provides

      _root(state, ctx) -> (root_logits_BV, root_h_BH, cache)
      _step(tokens_BW, parent_h_BWH, positions_BW, cache, mask) -> (logits_BWV, h_BWH, cache)

  `_step` scores one level: node tokens, the carried state `h` of each node's parent (H = 0
  for a plain model: nothing is carried) and returns each node's own `h`. The state must
  have `cache` and `node_slots` fields; `deterministic` (a static field of the subclass)
  chooses top-k candidates (q = None) over sampled ones.
  """

  root_offset = 0

  def draft_law(self, logits: Array, sampler) -> Array:
    """The law q [..., V] the children of a node are sampled from (stochastic drafting)."""
    return sampling.warp(logits, sampler)

  def _children(self, logits_BRV, q_BRV, parent_row, rank, width: int, key) -> Array:
    """Tokens [B, M] of one generation: child j of block row parent_row[j], rank rank[j]."""
    if self.deterministic:
      if width == 1:
        top = jnp.argmax(logits_BRV, axis=-1)[..., None]  # [B, R, 1]
      else:
        top = jax.lax.top_k(logits_BRV, width)[1]  # [B, R, W] distinct, best first
      return top[:, parent_row, rank].astype(jnp.int32)
    return sampling.sample(key, q_BRV[:, parent_row]).astype(jnp.int32)

  def propose(self, state, ctx: Context, tree, sampler, key):
    return _plan(tree).propose(self, state, ctx, sampler, key)

  def _propose_static(self, state, ctx, tree: TreeSpec, sampler, key):
    plan = _static_plan(tree)
    D, W = plan.depth, plan.width
    length = ctx.length
    base = length + self.root_offset  # the root's slot and position
    keys = jax.random.split(key, D)
    drafted = None  # every node drafted, unless the chain stops early
    stops = self._stops(tree)
    root_logits_BV, root_h_BH, cache = self._root(state, ctx)
    finite = finite_rows(root_logits_BV)  # and every level's logits, below
    warp = (lambda x: None) if self.deterministic else (lambda x: self.draft_law(x, sampler))
    root_q_BV = warp(root_logits_BV)
    gen0 = self._children(root_logits_BV[:, None], None if root_q_BV is None else
                          root_q_BV[:, None], plan.gen_parent_row[0], plan.gen_rank[0],
                          plan.child_width, keys[0])  # level 1: [B, M]
    gens, q_rows = [gen0[None]], [None if root_q_BV is None else root_q_BV[:, None]]
    if D > 1:
      masks = None if plan.masks is None else jnp.asarray(plan.masks)
      h0_BWH = jnp.broadcast_to(root_h_BH[:, None], (root_h_BH.shape[0], W) + root_h_BH.shape[1:])

      def level(carry, xs):
        cache, feed_BW, h_BWH = carry  # h: the previous level's fed rows (level 0: the root)
        t, step_key = xs  # level d = t + 1
        start = jnp.asarray(plan.starts)[t + 1].astype(jnp.int32)
        cache = kv.set_lengths(cache, base + start)
        pos = jnp.broadcast_to((base + t + 1)[:, None], feed_BW.shape)
        mask = None if masks is None else masks[t]
        parent_h = jnp.take(h_BWH, jnp.asarray(plan.gen_parent_row)[t, :W], axis=1)
        logits_BWV, h_BWH, cache = self._step(feed_BW, parent_h, pos, cache, mask)
        q_BWV = warp(logits_BWV)
        parent_row = jnp.asarray(plan.gen_parent_row)[t + 1]
        rank = jnp.asarray(plan.gen_rank)[t + 1]
        kids_BM = self._children(logits_BWV, q_BWV, parent_row, rank, plan.child_width,
                                 step_key)
        ok_B = finite_rows(logits_BWV)
        if stops:  # the stopping rule's confidence and filler candidate of each fed row
          return (cache, kids_BM[:, :W], h_BWH), (kids_BM, q_BWV, ok_B, logits_BWV[:, 0])
        return (cache, kids_BM[:, :W], h_BWH), (kids_BM, q_BWV, ok_B)

      carry0 = (cache, gen0[:, :W], h0_BWH)
      if stops:
        cache, kids_GBM, q_GBWV, ok_B, drafted = self._levels_until_unsure(
            level, carry0, keys[1:], root_logits_BV, root_q_BV, D - 1, plan.gen_width)
        finite = finite & ok_B
      else:
        xs = (jnp.arange(D - 1, dtype=jnp.int32), keys[1:])
        (cache, _, _), (kids_GBM, q_GBWV, ok_GB) = jax.lax.scan(level, carry0, xs)
        finite = finite & jnp.all(ok_GB, axis=0)
      gens.append(kids_GBM)
      if q_GBWV is not None:
        q_rows.append(q_GBWV.transpose(1, 0, 2, 3).reshape(q_GBWV.shape[1], -1,
                                                           q_GBWV.shape[-1]))
    gens_GBM = jnp.concatenate(gens, axis=0)
    tokens_BN = gens_GBM[jnp.asarray(plan.node_gen), :, jnp.asarray(plan.node_slot)].T
    q = None
    if root_q_BV is not None:
      q = _gather_rows(jnp.concatenate(q_rows, axis=1), plan.q_row)  # [B, T, V]
    cache = kv.set_lengths(cache, length)
    return (Proposal(tokens=tokens_BN, q=q, drafted=drafted, finite=finite),
            state.replace(cache=cache))

  # -- dynamic draft stopping (`base` module doc): chains
  def with_stopping(self, threshold):
    """This drafter stopping a chain once every row's cumulative confidence is below
    `threshold` (a runtime float32 leaf: changing it does not recompile; 0 = never)."""
    return self.replace(stop_below=jnp.asarray(threshold, jnp.float32))

  def _stops(self, tree: TreeSpec) -> bool:
    """Static: whether this proposal may stop early (a stopping threshold is set and the tree
    is a chain of >= 2 nodes)."""
    return self.stop_below is not None and tree.is_chain and tree.max_depth > 1

  def _levels_until_unsure(self, level, carry0, keys, root_logits_BV, root_q_BV,
                           levels: int, m: int):
    """The chain's levels (the `level` step of `_propose_static`) run while some row's
    newest drafted node has cumulative confidence >= `stop_below`, as a `while_loop` of at
    most `levels` trips with the scan's keys, so a run that never stops drafts exactly what
    the scan would. A node's confidence is the max probability of the draft's softmax (at
    temperature 1, whatever the sampler: a score, as a dynamic tree's) at its parent, and the
    cumulative confidence the product along the chain. The levels not run hold fillers: per
    row the token the newest draft logits make least likely (among those not at -inf: a
    padded or reduced vocabulary's missing ids are never proposed), with a one-hot law when the
    candidates are sampled (point masses are exact for any token). Returns (cache, kids
    [levels, B, M], q [levels, B, 1, V] or None, finite [B]: the levels run had finite
    logits (`Proposal.finite`), drafted [B]: nodes drafted, 1 + levels run)."""
    b, v = root_logits_BV.shape
    kids0 = jnp.zeros((levels, b, m), jnp.int32)
    q0 = None if root_q_BV is None else jnp.zeros((levels, b, 1, v), root_q_BV.dtype)

    def score(logits_BV):  # (confidence, filler: the least likely id it can draft, not -inf)
      low = jnp.argmin(jnp.where(logits_BV == -jnp.inf, jnp.inf, logits_BV), axis=-1)
      return jnp.max(jax.nn.softmax(logits_BV, axis=-1), axis=-1), low

    conf0, low0 = score(root_logits_BV)

    def unsure(c):
      return (c[0] < levels) & jnp.any(c[5] >= self.stop_below)

    def step(c):
      t, carry, kids, q, ok, conf, _ = c
      carry, (kids_BM, q_BWV, ok_B, logits_BV) = level(carry, (t, keys[t]))
      kids = jax.lax.dynamic_update_index_in_dim(kids, kids_BM, t, axis=0)
      if q is not None:
        q = jax.lax.dynamic_update_index_in_dim(q, q_BWV, t, axis=0)
      c_BV, low = score(logits_BV)
      return t + 1, carry, kids, q, ok & ok_B, conf * c_BV, low

    ok0 = jnp.ones((b,), bool)
    ran, (cache, _, _), kids, q, ok, _, low = jax.lax.while_loop(
        unsure, step, (jnp.zeros((), jnp.int32), carry0, kids0, q0, ok0, conf0, low0))
    filler = low.astype(jnp.int32)  # [B]
    skipped = (jnp.arange(levels) >= ran)[:, None, None]
    kids = jnp.where(skipped, filler[None, :, None], kids)
    if q is not None:
      point = jax.nn.one_hot(filler, v, dtype=q.dtype)[None, :, None]
      q = jnp.where(skipped[..., None], point, q)
    return cache, kids, q, ok, jnp.full((b,), ran + 1, jnp.int32)

  def _propose_dynamic(self, state, ctx, tree: DynamicTree, key):
    del key  # deterministic candidates
    K, D, N = tree.width, tree.depth, tree.budget
    P = 1 + tree.pool_size
    R = tree.region
    lookback = 1 + (D - 2) * K if D > 1 else 0
    length = ctx.length
    base = length + self.root_offset  # the root's slot and position
    b = length.shape[0]
    rows = jnp.arange(b)[:, None]
    root_logits_BV, root_h_BH, cache = self._root(state, ctx)
    finite = finite_rows(root_logits_BV)
    scale = 1.0 / tree.confidence  # scores from the draft softmax at that temperature
    logp, tok = jax.lax.top_k(jax.nn.log_softmax(root_logits_BV * scale, axis=-1), K)  # [B, K]
    neg = jnp.full((b, P), -jnp.inf, jnp.float32)
    pool = _Pool(tok=jnp.zeros((b, P), jnp.int32).at[:, 1:1 + K].set(tok.astype(jnp.int32)),
                 score=neg.at[:, 0].set(0.0).at[:, 1:1 + K].set(logp),
                 parent=jnp.zeros((b, P), jnp.int32),
                 depth=jnp.zeros((b, P), jnp.int32).at[:, 1:1 + K].set(1),
                 slot=jnp.full((b, P), -1, jnp.int32).at[:, 0].set(0))
    if D > 1:

      def level(search: _Search, t):  # expand the best K candidates of level d = t + 1
        pool = search.pool
        _, best = jax.lax.top_k(search.cand_score, K)
        f_idx = jnp.take_along_axis(search.cand_idx, best, axis=1)  # [B, K] pool indices
        slots = 1 + t * K + jnp.arange(K, dtype=jnp.int32)  # region slots of the frontier
        pool_slot = pool.slot.at[rows, f_idx].set(jnp.broadcast_to(slots, (b, K)))
        parent_slot = jnp.take_along_axis(
            pool_slot, jnp.take_along_axis(pool.parent, f_idx, axis=1), axis=1)
        own = jax.nn.one_hot(slots, R, dtype=jnp.bool_)[None]  # [1, K, R]
        anc = jnp.take_along_axis(search.anc, parent_slot[:, :, None], axis=1) | own  # [B,K,R]
        reg_anc = search.anc.at[rows, jnp.broadcast_to(slots, (b, K))].set(anc)
        start = 1 + t * K
        ri = jnp.arange(lookback + K, dtype=jnp.int32) - lookback + start  # window columns
        mask = (ri < 0)[None, None] | jnp.take(anc, jnp.clip(ri, 0, R - 1), axis=2)
        cache = kv.set_lengths(search.cache, base + start)
        feed = jnp.take_along_axis(pool.tok, f_idx, axis=1)
        pos = jnp.broadcast_to((base + t + 1)[:, None], (b, K))
        parent_h = jnp.take_along_axis(
            search.h, parent_slot.reshape((b, K) + (1,) * (search.h.ndim - 2)), axis=1)
        logits_BKV, h_BKH, cache = self._step(feed, parent_h, pos, cache, mask)
        reg_h = search.h.at[rows, jnp.broadcast_to(slots, (b, K))].set(h_BKH)
        logp, kid_tok = jax.lax.top_k(jax.nn.log_softmax(logits_BKV * scale, axis=-1), K)
        score = (jnp.take_along_axis(pool.score, f_idx, axis=1)[:, :, None] + logp)
        score = score.reshape(b, K * K)
        base_idx = 1 + K + t * K * K
        new_idx = base_idx + jnp.arange(K * K, dtype=jnp.int32)
        upd = lambda a, v: jax.lax.dynamic_update_slice_in_dim(a, v, base_idx, axis=1)
        pool = _Pool(tok=upd(pool.tok, kid_tok.reshape(b, K * K).astype(jnp.int32)),
                     score=upd(pool.score, score),
                     parent=upd(pool.parent, jnp.repeat(f_idx, K, axis=1)),
                     depth=upd(pool.depth, jnp.full((b, K * K), t + 2, jnp.int32)),
                     slot=pool_slot)
        return _Search(cache, pool, reg_anc, reg_h, jnp.broadcast_to(new_idx, (b, K * K)),
                       score, search.finite & finite_rows(logits_BKV)), None

      search = _Search(
          cache=cache, pool=pool,
          anc=jnp.zeros((b, R, R), bool).at[:, 0, 0].set(True),
          h=jnp.zeros((b, R) + root_h_BH.shape[1:], root_h_BH.dtype).at[:, 0].set(root_h_BH),
          cand_idx=jnp.zeros((b, K * K), jnp.int32).at[:, :K].set(1 + jnp.arange(K)),
          cand_score=jnp.full((b, K * K), -jnp.inf).at[:, :K].set(logp), finite=finite)
      search, _ = jax.lax.scan(level, search, jnp.arange(D - 1, dtype=jnp.int32))
      cache, pool, finite = search.cache, search.pool, search.finite
    pool_tok, pool_score, pool_parent, pool_depth, pool_slot = pool
    # The N best candidates (ties: lower pool index, i.e. ancestors first), in pool order.
    _, sel = jax.lax.top_k(pool_score[:, 1:], N)
    sel = jnp.sort(sel + 1, axis=1)  # [B, N] pool indices, topological
    node_of_pool = jnp.zeros((b, P), jnp.int32).at[rows, sel].set(
        jnp.broadcast_to(jnp.arange(1, N + 1, dtype=jnp.int32), (b, N)))
    parent_pool = jnp.take_along_axis(pool_parent, sel, axis=1)
    parents = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32),
                               jnp.take_along_axis(node_of_pool, parent_pool, axis=1)], axis=1)
    depth = jnp.concatenate([jnp.zeros((b, 1), jnp.int32),
                             jnp.take_along_axis(pool_depth, sel, axis=1)], axis=1)
    node_slots = jnp.concatenate([jnp.zeros((b, 1), jnp.int32),
                                  jnp.take_along_axis(pool_slot, sel, axis=1)], axis=1)
    proposal = Proposal(tokens=jnp.take_along_axis(pool_tok, sel, axis=1), q=None,
                        parents=parents, depth=depth, finite=finite)
    return proposal, state.replace(cache=kv.set_lengths(cache, length), node_slots=node_slots)
