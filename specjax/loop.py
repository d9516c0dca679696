"""The jitted decoding loops and their state: plain autoregressive, speculative (one tree)
and adaptive (a menu of shapes picked per cycle by `adaptive.AdaptivePolicy`, see
`adaptive_loop`), one `jax.lax.while_loop` each.

Bookkeeping shared by both loops (per row b of a ragged batch):
- `tokens[b]` holds the prompt then every emitted token; `length[b]` = L is the index of
  the pending token: tokens [0, L) are in the target's KV cache, token L (the last one
  emitted) is not yet. Prefill samples the first token, so L starts at the prompt length.
- A row is done when it emitted `budget[b]` tokens or an EOS; done rows keep flowing
  through the (static-shape) computation but commit nothing.
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
(`specjax.decoding`) validates inputs and resolves the tree before it calls them. They count
(`Stats`); the analysis of the counts is the host's (`decoding.Generation.summary`).
Runtime values (temperature, top-k, top-p, budgets, EOS id, seed, drafter weights) are
arrays: changing them reuses the compiled loop. Static: model shapes, batch, prompt bucket,
cache length, the tree shape (the adaptive loop: the policy's menu; its costs, estimate
parameters, threshold and forced schedule are arrays; draft stopping on or off is
static). See docs/architecture.md for the jit boundary.
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import acceptance, sampling, trees
from specjax.drafters.base import LM, Context
from specjax.models import cache as kv
from specjax.models.precision import DEFAULT_PRECISION, matmul_precision

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
  adapt: Any = None  # AdaptState (adaptive loop only)
  # int32 []: target passes (plain steps, verifications) in which an active row's logits, or
  # the draft's probabilities q, held a NaN or ±inf; the host API refuses such a run.
  nonfinite: Any = np.int32(0)

  def context(self) -> Context:
    return Context(tokens=self.tokens, length=self.length)


def _nonfinite(active_B, *arrays_B) -> Array:
  """1 (int32) if an active row of any of the arrays (None: skipped) holds a NaN or ±inf,
  else 0: one reduction over values the pass already computed, no host sync."""
  bad_B = jnp.zeros(active_B.shape, bool)
  for x in arrays_B:
    if x is not None:
      bad_B = bad_B | ~jnp.all(jnp.isfinite(x), axis=tuple(range(1, x.ndim)))
  return jnp.any(bad_B & active_B).astype(jnp.int32)


def _not_finished(state: LoopState) -> Array:
  return ~jnp.all(state.done)


def _start(target: LM, prompt_BP, prompt_len_B, sampler, key, cache_len: int, capture=()):
  """Prefill the target, sample the first token, lay out the token buffer. With `capture`
  also returns the prompt's captured features (`Transformer.__call__`), else None."""
  b, p = prompt_BP.shape
  cache = kv.init(target.config, b, cache_len)
  hidden_BD, cache, *features = target.prefill(cache, prompt_BP, prompt_len_B, capture)
  first = sampling.sample(key, sampling.warp(target.head(hidden_BD), sampler))
  tokens = jnp.zeros((b, cache_len), jnp.int32).at[:, :p].set(prompt_BP)
  tokens = tokens.at[jnp.arange(b), prompt_len_B].set(first)
  return tokens, cache, first, (features[0] if capture else None)


def _finished(emitted_B, budget_B, hit_eos_B):
  return (emitted_B >= budget_B) | hit_eos_B


def _write_rows(tokens_BS, start_B, values_BT, count_B):
  """tokens[b, start[b] + j] = values[b, j] for j < count[b]; other slots unchanged."""
  t = values_BT.shape[1]

  def one(row, start, vals, count):
    old = jax.lax.dynamic_slice(row, (start,), (t,))
    new = jnp.where(jnp.arange(t) < count, vals, old)
    return jax.lax.dynamic_update_slice(row, new, (start,))

  return jax.vmap(one)(tokens_BS, start_B, values_BT, count_B)


# ----------------------------------------------------------------------------- the loops


