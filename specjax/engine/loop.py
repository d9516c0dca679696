"""The jitted decoding loops and their state: plain autoregressive and speculative (one
tree), one `jax.lax.while_loop` each. The adaptive loop (a menu of shapes picked per cycle
by `adaptive.AdaptivePolicy`) is `specjax.engine.adaptive.loop`, built from this module's
public pieces (`start`: prefill, `emit`, `draft_proposal`, `spec_cycle`, `plain_step`,
`LoopState`, `Stats`).

Bookkeeping shared by the loops (per row b of a ragged batch):
- `tokens[b]` holds the prompt then every emitted token; `length[b]` = L is the index of
  the pending token: tokens [0, L) are in the target's KV cache, token L (the last one
  emitted) is not yet. Prefill samples the first token, so L starts at the prompt length.
- A row is done when it emitted `budget[b]` tokens or one of the EOS ids (`is_eos`); done
  rows keep flowing through the (static-shape) computation but commit nothing.
- Emitted so far = L + 1 - prompt_len.

A speculative cycle verifies a token tree (a chain of k drafts is the tree `chain(k)`;
there is one code path). The drafter proposes N nodes under the root x_L; the tree's verify
layout (`tree.layout(proposal)`: a constant for a `TreeSpec`, built from the proposal for
a `DynamicTree`) places node i at position L + depth[i] under the ancestor mask (a chain: a
causal block of k+1 tokens); the target scores [x_L, nodes] in one pass;
`acceptance.accept_tree` keeps the deepest surviving root-to-node path (n nodes) and draws
one more token (correction or bonus); n + 1 tokens are emitted (fewer if EOS or the budget
cuts in). The target's cache moves the path's entries to contiguous slots
(`cache.gather_block`, skipped for chains, where they already are) and commits by moving
lengths; the drafter does the same with its own cache.

The loops are pure, jittable and vmappable, and check nothing: the host API
(`specjax.engine.decoding`) validates inputs and resolves the tree before it calls them. They count
(`Stats`); the analysis of the counts is the host's (`decoding.Generation.summary`).
Runtime values (temperature, top-k, top-p, budgets, EOS ids, seed, drafter weights) are
arrays: changing them reuses the compiled loop. Static: model shapes, batch, prompt bucket,
cache length, the tree shape (the adaptive loop: the policy's menu, see
`specjax.engine.adaptive.loop`). See docs/architecture.md for the jit boundary.
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.verify import acceptance, sampling
from specjax.models.lm import LM
from specjax.drafters.base import Context
from specjax.models import cache as kv
from specjax.models.precision import DEFAULT_PRECISION, matmul_precision
from specjax.models.fused import prefused

Array = jax.Array

# Number of times each loop was traced (compiled); tests assert on it.
TRACE_COUNTS: collections.Counter = collections.Counter()


# ----------------------------------------------------------------------------- loop state


@struct.dataclass
class Stats:
  """Per-row counters of a speculative run (D = tree depth, W = tree width; chain: D = k).

  cycles, drafted (N nodes per cycle; k for a chain), accepted (accepted path length = drafts
  accepted), hist[n] (cycles that accepted n), cycle_log (n of each cycle, -1 unused) mean
  the same for chains as for trees. Trees add: verified (nodes the target verified),
  depth_tried / depth_accepted [B, D] (cycles that tried / accepted a depth-d node),
  rank_tried / rank_accepted [B, W] (candidates of sibling rank r tried / accepted).

  cycle_log is int32: a cycle accepts n <= D nodes and D < the cache length, an int32, so
  no allowed tree overflows it.
  """

  cycles: Array  # int32 [B] verification passes
  drafted: Array  # int32 [B] drafted nodes
  accepted: Array  # int32 [B] accepted drafted nodes (path lengths)
  hist: Array  # int32 [B, D+1] cycles by accepted path length
  cycle_log: Array  # int32 [B, C] accepted path length of each cycle, -1 where unused
  verified: Array  # int32 [B] nodes verified by the target
  depth_tried: Array  # int32 [B, D]
  depth_accepted: Array  # int32 [B, D]
  rank_tried: Array  # int32 [B, W]
  rank_accepted: Array  # int32 [B, W]

  @classmethod
  def zeros(cls, batch: int, depth: int, max_cycles: int, width: int = 1) -> "Stats":
    z = jnp.zeros((batch,), jnp.int32)
    return cls(cycles=z, drafted=z, accepted=z, hist=jnp.zeros((batch, depth + 1), jnp.int32),
               cycle_log=jnp.full((batch, max_cycles), -1, jnp.int32), verified=z,
               depth_tried=jnp.zeros((batch, depth), jnp.int32),
               depth_accepted=jnp.zeros((batch, depth), jnp.int32),
               rank_tried=jnp.zeros((batch, width), jnp.int32),
               rank_accepted=jnp.zeros((batch, width), jnp.int32))

  def record(self, active_B, result: acceptance.TreeResult, nodes: int,
             drafted_B=None) -> "Stats":
    """Adds one cycle of the active rows: `nodes` verified, `drafted_B` of them drafted (None:
    all; fewer when drafting stopped early, `_drafted_only`)."""
    act = active_B.astype(jnp.int32)
    drafted = nodes if drafted_B is None else drafted_B
    n = result.n_accepted
    rows = jnp.arange(act.shape[0])
    at = jnp.minimum(self.cycles, self.cycle_log.shape[1] - 1)
    log = self.cycle_log.at[rows, at].set(
        jnp.where(active_B, n.astype(self.cycle_log.dtype), self.cycle_log[rows, at]))
    depth = self.depth_tried.shape[1]
    reached = (jnp.arange(1, depth + 1, dtype=jnp.int32)[None] <= n[:, None]).astype(jnp.int32)
    a1 = act[:, None]
    return Stats(cycles=self.cycles + act, drafted=self.drafted + drafted * act,
                 accepted=self.accepted + n * act,
                 hist=self.hist.at[rows, n].add(act), cycle_log=log,
                 verified=self.verified + nodes * act,
                 depth_tried=self.depth_tried + result.depth_tried.astype(jnp.int32) * a1,
                 depth_accepted=self.depth_accepted + reached * a1,
                 rank_tried=self.rank_tried + result.rank_tried * a1,
                 rank_accepted=self.rank_accepted + result.rank_accepted * a1)


@struct.dataclass
class LoopState:
  tokens: Array  # int32 [B, S]
  length: Array  # int32 [B] index of the pending token
  done: Array  # bool [B]
  cache: kv.KVCache
  key: Array
  draft: Any = None  # drafter state (speculative loops only)
  stats: Stats | None = None
  adapt: Any = None  # adaptive_loop.AdaptState (adaptive loop only)
  # int32 []: target passes (plain steps, verifications) in which an active row's logits
  # held a NaN or ±inf; the host API refuses such a run.
  nonfinite: Any = np.int32(0)
  # int32 []: drafting passes (proposals, catch-ups) in which an active row's draft logits
  # held a NaN or +inf (`Proposal.finite`) or its q a NaN or ±inf; refused the same way.
  draft_nonfinite: Any = np.int32(0)

  def context(self) -> Context:
    return Context(tokens=self.tokens, length=self.length)


def count_nonfinite(active_B, *arrays_B) -> Array:
  """1 (int32) if an active row of any of the arrays (None: skipped) holds a NaN or ±inf,
  else 0: one reduction over values the pass already computed, no host sync."""
  bad_B = jnp.zeros(active_B.shape, bool)
  for x in arrays_B:
    if x is not None:
      bad_B = bad_B | ~jnp.all(jnp.isfinite(x), axis=tuple(range(1, x.ndim)))
  return jnp.any(bad_B & active_B).astype(jnp.int32)


def count_draft_nonfinite(active_B, proposal) -> Array:
  """1 (int32) if an active row's proposal was drafted from non-finite logits
  (`Proposal.finite`; None: no logits to check) or its q holds a NaN or ±inf, else 0: a
  NaN draft proposes argmaxes of NaNs that look like ordinary rejected drafts (α = 0)."""
  bad = count_nonfinite(active_B, proposal.q)
  if proposal.finite is not None:
    bad = bad | jnp.any(active_B & ~proposal.finite).astype(jnp.int32)
  return bad


def not_finished(state: LoopState) -> Array:
  return ~jnp.all(state.done)


def start(target: LM, prompt_BP, prompt_len_B, budget_B, eos, sampler, key, cache_len: int,
           capture=()):
  """Every loop's prologue: prefill the target, sample the first token (with the first half
  of a split of `key`), lay out the token buffer; a row whose first token ends it (budget 1
  or an EOS id) starts done. Returns (LoopState without drafter state or counters, the
  prompt's captured features (`Transformer.__call__`) with `capture`, else None)."""
  b, p = prompt_BP.shape
  key, first_key = jax.random.split(key)
  cache = kv.init(target.config, b, cache_len)
  hidden_BD, cache, *features = target.prefill(cache, prompt_BP, prompt_len_B, capture)
  first = sampling.sample(first_key, sampling.warp(target.head(hidden_BD), sampler))
  tokens = jnp.zeros((b, cache_len), jnp.int32).at[:, :p].set(prompt_BP)
  tokens = tokens.at[jnp.arange(b), prompt_len_B].set(first)
  length = prompt_len_B.astype(jnp.int32)
  done = _finished(jnp.ones_like(length), budget_B, is_eos(first, eos))
  state = LoopState(tokens=tokens, length=length, done=done, cache=cache, key=key)
  return state, (features[0] if capture else None)


def _finished(emitted_B, budget_B, hit_eos_B):
  return (emitted_B >= budget_B) | hit_eos_B


def is_eos(tokens, eos) -> Array:
  """tokens (any shape) equal to one of the EOS ids: `eos` is an int32 scalar or an [E]
  array padded with -1 (`batching.eos_ids`: a fixed E, so other ids of the same count or
  fewer reuse the compiled loop); -1 matches no token."""
  eos = jnp.reshape(eos, (1,) * jnp.ndim(tokens) + (-1,))
  return jnp.any(tokens[..., None] == eos, axis=-1)


def _write_rows(tokens_BS, start_B, values_BT, count_B):
  """tokens[b, start[b] + j] = values[b, j] for j < count[b]; other slots unchanged."""
  t = values_BT.shape[1]

  def one(row, start, vals, count):
    old = jax.lax.dynamic_slice(row, (start,), (t,))
    new = jnp.where(jnp.arange(t) < count, vals, old)
    return jax.lax.dynamic_update_slice(row, new, (start,))

  return jax.vmap(one)(tokens_BS, start_B, values_BT, count_B)


# ----------------------------------------------------------------------------- the loops


def under_precision(loop_fn):
  """The loop with a `precision` keyword (static; `specjax.models.precision`, "highest" by
  default): every product of the loop is traced under that policy, whoever calls it, so a
  direct call and the host API's compile the same program (but for the packed weights the
  API's models carry, `decoding.with_packs`). The fused products' weights of every model
  among the arguments (`fused.prefused`: the target, a drafter's models) are concatenated,
  and packed where the models carry no packed copies, once, before the loop."""
  def run(*args, precision: str = DEFAULT_PRECISION, **kwargs):
    lms = [x for x in jax.tree_util.tree_leaves((args, kwargs),
                                                is_leaf=lambda x: isinstance(x, LM))
           if isinstance(x, LM)]
    with matmul_precision(precision), prefused([x.module() for x in lms],
                                               [x.packs for x in lms]):
      return loop_fn(*args, **kwargs)
  run.__name__, run.__qualname__, run.__doc__ = (loop_fn.__name__, loop_fn.__qualname__,
                                                 loop_fn.__doc__)
  run.__module__ = loop_fn.__module__
  return run


def generate_loop(target: LM, prompt_BP, prompt_len_B, budget_B, eos, sampler, key, *,
                  cache_len: int) -> LoopState:
  """Plain autoregressive decoding (pure, jittable, vmappable). Returns the final LoopState."""
  TRACE_COUNTS["generate"] += 1
  init, _ = start(target, prompt_BP, prompt_len_B, budget_B, eos, sampler, key, cache_len)

  def body(s: LoopState) -> LoopState:
    return plain_step(target, s, sampler, prompt_len_B, budget_B, eos)[0]

  return jax.lax.while_loop(not_finished, body, init)


def plain_step(target: LM, s: LoopState, sampler, prompt_len_B, budget_B, eos, capture=()):
  """One plain decoding step of every active row (the body of `generate_loop`; the adaptive
  loop's lazy k = 0 steps are the same step): the pending token through the target, the next
  token sampled from its warped law p (the second half of a split of the state's key).
  Returns (state, p_BV, next token per row, active rows, the pending token's captured
  features [B, C, D] with `capture`, else None)."""
  rows = jnp.arange(s.tokens.shape[0])
  key, step_key = jax.random.split(s.key)
  cur = s.tokens[rows, s.length]
  logits, _, cache, *features = target(cur[:, None], s.length[:, None], s.cache, None, capture)
  p_BV = sampling.warp(logits[:, 0], sampler)
  nxt = sampling.sample(step_key, p_BV)
  active = ~s.done
  write_at = jnp.minimum(s.length + 1, s.tokens.shape[1] - 1)
  tokens = s.tokens.at[rows, write_at].set(jnp.where(active, nxt, s.tokens[rows, write_at]))
  length = s.length + active.astype(jnp.int32)
  done = s.done | _finished(length + 1 - prompt_len_B, budget_B, active & is_eos(nxt, eos))
  new = s.replace(tokens=tokens, length=length, done=done, key=key,
                  cache=kv.set_lengths(cache, length),
                  nonfinite=s.nonfinite + count_nonfinite(active, logits))
  return new, p_BV, nxt, active, (features[0][:, 0] if capture else None)


def emit(s: LoopState, emitted_BT, n_B, prompt_len_B, budget_B, eos, stop_B=None):
  """Writes a cycle's tokens: emitted_BT[:, :m] with m = min(n + 1, room, stop + 1), cut
  after an EOS; done rows write nothing. Returns (tokens, length, done, active)."""
  steps = jnp.arange(emitted_BT.shape[1], dtype=jnp.int32)
  active = ~s.done
  room = budget_B - (s.length + 1 - prompt_len_B)
  m = jnp.minimum(n_B + 1, room)
  if stop_B is not None:  # dynamic draft stopping: the cut is fixed before verification
    m = jnp.minimum(m, stop_B + 1)
  at_eos = is_eos(emitted_BT, eos) & (steps[None] < m[:, None])
  hit_eos = jnp.any(at_eos, axis=1)
  m = jnp.where(hit_eos, jnp.argmax(at_eos, axis=1) + 1, m)
  m = jnp.where(active, m, 0).astype(jnp.int32)
  tokens = _write_rows(s.tokens, s.length + 1, emitted_BT, m)
  length = s.length + m
  done = s.done | (active & (hit_eos | (m >= room)))
  return tokens, length, done, active


def draft_proposal(drafter, s: LoopState, tree, sampler, key):
  """drafter.propose on the loop state: (proposal, draft state, target cache). A drafter that
  shares the target's cache (`Drafter.shares_target_cache`, static) borrows it for the
  proposal (`borrow_cache`) and hands it back (`return_cache`) with its entries at slots >= L,
  which the verify pass (or the plain step) rewrites before reading; the committed prefix
  [0, L) is never written, so the target computes exactly what it computes without it."""
  if not drafter.shares_target_cache:
    proposal, draft = drafter.propose(s.draft, s.context(), tree, sampler, key)
    return proposal, draft, s.cache
  draft = drafter.borrow_cache(s.draft, s.cache)
  proposal, draft = drafter.propose(draft, s.context(), tree, sampler, key)
  draft, cache = drafter.return_cache(draft, s.cache)
  return proposal, draft, cache


def _drafted_only(result: acceptance.TreeResult, drafted_B) -> acceptance.TreeResult:
  """A chain's result counted over its drafted nodes only (dynamic draft stopping: nodes
  past drafted_B are fillers, and the cycle emits at most drafted + 1 tokens): accepted
  drafts capped at drafted_B, deeper depths not tried, rank 0 counts to match. What the
  stats and the policy's acceptance estimate see, so fillers never count as rejections."""
  depths = result.depth_tried.shape[1]
  keep = jnp.arange(1, depths + 1, dtype=jnp.int32)[None] <= drafted_B[:, None]
  tried = result.depth_tried & keep
  n = jnp.minimum(result.n_accepted, drafted_B)
  return result.replace(n_accepted=n, depth_tried=tried,
                        rank_tried=result.rank_tried.at[:, 0].set(
                            jnp.sum(tried, axis=1).astype(result.rank_tried.dtype)),
                        rank_accepted=result.rank_accepted.at[:, 0].set(
                            n.astype(result.rank_accepted.dtype)))


def spec_cycle(target, drafter, s: LoopState, tree, sampler, draft_key, accept_key,
                prompt_len_B, budget_B, eos, capture, width=None):
  """One speculative cycle of `tree` (module doc). Emission padded to `width` tokens (None:
  the tree's D + 1). A proposal that stopped drafting early (`Proposal.drafted`, dynamic
  draft stopping) emits at most drafted + 1 tokens, and the TreeResult returned (for the
  stats and the policy) counts its drafted nodes only (`_drafted_only`). Returns (state
  without stats, TreeResult, active_B, drafted_B or None)."""
  depth = tree.max_depth
  steps = jnp.arange(depth + 1, dtype=jnp.int32)
  extra = (lambda f: {"features": f}) if capture else (lambda f: {})
  proposal, draft, cache = draft_proposal(drafter, s, tree, sampler, draft_key)

  # One target pass over [x_L, nodes] at positions L + depth, ancestor mask.
  layout = tree.layout(proposal)
  cur = jnp.take_along_axis(s.tokens, s.length[:, None], axis=1)
  verify_BT = jnp.concatenate([cur, proposal.tokens], axis=1)
  logits, _, cache, *features = target(verify_BT, layout.positions(s.length), cache,
                                       layout.block_mask(), capture)
  p_BTV = sampling.warp(logits, sampler)
  result = acceptance.accept_tree(accept_key, layout, verify_BT, p_BTV, proposal.q)
  n = result.n_accepted

  # Emitted this cycle: the path's n nodes then the target's token; cut at EOS and budget.
  path_tokens = jnp.take_along_axis(verify_BT, result.path, axis=1)  # [B, D+1], root first
  path_tokens = jnp.concatenate([path_tokens[:, 1:], path_tokens[:, :1]], axis=1)
  emitted_BT = jnp.where(steps[None] < n[:, None], path_tokens, result.next_token[:, None])
  if width is not None and width > depth + 1:  # tokens past n + 1 are never written
    emitted_BT = jnp.pad(emitted_BT, ((0, 0), (0, width - depth - 1)))
  stop = proposal.drafted
  tokens, length, done, active = emit(s, emitted_BT, n, prompt_len_B, budget_B, eos, stop)
  ctx = Context(tokens=tokens, length=length)
  if not layout.is_chain:  # the path's entries to [L, L + n]; a chain's are in place
    cache = kv.gather_block(cache, result.path, layout.n_nodes)
  new = s.replace(tokens=tokens, length=length, done=done,
                  cache=kv.set_lengths(cache, length),
                  nonfinite=s.nonfinite + count_nonfinite(active, logits),
                  draft_nonfinite=s.draft_nonfinite + count_draft_nonfinite(active, proposal),
                  draft=drafter.commit(draft, ctx, tree, result.path, n,
                                       **extra(features[0] if capture else None)))
  if stop is not None:  # fillers are not drafts (after emission and commit, which use all)
    result = _drafted_only(result, stop)
  return new, result, active, stop


def speculative_loop(target: LM, drafter, prompt_BP, prompt_len_B, budget_B, eos, sampler,
                     key, *, tree, cache_len: int) -> LoopState:
  """Speculative decoding of a token tree (pure, jittable, vmappable).

  tree: a resolved `trees.TreeSpec` (a chain of k drafts is `trees.chain(k)`) or
  `trees.DynamicTree`, static. Returns the final LoopState (its `stats` hold the counters).
  """
  TRACE_COUNTS["speculative"] += 1
  b = prompt_BP.shape[0]
  nodes, depth = tree.size, tree.max_depth
  capture = tuple(drafter.feature_layers)  # static: target features the drafter reads
  extra = (lambda f: {"features": f}) if capture else (lambda f: {})
  init, prompt_features = start(target, prompt_BP, prompt_len_B, budget_B, eos, sampler, key,
                                 cache_len, capture)

  def body(s: LoopState) -> LoopState:
    key, draft_key, accept_key = jax.random.split(s.key, 3)
    new, result, active, drafted = spec_cycle(target, drafter, s, tree, sampler, draft_key,
                                               accept_key, prompt_len_B, budget_B, eos,
                                               capture)
    return new.replace(key=key, stats=s.stats.record(active, result, nodes, drafted))

  init = init.replace(draft=drafter.init(prompt_BP, prompt_len_B, cache_len, tree,
                                          **extra(prompt_features)),
                      stats=Stats.zeros(b, depth, cache_len, tree.max_width))
  return jax.lax.while_loop(not_finished, body, init)


# Lazy catch-up bound P (`adaptive.loop.adaptive_loop`): plain steps a drafter may fall behind
# by, and the longest run of plain steps one k = 0 cycle makes. The per-cycle choice and
# bookkeeping cost about a small target's step, so P sets how visible they stay where plain
# decoding is best (figures by P: BUILD_NOTES.md, "Engine"); the price is a wider catch-up
# pass (P + 1 tokens through the draft) once per P steps.
LAZY_SLOTS = 32


# The compiled loops the host API calls: one compile per static configuration.
generate_loop = under_precision(generate_loop)
speculative_loop = under_precision(speculative_loop)
generate_jit = jax.jit(generate_loop, static_argnames=("cache_len", "precision"))
speculative_jit = jax.jit(speculative_loop, static_argnames=("tree", "cache_len", "precision"))
