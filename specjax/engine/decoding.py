"""The host API: the compiled loops (`engine.loop`, `engine.adaptive.loop`) behind two calls, and
the result type.

`generate` (plain autoregressive decoding) and `speculative_generate` (a chain of k drafts,
a token tree, or an adaptive policy: a speculation plan, `specjax.engine.plan`) validate every
argument at the Python boundary (ValueError naming the argument, its value and what is
allowed), once: a speculative call builds its plan (`plan.of`) and passes
`plan.prepare`'s checks (vocabulary, shapes, drafter, context, memory); both pad a ragged
batch to a prompt bucket and size the KV cache (`batching.prepare_batch`,
`batching.cache_len_for`), call the compiled loop and return a `Generation` on the host.

Context. A request fits when the longest prompt + max_new_tokens + the slots one cycle
writes is at most the context: cache_len when given, else the models' max_len (learned
position embeddings end there; a RoPE model is held to its trained length unless
`allow_beyond_max_len=True`). The power-of-two prompt bucket and the cache length are
capped at that context, so rounding never refuses a request that fits. The
analysis of a run (`metrics.summarize`, `metrics.summarize_tree`) is called by
`Generation.summary` / `Generation.tree_summary`, never by the loop.

Runtime values (temperature, top-k, top-p, budgets, EOS ids, seed) are arrays: changing
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

from specjax.engine.adaptive import policy as adaptive, loop as adaptive_loop
from specjax.engine import loop
from specjax.analysis import metrics
from specjax.verify import sampling
from specjax import sharding
# the call's inputs and the speculation plan live below this module; their public names are
# the host API's too (decoding.prepare_batch, decoding.default_policy, ...)
from specjax.engine.batching import (MIN_BUCKET, Batch, cache_len_for,  # noqa: F401
                                     eos_ids, key_of, pad_rows, prepare_batch, sized_batch)
from specjax.models.lm import LM
from specjax.models import cache as kv
from specjax.models.fused import packed_lm
from specjax.models.precision import DEFAULT_PRECISION, check_precision
from specjax.engine.plan import (Prepared, SpeculationPlan, as_drafter, default_policy,
                                 drafter_menu, fit_vocab, lazy_slots_of, prepare,
                                 resolve_tree)  # noqa: F401
from specjax.engine.plan import draft_cache_bytes as _draft_cache_bytes  # noqa: F401
from specjax.engine.plan import of as plan_of
from specjax.verify.trees import DynamicTree, TreeSpec

Array = jax.Array


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
  must divide the number of prompts.

  The callable's `warm_up` attribute decodes one batch per longest-prompt length among the
  batches: every program the whole call compiles (each batch's shapes follow from its
  longest prompt), at a fraction of its time (`timing.alternate`'s warm-up call)."""
  if (isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1
      or len(prompt_ids) % batch):
    raise ValueError(f"batch must be an int >= 1 dividing the {len(prompt_ids)} prompts, "
                     f"got {batch!r}")
  groups = [list(prompt_ids[i:i + batch]) for i in range(0, len(prompt_ids), batch)]
  if len(groups) == 1:
    run = lambda: call(groups[0])  # noqa: E731
  else:
    run = lambda: Generation.concat([call(g) for g in groups])  # noqa: E731
  firsts: dict[int, list] = {}
  for g in groups:  # the first batch of each longest-prompt length, in order
    firsts.setdefault(max(len(p) for p in g), g)
  run.warm_up = lambda: [call(g) for g in firsts.values()][-1]
  return run


def loop_iterations(run: Generation, batch: int) -> int:
  """Loop iterations a run of consecutive batches of `batch` rows took: the sum over its
  batches of the most cycles any row of the batch ran (a batch loops until its slowest row
  is done)."""
  cycles = np.asarray(run.stats["cycles"]).reshape(-1, batch)
  return int(cycles.max(axis=1).sum())


def _precision_kw(precision: str) -> dict:
  """The loops' `precision` keyword, left out at its default so that a direct call of a
  compiled loop and the host API's share one compile (jit keys on the keywords passed),
  unless the API's models carry packed weights (`with_packs`: another argument structure)."""
  return {} if precision == DEFAULT_PRECISION else {"precision": precision}