def _under_precision(loop_fn):
  """The loop with a `precision` keyword (static; `specjax.models.precision`, "highest" by
  default): every product of the loop is traced under that policy, whoever calls it, so a
  direct call and the host API's compile the same program."""
  def run(*args, precision: str = DEFAULT_PRECISION, **kwargs):
    with matmul_precision(precision):
      return loop_fn(*args, **kwargs)
  run.__name__, run.__qualname__, run.__doc__ = (loop_fn.__name__, loop_fn.__qualname__,
                                                 loop_fn.__doc__)
  run.__module__ = loop_fn.__module__
  return run


def generate_loop(target: LM, prompt_BP, prompt_len_B, budget_B, eos, sampler, key, *,
                  cache_len: int) -> LoopState:
  """Plain autoregressive decoding (pure, jittable, vmappable). Returns the final LoopState."""
  TRACE_COUNTS["generate"] += 1
  key, first_key = jax.random.split(key)
  tokens, cache, first, _ = _start(target, prompt_BP, prompt_len_B, sampler, first_key,
                                   cache_len)
  length = prompt_len_B.astype(jnp.int32)
  done = _finished(jnp.ones_like(length), budget_B, first == eos)
  rows = jnp.arange(length.shape[0])

  def body(s: LoopState) -> LoopState:
    key, step_key = jax.random.split(s.key)
    cur = s.tokens[rows, s.length]
    logits, _, cache = target(cur[:, None], s.length[:, None], s.cache)
    nxt = sampling.sample(step_key, sampling.warp(logits[:, 0], sampler))
    active = ~s.done
    write_at = jnp.minimum(s.length + 1, s.tokens.shape[1] - 1)
    tokens = s.tokens.at[rows, write_at].set(jnp.where(active, nxt, s.tokens[rows, write_at]))
    length = s.length + active.astype(jnp.int32)
    done = s.done | _finished(length + 1 - prompt_len_B, budget_B, active & (nxt == eos))
    return s.replace(tokens=tokens, length=length, done=done, key=key,
                     cache=kv.set_lengths(cache, length),
                     nonfinite=s.nonfinite + _nonfinite(active, logits))

  init = LoopState(tokens=tokens, length=length, done=done, cache=cache, key=key)
  return jax.lax.while_loop(_not_finished, body, init)


def _emit(s: LoopState, emitted_BT, n_B, prompt_len_B, budget_B, eos, stop_B=None):
  """Writes a cycle's tokens: emitted_BT[:, :m] with m = min(n + 1, room, stop + 1), cut
  after an EOS; done rows write nothing. Returns (tokens, length, done, active)."""
  steps = jnp.arange(emitted_BT.shape[1], dtype=jnp.int32)
  active = ~s.done
  room = budget_B - (s.length + 1 - prompt_len_B)
  m = jnp.minimum(n_B + 1, room)
  if stop_B is not None:  # dynamic draft stopping: the cut is fixed before verification
    m = jnp.minimum(m, stop_B + 1)
  is_eos = (emitted_BT == eos) & (steps[None] < m[:, None])
  hit_eos = jnp.any(is_eos, axis=1)
  m = jnp.where(hit_eos, jnp.argmax(is_eos, axis=1) + 1, m)
  m = jnp.where(active, m, 0).astype(jnp.int32)
  tokens = _write_rows(s.tokens, s.length + 1, emitted_BT, m)
  length = s.length + m
  done = s.done | (active & (hit_eos | (m >= room)))
  return tokens, length, done, active


def _propose(drafter, s: LoopState, tree, sampler, key):
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


