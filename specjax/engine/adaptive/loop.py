"""The adaptive decoding loop: speculative decoding that picks a menu shape every cycle
(`adaptive.AdaptivePolicy`), one `jax.lax.while_loop` (`adaptive_loop`; compiled:
`adaptive_jit`), and its own state (`AdaptState`, `LoopState.adapt`).

It is built from the pieces of `specjax.engine.loop` (prefill, emission, the speculative cycle, the
loop state and counters; their bookkeeping is described there) and shares its rules: pure,
jittable and vmappable, checks nothing (the host API, `specjax.engine.decoding`, validates inputs
first), counts in `Stats`. Static: the policy's menu, draft stopping on or off, the lazy
catch-up bound (`loop.LAZY_SLOTS` by default); the policy's costs, estimate parameters,
threshold and forced schedule are arrays. Layering: loop <- adaptive_loop <- decoding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from specjax.verify import acceptance, sampling, trees
from specjax.models.lm import LM
from specjax.drafters.base import Context
from specjax.engine.loop import (LAZY_SLOTS, TRACE_COUNTS, LoopState, Stats, count_nonfinite,
                                 count_draft_nonfinite, draft_proposal, emit, not_finished, plain_step, spec_cycle,
                                 start, under_precision)
from specjax.models import cache as kv

Array = jax.Array


@struct.dataclass
class AdaptState:
  """The adaptive loop's own state: the policy's per-row exponentially weighted counts
  (acc, tried [B, R + D]: per sibling rank, then per depth, `AdaptivePolicy.columns`), the
  loop iteration, the menu entry chosen at each iteration
  (choices [C], -1 unused), the plain (k = 0) steps each row took (plain_steps [B]; one
  token each), the draft-stopping counters per row: cycles whose drafting stopped early
  (stopped) and the draft nodes those cycles did not draft (skipped), and the lazy catch-up
  bookkeeping (`adaptive_loop`): per
  row the tokens emitted by plain steps the drafter has not seen (behind, <= P), the
  target's probability of each (behind_p, for the acceptance estimate) and, for a drafter
  that reads target features, the features of each of those steps' pending token
  (behind_f), and the number of catch-up passes run (catch_ups)."""

  acc: Array  # float32 [B, R + D]
  tried: Array  # float32 [B, R + D]
  cycle: Array  # int32 []
  choices: Array  # int32 [C]
  plain_steps: Array  # int32 [B]
  stopped: Array  # int32 [B]
  skipped: Array  # int32 [B]
  behind: Array  # int32 [B] lazy catch-up: tokens emitted since the drafter was last synced
  behind_p: Array  # float32 [B, P] the target's probability of each of them (its warped law)
  behind_f: Array | None  # float32 [B, P, C, D] features of positions L - behind + j; None: no
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


@struct.dataclass
class _Call:
  """One `adaptive_loop` call's values that every branch reads, built once at its top:
  the models, policy and sampler, the per-row bounds, and the static shapes (the loop's
  batch b, emission width, padded depth and ranks, lazy catch-up slots and whether it is
  on, the target's captured feature layers)."""

  target: LM
  drafter: object
  policy: object
  sampler: object
  prompt_len_B: Array
  budget_B: Array
  eos: object
  rows: Array  # int32 [B] row indices
  zero_obs: Array  # float32 [B, R + D]
  zb: Array  # int32 [B] zeros
  b: int = struct.field(pytree_node=False)
  width: int = struct.field(pytree_node=False)  # emitted tokens, padded
  depth: int = struct.field(pytree_node=False)
  ranks: int = struct.field(pytree_node=False)
  slots: int = struct.field(pytree_node=False)
  lazy: bool = struct.field(pytree_node=False)
  capture: tuple = struct.field(pytree_node=False)

  def extra(self, f):
    """The drafter's feature keyword arguments: {"features": f} when it reads them."""
    return {"features": f} if self.capture else {}


def _catch_up(call: _Call, s: LoopState):
  """Syncs the drafter with the context: (state, acc_obs, tried_obs)."""
  a = s.adapt
  draft, guess = call.drafter.catch_up(s.draft, s.context(), a.behind, call.slots, call.sampler,
                                       **call.extra(a.behind_f))
  acc_obs, tried_obs = _catch_up_observation(guess, s.tokens, s.length, a.behind, a.behind_p,
                                             call.policy)
  adapt = a.replace(behind=jnp.zeros_like(a.behind), catch_ups=a.catch_ups + 1)
  # the guess's `finite` covers its rows j < behind (its q's padding rows are not guesses)
  bad = 0 if guess is None else count_draft_nonfinite(a.behind > 0, guess.replace(q=None))
  return (s.replace(draft=draft, adapt=adapt, draft_nonfinite=s.draft_nonfinite + bad),
          acc_obs, tried_obs)


def _catch_up_and_choose(call: _Call, s: LoopState, active0, left):
  """A catch-up, its observations (one decay step for the rows it observed) and the
  choice they inform: (state, entry index)."""
  policy = call.policy
  s, acc_obs, tried_obs = _catch_up(call, s)
  a = s.adapt
  acc, tried = policy.observe(a.acc, a.tried, acc_obs, tried_obs,
                              active0 & (jnp.sum(tried_obs, axis=1) > 0))
  s = s.replace(adapt=a.replace(acc=acc, tried=tried))
  return s, policy.pick(policy.rates(acc, tried), active0, call.b, a.cycle, left)


def _lazy_plain_step(call: _Call, c):
  """One plain step, `generate_loop`'s body (`loop.plain_step`), that leaves the drafter one
  more token behind (and keeps the target's probability of that token and, for a drafter
  that reads them, the features of the pending token the step fed)."""
  i, s = c
  s, p_BV, nxt, active, feats = plain_step(call.target, s, call.sampler, call.prompt_len_B,
                                           call.budget_B, call.eos, call.capture)
  a, rows = s.adapt, call.rows
  p_x = jnp.take_along_axis(p_BV, nxt[:, None], axis=1)[:, 0]
  slot = jnp.minimum(a.behind, call.slots - 1)
  behind_p = a.behind_p.at[rows, slot].set(jnp.where(active, p_x, a.behind_p[rows, slot]))
  behind_f = a.behind_f
  if call.capture:
    behind_f = behind_f.at[rows, slot].set(
        jnp.where(active[:, None, None], feats.astype(jnp.float32), behind_f[rows, slot]))
  adapt = a.replace(behind=a.behind + active.astype(jnp.int32), behind_p=behind_p,
                    behind_f=behind_f)
  return i + 1, s.replace(adapt=adapt)


def _lazy_plain_branch(call: _Call, s: LoopState):
  """A run of plain steps (a nested while_loop): as many as the bound allows (P − the
  furthest row's lag, after a catch-up when some row is P behind), ending after the step in
  which a row finishes. Within the run the policy would choose k = 0 again every step (it
  observes nothing and the active rows are the same), so the run saves the per-cycle
  choice and bookkeeping, not a decision."""
  room = call.slots - jnp.max(s.adapt.behind)
  done0, length0 = s.done, s.length

  def more(c):
    i, t = c
    return (i < room) & ~jnp.all(t.done) & jnp.all(t.done == done0)

  _, new = jax.lax.while_loop(more, functools.partial(_lazy_plain_step, call),
                              (jnp.zeros((), jnp.int32), s))
  return (new, call.zero_obs, call.zero_obs, ~done0, jnp.zeros((call.b,), jnp.int32),
          new.length - length0)


def _plain_branch(call: _Call, s: LoopState):
  """An eager k = 0 cycle: a plain step (`generate_loop`'s key use) and the drafter's
  catch-up, a chain(1) proposed and committed with nothing accepted."""
  b, one, rows, drafter = call.b, trees.chain(1), call.rows, call.drafter
  key, step_key = jax.random.split(s.key)  # generate_loop's key use
  draft_key = jax.random.fold_in(step_key, 1)
  proposal, draft, cache = draft_proposal(drafter, s, one, call.sampler, draft_key)
  cur = s.tokens[rows, s.length]
  logits, _, cache, *features = call.target(cur[:, None], s.length[:, None], cache, None,
                                            call.capture)
  p_BV = sampling.warp(logits[:, 0], call.sampler)
  nxt = sampling.sample(step_key, p_BV)
  emitted_BT = jnp.broadcast_to(nxt[:, None], (b, call.width))
  tokens, length, done, active = emit(s, emitted_BT, jnp.zeros_like(s.length),
                                       call.prompt_len_B, call.budget_B, call.eos)
  ctx = Context(tokens=tokens, length=length)
  feats = (jnp.concatenate([features[0], features[0]], axis=1) if call.capture else None)
  draft = drafter.commit(draft, ctx, one, jnp.zeros((b, 2), jnp.int32),
                         jnp.zeros((b,), jnp.int32), **call.extra(feats))
  new = s.replace(tokens=tokens, length=length, done=done, key=key, draft=draft,
                  cache=kv.set_lengths(cache, length),
                  nonfinite=s.nonfinite + count_nonfinite(active, logits),
                  draft_nonfinite=s.draft_nonfinite + count_draft_nonfinite(active, proposal))
  acc_obs = call.policy.first_draft_observation(_draft_acceptance(proposal, p_BV))
  tried_obs = call.policy.first_draft_observation(jnp.ones((b,), jnp.float32))
  return (new, acc_obs, tried_obs, active, jnp.zeros((b,), jnp.int32),
          active.astype(jnp.int32))


def _spec_branch(call: _Call, tree, s: LoopState):
  """A speculative cycle of `tree` (`loop.spec_cycle`), its stats and observations."""
  key, draft_key, accept_key = jax.random.split(s.key, 3)
  new, result, active, drafted = spec_cycle(call.target, call.drafter, s, tree, call.sampler,
                                             draft_key, accept_key, call.prompt_len_B,
                                             call.budget_B, call.eos, call.capture, call.width)
  n = result.n_accepted
  skipped = (jnp.zeros_like(n) if drafted is None  # dynamic draft stopping
             else jnp.maximum(tree.size - drafted, 0).astype(jnp.int32))
  stats = s.stats.record(active, _pad_result(result, call.depth, call.ranks), tree.size, drafted)
  new = new.replace(key=key, stats=stats)
  a1 = active[:, None]
  acc_c, tried_c = call.policy.cycle_observation(tree, result)
  acc_obs = jnp.where(a1, acc_c, 0.0)
  tried_obs = jnp.where(a1, tried_c, 0.0)
  return (new, acc_obs, tried_obs, active, jnp.where(active, skipped, 0),
          jnp.zeros((call.b,), jnp.int32))


def _branches(call: _Call) -> list:
  """The menu's entries as one-argument cycles, in menu order (k = 0: lazy or eager)."""
  plain = _lazy_plain_branch if call.lazy else _plain_branch
  return [functools.partial(plain, call) if e is None
          else functools.partial(_spec_branch, call, e) for e in call.policy.menu]


def _body(call: _Call, branches, s: LoopState) -> LoopState:
  """One loop iteration: choose (after the catch-up the choice needs, lazily), run the
  chosen entry, observe, log the choice and count."""
  policy, b = call.policy, call.b
  active0 = ~s.done
  left = call.budget_B - (s.length + 1 - call.prompt_len_B)  # each row's budget left
  a = s.adapt
  choice = policy.pick(policy.rates(a.acc, a.tried), active0, b, a.cycle, left)
  if call.lazy:  # the catch-up the choice needs, then the choice again from what it observed
    plain_entry = [e is None for e in policy.menu]
    need = jnp.any(a.behind >= call.slots) | (~jnp.asarray(plain_entry)[choice]
                                              & jnp.any(a.behind > 0))
    # after a catch-up every row is up to date: a speculative choice never finds the
    # drafter behind
    s, choice = jax.lax.cond(need, lambda s: _catch_up_and_choose(call, s, active0, left),
                             lambda s: (s, choice), s)
  # the state and outputs before any entry ran
  none = (s, call.zero_obs, call.zero_obs, jnp.zeros((b,), bool), call.zb, call.zb)
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


def adaptive_loop(target: LM, drafter, policy, prompt_BP, prompt_len_B, budget_B, eos,
                  sampler, key, *, cache_len: int, lazy_slots: int = LAZY_SLOTS) -> LoopState:
  """Speculative decoding that picks a menu shape every cycle (`adaptive.AdaptivePolicy`).

  Every menu entry is traced once into this loop and the chosen one runs each cycle
  (`_run_chosen`: one zero-or-one-trip loop per entry, which keeps both KV caches updated in
  place; one compile; the menu is static, the policy's numbers are arrays). All branches return
  the same state: emission is padded to the deepest entry, results to its depth and width.
  A spec entry is a `spec_cycle` of its tree. k = 0 (entry None) is a plain decoding step,
  token for token `loop.generate_loop`'s (same key use), plus the drafter's catch-up: it proposes
  a chain(1) and commits it with nothing accepted, so a separate-model drafter's cache stays
  at L − 1 (it feeds [x_{L−1}, x_L]); that draft's acceptance probability is the policy's
  observation for the cycle (features for drafters that read them: the one-token pass's,
  the root's row repeated). Speculative cycles only are counted in `stats`; every loop
  iteration's choice is logged in `adapt.choices`.

  Lazy catch-up (drafters with `lazy_catch_up`, when lazy_slots = P > 0, static): a k = 0
  cycle is a run of plain steps, each exactly `generate_loop`'s (same key use), that leave
  the drafter behind; `adapt.behind` counts per row the tokens it has not seen (and, for a
  drafter that reads target features, `adapt.behind_f` keeps the features each plain step
  captured, handed to its catch-up). Before a
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
  depth = max(policy.max_depth, 1)
  capture = tuple(drafter.feature_layers)
  init, prompt_features = start(target, prompt_BP, prompt_len_B, budget_B, eos, sampler, key,
                                 cache_len, capture)
  # the drafter's state is sized for every entry: their nodes, the deepest one's depth
  largest = trees.cover([e for e in policy.menu if e is not None] or [trees.chain(1)])
  lazy = bool(drafter.lazy_catch_up) and lazy_slots > 0
  slots = max(int(lazy_slots), 0)
  zb = jnp.zeros((b,), jnp.int32)
  call = _Call(target=target, drafter=drafter, policy=policy, sampler=sampler,
               prompt_len_B=prompt_len_B, budget_B=budget_B, eos=eos, rows=jnp.arange(b),
               zero_obs=jnp.zeros((b, policy.columns), jnp.float32), zb=zb, b=b,
               width=depth + 1, depth=depth, ranks=policy.width, slots=slots, lazy=lazy,
               capture=capture)
  acc0, tried0 = policy.init_state(b)
  init = init.replace(draft=drafter.init(prompt_BP, prompt_len_B, cache_len, largest,
                                          **call.extra(prompt_features)),
                      stats=Stats.zeros(b, depth, cache_len, call.ranks),
                      adapt=AdaptState(acc=acc0, tried=tried0, cycle=jnp.zeros((), jnp.int32),
                                       choices=jnp.full((cache_len,), -1, jnp.int32),
                                       plain_steps=zb, stopped=zb, skipped=zb, behind=zb,
                                       behind_p=jnp.ones((b, slots), jnp.float32),
                                       behind_f=(jnp.zeros((b, slots) + prompt_features.shape[2:],
                                                           jnp.float32)
                                                 if lazy and capture else None),
                                       catch_ups=jnp.zeros((), jnp.int32)))
  return jax.lax.while_loop(not_finished, functools.partial(_body, call, _branches(call)),
                            init)


# The compiled loop the host API calls: one compile per static configuration.
adaptive_loop = under_precision(adaptive_loop)
adaptive_jit = jax.jit(adaptive_loop, static_argnames=("cache_len", "lazy_slots", "precision"))