class NonFiniteLogitsError(ValueError):
  """A run whose target logits, or draft logits / probabilities, held a NaN or ±inf: its
  tokens (target) or its acceptance figures (draft: NaN drafts look like rejected ones, α =
  0) are meaningless. The loops count such passes (`loop.LoopState.nonfinite` for the
  target, `draft_nonfinite` for the draft; one reduction per pass, no host sync); the host
  refuses the result. `generation` holds it for inspection; `passes` is the sum of
  `target_passes` and `draft_passes`."""

  def __init__(self, target_passes: int, generation: "Generation", draft_passes: int = 0):
    numerics = "numerics (dtype, norm_eps, positions past max_len)"
    if target_passes:
      also = (f" (the draft's logits too, in {draft_passes} drafting pass(es))"
              if draft_passes else "")
      text = (f"the target's logits were NaN or infinite in {target_passes} decoding "
              f"pass(es){also}: the generated tokens are meaningless; check the model's "
              f"weights (a checkpoint holding NaN/inf) and {numerics}")
    else:
      text = (f"the draft's logits were NaN or infinite in {draft_passes} drafting pass(es): "
              f"its proposals and the acceptance figures (α) are meaningless; check the "
              f"draft's weights (a checkpoint or head holding NaN/inf) and {numerics}")
    super().__init__(text)
    self.target_passes, self.draft_passes = target_passes, draft_passes
    self.passes, self.generation = target_passes + draft_passes, generation


def _collect(state: loop.LoopState, batch: Batch, seconds: float, k: int,
             tree: Any = None, policy: Any = None) -> Generation:
  """The loop's final state as a Generation on the host, without the rows that only pad the
  batch for a mesh (`Batch.padded`); raises NonFiniteLogitsError when the loop counted
  non-finite target or draft logits (a run can never silently return NaN-driven tokens or
  figures)."""
  rows = len(batch.prompt_len_B) - batch.padded
  tokens = np.asarray(state.tokens)
  length = np.asarray(state.length)
  out = [tokens[b, p:l + 1].tolist()
         for b, (p, l) in enumerate(zip(batch.prompt_len_B[:rows], length[:rows]))]
  stats = None
  if state.stats is not None:
    stats = {f.name: np.asarray(getattr(state.stats, f.name))[:rows]
             for f in dataclasses.fields(state.stats)}
  extra = {}
  if state.adapt is not None:
    a = state.adapt
    extra = dict(choices=np.asarray(a.choices)[:int(a.cycle)], menu=policy.names,
                 plain_steps=np.asarray(a.plain_steps)[:rows],
                 stopping={"stopped": np.asarray(a.stopped)[:rows],
                           "skipped": np.asarray(a.skipped)[:rows]})
  run = Generation(tokens=out, prompt_lengths=batch.prompt_len_B[:rows].tolist(), stats=stats,
                   seconds=seconds, k=k, tree=tree, **extra)
  passes = int(np.sum(np.asarray(state.nonfinite)))  # vmapped loops: one count per instance
  draft_passes = int(np.sum(np.asarray(state.draft_nonfinite)))
  if passes or draft_passes:
    raise NonFiniteLogitsError(passes, run, draft_passes)
  return run


def with_packs(mesh, args: tuple) -> tuple:
  """A loop's arguments with every model (`LM`, the drafter's included) carrying the row
  kernel's packed weights, made once per model (`fused.packed_lm`) instead of inside every
  call's program (+0.3 s a call on SmolLM2-135M); unchanged on a mesh, where the loop packs
  the placed weights itself."""
  if mesh is not None:
    return args
  is_lm = lambda x: isinstance(x, LM)
  return jax.tree_util.tree_map(lambda x: packed_lm(x) if is_lm(x) else x, args,
                                is_leaf=is_lm)


