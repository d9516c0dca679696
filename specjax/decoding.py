"""The host API: validation, padding and the cache-length rule around the jitted loops
(`specjax.loop`), and the result type.

`generate` (plain autoregressive decoding) and `speculative_generate` (a chain of k drafts
or a token tree) validate every argument at the Python boundary (ValueError naming the
argument, its value and what is allowed), resolve the tree once (k = K is
`trees.chain(K)`, its size checked against the context before the chain is built), pad a
ragged batch to a prompt bucket (`prepare_batch`), size the KV cache (`cache_len_for`),
call the compiled loop and return a `Generation` on the host.

Context. A request fits when the longest prompt + max_new_tokens + the slots one cycle
writes is at most the context: cache_len when given, else the models' max_len (learned
position embeddings end there; a RoPE model is held to its trained length unless
`allow_beyond_max_len=True`). The power-of-two prompt bucket and the cache length are
capped at that context, so rounding never refuses a request that fits. The
analysis of a run (`metrics.summarize`, `metrics.summarize_tree`) is called by
`Generation.summary` / `Generation.tree_summary`, never by the loop.

Runtime values (temperature, top-k, top-p, budgets, EOS id, seed) are arrays: changing
them reuses the compiled loop. Static: model shapes, batch, prompt bucket, cache length, the
tree shape.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import adaptive, adaptive_loop, loop, metrics, sampling, trees
from specjax.drafters.base import LM, Drafter
from specjax.drafters.model import ModelDrafter
from specjax.models import cache as kv
from specjax.models.precision import DEFAULT_PRECISION, check_precision
from specjax.trees import DynamicTree, TreeSpec

Array = jax.Array

MIN_BUCKET = 8


@dataclasses.dataclass
class Generation:
  """What a generate call produced, on the host.

  `tokens[b]` are the emitted tokens of row b (EOS included when hit); `stats` is None for
  plain decoding, else per-row arrays (see `loop.Stats`): cycles, drafted, accepted, hist
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
  choices: np.ndarray | None = None  # adaptive: menu index of each loop iteration
  menu: list[str] | None = None  # adaptive: the menu's entry names (adaptive.entry_name)
  stopping: dict[str, np.ndarray] | None = None  # adaptive: per-row stopped / skipped
  plain_steps: np.ndarray | None = None  # adaptive: per-row k = 0 steps (one token each)

  @classmethod
  def concat(cls, parts: Sequence["Generation"]) -> "Generation":
    """The rows of several calls of one kind (all plain, all speculative with one shape, or
    all adaptive over one menu) as one Generation: tokens, prompt lengths and per-row
    statistics concatenated in order (per-cycle logs padded with -1 to the longest),
    seconds summed; an adaptive run's per-iteration choices are the calls' choices one
    after another. How a workload decoded in several batches is analysed as a whole."""
    parts = list(parts)
    if not parts or not all(isinstance(g, Generation) for g in parts):
      raise ValueError(f"parts must be a non-empty list of Generations, got {parts!r}")
    first = parts[0]
    kinds = {(g.stats is None, g.k, repr(g.tree), g.choices is None, repr(g.menu))
             for g in parts}
    if len(kinds) != 1:
      raise ValueError(f"parts must all be plain, all speculative with one shape or all "
                       f"adaptive over one menu, got {sorted(map(str, kinds))}")

    def rows(name: str, arrays):
      arrays = [np.asarray(a) for a in arrays]
      if name == "cycle_log":
        width = max(a.shape[1] for a in arrays)
        arrays = [np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=-1)
                  for a in arrays]
      return np.concatenate(arrays, axis=0)

    def per_row(field: str):
      d = getattr(first, field)
      return None if d is None else {n: rows(n, [getattr(g, field)[n] for g in parts])
                                     for n in d}

    return dataclasses.replace(
        first, tokens=[t for g in parts for t in g.tokens],
        prompt_lengths=[n for g in parts for n in g.prompt_lengths], stats=per_row("stats"),
        seconds=sum(g.seconds for g in parts),
        choices=None if first.choices is None else rows("choices", [g.choices for g in parts]),
        stopping=per_row("stopping"),
        plain_steps=None if first.plain_steps is None else rows(
            "plain_steps", [g.plain_steps for g in parts]))

  def _spec_emitted(self) -> np.ndarray:
    """Tokens per row emitted by speculative cycles (the prefill's and plain steps' out)."""
    emitted = np.asarray([len(t) for t in self.tokens]) - 1
    return emitted if self.plain_steps is None else emitted - self.plain_steps

  @property
  def emitted(self) -> int:
    return sum(len(t) for t in self.tokens)

  def summary(self):
    """α (with interval), τ, histogram and burstiness over all rows (metrics.summarize).

    For trees α = accepted / drafted nodes is the node utilisation and the run lengths are
    accepted path lengths 0..depth (`tree_summary` has the per-depth and per-rank view).
    Adaptive runs (shapes mixed) count speculative cycles only; their per-trial α here
    assumes the deepest menu shape in every cycle: read α, τ or `tree_summary` (per-depth
    reach, exact for mixed shapes) instead.
    """
    if self.stats is None:
      raise ValueError("plain generation has no speculative statistics")
    depth = self.tree.max_depth if self.tree is not None else self.k
    return metrics.summarize(cycles=self.stats["cycles"], drafted=self.stats["drafted"],
                             accepted=self.stats["accepted"],
                             emitted=self._spec_emitted(),
                             cycle_log=self.stats["cycle_log"], k=depth)

  def tree_summary(self) -> metrics.TreeSummary:
    """τ, node utilisation, acceptance by depth and by candidate rank
    (metrics.summarize_tree)."""
    if self.stats is None:
      raise ValueError("plain generation has no speculative statistics")
    return metrics.summarize_tree(self.stats, self._spec_emitted())


