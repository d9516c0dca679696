"""Plain vs speculative decoding of the same prompts, measured side by side: `compare(...)
-> Comparison`, their speedup, and the speedup predicted from the costs.

With `loop_costs` (a `specjax.calibration.LoopCosts`: the compiled loop's own step and cycle
times, see docs/cost_model.md, "Calibrated loop costs") the prediction is

    predicted = τ / cycle_steps(tree),   efficiency = measured ÷ predicted speedup;

without, it is built from standalone forward timings (`forward_timing.step_costs`),
τ / (D·c + v), with D the draft passes per cycle, c the draft's cost per pass and v the
verification cost, both in one-token target steps (see docs/cost_model.md, "c as
measured"); τ is the tokens per cycle the experiment predicts (E[τ](α, k) for a chain, the
measured τ for a tree).

Every run and timing of a point reads one cache length: `cycle_slots` +
`decoding.cache_len_for`, the engine's own rule (attention reads every slot, so a different
length is a different cost).

`calibrated_compare` is the sequence the studies share: one cache length for the calibrated
shapes and the measured tree, the calibration (cached per machine), then `compare` of the
decode phase with the calibrated costs as the prediction.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from specjax.calibration import loop_costs as calibration
from specjax.engine import decoding
from specjax.verify import sampling
from specjax.drafters.base import Drafter
from specjax.drafters.model import ModelDrafter

from specjax.experiments.forward_timing import StepCosts, alternate, step_costs


def drafter_of(draft, deterministic: bool = False) -> Drafter:
  """A `Drafter` object as is; a draft model as a `ModelDrafter` (top-k candidates when
  `deterministic`)."""
  return draft if isinstance(draft, Drafter) else ModelDrafter.of(draft,
                                                                  deterministic=deterministic)


def cycle_slots(tree, draft) -> int:
  """Cache slots one speculative cycle of `tree` writes from the pending token with a draft
  model or a `Drafter` (the engine's rule: the verified nodes, or the drafter's extent if
  larger); with `decoding.cache_len_for` it gives the cache length the engine allocates."""
  return max(tree.n_nodes, drafter_of(draft).slots_needed(tree))


@dataclasses.dataclass(frozen=True)
class Comparison:
  """Plain vs speculative decoding of the same prompts, timed side by side (`compare`).

  plain, spec: the `decoding.Generation` of each one's last call; plain_s, spec_s: seconds
  per call (the median of the alternated calls, or the fastest); with `decode_only`, also
  the seconds of the same calls with max_new_tokens = 1 (the prefill alone), and rates are
  of the decode phase (the difference), NaN when the difference is lost in the noise.
  costs: the standalone step costs at the mean decoding context, same cache length (None
  when `loop_costs`, the calibrated loop costs, make the prediction instead).
  """

  plain: Any
  spec: Any
  plain_s: float
  spec_s: float
  costs: StepCosts | None
  tree: Any
  cache_len: int
  context: int
  plain_prefill_s: float | None = None
  spec_prefill_s: float | None = None
  loop_costs: Any = None  # specjax.calibration.loop_costs.LoopCosts

  @staticmethod
  def _rate(run, seconds: float, prefill_s: float | None) -> float:
    if prefill_s is None:
      return run.emitted / seconds
    decoded = run.emitted - len(run.tokens)  # tokens after each row's prefill token
    return decoded / (seconds - prefill_s) if seconds > prefill_s else float("nan")

  @property
  def plain_tok_s(self) -> float:
    return self._rate(self.plain, self.plain_s, self.plain_prefill_s)

  @property
  def spec_tok_s(self) -> float:
    return self._rate(self.spec, self.spec_s, self.spec_prefill_s)

  @property
  def speedup(self) -> float:
    """Measured: speculative ÷ plain tokens/s (the decode phase when the prefill was timed,
    else whole calls)."""
    return self.spec_tok_s / self.plain_tok_s

  @property
  def plain_tok_s_e2e(self) -> float:
    """Whole calls, prefill included (Spec-Bench's measure)."""
    return self.plain.emitted / self.plain_s

  @property
  def spec_tok_s_e2e(self) -> float:
    return self.spec.emitted / self.spec_s

  @property
  def speedup_e2e(self) -> float:
    """End to end: plain ÷ speculative wall time of the same calls, prefill included."""
    return self.plain_s / self.spec_s

  @property
  def identical(self) -> bool:
    """Whether both emitted the same tokens (they must at temperature 0)."""
    return self.plain.tokens == self.spec.tokens

  def predicted(self, tau: float) -> float:
    """Predicted speedup at τ tokens per cycle: τ / cycle_steps(tree) with the calibrated
    loop costs, else τ / (D·c + v) from the standalone step costs."""
    if self.loop_costs is not None:
      return self.loop_costs.predicted_speedup(self.tree, tau)
    return tau / self.costs.cycle

  def efficiency(self, predicted: float) -> float:
    """Measured ÷ predicted speedup (NaN when the prediction is not positive)."""
    return self.speedup / predicted if predicted > 0 else float("nan")


def compare(target, draft, prompt_ids: Sequence[Sequence[int]], *, tree, max_new_tokens: int,
            repeats: int, temperature: float = 0.0, seed: int = 0,
            deterministic: bool = False, cache_len: int | None = None,
            forward_repeats: int | None = None, statistic: str = "median",
            decode_only: bool = False, loop_costs=None,
            batch: int | None = None) -> Comparison:
  """Plain `decoding.generate` and `decoding.speculative_generate` of `tree` (a chain is
  `trees.chain(k)`) with the draft model `draft` (or any `Drafter` object, used as is:
  `deterministic` is then ignored; pass `loop_costs`, the standalone step costs time a
  draft model), on the same prompts, alternated `repeats`
  times (`alternate`); then the step costs at the mean decoding context (the longest prompt
  + max_new_tokens // 2), medians of `forward_repeats` (default `repeats`) samples.

  Every run and timing reads one cache length: `cache_len`, by default the engine's for the
  speculative call (`decoding.cache_len_for` with `cycle_slots`). deterministic: the draft
  proposes distinct top-k candidates (the point-mass rule) instead of sampling.
  statistic: "median" or "fastest" call. decode_only: also time both with max_new_tokens =
  1 and rate the decode phase only (long contexts, where the prefill dominates a call).
  loop_costs: a `specjax.calibration.LoopCosts` of these models at this batch: the
  prediction uses it (`Comparison.predicted`) and the standalone forwards are not timed.
  batch: rows per call (default: all prompts in one call). Fewer rows than prompts decode
  the prompts as consecutive batches of `batch` rows (their number must divide evenly),
  one after another inside each timed call, and the Generations are concatenated
  (`decoding.in_batches`): a batch-1 figure then covers several prompts, not one.
  """
  if statistic not in ("median", "fastest"):
    raise ValueError(f"statistic must be 'median' or 'fastest', got {statistic!r}")
  prompt_len = max(len(p) for p in prompt_ids)
  if cache_len is None:
    cache_len = decoding.cache_len_for(prompt_len, max_new_tokens, cycle_slots(tree, draft))
  rows = len(prompt_ids) if batch is None else batch
  drafter = drafter_of(draft, deterministic)
  common = dict(sampler=sampling.make_sampler(temperature), seed=seed, cache_len=cache_len)

  def plain(n):
    return decoding.in_batches(
        lambda ids: decoding.generate(target, ids, max_new_tokens=n, **common), prompt_ids, rows)

  def spec(n):
    return decoding.in_batches(lambda ids: decoding.speculative_generate(
        target, drafter, ids, tree=tree, max_new_tokens=n, **common), prompt_ids, rows)

  fns = {"plain": plain(max_new_tokens), "spec": spec(max_new_tokens)}
  if decode_only:
    fns.update(plain_prefill=plain(1), spec_prefill=spec(1))
  timed = alternate(fns, repeats)
  seconds = {name: getattr(t, statistic) for name, t in timed.items()}
  context = prompt_len + max_new_tokens // 2
  costs = None if loop_costs is not None else step_costs(
      target, draft, rows, tree, context, cache_len, forward_repeats or repeats)
  return Comparison(plain=timed["plain"].result, spec=timed["spec"].result,
                    plain_s=seconds["plain"], spec_s=seconds["spec"], costs=costs, tree=tree,
                    cache_len=cache_len, context=context,
                    plain_prefill_s=seconds.get("plain_prefill"),
                    spec_prefill_s=seconds.get("spec_prefill"), loop_costs=loop_costs)


def calibrated_compare(target, draft, prompt_ids: Sequence[Sequence[int]],
                       shapes: Sequence[Any], *, tree, max_new_tokens: int, repeats: int,
                       calibration_repeats: int, temperature: float = 0.0, seed: int = 0,
                       batch: int | None = None, statistic: str = "median",
                       recalibrate: bool = False, revalidate: float | None = None,
                       drafter_for=None, deterministic: bool = False,
                       cache_len: int | None = None) -> Comparison:
  """Calibrate, then compare: the loop costs of `shapes` (`calibration.calibrate`, with
  `drafter_for(draft, shape)` as each shape's drafter, cached per machine) and `compare` of
  `tree` on the decode phase with those costs as the prediction (`Comparison.loop_costs`).
  Both read one cache length: `cache_len`, by default the largest the engine picks for
  `shapes` (which hold `tree`) with their drafters (`calibration.default_cache_len`), so
  what is calibrated is what is measured and the compiled loops are shared. The measured
  speculative run drafts with `drafter_for(draft, tree)` (default: `draft` itself,
  top-k candidates when `deterministic`)."""
  if cache_len is None:
    cache_len = calibration.default_cache_len(target, draft, prompt_ids, list(shapes),
                                              max_new_tokens, drafter_for)
  costs = calibration.calibrate(target, draft, prompt_ids, list(shapes), batch=batch,
                                max_new_tokens=max_new_tokens, repeats=calibration_repeats,
                                temperature=temperature, seed=seed, cache_len=cache_len,
                                recalibrate=recalibrate, statistic=statistic,
                                drafter_for=drafter_for, revalidate=revalidate)
  spec_draft = draft if drafter_for is None else drafter_for(draft, tree)
  return compare(target, spec_draft, prompt_ids, batch=batch, tree=tree,
                 max_new_tokens=max_new_tokens, repeats=repeats, temperature=temperature,
                 seed=seed, deterministic=deterministic, cache_len=cache_len,
                 decode_only=True, loop_costs=costs, statistic=statistic)