def generate(target, prompts, *, max_new_tokens, sampler=None, seed=0, eos_id=None,
             cache_len: int | None = None, allow_beyond_max_len: bool = False,
             precision: str = DEFAULT_PRECISION, mesh=None) -> Generation:
  """Plain autoregressive decoding of a ragged batch of prompts (one compiled loop).

  eos_id: None, an id, or a sequence of ids (`batching.eos_ids`): a row stops at the first
  of any of them (emitted, then done).

  allow_beyond_max_len: let a RoPE model generate past its trained length `max_len`
  (refused by default: quality past it is not guaranteed). Learned position embeddings
  always end at max_len.
  precision: the matmul-precision policy ("highest", "high", "default";
  `specjax.models.precision`): compare plain and speculative runs under the same one.
  mesh: a `jax.sharding.Mesh` with axes ('data', 'model') (`sharding.make_mesh`): weights
  tensor-parallel over `model`, rows over `data` (`specjax.sharding`); None: one device.
  A batch that `data` does not divide is padded with copies of its last prompt (one token
  each, dropped from the result; `batching.pad_rows`).
  """
  check_precision(precision)
  mesh = sharding.check_mesh(mesh)
  target = LM.of(target)
  cfg = target.config
  batch = sized_batch([cfg], prompts, max_new_tokens=max_new_tokens, cache_len=cache_len,
                      allow_beyond_max_len=allow_beyond_max_len)
  batch = pad_rows(batch, sharding.data_size(mesh))
  with sharding.on(mesh):  # a cache split over the mesh is checked per device
    kv.check_fits(cfg, len(batch.budget_B), batch.cache_len, what="target KV cache")
  sampler = sampler if sampler is not None else sampling.make_sampler(0.0)
  args = with_packs(mesh, (target, batch.prompt_BP, batch.prompt_len_B, batch.budget_B,
                           eos_ids(eos_id, cfg.vocab_size), sampler, key_of(seed)))
  start = time.perf_counter()
  args = sharding.place_args(mesh, args, models=1)
  with sharding.on(mesh):
    state = loop.generate_jit(*args, cache_len=batch.cache_len, **_precision_kw(precision))
  state = sharding.fetched(jax.block_until_ready(state))  # gathered from every process
  return _collect(state, batch, time.perf_counter() - start, 0)


def speculative_generate(target, draft, prompts, *, k: int | str | None = None,
                         tree: TreeSpec | DynamicTree | None = None,
                         policy: adaptive.AdaptivePolicy | None = None,
                         plan: SpeculationPlan | None = None, max_new_tokens,
                         sampler=None, seed=0, eos_id=None, cache_len: int | None = None,
                         allow_beyond_max_len: bool = False,
                         precision: str = DEFAULT_PRECISION, mesh=None) -> Generation:
  """Speculative decoding of a chain of k drafts, or of a token tree (exactly one of them),
  or adaptive: `k="auto"` and/or `policy=` (an `adaptive.AdaptivePolicy`; default
  `default_policy`) picks a shape of the policy's menu every cycle inside one compiled loop
  (`adaptive_loop.adaptive_loop`). Or `plan=`: a `plan.SpeculationPlan` built once
  (`specjax.engine.plan.of`) instead of k / tree / policy.

  draft: a draft model (wrapped as a `ModelDrafter`) or any `drafters.Drafter`, e.g.
  `LookupDrafter(max_ngram=3)` (prompt lookup, no model) or
  `LayerSkipDrafter.of(target, m)` (the target's first m layers).

  tree: a `trees.TreeSpec` (static shape, e.g. trees.branching((3, 2, 1)),
  trees.optimal(16, rank_probs)) or a `trees.DynamicTree` (EAGLE-2 style, deterministic
  candidates). k = K is tree = trees.chain(K): the same compiled code path.
  eos_id: None, an id, or a sequence of ids (a row stops at the first of any).
  allow_beyond_max_len, precision: as in `generate` (the policy covers the draft too).
  Every check is `plan.prepare`'s, done once before anything compiles.
  mesh: as in `generate` (a drafter's weights follow the target's rules; a batch that
  `data` does not divide is padded the same way).
  """
  check_precision(precision)
  mesh = sharding.check_mesh(mesh)
  with sharding.on(mesh):  # caches split over the mesh are checked per device
    run = prepare(target, draft, prompts, plan_of(k=k, tree=tree, policy=policy, plan=plan),
                  max_new_tokens=max_new_tokens, sampler=sampler, seed=seed, eos_id=eos_id,
                  cache_len=cache_len, allow_beyond_max_len=allow_beyond_max_len,
                  row_multiple=sharding.data_size(mesh))
  spec = run.plan
  compiled = adaptive_loop.adaptive_jit if spec.adaptive else loop.speculative_jit
  args = with_packs(mesh, run.loop_args())
  start = time.perf_counter()
  args = sharding.place_args(mesh, args, models=3 if spec.adaptive else 2)
  with sharding.on(mesh):
    state = compiled(*args, **run.loop_kwargs(), **_precision_kw(precision))
  state = sharding.fetched(jax.block_until_ready(state))  # gathered from every process
  return _collect(state, run.batch, time.perf_counter() - start, spec.k, spec.tree,
                  spec.policy)