def in_batches(call, prompt_ids: Sequence[Sequence[int]], batch: int):
  """A callable that decodes `prompt_ids` as consecutive batches of `batch` rows, one
  `call(batch_of_prompts) -> Generation` after another, and returns their rows as one
  Generation (`Generation.concat`; the call's own result when one batch holds them all):
  how a workload of many prompts is decoded, timed and analysed at a small batch. `batch`
  must divide the number of prompts."""
  if (isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1
      or len(prompt_ids) % batch):
    raise ValueError(f"batch must be an int >= 1 dividing the {len(prompt_ids)} prompts, "
                     f"got {batch!r}")
  groups = [list(prompt_ids[i:i + batch]) for i in range(0, len(prompt_ids), batch)]
  if len(groups) == 1:
    return lambda: call(groups[0])
  return lambda: Generation.concat([call(g) for g in groups])


def loop_iterations(run: Generation, batch: int) -> int:
  """Loop iterations a run of consecutive batches of `batch` rows took: the sum over its
  batches of the most cycles any row of the batch ran (a batch loops until its slowest row
  is done)."""
  cycles = np.asarray(run.stats["cycles"]).reshape(-1, batch)
  return int(cycles.max(axis=1).sum())


def _bucket(n: int, cap: int) -> int:
  """The prompt bucket: the power of two >= max(n, MIN_BUCKET), capped at `cap` (what the
  cache / the model's positions allow) when n fits under it, so a bucket never refuses a
  prompt that fits."""
  b = MIN_BUCKET
  while b < n:
    b *= 2
  return min(b, cap) if cap >= n else b


