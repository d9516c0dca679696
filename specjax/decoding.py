"""Prefill, plain autoregressive and speculative generation: one jitted while_loop each.

Bookkeeping shared by both loops (per row b of a ragged batch):
- `tokens[b]` holds the prompt then every emitted token; `length[b]` = L is the index of
  the pending token: tokens [0, L) are in the target's KV cache, token L (the last one
  emitted) is not yet. Prefill samples the first token, so L starts at the prompt length.
- A row is done when it emitted `budget[b]` tokens or an EOS; done rows keep flowing
  through the (static-shape) computation but commit nothing.
- Emitted so far = L + 1 - prompt_len.

A speculative cycle verifies a token tree (a chain of k drafts is the tree `chain(k)`;
there is one code path). The drafter proposes N nodes under the root x_L; the target scores
[x_L, nodes] in one pass, node i at position L + depth[i] under the ancestor mask (a chain:
a causal block of k+1 tokens); `acceptance.accept_tree` keeps the deepest surviving
root-to-node path (n nodes) and draws one more token (correction or bonus); n + 1 tokens are
emitted (fewer if EOS or the budget cuts in). The target's cache moves the path's entries to
contiguous slots (`cache.gather_block`, skipped for chains, where they already are) and
commits by moving lengths; the drafter does the same with its own cache.

Runtime values (temperature, top-k, top-p, budgets, EOS id, seed) are arrays: changing
them reuses the compiled loop. Static: model shapes, batch, prompt bucket, cache length, the
tree shape.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import acceptance, sampling, trees
from specjax.drafters.base import LM, Context
from specjax.drafters.model import ModelDrafter
from specjax.models import cache as kv
from specjax.trees import DynamicTree, TreeSpec

Array = jax.Array

# Number of times each loop was traced (compiled); tests assert on it.
TRACE_COUNTS: collections.Counter = collections.Counter()

MIN_BUCKET = 8


# ----------------------------------------------------------------------------- loop state


@struct.dataclass
class Stats:
  """Per-row counters of a speculative run (D = tree depth, W = tree width; chain: D = k).

  cycles, drafted (N nodes per cycle; k for a chain), accepted (accepted path length = drafts
  accepted), hist[n] (cycles that accepted n), cycle_log (n of each cycle, -1 unused) mean
  the same for chains as before trees. Trees add: verified (nodes the target verified),
  depth_tried / depth_accepted [B, D] (cycles that tried / accepted a depth-d node),
  rank_tried / rank_accepted [B, W] (candidates of sibling rank r tried / accepted).
  """

  cycles: Array  # int32 [B] verification passes
  drafted: Array  # int32 [B] drafted nodes
  accepted: Array  # int32 [B] accepted drafted nodes (path lengths)
  hist: Array  # int32 [B, D+1] cycles by accepted path length
  cycle_log: Array  # int8 [B, C] accepted path length of each cycle, -1 where unused
  verified: Array  # int32 [B] nodes verified by the target
  depth_tried: Array  # int32 [B, D]
  depth_accepted: Array  # int32 [B, D]
  rank_tried: Array  # int32 [B, W]
  rank_accepted: Array  # int32 [B, W]

  @classmethod
  def zeros(cls, batch: int, depth: int, max_cycles: int, width: int = 1) -> "Stats":
    z = jnp.zeros((batch,), jnp.int32)
    return cls(cycles=z, drafted=z, accepted=z, hist=jnp.zeros((batch, depth + 1), jnp.int32),
               cycle_log=jnp.full((batch, max_cycles), -1, jnp.int8), verified=z,
               depth_tried=jnp.zeros((batch, depth), jnp.int32),
               depth_accepted=jnp.zeros((batch, depth), jnp.int32),
               rank_tried=jnp.zeros((batch, width), jnp.int32),
               rank_accepted=jnp.zeros((batch, width), jnp.int32))

  def record(self, active_B, result: acceptance.TreeResult, nodes: int) -> "Stats":
    act = active_B.astype(jnp.int32)
    n = result.n_accepted
    rows = jnp.arange(act.shape[0])
    at = jnp.minimum(self.cycles, self.cycle_log.shape[1] - 1)
    log = self.cycle_log.at[rows, at].set(
        jnp.where(active_B, n.astype(jnp.int8), self.cycle_log[rows, at]))
    depth = self.depth_tried.shape[1]
    reached = (jnp.arange(1, depth + 1, dtype=jnp.int32)[None] <= n[:, None]).astype(jnp.int32)
    a1 = act[:, None]
    return Stats(cycles=self.cycles + act, drafted=self.drafted + nodes * act,
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
  draft: Any = None  # drafter state (speculative loop only)
  stats: Stats | None = None

  def context(self) -> Context:
    return Context(tokens=self.tokens, length=self.length)


def _not_finished(state: LoopState) -> Array:
  return ~jnp.all(state.done)


def _start(target: LM, prompt_BP, prompt_len_B, sampler, key, cache_len: int):
  """Prefill the target, sample the first token, lay out the token buffer."""
  b, p = prompt_BP.shape
  cache = kv.init(target.config, b, cache_len)
  hidden_BD, cache = target.prefill(cache, prompt_BP, prompt_len_B)
  first = sampling.sample(key, sampling.warp(target.head(hidden_BD), sampler))
  tokens = jnp.zeros((b, cache_len), jnp.int32).at[:, :p].set(prompt_BP)
  tokens = tokens.at[jnp.arange(b), prompt_len_B].set(first)
  return tokens, cache, first


def _finished(emitted_B, budget_B, hit_eos_B):
  return (emitted_B >= budget_B) | hit_eos_B


# ----------------------------------------------------------------------------- the loops


def generate_loop(target: LM, prompt_BP, prompt_len_B, budget_B, eos, sampler, key, *,
                  cache_len: int):
  """Plain autoregressive decoding (pure, jittable, vmappable). Returns the final LoopState."""
  TRACE_COUNTS["generate"] += 1
  key, first_key = jax.random.split(key)
  tokens, cache, first = _start(target, prompt_BP, prompt_len_B, sampler, first_key, cache_len)
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
                     cache=kv.set_lengths(cache, length))

  init = LoopState(tokens=tokens, length=length, done=done, cache=cache, key=key)
  return jax.lax.while_loop(_not_finished, body, init)


def _verify_layout(tree, proposal, length_B):
  """Positions [B, T], block mask (None / [T, T] / [B, T, T]) and the acceptance's tree
  argument for one verify pass."""
  if isinstance(tree, TreeSpec):
    positions = length_B[:, None] + jnp.asarray(tree.depth)[None]
    mask = None if tree.is_chain else jnp.asarray(tree.ancestors)
    return positions, mask, tree
  parents_BT, depth_BT = proposal.parents, proposal.depth
  b, t = parents_BT.shape
  rows = jnp.arange(b)[:, None]
  nodes = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  # Ancestor-or-self mask by pointer jumping: D steps up from every node.
  mask = nodes[:, :, None] == nodes[:, None, :]
  up = nodes
  for _ in range(tree.max_depth):
    up = jnp.maximum(jnp.take_along_axis(parents_BT, up, axis=1), 0)
    mask = mask | (up[:, :, None] == nodes[:, None, :])
  # children[b, i, r] = the r-th node (index order) whose parent is i.
  same = parents_BT[:, :, None] == parents_BT[:, None, :]  # [B, T, T]
  earlier = nodes[:, None, :] < nodes[:, :, None]
  rank = jnp.sum(same & earlier, axis=2)  # [B, T]
  par = jnp.where(parents_BT >= 0, parents_BT, t)  # the root's entry goes out of range
  children = jnp.full((b, t, tree.max_width), -1, jnp.int32).at[rows, par, rank].set(
      nodes, mode="drop")
  return length_B[:, None] + depth_BT, mask, (children, tree.max_depth)


def speculative_loop(target: LM, drafter, prompt_BP, prompt_len_B, budget_B, eos, sampler,
                     key, *, k: int | None = None, tree=None, cache_len: int):
  """Speculative decoding of a chain (k) or a token tree (tree), pure, jittable, vmappable.

  Exactly one of k / tree; k = K means tree = trees.chain(K). Returns the final LoopState.
  """
  TRACE_COUNTS["speculative"] += 1
  tree = _resolve_tree(k, tree)
  b = prompt_BP.shape[0]
  nodes, depth = tree.size, tree.max_depth
  key, first_key = jax.random.split(key)
  tokens, cache, first = _start(target, prompt_BP, prompt_len_B, sampler, first_key, cache_len)
  length = prompt_len_B.astype(jnp.int32)
  done = _finished(jnp.ones_like(length), budget_B, first == eos)
  steps = jnp.arange(depth + 1, dtype=jnp.int32)

  def body(s: LoopState) -> LoopState:
    key, draft_key, accept_key = jax.random.split(s.key, 3)
    proposal, draft = drafter.propose(s.draft, s.context(), tree, sampler, draft_key)

    # One target pass over [x_L, nodes] at positions L + depth, ancestor mask.
    cur = jnp.take_along_axis(s.tokens, s.length[:, None], axis=1)
    verify_BT = jnp.concatenate([cur, proposal.tokens], axis=1)
    positions, mask, shape = _verify_layout(tree, proposal, s.length)
    logits, _, cache = target(verify_BT, positions, s.cache, mask)
    p_BTV = sampling.warp(logits, sampler)
    result = acceptance.accept_tree(accept_key, shape, verify_BT, p_BTV, proposal.q)
    n = result.n_accepted

    # Emitted this cycle: the path's n nodes then the target's token; cut at EOS and budget.
    path_tokens = jnp.take_along_axis(verify_BT, result.path, axis=1)  # [B, D+1], root first
    path_tokens = jnp.concatenate([path_tokens[:, 1:], path_tokens[:, :1]], axis=1)
    emitted_BT = jnp.where(steps[None] < n[:, None], path_tokens, result.next_token[:, None])
    active = ~s.done
    room = budget_B - (s.length + 1 - prompt_len_B)
    m = jnp.minimum(n + 1, room)
    is_eos = (emitted_BT == eos) & (steps[None] < m[:, None])
    hit_eos = jnp.any(is_eos, axis=1)
    m = jnp.where(hit_eos, jnp.argmax(is_eos, axis=1) + 1, m)
    m = jnp.where(active, m, 0).astype(jnp.int32)

    tokens = _write_rows(s.tokens, s.length + 1, emitted_BT, m)
    length = s.length + m
    done = s.done | (active & (hit_eos | (m >= room)))
    ctx = Context(tokens=tokens, length=length)
    if not tree.is_chain:  # the path's entries to [L, L + n]; a chain's are in place
      cache = kv.gather_block(cache, result.path, tree.n_nodes)
    return s.replace(tokens=tokens, length=length, done=done, key=key,
                     cache=kv.set_lengths(cache, length),
                     draft=drafter.commit(draft, ctx, tree, result.path, n),
                     stats=s.stats.record(active, result, nodes))

  init = LoopState(tokens=tokens, length=length, done=done, cache=cache, key=key,
                   draft=drafter.init(prompt_BP, prompt_len_B, cache_len, tree),
                   stats=Stats.zeros(b, depth, cache_len, tree.max_width))
  return jax.lax.while_loop(_not_finished, body, init)


def _resolve_tree(k, tree):
  """The tree of a speculative call: exactly one of k (a chain) or tree."""
  if (k is None) == (tree is None):
    got = "neither" if k is None else f"both k={k!r} and tree={tree!r}"
    raise ValueError(f"speculative decoding needs exactly one of k (chain length) or tree "
                     f"(a trees.TreeSpec or trees.DynamicTree), got {got}")
  if tree is None:
    return trees.chain(_check_int("k", k, 1))
  if not isinstance(tree, (TreeSpec, DynamicTree)):
    raise ValueError(f"tree must be a trees.TreeSpec or trees.DynamicTree, got {tree!r}")
  return tree


def _write_rows(tokens_BS, start_B, values_BT, count_B):
  """tokens[b, start[b] + j] = values[b, j] for j < count[b]; other slots unchanged."""
  t = values_BT.shape[1]

  def one(row, start, vals, count):
    old = jax.lax.dynamic_slice(row, (start,), (t,))
    new = jnp.where(jnp.arange(t) < count, vals, old)
    return jax.lax.dynamic_update_slice(row, new, (start,))

  return jax.vmap(one)(tokens_BS, start_B, values_BT, count_B)


_generate_jit = jax.jit(generate_loop, static_argnames=("cache_len",))
_speculative_jit = jax.jit(speculative_loop, static_argnames=("k", "tree", "cache_len"))


# ----------------------------------------------------------------------------- host API


@dataclasses.dataclass
class Generation:
  """What a generate call produced, on the host.

  `tokens[b]` are the emitted tokens of row b (EOS included when hit); `stats` is None for
  plain decoding, else per-row arrays (see `Stats`): cycles, drafted, accepted, hist
  [B, D+1], cycle_log [B, C] (-1 = unused) for metrics.summarize, and the tree counters
  verified, depth_tried / depth_accepted [B, D], rank_tried / rank_accepted [B, W] for
  `tree_summary`. `k` is the number of drafted nodes per cycle (a chain's k); `tree` the
  shape that was verified (`trees.chain(k)` for a chain).
  """

  tokens: list[list[int]]
  prompt_lengths: list[int]
  stats: dict[str, np.ndarray] | None
  seconds: float  # wall time of the call, compilation included on a first call
  k: int = 0
  tree: Any = None

  @property
  def emitted(self) -> int:
    return sum(len(t) for t in self.tokens)

  def summary(self):
    """α (with interval), τ, histogram and burstiness over all rows (metrics.summarize).

    For trees α = accepted / drafted nodes is the node utilisation and the run lengths are
    accepted path lengths 0..depth (`tree_summary` has the per-depth and per-rank view).
    """
    if self.stats is None:
      raise ValueError("plain generation has no speculative statistics")
    from specjax import metrics
    emitted = np.asarray([len(t) for t in self.tokens])
    depth = self.tree.max_depth if self.tree is not None else self.k
    return metrics.summarize(cycles=self.stats["cycles"], drafted=self.stats["drafted"],
                             accepted=self.stats["accepted"], emitted=emitted - 1,
                             cycle_log=self.stats["cycle_log"], k=depth)

  def tree_summary(self) -> trees.TreeSummary:
    """τ, node utilisation, acceptance by depth and by candidate rank (trees.summarize_tree)."""
    if self.stats is None:
      raise ValueError("plain generation has no speculative statistics")
    emitted = np.asarray([len(t) for t in self.tokens]) - 1  # the prefill's token excluded
    return trees.summarize_tree(self.stats, emitted)


def _bucket(n: int, cap: int) -> int:
  b = MIN_BUCKET
  while b < n:
    b *= 2
  return min(b, cap) if cap >= n else b


def cache_len_for(prompt_len: int, max_new_tokens: int, slots: int = 1) -> int:
  """The engine's cache-length rule: the prompt's bucket + the token budget + the `slots`
  one cycle writes from the pending token (1 for plain decoding, k + 1 for a chain of k, a
  tree's nodes or its drafter's extent), rounded up to a power of two, so budgets that change
  within it do not recompile. Experiments use this rule too, so what they time is what the
  engine runs."""
  return _bucket(_bucket(prompt_len, 1 << 62) + max_new_tokens + slots, 1 << 62)


def _check_int(name: str, value, lo: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
    raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
  return int(value)


@dataclasses.dataclass(frozen=True)
class Batch:
  """Validated, padded inputs for one call of a loop."""

  prompt_BP: np.ndarray
  prompt_len_B: np.ndarray
  budget_B: np.ndarray
  cache_len: int


def prepare_batch(prompts: Sequence[Sequence[int]], *, vocab_size: int, max_len: int,
                  max_new_tokens, k: int = 0, cache_len: int | None = None,
                  positions_limited: bool = True) -> Batch:
  """Validates prompts and budgets at the Python boundary and pads to a length bucket.

  The cache needs `bucket + max budget + k + 1` slots, k + 1 being the slots one cycle
  writes from the pending token (a chain: k + 1; a tree: its nodes or the drafter's extent);
  by default the cache length is that rounded up to a power of two, so budgets that change
  within it do not recompile.
  """
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) and not isinstance(
      prompts, np.ndarray):
    raise ValueError(f"prompts must be a sequence of token-id sequences, got {type(prompts)}")
  if len(prompts) < 1:
    raise ValueError("prompts: batch must be >= 1 prompt, got an empty batch")
  rows = []
  for i, p in enumerate(prompts):
    p = np.asarray(p)
    if p.ndim != 1 or p.size == 0:
      raise ValueError(f"prompts[{i}] must be a non-empty 1-D sequence of token ids, "
                       f"got shape {p.shape}")
    if not np.issubdtype(p.dtype, np.integer):
      raise ValueError(f"prompts[{i}] must hold integer token ids, got dtype {p.dtype}")
    bad = (p < 0) | (p >= vocab_size)
    if bad.any():
      raise ValueError(f"prompts[{i}] has token id {int(p[bad][0])} out of range "
                       f"[0, {vocab_size})")
    rows.append(p.astype(np.int32))
  batch = len(rows)
  if np.ndim(max_new_tokens) == 0:
    budgets = [_check_int("max_new_tokens", max_new_tokens, 1)] * batch
  else:
    budgets = [_check_int(f"max_new_tokens[{i}]", v, 1) for i, v in enumerate(max_new_tokens)]
    if len(budgets) != batch:
      raise ValueError(f"max_new_tokens has {len(budgets)} entries for {batch} prompts")
  longest = max(len(r) for r in rows)
  bucket = _bucket(longest, cache_len or (1 << 62))
  need = bucket + max(budgets) + k + 1
  if cache_len is None:
    cache_len = cache_len_for(longest, max(budgets), k + 1)
    if positions_limited:
      cache_len = min(cache_len, max_len)
  else:
    cache_len = _check_int("cache_len", cache_len, 1)
  if need > cache_len or (positions_limited and need > max_len):
    limit = min(cache_len, max_len) if positions_limited else cache_len
    raise ValueError(
        f"prompt length {longest} (bucket {bucket}) + max_new_tokens {max(budgets)} + k {k} "
        f"+ 1 = {need} exceeds the cache/context length {limit}: shorten the prompt or "
        f"lower max_new_tokens")
  prompt = np.zeros((batch, bucket), np.int32)
  for i, r in enumerate(rows):
    prompt[i, :len(r)] = r
  return Batch(prompt_BP=prompt, prompt_len_B=np.asarray([len(r) for r in rows], np.int32),
               budget_B=np.asarray(budgets, np.int32), cache_len=cache_len)


def _key(seed) -> Array:
  if isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
    return seed
  return jax.random.key(_check_int("seed", seed, 0))


def _eos(eos_id, vocab_size: int) -> Array:
  if eos_id is None:
    return jnp.asarray(-1, jnp.int32)
  eos_id = _check_int("eos_id", eos_id, 0)
  if eos_id >= vocab_size:
    raise ValueError(f"eos_id must be in [0, {vocab_size}), got {eos_id}")
  return jnp.asarray(eos_id, jnp.int32)


def _collect(state: LoopState, batch: Batch, seconds: float, k: int,
             tree: Any = None) -> Generation:
  tokens = np.asarray(state.tokens)
  length = np.asarray(state.length)
  out = [tokens[b, p:l + 1].tolist() for b, (p, l) in enumerate(zip(batch.prompt_len_B, length))]
  stats = None
  if state.stats is not None:
    stats = {f.name: np.asarray(getattr(state.stats, f.name))
             for f in dataclasses.fields(state.stats)}
  return Generation(tokens=out, prompt_lengths=batch.prompt_len_B.tolist(), stats=stats,
                    seconds=seconds, k=k, tree=tree)


def _positions_limited(config) -> bool:
  return config.positions == "learned"


def generate(target, prompts, *, max_new_tokens, sampler=None, seed=0, eos_id=None,
             cache_len: int | None = None) -> Generation:
  """Plain autoregressive decoding of a ragged batch of prompts (one compiled loop)."""
  target = LM.of(target)
  cfg = target.config
  batch = prepare_batch(prompts, vocab_size=cfg.vocab_size, max_len=cfg.max_len,
                        max_new_tokens=max_new_tokens, cache_len=cache_len,
                        positions_limited=_positions_limited(cfg))
  kv.check_fits(cfg, len(batch.budget_B), batch.cache_len, what="target KV cache")
  sampler = sampler if sampler is not None else sampling.make_sampler(0.0)
  start = time.perf_counter()
  state = _generate_jit(target, batch.prompt_BP, batch.prompt_len_B, batch.budget_B,
                        _eos(eos_id, cfg.vocab_size), sampler, _key(seed),
                        cache_len=batch.cache_len)
  state = jax.block_until_ready(state)
  return _collect(state, batch, time.perf_counter() - start, 0)


def as_drafter(draft):
  """A drafter pytree from a drafter or a bare draft model (separate-model drafter)."""
  if hasattr(draft, "propose"):
    return draft
  return ModelDrafter.of(draft)


def speculative_generate(target, draft, prompts, *, k: int | None = None,
                         tree: TreeSpec | DynamicTree | None = None, max_new_tokens,
                         sampler=None, seed=0, eos_id=None,
                         cache_len: int | None = None) -> Generation:
  """Speculative decoding of a chain of k drafts, or of a token tree (exactly one of them).

  tree: a `trees.TreeSpec` (static shape, e.g. trees.branching((3, 2, 1)),
  trees.optimal(16, rank_probs)) or a `trees.DynamicTree` (EAGLE-2 style, deterministic
  candidates). k = K is tree = trees.chain(K): the same compiled code path.
  """
  target = LM.of(target)
  drafter = as_drafter(draft)
  cfg = target.config
  tree = _resolve_tree(k, tree)
  width = tree.max_width
  if width > cfg.vocab_size:
    raise ValueError(f"tree has a node with {width} candidates (width {width}) but the "
                     f"vocabulary has only {cfg.vocab_size} tokens: width must be <= "
                     f"{cfg.vocab_size}")
  draft_cfg = getattr(drafter, "config", None)
  if draft_cfg is not None and draft_cfg.vocab_size != cfg.vocab_size:
    raise ValueError(f"draft vocabulary ({draft_cfg.vocab_size}) must match the target's "
                     f"({cfg.vocab_size})")
  limited = _positions_limited(cfg) or (draft_cfg is not None and _positions_limited(draft_cfg))
  max_len = min(cfg.max_len, draft_cfg.max_len) if draft_cfg is not None else cfg.max_len
  slots = tree.n_nodes
  if hasattr(drafter, "slots_needed"):
    slots = max(slots, drafter.slots_needed(tree))
  batch = prepare_batch(prompts, vocab_size=cfg.vocab_size, max_len=max_len,
                        max_new_tokens=max_new_tokens, k=slots - 1, cache_len=cache_len,
                        positions_limited=limited)
  b = len(batch.budget_B)
  extra = kv.cache_bytes(draft_cfg, b, batch.cache_len) if draft_cfg is not None else 0
  kv.check_fits(cfg, b, batch.cache_len, extra_bytes=extra, what="target + draft KV caches")
  sampler = sampler if sampler is not None else sampling.make_sampler(0.0)
  start = time.perf_counter()
  state = _speculative_jit(target, drafter, batch.prompt_BP, batch.prompt_len_B,
                           batch.budget_B, _eos(eos_id, cfg.vocab_size), sampler, _key(seed),
                           tree=tree, cache_len=batch.cache_len)
  state = jax.block_until_ready(state)
  return _collect(state, batch, time.perf_counter() - start, tree.size, tree)