def _spec_cycle(target, drafter, s: LoopState, tree, sampler, draft_key, accept_key,
                prompt_len_B, budget_B, eos, capture, width=None):
  """One speculative cycle of `tree` (module doc). Emission padded to `width` tokens (None:
  the tree's D + 1). A proposal that stopped drafting early (`Proposal.drafted`, dynamic
  draft stopping) emits at most drafted + 1 tokens, and the TreeResult returned (for the
  stats and the policy) counts its drafted nodes only (`_drafted_only`). Returns (state
  without stats, TreeResult, active_B, drafted_B or None)."""
  depth = tree.max_depth
  steps = jnp.arange(depth + 1, dtype=jnp.int32)
  extra = (lambda f: {"features": f}) if capture else (lambda f: {})
  proposal, draft, cache = _propose(drafter, s, tree, sampler, draft_key)

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
  tokens, length, done, active = _emit(s, emitted_BT, n, prompt_len_B, budget_B, eos, stop)
  ctx = Context(tokens=tokens, length=length)
  if not layout.is_chain:  # the path's entries to [L, L + n]; a chain's are in place
    cache = kv.gather_block(cache, result.path, layout.n_nodes)
  new = s.replace(tokens=tokens, length=length, done=done,
                  cache=kv.set_lengths(cache, length),
                  nonfinite=s.nonfinite + _nonfinite(active, logits, proposal.q),
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
  key, first_key = jax.random.split(key)
  capture = tuple(drafter.feature_layers)  # static: target features the drafter reads
  extra = (lambda f: {"features": f}) if capture else (lambda f: {})
  tokens, cache, first, prompt_features = _start(target, prompt_BP, prompt_len_B, sampler,
                                                 first_key, cache_len, capture)
  length = prompt_len_B.astype(jnp.int32)
  done = _finished(jnp.ones_like(length), budget_B, first == eos)

  def body(s: LoopState) -> LoopState:
    key, draft_key, accept_key = jax.random.split(s.key, 3)
    new, result, active, drafted = _spec_cycle(target, drafter, s, tree, sampler, draft_key,
                                               accept_key, prompt_len_B, budget_B, eos,
                                               capture)
    return new.replace(key=key, stats=s.stats.record(active, result, nodes, drafted))

  init = LoopState(tokens=tokens, length=length, done=done, cache=cache, key=key,
                   draft=drafter.init(prompt_BP, prompt_len_B, cache_len, tree,
                                      **extra(prompt_features)),
                   stats=Stats.zeros(b, depth, cache_len, tree.max_width))
  return jax.lax.while_loop(_not_finished, body, init)


@struct.dataclass
class AdaptState:
  """The adaptive loop's own state: the policy's per-row exponentially weighted counts
  (acc, tried [B, R + D]: per sibling rank, then per depth, `AdaptivePolicy.columns`), the
  loop iteration, the menu entry chosen at each iteration
  (choices [C], -1 unused), the plain (k = 0) steps each row took (plain_steps [B]; one
  token each), the draft-stopping counters per row: cycles whose drafting stopped early
  (stopped) and the draft nodes those cycles did not draft (skipped), and the lazy catch-up
  bookkeeping (`adaptive_loop`): per
  row the tokens emitted by plain steps the drafter has not seen (behind, <= P) and the
  target's probability of each (behind_p, for the acceptance estimate), and the number of
  catch-up passes run (catch_ups)."""

  acc: Array  # float32 [B, R + D]
  tried: Array  # float32 [B, R + D]
  cycle: Array  # int32 []
  choices: Array  # int32 [C]
  plain_steps: Array  # int32 [B]
  stopped: Array  # int32 [B]
  skipped: Array  # int32 [B]
  behind: Array  # int32 [B] lazy catch-up: tokens emitted since the drafter was last synced
  behind_p: Array  # float32 [B, P] the target's probability of each of them (its warped law)
  catch_ups: Array  # int32 [] lazy catch-up passes run


def _pad_result(result: acceptance.TreeResult, depth: int, width: int) -> acceptance.TreeResult:
  """A TreeResult padded to depth D and width W (path: deepest node repeated, as the rule
  pads it; tried/accepted counters: zeros)."""
  d = result.depth_tried.shape[1]
  w = result.rank_tried.shape[1]
  path = jnp.concatenate([result.path, jnp.repeat(result.path[:, -1:], depth - d, axis=1)],
                         axis=1)
  return result.replace(path=path,
                        depth_tried=jnp.pad(result.depth_tried, ((0, 0), (0, depth - d))),
                        rank_tried=jnp.pad(result.rank_tried, ((0, 0), (0, width - w))),
                        rank_accepted=jnp.pad(result.rank_accepted, ((0, 0), (0, width - w))))


def _draft_acceptance(proposal, p_BV) -> Array:
  """P(the one-token draft of a chain(1) proposal would be accepted) given the target's
  warped law p: Σ min(p, q) for a sampled draft, p(x) for a deterministic one."""
  if proposal.q is None:
    return jnp.take_along_axis(p_BV, proposal.tokens[:, :1], axis=1)[:, 0]
  return jnp.sum(jnp.minimum(p_BV, proposal.q[:, 0]), axis=-1)


# Lazy catch-up bound P (`adaptive_loop`): plain steps a drafter may fall behind by, and the
# longest run of plain steps one k = 0 cycle makes. The per-cycle choice and bookkeeping cost
# about a small target's step, so P sets how visible they stay where plain decoding is best
# (embedded pair, batch 1, CPU, forced k = 0 vs plain: P = 8 ~0.92x, 16 ~0.95x, 32 ~0.98x);
# the price is a wider catch-up pass (P + 1 tokens through the draft) once per P steps.
LAZY_SLOTS = 32


def _catch_up_observation(guess, tokens_BS, length_B, behind_B, p_BP, policy):
  """The policy's first-draft observation (rank 0, depth 1) from a catch-up's guesses for
  the skipped tokens x_j (the target sampled x_j from its warped law p_j): per token the
  acceptance probability's unbiased estimate min(1, q_j(x_j) / p_j(x_j)) (E over x ~ p:
  Σ min(p, q)), or [guess_j = x_j] for point masses (E: p(guess)). Returns (acc_obs,
  tried_obs) [B, R + D] (`AdaptivePolicy.observation`)."""
  width = p_BP.shape[1]
  if guess is None:
    z = policy.first_draft_observation(jnp.zeros(length_B.shape, jnp.float32))
    return z, z
  j = jnp.arange(width, dtype=jnp.int32)[None]
  valid = j < behind_B[:, None]
  at = jnp.clip(length_B[:, None] - behind_B[:, None] + 1 + j, 0, tokens_BS.shape[1] - 1)
  x_BP = jnp.take_along_axis(tokens_BS, at, axis=1)
  if guess.q is None:
    hit = (guess.tokens == x_BP).astype(jnp.float32)
  else:
    q_x = jnp.take_along_axis(guess.q, x_BP[:, :, None], axis=2)[:, :, 0]
    hit = jnp.minimum(1.0, q_x / jnp.maximum(p_BP, 1e-30))
  hits = jnp.sum(jnp.where(valid, hit, 0.0), axis=1)
  count = jnp.sum(valid, axis=1).astype(jnp.float32)
  return policy.first_draft_observation(hits), policy.first_draft_observation(count)


def _run_chosen(choice, branches, none):
  """branches[choice](none[0]): the chosen menu entry's cycle, run as a chain of
  `lax.while_loop`s of zero or one trip (entry j's loop runs once where choice == j), not as
  one `lax.switch` (nor a chain of `lax.cond`s). XLA:CPU copies buffers that a conditional's
  branch updates in place: every entry of a switch receives the same operand buffers, and an
  entry that writes a cache more than once (a drafter's root then level steps) gets copies
  even alone in a two-way cond; both KV caches were copied each cycle. A loop body updates its
  carry in place (docs/xla_notes.md, trap 10). `none`: the state and the entries' other
  outputs, of their shapes, before any entry ran (exactly one runs)."""
  out = none
  for j, branch in enumerate(branches):
    _, out = jax.lax.while_loop(lambda c: c[0],
                                lambda c, f=branch: (jnp.zeros((), bool), f(c[1][0])),
                                (choice == j, out))
  return out


def adaptive_loop(target: LM, drafter, policy, prompt_BP, prompt_len_B, budget_B, eos,
                  sampler, key, *, cache_len: int, lazy_slots: int = LAZY_SLOTS) -> LoopState:
  """Speculative decoding that picks a menu shape every cycle (`adaptive.AdaptivePolicy`).

  Every menu entry is traced once into this loop and the chosen one runs each cycle
  (`_run_chosen`: one zero-or-one-trip loop per entry, which keeps both KV caches updated in
  place; one compile; the menu is static, the policy's numbers are arrays). All branches return
  the same state: emission is padded to the deepest entry, results to its depth and width.
  A spec entry is a `_spec_cycle` of its tree. k = 0 (entry None) is a plain decoding step,
  token for token `generate_loop`'s (same key use), plus the drafter's catch-up: it proposes
  a chain(1) and commits it with nothing accepted, so a separate-model drafter's cache stays
  at L − 1 (it feeds [x_{L−1}, x_L]); that draft's acceptance probability is the policy's
  observation for the cycle (features for drafters that read them: the one-token pass's,
  the root's row repeated). Speculative cycles only are counted in `stats`; every loop
  iteration's choice is logged in `adapt.choices`.

  Lazy catch-up (drafters with `lazy_catch_up`, when lazy_slots = P > 0, static): a k = 0
  cycle is a run of plain steps, each exactly `generate_loop`'s (same key use), that leave
  the drafter behind; `adapt.behind` counts per row the tokens it has not seen. Before a
  speculative entry drafts, and at the start of a k = 0 cycle where some row is already P
  behind, one `drafter.catch_up` pass (under `lax.cond`: skipped when not needed) brings
  every row up to date; its guesses for the skipped tokens are the policy's observations
  (`_catch_up_observation`), taken before the cycle's choice: a run of plain steps ends
  with the policy choosing again from what the skipped tokens showed (choosing first and
  observing after would let a k = 0 start repeat itself until the budget ran out). Each
  observation (a catch-up pass, a speculative cycle) is one decay step. The run lasts until
  some row would be P behind or a row finishes: until then the policy would choose k = 0
  again (it observed nothing and the active rows are the same), so the run saves the
  per-cycle choice and bookkeeping, which cost as much as a small target's step. A cycle
  that observes nothing leaves the estimate unchanged (no decay). Other drafters (or P = 0)
  catch up eagerly, one step per cycle, as above. `adapt.plain_steps` counts the plain
  steps (tokens) of each row either way.
  """
  TRACE_COUNTS["adaptive"] += 1
  if policy.stopping:  # dynamic draft stopping (static: threshold > 0)
    drafter = drafter.with_stopping(policy.threshold)
  b = prompt_BP.shape[0]
  menu = policy.menu
  depth = max(policy.max_depth, 1)
  width = depth + 1  # emitted tokens, padded
  ranks = policy.width
  key, first_key = jax.random.split(key)
  capture = tuple(drafter.feature_layers)
  extra = (lambda f: {"features": f}) if capture else (lambda f: {})
  tokens, cache, first, prompt_features = _start(target, prompt_BP, prompt_len_B, sampler,
                                                 first_key, cache_len, capture)
  length = prompt_len_B.astype(jnp.int32)
  done = _finished(jnp.ones_like(length), budget_B, first == eos)
  rows = jnp.arange(b)
  one = trees.chain(1)
  # the drafter's state is sized for every entry: their nodes, the deepest one's depth
  largest = trees.cover([e for e in menu if e is not None] or [one])

  lazy = bool(drafter.lazy_catch_up) and lazy_slots > 0
  if lazy and capture:
    raise ValueError("a drafter that reads target features cannot catch up lazily (the loop "
                     "does not keep the features of skipped plain steps); its lazy_catch_up "
                     "must be False")
  slots = max(int(lazy_slots), 0)
  zero_obs = jnp.zeros((b, policy.columns), jnp.float32)

  def catch_up(s: LoopState):
    """Syncs the drafter with the context: (state, acc_obs, tried_obs)."""
    a = s.adapt
    draft, guess = drafter.catch_up(s.draft, s.context(), a.behind, slots, sampler)
    acc_obs, tried_obs = _catch_up_observation(guess, s.tokens, s.length, a.behind,
                                               a.behind_p, policy)
    adapt = a.replace(behind=jnp.zeros_like(a.behind), catch_ups=a.catch_ups + 1)
    return s.replace(draft=draft, adapt=adapt), acc_obs, tried_obs

  def catch_up_and_choose(s: LoopState, active0, left):
    """A catch-up, its observations (one decay step for the rows it observed) and the
    choice they inform: (state, entry index)."""
    s, acc_obs, tried_obs = catch_up(s)
    a = s.adapt
    acc, tried = policy.observe(a.acc, a.tried, acc_obs, tried_obs,
                                active0 & (jnp.sum(tried_obs, axis=1) > 0))
    s = s.replace(adapt=a.replace(acc=acc, tried=tried))
    return s, policy.pick(policy.rates(acc, tried), active0, b, a.cycle, left)

  def lazy_plain_step(c):
    """One plain step, `generate_loop`'s body (same key use), that leaves the drafter one
    more token behind (and keeps the target's probability of that token)."""
    i, s = c
    key, step_key = jax.random.split(s.key)
    cur = s.tokens[rows, s.length]
    logits, _, cache = target(cur[:, None], s.length[:, None], s.cache)
    p_BV = sampling.warp(logits[:, 0], sampler)
    nxt = sampling.sample(step_key, p_BV)
    active = ~s.done
    write_at = jnp.minimum(s.length + 1, s.tokens.shape[1] - 1)
    tokens = s.tokens.at[rows, write_at].set(jnp.where(active, nxt, s.tokens[rows, write_at]))
    length = s.length + active.astype(jnp.int32)
    done = s.done | _finished(length + 1 - prompt_len_B, budget_B, active & (nxt == eos))
    a = s.adapt
    p_x = jnp.take_along_axis(p_BV, nxt[:, None], axis=1)[:, 0]
    slot = jnp.minimum(a.behind, slots - 1)
    behind_p = a.behind_p.at[rows, slot].set(jnp.where(active, p_x, a.behind_p[rows, slot]))
    adapt = a.replace(behind=a.behind + active.astype(jnp.int32), behind_p=behind_p)
    return i + 1, s.replace(tokens=tokens, length=length, done=done, key=key, adapt=adapt,
                            cache=kv.set_lengths(cache, length),
                            nonfinite=s.nonfinite + _nonfinite(active, logits))

  def lazy_plain_branch(s: LoopState):
    """A run of plain steps (a nested while_loop): as many as the bound allows (P − the
    furthest row's lag, after a catch-up when some row is P behind), ending after the step in
    which a row finishes. Within the run the policy would choose k = 0 again every step (it
    observes nothing and the active rows are the same), so the run saves the per-cycle
    choice and bookkeeping, not a decision."""
    room = slots - jnp.max(s.adapt.behind)
    done0, length0 = s.done, s.length

    def more(c):
      i, t = c
      return (i < room) & ~jnp.all(t.done) & jnp.all(t.done == done0)

    _, new = jax.lax.while_loop(more, lazy_plain_step, (jnp.zeros((), jnp.int32), s))
    return new, zero_obs, zero_obs, ~done0, jnp.zeros((b,), jnp.int32), new.length - length0

  def plain_branch(s: LoopState):
    key, step_key = jax.random.split(s.key)  # generate_loop's key use
    draft_key = jax.random.fold_in(step_key, 1)
    proposal, draft, cache = _propose(drafter, s, one, sampler, draft_key)
    cur = s.tokens[rows, s.length]
    logits, _, cache, *features = target(cur[:, None], s.length[:, None], cache, None,
                                         capture)
    p_BV = sampling.warp(logits[:, 0], sampler)
    nxt = sampling.sample(step_key, p_BV)
    emitted_BT = jnp.broadcast_to(nxt[:, None], (b, width))
    tokens, length, done, active = _emit(s, emitted_BT, jnp.zeros_like(s.length), prompt_len_B,
                                         budget_B, eos)
    ctx = Context(tokens=tokens, length=length)
    feats = (jnp.concatenate([features[0], features[0]], axis=1) if capture else None)
    draft = drafter.commit(draft, ctx, one, jnp.zeros((b, 2), jnp.int32),
                           jnp.zeros((b,), jnp.int32), **extra(feats))
    new = s.replace(tokens=tokens, length=length, done=done, key=key, draft=draft,
                    cache=kv.set_lengths(cache, length),
                    nonfinite=s.nonfinite + _nonfinite(active, logits))
    acc_obs = policy.first_draft_observation(_draft_acceptance(proposal, p_BV))
    tried_obs = policy.first_draft_observation(jnp.ones((b,), jnp.float32))
    return (new, acc_obs, tried_obs, active, jnp.zeros((b,), jnp.int32),
            active.astype(jnp.int32))

  def spec_branch(tree):
    def run(s: LoopState):
      key, draft_key, accept_key = jax.random.split(s.key, 3)
      new, result, active, drafted = _spec_cycle(target, drafter, s, tree, sampler,
                                                 draft_key, accept_key, prompt_len_B, budget_B,
                                                 eos, capture, width)
      n = result.n_accepted
      skipped = (jnp.zeros_like(n) if drafted is None  # dynamic draft stopping
                 else jnp.maximum(tree.size - drafted, 0).astype(jnp.int32))
      stats = s.stats.record(active, _pad_result(result, depth, ranks), tree.size, drafted)
      new = new.replace(key=key, stats=stats)
      a1 = active[:, None]
      acc_c, tried_c = policy.cycle_observation(tree, result)
      acc_obs = jnp.where(a1, acc_c, 0.0)
      tried_obs = jnp.where(a1, tried_c, 0.0)
      return (new, acc_obs, tried_obs, active, jnp.where(active, skipped, 0),
              jnp.zeros((b,), jnp.int32))
    return run

  plain = lazy_plain_branch if lazy else plain_branch
  branches = [plain if e is None else spec_branch(e) for e in menu]
  plain_entry = [e is None for e in menu]

  def body(s: LoopState) -> LoopState:
    active0 = ~s.done
    left = budget_B - (s.length + 1 - prompt_len_B)  # each row's budget left
    a = s.adapt
    choice = policy.pick(policy.rates(a.acc, a.tried), active0, b, a.cycle, left)
    if lazy:  # the catch-up the choice needs, then the choice again from what it observed
      need = jnp.any(a.behind >= slots) | (~jnp.asarray(plain_entry)[choice]
                                           & jnp.any(a.behind > 0))
      # after a catch-up every row is up to date: a speculative choice never finds the
      # drafter behind
      s, choice = jax.lax.cond(need, lambda s: catch_up_and_choose(s, active0, left),
                               lambda s: (s, choice), s)
    none = (s, zero_obs, zero_obs, jnp.zeros((b,), bool), zb, zb)  # before any entry ran
    new, acc_obs, tried_obs, active, skipped, plain = _run_chosen(choice, branches, none)
    a = new.adapt  # with the catch-up bookkeeping
    # a lazy plain step observes nothing: the estimate stays as it is
    observed = active & (jnp.sum(tried_obs, axis=1) > 0)
    acc, tried = policy.observe(a.acc, a.tried, acc_obs, tried_obs, observed)
    at = jnp.minimum(a.cycle, a.choices.shape[0] - 1)
    adapt = a.replace(acc=acc, tried=tried, cycle=a.cycle + 1,
                      choices=a.choices.at[at].set(choice),
                      plain_steps=a.plain_steps + plain,
                      stopped=a.stopped + (skipped > 0).astype(jnp.int32),
                      skipped=a.skipped + skipped)
    return new.replace(adapt=adapt)

  acc0, tried0 = policy.init_state(b)
  zb = jnp.zeros((b,), jnp.int32)
  init = LoopState(tokens=tokens, length=length, done=done, cache=cache, key=key,
                   draft=drafter.init(prompt_BP, prompt_len_B, cache_len, largest,
                                      **extra(prompt_features)),
                   stats=Stats.zeros(b, depth, cache_len, ranks),
                   adapt=AdaptState(acc=acc0, tried=tried0, cycle=jnp.zeros((), jnp.int32),
                                    choices=jnp.full((cache_len,), -1, jnp.int32),
                                    plain_steps=zb, stopped=zb, skipped=zb, behind=zb,
                                    behind_p=jnp.ones((b, slots), jnp.float32),
                                    catch_ups=jnp.zeros((), jnp.int32)))
  return jax.lax.while_loop(_not_finished, body, init)


# The compiled loops the host API calls: one compile per static configuration.
generate_loop = _under_precision(generate_loop)
speculative_loop = _under_precision(speculative_loop)
adaptive_loop = _under_precision(adaptive_loop)
generate_jit = jax.jit(generate_loop, static_argnames=("cache_len", "precision"))
speculative_jit = jax.jit(speculative_loop, static_argnames=("tree", "cache_len", "precision"))
adaptive_jit = jax.jit(adaptive_loop, static_argnames=("cache_len", "lazy_slots", "precision"))