def cache_len_for(prompt_len: int, max_new_tokens: int, slots: int = 1,
                  limit: int | None = None) -> int:
  """The engine's cache-length rule: the prompt's bucket + the token budget + the `slots`
  one cycle writes from the pending token (1 for plain decoding, k + 1 for a chain of k, a
  tree's nodes or its drafter's extent), rounded up to a power of two, so budgets that change
  within it do not recompile; capped at `limit` (the positions the model allows, e.g. its
  max_len) when given. Experiments use this rule too, so what they time is what the engine
  runs."""
  n = _bucket(_bucket(prompt_len, 1 << 62) + max_new_tokens + slots, 1 << 62)
  return n if limit is None else min(n, limit)


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
                  max_new_tokens, slots: int = 1, cache_len: int | None = None,
                  positions_limited: bool = True, max_len_opt_in: bool = False) -> Batch:
  """Validates prompts and budgets at the Python boundary and pads to a length bucket.

  slots: the cache slots one cycle writes from the pending token (1 for plain decoding,
  k + 1 for a chain of k, a tree's nodes or its drafter's extent). The longest row needs
  `prompt + max budget + slots` positions; the prompt bucket (a power of two, so prompt
  lengths share compiled loops) is capped at what the cache or the model allows, so it
  never refuses a request that fits. By default the cache length is `cache_len_for` (a
  power of two, so budgets that change within it do not recompile), capped at max_len.
  positions_limited: positions may not reach max_len (learned position embeddings, or a
  RoPE model held to its trained length). max_len_opt_in: max_len is a RoPE model's trained
  length, which `allow_beyond_max_len=True` lifts; the error says so.
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
  slots = _check_int("slots", slots, 1)
  if np.ndim(max_new_tokens) == 0:
    budgets = [_check_int("max_new_tokens", max_new_tokens, 1)] * batch
  else:
    budgets = [_check_int(f"max_new_tokens[{i}]", v, 1) for i, v in enumerate(max_new_tokens)]
    if len(budgets) != batch:
      raise ValueError(f"max_new_tokens has {len(budgets)} entries for {batch} prompts")
  longest, budget = max(len(r) for r in rows), max(budgets)
  need = longest + budget + slots
  position_limit = max_len if positions_limited else None
  if cache_len is None:
    cache_len = cache_len_for(longest, budget, slots, limit=position_limit)
  else:
    cache_len = _check_int("cache_len", cache_len, 1)
  limit = cache_len if position_limit is None else min(cache_len, position_limit)
  if need > limit:
    if position_limit is not None and position_limit < need and position_limit <= cache_len:
      what = f"the model's max_len {position_limit}"
      if max_len_opt_in:
        what += (" (the length this RoPE model was trained for; pass allow_beyond_max_len="
                 "True, --allow-beyond-max-len on the command line, to generate past it "
                 "anyway: quality past the trained length is not guaranteed)")
      else:
        what += " (learned position embeddings end there)"
    else:
      what = f"cache_len {cache_len}"
    raise ValueError(
        f"prompt length {longest} + max_new_tokens {budget} + slots {slots} (cache slots one "
        f"cycle writes: k + 1 for a chain of k, a tree's nodes) = {need} exceeds the "
        f"cache/context length {limit}, {what}: shorten the prompt or lower max_new_tokens "
        f"or k")
  bucket = _bucket(longest, limit)
  prompt = np.zeros((batch, bucket), np.int32)
  for i, r in enumerate(rows):
    prompt[i, :len(r)] = r
  return Batch(prompt_BP=prompt, prompt_len_B=np.asarray([len(r) for r in rows], np.int32),
               budget_B=np.asarray(budgets, np.int32), cache_len=cache_len)


def _precision_kw(precision: str) -> dict:
  """The loops' `precision` keyword, left out at its default so that a direct call of a
  compiled loop and the host API's share one compile (jit keys on the keywords passed)."""
  return {} if precision == DEFAULT_PRECISION else {"precision": precision}


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


class NonFiniteLogitsError(ValueError):
  """A run whose target logits (or draft probabilities) held a NaN or ±inf: its tokens are
  meaningless. The loops count such passes (`loop.LoopState.nonfinite`, one reduction per
  pass, no host sync); the host refuses the result. `generation` holds it for inspection."""

  def __init__(self, passes: int, generation: "Generation"):
    super().__init__(
        f"the target's logits (or the draft's probabilities) were NaN or infinite in {passes} "
        f"decoding pass(es): the generated tokens are meaningless; check the model's weights "
        f"(a checkpoint holding NaN/inf) and numerics (dtype, norm_eps, positions past "
        f"max_len)")
    self.passes, self.generation = passes, generation


def _collect(state: loop.LoopState, batch: Batch, seconds: float, k: int,
             tree: Any = None, policy: Any = None) -> Generation:
  """The loop's final state as a Generation on the host; raises NonFiniteLogitsError when
  the loop counted non-finite logits (a run can never silently return NaN-driven tokens)."""
  tokens = np.asarray(state.tokens)
  length = np.asarray(state.length)
  out = [tokens[b, p:l + 1].tolist() for b, (p, l) in enumerate(zip(batch.prompt_len_B, length))]
  stats = None
  if state.stats is not None:
    stats = {f.name: np.asarray(getattr(state.stats, f.name))
             for f in dataclasses.fields(state.stats)}
  extra = {}
  if state.adapt is not None:
    a = state.adapt
    extra = dict(choices=np.asarray(a.choices)[:int(a.cycle)], menu=policy.names,
                 plain_steps=np.asarray(a.plain_steps),
                 stopping={"stopped": np.asarray(a.stopped),
                           "skipped": np.asarray(a.skipped)})
  run = Generation(tokens=out, prompt_lengths=batch.prompt_len_B.tolist(), stats=stats,
                   seconds=seconds, k=k, tree=tree, **extra)
  passes = int(np.sum(np.asarray(state.nonfinite)))  # vmapped loops: one count per instance
  if passes:
    raise NonFiniteLogitsError(passes, run)
  return run


def _check_opt_in(value) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"allow_beyond_max_len must be True or False, got {value!r}")
  return bool(value)


def _limits(configs, allow_beyond_max_len: bool) -> tuple[int, bool, bool]:
  """(max_len, positions_limited, max_len_opt_in) for the models of one call.

  Learned position embeddings end at max_len: a hard limit. A RoPE model has no table, but
  past the length it was trained for its outputs are not to be trusted, so it is held to
  max_len too unless the caller opts in (`allow_beyond_max_len=True`)."""
  allow = _check_opt_in(allow_beyond_max_len)
  shortest = min(c.max_len for c in configs)
  hard = [c.max_len for c in configs if c.positions == "learned"]
  if allow:
    return (min(hard), True, False) if hard else (shortest, False, False)
  return shortest, True, not hard or min(hard) > shortest


def generate(target, prompts, *, max_new_tokens, sampler=None, seed=0, eos_id=None,
             cache_len: int | None = None, allow_beyond_max_len: bool = False,
             precision: str = DEFAULT_PRECISION) -> Generation:
  """Plain autoregressive decoding of a ragged batch of prompts (one compiled loop).

  allow_beyond_max_len: let a RoPE model generate past its trained length `max_len`
  (refused by default: quality past it is not guaranteed). Learned position embeddings
  always end at max_len.
  precision: the matmul-precision policy ("highest", "high", "default";
  `specjax.models.precision`): compare plain and speculative runs under the same one.
  """
  check_precision(precision)
  target = LM.of(target)
  cfg = target.config
  max_len, limited, opt_in = _limits([cfg], allow_beyond_max_len)
  batch = prepare_batch(prompts, vocab_size=cfg.vocab_size, max_len=max_len,
                        max_new_tokens=max_new_tokens, cache_len=cache_len,
                        positions_limited=limited, max_len_opt_in=opt_in)
  kv.check_fits(cfg, len(batch.budget_B), batch.cache_len, what="target KV cache")
  sampler = sampler if sampler is not None else sampling.make_sampler(0.0)
  start = time.perf_counter()
  state = loop.generate_jit(target, batch.prompt_BP, batch.prompt_len_B, batch.budget_B,
                            _eos(eos_id, cfg.vocab_size), sampler, _key(seed),
                            cache_len=batch.cache_len, **_precision_kw(precision))
  state = jax.block_until_ready(state)
  return _collect(state, batch, time.perf_counter() - start, 0)


def as_drafter(draft) -> Drafter:
  """A drafter from a drafter (a `drafters.base.Drafter`) or a bare draft model (wrapped as
  a separate-model drafter, `ModelDrafter`)."""
  if isinstance(draft, Drafter):
    return draft
  return ModelDrafter.of(draft)


def fit_vocab(drafter: Drafter, vocab_size: int) -> Drafter:
  """The drafter for a target of `vocab_size` ids: as it is when its model's vocabulary has
  as many ids (or it has no model), padded when it has fewer (a target with extra padded
  or reserved rows: `ModelDrafter.padded_to`, docs/exactness.md "Padded vocabularies");
  ValueError naming both sizes when it has more, or cannot be padded."""
  cfg = drafter.config
  if cfg is None or cfg.vocab_size == vocab_size:
    return drafter
  if isinstance(drafter, ModelDrafter):
    return drafter.padded_to(vocab_size)
  raise ValueError(f"draft vocabulary ({cfg.vocab_size}) must match the target's "
                   f"({vocab_size}): {type(drafter).__name__} cannot pad its vocabulary")


def resolve_tree(k: int | None, tree: TreeSpec | DynamicTree | None) -> TreeSpec | DynamicTree:
  """The tree of a speculative call: exactly one of k (a chain, `trees.chain(k)`) or tree."""
  if (k is None) == (tree is None):
    got = "neither" if k is None else f"both k={k!r} and tree={tree!r}"
    raise ValueError(f"speculative decoding needs exactly one of k (chain length) or tree "
                     f"(a trees.TreeSpec or trees.DynamicTree), got {got}")
  if tree is None:
    return trees.chain(_check_int("k", k, 1))
  if not isinstance(tree, (TreeSpec, DynamicTree)):
    raise ValueError(f"tree must be a trees.TreeSpec or trees.DynamicTree, got {tree!r}")
  return tree


def default_policy(target, drafter, entries=adaptive.DEFAULT_CHAINS,
                   **kwargs) -> adaptive.AdaptivePolicy:
  """The policy of `k="auto"` without calibrated costs: the menu `entries` (default
  `adaptive.DEFAULT_CHAINS`) priced by `AdaptivePolicy.from_model` with c = the draft's share
  of the target's per-token matmul weights (1 for a drafter without a model of its own or
  the target itself), a k = 0 step's catch-up share 1 / `loop.LAZY_SLOTS` for a drafter that
  catches up lazily. kwargs: the policy's runtime values (threshold, decay, ...). Calibrate
  for real costs (`adaptive.AdaptivePolicy.from_costs`)."""
  from specjax import roofline  # plain numpy; only needed here

  drafter = as_drafter(drafter)
  if entries is adaptive.DEFAULT_CHAINS:  # a menu the caller chose is taken as given
    entries = _entries_drafter_takes(drafter, entries)
  cfg = drafter.config
  c = 1.0
  if cfg is not None and cfg != target.config:
    c = roofline.param_counts(cfg)["matmul"] / roofline.param_counts(target.config)["matmul"]
  return adaptive.AdaptivePolicy.from_model(entries, c=min(c, 1.0),
                                            lazy_slots=lazy_slots_of(drafter), **kwargs)


def _entries_drafter_takes(drafter, entries) -> tuple:
  """The default menu's entries this drafter can draft (e.g. chains no deeper than its
  Medusa heads): k = 0 is always kept; none left but k = 0 is refused."""
  kept = []
  for e in entries:
    tree = None if e == 0 else (e if isinstance(e, TreeSpec) else trees.chain(int(e)))
    try:
      if tree is not None:
        drafter.validate(tree, 1)
    except ValueError:
      continue
    kept.append(e)
  if all(e == 0 for e in kept):
    raise ValueError(f"the drafter can draft none of the default menu's shapes {entries!r}: "
                     f"pass policy= with shapes it takes")
  return tuple(kept)


def lazy_slots_of(drafter) -> int:
  """The adaptive loop's lazy catch-up bound for this drafter: `loop.LAZY_SLOTS` if it
  declares `lazy_catch_up`, else 0 (eager). Price k = 0 with it (`AdaptivePolicy.from_costs`
  / `from_model`, `lazy_slots=`)."""
  return loop.LAZY_SLOTS if as_drafter(drafter).lazy_catch_up else 0


def speculative_generate(target, draft, prompts, *, k: int | str | None = None,
                         tree: TreeSpec | DynamicTree | None = None,
                         policy: adaptive.AdaptivePolicy | None = None, max_new_tokens,
                         sampler=None, seed=0, eos_id=None, cache_len: int | None = None,
                         allow_beyond_max_len: bool = False,
                         precision: str = DEFAULT_PRECISION) -> Generation:
  """Speculative decoding of a chain of k drafts, or of a token tree (exactly one of them),
  or adaptive: `k="auto"` and/or `policy=` (an `adaptive.AdaptivePolicy`; default
  `default_policy`) picks a shape of the policy's menu every cycle inside one compiled loop
  (`adaptive_loop.adaptive_loop`).

  draft: a draft model (wrapped as a `ModelDrafter`) or any `drafters.Drafter`, e.g.
  `LookupDrafter(max_ngram=3)` (prompt lookup, no model) or
  `LayerSkipDrafter.of(target, m)` (the target's first m layers).

  tree: a `trees.TreeSpec` (static shape, e.g. trees.branching((3, 2, 1)),
  trees.optimal(16, rank_probs)) or a `trees.DynamicTree` (EAGLE-2 style, deterministic
  candidates). k = K is tree = trees.chain(K): the same compiled code path.
  allow_beyond_max_len, precision: as in `generate` (the policy covers the draft too).
  """
  check_precision(precision)
  target = LM.of(target)
  drafter = fit_vocab(as_drafter(draft), target.config.vocab_size)
  if (isinstance(k, str) and k == "auto") or policy is not None:
    if tree is not None or (k is not None and not (isinstance(k, str) and k == "auto")):
      raise ValueError(f"adaptive speculation (k='auto' or policy=) takes its shapes from the "
                       f"policy's menu: pass neither k={k!r} nor tree={tree!r} with it")
    if policy is None:
      policy = default_policy(target, drafter)
    if not isinstance(policy, adaptive.AdaptivePolicy):
      raise ValueError(f"policy must be an adaptive.AdaptivePolicy, got {policy!r}")
    return _adaptive_generate(target, drafter, policy, prompts, max_new_tokens=max_new_tokens,
                              sampler=sampler, seed=seed, eos_id=eos_id, cache_len=cache_len,
                              allow_beyond_max_len=allow_beyond_max_len, precision=precision)
  if isinstance(k, str):
    raise ValueError(f"k must be an int >= 1 or 'auto', got {k!r}")
  cfg = target.config
  if tree is None and k is not None:
    # A chain of k writes k + 1 slots a cycle: check that against the context before the
    # chain (and anything sized by it) is built.
    _sized_batch(target, drafter, prompts, max_new_tokens, cache_len, allow_beyond_max_len,
                 slots=_check_int("k", k, 1) + 1)
  tree = resolve_tree(k, tree)
  batch, sampler = _checked_plan(target, drafter, prompts, [tree], "tree",
                                 max_new_tokens=max_new_tokens, cache_len=cache_len,
                                 allow_beyond_max_len=allow_beyond_max_len, sampler=sampler)
  start = time.perf_counter()
  state = loop.speculative_jit(target, drafter, batch.prompt_BP, batch.prompt_len_B,
                               batch.budget_B, _eos(eos_id, cfg.vocab_size), sampler,
                               _key(seed), tree=tree, cache_len=batch.cache_len,
                               **_precision_kw(precision))
  state = jax.block_until_ready(state)
  return _collect(state, batch, time.perf_counter() - start, tree.size, tree)


def _sized_batch(target: LM, drafter: Drafter, prompts, max_new_tokens, cache_len,
                 allow_beyond_max_len, *, slots: int) -> Batch:
  """`prepare_batch` against the target's and the draft's limits (positions, vocabulary)."""
  cfg, draft_cfg = target.config, drafter.config
  configs = [cfg] if draft_cfg is None else [cfg, draft_cfg]
  max_len, limited, opt_in = _limits(configs, allow_beyond_max_len)
  return prepare_batch(prompts, slots=slots, vocab_size=cfg.vocab_size, max_len=max_len,
                       max_new_tokens=max_new_tokens, cache_len=cache_len,
                       positions_limited=limited, max_len_opt_in=opt_in)


def _checked_plan(target: LM, drafter: Drafter, prompts, shapes, what: str, *,
                  max_new_tokens, cache_len, allow_beyond_max_len, sampler):
  """The one set of checks every speculative run passes before anything compiles, for the
  shapes it may verify (one tree, or a policy's menu): widths within the vocabulary, the
  batch and its cache sized for the most slots any shape writes, the drafter able to draft
  each shape at this batch, both KV caches within memory. Returns (batch, sampler)."""
  cfg = target.config
  width = max(e.max_width for e in shapes)
  if width > cfg.vocab_size:
    raise ValueError(f"{what} has a node with {width} candidates (width {width}) but the "
                     f"vocabulary has only {cfg.vocab_size} tokens: width must be <= "
                     f"{cfg.vocab_size}")
  slots = max(max(e.n_nodes, drafter.slots_needed(e)) for e in shapes)
  batch = _sized_batch(target, drafter, prompts, max_new_tokens, cache_len,
                       allow_beyond_max_len, slots=slots)
  b = len(batch.budget_B)
  for e in shapes:
    drafter.validate(e, b)
  extra = _draft_cache_bytes(drafter, b, batch.cache_len)
  kv.check_fits(cfg, b, batch.cache_len, extra_bytes=extra, what="target + draft KV caches")
  return batch, sampler if sampler is not None else sampling.make_sampler(0.0)


def _draft_cache_bytes(drafter: Drafter, batch: int, cache_len: int) -> int:
  """The drafter's own KV cache: none without a model or when it shares the target's."""
  if drafter.config is None or drafter.shares_target_cache:
    return 0
  return kv.cache_bytes(drafter.config, batch, cache_len)


def _adaptive_generate(target: LM, drafter: Drafter, policy: adaptive.AdaptivePolicy, prompts, *,
                       max_new_tokens, sampler, seed, eos_id, cache_len,
                       allow_beyond_max_len, precision) -> Generation:
  """`speculative_generate` with a policy: every menu shape validated (the drafter, the
  vocabulary, the cache: the largest shape's slots must fit) before anything compiles."""
  cfg = target.config
  adaptive.menu(policy.menu)  # empty, dynamic or duplicate shapes: ValueError
  adaptive.check_threshold(float(policy.threshold))
  shapes = [trees.chain(1) if e is None else e for e in policy.menu]  # k = 0 drafts a chain(1)
  batch, sampler = _checked_plan(target, drafter, prompts, shapes, "policy menu",
                                 max_new_tokens=max_new_tokens, cache_len=cache_len,
                                 allow_beyond_max_len=allow_beyond_max_len, sampler=sampler)
  start = time.perf_counter()
  state = adaptive_loop.adaptive_jit(target, drafter, policy, batch.prompt_BP,
                                     batch.prompt_len_B, batch.budget_B,
                                     _eos(eos_id, cfg.vocab_size), sampler, _key(seed),
                                     cache_len=batch.cache_len, **_precision_kw(precision))
  state = jax.block_until_ready(state)
  return _collect(state, batch, time.perf_counter() - start, max(policy.max_depth, 1), None,
                  policy)
