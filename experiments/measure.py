"""The measurement skeleton every experiment shares: models, prompts, timing, costs, checks.

An experiment keeps only its point function, its validation, its memory estimate and its
report; everything it measures goes through here:

- models: `models(which, target_dtype, draft)` with `which` any target reference and `draft`
  any draft model reference of `experiments/references.py` ("default" = the embedded
  trained tiny pair, with held-out prompts from its corpus; "random" = random tiny Llama
  models on the byte vocabulary, fast, for tests and smoke runs; a Hugging Face or specjax
  model directory), `draft_model` (also a random draft of a preset size), `model_configs` /
  `cache_bytes` (their configs and KV bytes without loading weights, for memory
  estimates), `prompts` (the embedded sets' windows; a study's prompts by reference:
  `references.workload`);
- the cache length: `cycle_slots` + `decoding.cache_len_for`, the engine's own rule, so
  plain and speculative runs and the standalone timings of a point read caches of the same
  length (attention reads every slot, so a different length is a different cost);
- timing: `alternate(fns, repeats)`, the one alternating-timing loop (drift and other load
  hit every callable alike); `forward_seconds`, one jitted forward of T tokens per row at a
  fixed context; `step_costs`, the standalone costs (t_1, v, c) a prediction is built from
  when no calibrated loop costs are given;
- `compare(...) -> Comparison`: plain vs speculative decoding measured side by side, their
  speedup, and the speedup predicted from the costs. With `loop_costs` (a
  `specjax.calibration.LoopCosts`: the compiled loop's own step and cycle times, see
  docs/cost_model.md, "Calibrated loop costs") the prediction is

      predicted = τ / cycle_steps(tree),   efficiency = measured ÷ predicted speedup;

  without, it is built from standalone forward timings, τ / (D·c + v), with D the draft
  passes per cycle, c the draft's cost per pass and v the verification cost, both in
  one-token target steps (see docs/cost_model.md, "c as measured"); τ is the tokens per
  cycle the experiment predicts (E[τ](α, k) for a chain, the measured τ for a tree);
- `speculative_row(cmp, tau_loop, temperature)`: the result fields every point reports about
  a `Comparison` measured with calibrated loop costs; `say(line)`: a verdict on the console;
- `hardware()`: this machine's roofline, calibrated once per process;
- `check_int` / `check_number` / `check_choice`: the parameter checks of every `validate`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import calibration, decoding, metrics, roofline, sampling, timing, trees
from specjax.drafters.base import LM, Drafter
from specjax.drafters.model import ModelDrafter
from specjax.models import cache as kv

from specjax.experiments import references


# ----------------------------------------------------------------------------- checks


def _range(lo, hi, lo_open: bool = False, hi_open: bool = False) -> str:
  if hi is None:
    return f"{'>' if lo_open else '>='} {lo}"
  return f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


def check_int(params: Mapping, name: str, default, lo: int, hi: int | None = None) -> int:
  """params[name] (or `default`) as an int in [lo, hi] (hi None: no upper bound)."""
  v = params.get(name, default)
  if (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo
      or (hi is not None and v > hi)):
    raise ValueError(f"{name} must be an int {_range(lo, hi)}, got {v!r}")
  return int(v)


def check_number(params: Mapping, name: str, default, lo: float | None = None,
                 hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False,
                 allow_none: bool = False, note: str = "") -> float | None:
  """params[name] (or `default`) as a finite number in the stated interval (None allowed
  only with allow_none; `note` says what the value means, in the message)."""
  v = params.get(name, default)
  if v is None and allow_none:
    return None
  ok = not isinstance(v, bool) and isinstance(v, (int, float, np.floating, np.integer))
  ok = ok and math.isfinite(v)
  if ok and lo is not None:
    ok = v > lo if lo_open else v >= lo
  if ok and hi is not None:
    ok = v < hi if hi_open else v <= hi
  if not ok:
    bound = "" if lo is None else " " + _range(lo, hi, lo_open, hi_open)
    raise ValueError(f"{name} must be {'None or ' if allow_none else ''}a finite number"
                     f"{bound}{note}, got {v!r}")
  return float(v)


def check_choice(params: Mapping, name: str, default, choices: Sequence):
  v = params.get(name, default)
  if v not in choices:
    raise ValueError(f"{name} must be one of {tuple(choices)}, got {v!r}")
  return v


# ----------------------------------------------------------------------------- models


def _held_out_texts() -> list[str]:
  from specjax.data.corpus import load_corpus
  return [d.text for d in load_corpus("code").validation[:64]]  # held out from training


@functools.lru_cache(maxsize=2)
def target_model(which: str, target_dtype: str = "float32"):
  """(target, tokenizer, prompt texts) of the target reference `which`
  (`references.target_ref`: "default", "random", "random:SPEC", a model directory) without
  its draft (for "default" the default target alone, `load_default_target`: a first use does
  not train the draft); the target's weights served in `target_dtype` (float32 as stored,
  or bfloat16: `transformer.with_dtype`). One target object per (which, dtype) in a
  process. The texts are what the embedded "code" prompts are cut from (None: the random
  target's fixed snippet)."""
  from specjax.models.transformer import with_dtype
  if target_dtype != "float32":
    target, tok, texts = target_model(which)
    return with_dtype(target, target_dtype), tok, texts
  if which == "default":
    from specjax.training.defaults import load_default_target
    default = load_default_target()  # training.presets.DEFAULT_PRESET
    return default.target_module(), default.tokenizer, _held_out_texts()
  target, tok, texts = references.load_target(which)
  if target.config.dtype != "float32":  # a checkpoint stored in bf16: served as asked
    target = with_dtype(target, "float32")
  return target, tok, texts


@functools.lru_cache(maxsize=4)
def models(which: str, target_dtype: str = "float32", draft: str = "default"):
  """(target, draft, tokenizer, prompt texts): `target_model(which, target_dtype)` and the
  draft model `draft` names (`references.draft_for`: "default" is the distilled draft of
  the default pair, or a random 1-layer model of the target's shape for any other target;
  else a draft model reference)."""
  target, tok, texts = target_model(which, target_dtype)
  stored = target_model(which)[0]  # as trained (float32), whatever the target is served in
  return target, references.draft_for(which, stored, tok, draft), tok, texts


@functools.lru_cache(maxsize=8)
def draft_model(name: str, which: str):
  """The draft of `models(which)` ("default"), a random model of preset `name` on the
  target's vocabulary (its max_len at least the target's), or any draft model reference
  (`references.draft_for`)."""
  from specjax.models.presets import PRESETS
  if name != "default" and (name not in PRESETS or os.path.isdir(name)):
    return models(which, draft=name)[1]
  target, draft, _, _ = models(which)
  if name == "default":
    return draft
  from flax import nnx

  from specjax.models.transformer import Transformer
  cfg = PRESETS[name].replace(vocab_size=target.config.vocab_size,
                              max_len=max(PRESETS[name].max_len, target.config.max_len))
  return Transformer(cfg, rngs=nnx.Rngs(1))


def _default_head(kind: str):
  """The default target's cached heads and their training seconds (the manifest's
  build_seconds, else the time of this load, which built them, with progress bars)."""
  import json

  from specjax.training import defaults
  start = time.perf_counter()
  head = defaults.load_default_heads(kind, progress=True)
  elapsed = time.perf_counter() - start
  seconds = head.metadata.get("build_seconds") if isinstance(head.metadata, dict) else None
  if seconds is None:
    entry = defaults.heads_entry_dir(kind, defaults.DEFAULT_PRESET,
                                     defaults.corpus_of(defaults.DEFAULT_PRESET, None),
                                     head.target.fingerprint)
    try:
      seconds = float(json.loads((entry / defaults.MANIFEST).read_text())["build_seconds"])
    except (OSError, KeyError, TypeError, ValueError):
      seconds = elapsed
  return head.kind, head.params, head.acceptance, seconds


@functools.lru_cache(maxsize=8)
def head(kind: str, which: str, steps: int = 8):
  """(kind object, params, acceptance, training seconds) of `kind` heads ("eagle",
  "medusa") for the target of `models(which)`: the cached default heads (built on first
  use), or trained here for `steps` steps (random models: tests)."""
  if which == "default":
    return _default_head(kind)
  references.check_embedded_only({}, f"the study's {kind} head", which)  # trained here: tests
  from flax import nnx

  from specjax.data.batches import TokenData
  from specjax.data.corpus import load_corpus
  from specjax.training.config import TrainConfig
  from specjax.training.defaults import default_head_spec
  from specjax.training.heads import kind_from_spec, train_head
  target, _, tok, _ = models(which)
  data = TokenData.from_corpus(load_corpus("code", max_bytes=60_000), tok)
  tc = TrainConfig(steps=steps, batch_size=4, seq_len=32, lr=1e-2, warmup_steps=1,
                   eval_every=0, ckpt_every=0, eval_windows=8)
  result = train_head(kind_from_spec(kind, default_head_spec(kind, target.config)), target.config,
                      nnx.state(target, nnx.Param), tc, data, tok, progress=False)
  return result.kind, result.params, result.acceptance, result.seconds


def eagle_drafter(target, which: str, deterministic: bool, steps: int = 8):
  """The EAGLE drafter of `head("eagle", which, steps)` over `target` (served in any dtype:
  the head reads its features and shares its embedding and LM head). deterministic: top-k
  candidates (trees at T = 0) instead of samples of the head's law."""
  from specjax.drafters.eagle import EagleDrafter
  kind, params, _, _ = head("eagle", which, steps)
  return EagleDrafter.of(target, params, kind.feature_layers(target.config),
                         deterministic=deterministic)


def model_configs(which: str, draft: str = "default"):
  """(target, draft) ModelConfigs of `models(which, draft=draft)`, without loading any
  weights (a directory's config is read from its files)."""
  if which == "default" and draft == "default":
    from specjax.training.presets import DEFAULT_PRESET, PRESETS
    return PRESETS[DEFAULT_PRESET].target, PRESETS[DEFAULT_PRESET].draft
  cfg = references.target_config(which)
  if draft == "default":
    if which == "default":
      from specjax.training.presets import DEFAULT_PRESET, PRESETS
      return cfg, PRESETS[DEFAULT_PRESET].draft
    return cfg, cfg.replace(n_layers=1)
  if draft == "self":
    return cfg, cfg
  if draft.startswith("random:"):
    from specjax.resolve import config_from_ref
    return cfg, config_from_ref("draft", draft.partition(":")[2], cfg.vocab_size)
  return cfg, references.target_config(draft, name="draft")


def eagle_config(which: str):
  """The ModelConfig of the default EAGLE head's decoder layer for the target of
  `models(which)` (its KV cache), without loading anything."""
  from specjax.drafters.eagle import head_config
  from specjax.training.defaults import default_head_spec
  target_cfg = model_configs(which)[0]
  return head_config(target_cfg, default_head_spec("eagle", target_cfg).get("width"))


def cache_bytes(which: str, batch: int, cache_len: int, draft: str = "default"
                ) -> tuple[int, int]:
  """(target, draft) KV-cache bytes of `models(which, draft=draft)` for batch × cache_len
  slots."""
  target_cfg, draft_cfg = model_configs(which, draft)
  return kv.cache_bytes(target_cfg, batch, cache_len), kv.cache_bytes(draft_cfg, batch,
                                                                       cache_len)


FALLBACK_TEXT = '''def _check(name, value, lo):
    if not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
    return value


class Counter:
    """Counts things."""

    def __init__(self):
        self.counts = {}

    def add(self, key):
        self.counts[key] = self.counts.get(key, 0) + 1
'''


def prompts(tok, texts, batch: int, prompt_len: int) -> list[list[int]]:
  source = "\n".join(texts) if texts else FALLBACK_TEXT * 8
  ids = tok.encode(source)
  stride = max(1, (len(ids) - prompt_len) // max(batch, 1))
  return [ids[i * stride:i * stride + prompt_len] for i in range(batch)]


def workload(tok, texts, batch: int, count: int, prompt_len: int) -> list[list[int]]:
  """`count` held-out prompts (`prompts`) rounded up to whole batches of `batch` rows, at
  least one batch: what a point decodes with `compare(..., batch=batch)`, so points of
  different batch sizes decode the same prompts."""
  return prompts(tok, texts, batch * -(-max(count, batch) // batch), prompt_len)


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


@functools.lru_cache(maxsize=1)
def hardware() -> roofline.Hardware:
  """This machine's roofline, calibrated once per process (on CPU a 64 MiB stream and a
  1024² matmul, fastest of 3 calls each: a second or two with compilation; 1 GiB and 8192²
  on accelerators)."""
  return roofline.calibrate(repeats=3)


# ----------------------------------------------------------------------------- timing


@dataclasses.dataclass(frozen=True)
class Timing:
  """Seconds of every timed call of one callable (in order) and what its last call gave."""

  times: tuple[float, ...]
  result: Any

  @property
  def median(self) -> float:
    return statistics.median(self.times)

  @property
  def fastest(self) -> float:
    """Other load on a shared machine only slows a call down: the fastest call is the one
    to use when a time is differenced with another."""
    return min(self.times)


def alternate(fns: Mapping[str, Callable[[], Any]], repeats: int) -> dict[str, Timing]:
  """{name: Timing} of each callable, alternated (`specjax.timing.alternate`: one
  warm-up call each, then every callable in turn, `repeats` times)."""
  times, last = timing.alternate(fns, repeats)
  return {name: Timing(tuple(times[name]), last[name]) for name in fns}


@functools.partial(jax.jit, donate_argnames="cache")
def _forward(lm, tokens, positions, cache):
  """One forward against the cache; the cache is donated and returned (lengths unchanged, so
  feeding it back keeps the context fixed) so the write updates it in place, as in the
  decoding loop, instead of copying the whole cache every call (an undonated cache
  argument costs a full copy per step; see docs/xla_notes.md, trap 1)."""
  logits, _, cache = lm(tokens, positions, cache)
  return logits[:, -1], cache


@functools.lru_cache(maxsize=None)
def forward_seconds(model, batch: int, t: int, context: int, cache_len: int, repeats: int,
                    min_sample_s: float = 0.02) -> float:
  """Median seconds of one forward of `t` tokens per row at `context` cached tokens.

  Tiny models run in well under a millisecond, where one timing is mostly noise: each sample
  is the mean over a burst of calls lasting at least `min_sample_s`; the median is over
  max(repeats, 5) samples. Cached per process (by model and shape): every point of a sweep
  that needs the same forward reuses one measurement.
  """
  lm = LM.of(model)
  cache = kv.set_lengths(kv.init(lm.config, batch, cache_len),
                         jnp.full((batch,), context, jnp.int32))
  toks = jnp.zeros((batch, t), jnp.int32)
  pos = context + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))
  out, cache = jax.block_until_ready(_forward(lm, toks, pos, cache))  # compile
  start = time.perf_counter()
  out, cache = jax.block_until_ready(_forward(lm, toks, pos, cache))
  once = max(time.perf_counter() - start, 1e-6)
  burst = max(1, min(1000, int(min_sample_s / once)))
  times = []
  for _ in range(max(repeats, 5)):
    start = time.perf_counter()
    for _ in range(burst):
      out, cache = _forward(lm, toks, pos, cache)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / burst)
  return statistics.median(times)


def draft_passes(tree) -> tuple[int, int]:
  """(D, W): draft passes per cycle and the rows each pass after the first feeds.

  One pass per tree level (a level's nodes share a pass), so D = the depth (k for a chain);
  the first pass feeds 2 tokens (the catch-up rule: the last committed token and the root),
  each later one a whole level, W = the widest level fed (1 for a chain).
  """
  if isinstance(tree, trees.DynamicTree):
    return tree.depth, tree.width
  depth = tree.max_depth
  return depth, int(max(tree.level_sizes[1:depth], default=1))


@dataclasses.dataclass(frozen=True)
class StepCosts:
  """Standalone forward timings of one cycle's parts, in seconds, at a fixed context:

  t1       one-token target step (one plain decode step);
  t_verify target forward of the N + 1 verified nodes;
  t_draft  one cycle's draft passes, d(2) + (D − 1)·d(W) (`draft_passes`);
  and in units of t1: v = t_verify / t1, c = t_draft / (D·t1) (the draft's cost per pass),
  cycle = D·c + v (a whole cycle).
  """

  t1: float
  t_verify: float
  t_draft: float
  passes: int

  @property
  def v(self) -> float:
    return self.t_verify / self.t1

  @property
  def c(self) -> float:
    return self.t_draft / (self.passes * self.t1)

  @property
  def cycle(self) -> float:
    return self.passes * self.c + self.v


def step_costs(target, draft, batch: int, tree, context: int, cache_len: int,
               repeats: int) -> StepCosts:
  """The costs every prediction here uses, timed standalone at `context` (module doc)."""
  passes, width = draft_passes(tree)
  t1 = forward_seconds(target, batch, 1, context, cache_len, repeats)
  t_verify = forward_seconds(target, batch, tree.n_nodes, context, cache_len, repeats)
  t_draft = forward_seconds(draft, batch, 2, context, cache_len, repeats)
  if passes > 1:
    t_draft += (passes - 1) * forward_seconds(draft, batch, width, context, cache_len, repeats)
  return StepCosts(t1=t1, t_verify=t_verify, t_draft=t_draft, passes=passes)


# ----------------------------------------------------------------------------- comparison


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
  loop_costs: Any = None  # specjax.calibration.LoopCosts

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


def speculative_row(cmp: Comparison, tau_loop: float, temperature: float,
                    cycle_name: Callable[[str, int, int], str] | None = None,
                    tau_loop_iid: float | None = None, target=None,
                    prompt_ids=None) -> dict:
  """The result fields every point reports about a `Comparison` measured with calibrated loop
  costs (`compare(..., loop_costs=...)`):

  plain_tok_s, spec_tok_s, speedup (measured); predicted_speedup = cmp.predicted(tau_loop)
  and efficiency = measured ÷ predicted; alpha, alpha_trial, alpha_ci, tau of the
  speculative run; tau_loop_predicted = tau_loop; loop_iterations (the most cycles of any
  row); depth_tried / depth_accepted (per draft depth, summed over rows); run_lengths (the
  histogram of accepted lengths); drafted_per_cycle (tree size); cycle_steps of the tree and
  t_step_ms (calibrated); calibration: every calibrated cycle in target steps (named by
  `cycle_name(key, N, D)`, by default its key), the fitted cost model in target steps, and
  whether the costs came from the cache; identical_to_plain (at T = 0, else None); backend.
  With `tau_loop_iid` (a chain's τ_loop under the i.i.d. acceptance model:
  `calibration.run_tokens_per_iteration(..., iid=True)`) also tau_loop_iid and
  predicted_speedup_iid, the prediction that model would make, reported beside.
  With `target` and `prompt_ids`, a T = 0 run that is not identical also reports
  `divergences` (where, and by how many ulps of the served dtype: `divergences`) and
  `only_ties` (every divergence within 2 ulps: numerical ties, not a broken rule).
  """
  costs = cmp.loop_costs
  extra = {}
  if temperature == 0 and target is not None and not cmp.identical:
    div = divergences(target, prompt_ids, cmp.plain.tokens, cmp.spec.tokens)
    extra = {"divergences": div,
             "only_ties": all(d["ulps"] is not None and d["ulps"] <= 2 for d in div)}
  summary, st = cmp.spec.summary(), cmp.spec.stats
  predicted = cmp.predicted(tau_loop)
  name = cycle_name or (lambda key, n, d: key)
  fit = costs.fitted
  return {
      "plain_tok_s": cmp.plain_tok_s, "spec_tok_s": cmp.spec_tok_s, "speedup": cmp.speedup,
      "speed_basis": "decode phase" if cmp.plain_prefill_s is not None else "end to end",
      "plain_tok_s_e2e": cmp.plain_tok_s_e2e, "spec_tok_s_e2e": cmp.spec_tok_s_e2e,
      "speedup_e2e": cmp.speedup_e2e,
      **loop_fields(cmp.plain.tokens, cmp.spec.tokens),
      "predicted_speedup": predicted, "efficiency": cmp.efficiency(predicted),
      "alpha": summary.alpha, "alpha_trial": summary.alpha_trial,
      "alpha_ci": list(summary.alpha_ci), "tau": summary.tau, "tau_loop_predicted": tau_loop,
      "loop_iterations": int(np.max(st["cycles"])),
      "depth_tried": st["depth_tried"].sum(axis=0).tolist(),
      "depth_accepted": st["depth_accepted"].sum(axis=0).tolist(),
      "run_lengths": st["hist"].sum(axis=0).tolist(),
      "drafted_per_cycle": cmp.tree.size,
      "cycle_steps": costs.cycle_steps(cmp.tree), "t_step_ms": 1e3 * costs.t_step,
      "calibration": {"cycle_steps": {name(key, n, d): sec / costs.t_step
                                      for key, (n, d, sec) in costs.cycles.items()},
                      "fit_steps": None if fit is None else {
                          "t_fixed": fit.t_fixed / costs.t_step,
                          "t_verify": fit.t_verify / costs.t_step,
                          "t_draft": fit.t_draft / costs.t_step, "rel_rms": fit.rel_rms},
                      "cached": bool(costs.meta.get("cached")), "key": costs.meta.get("key"),
                      "revalidated": costs.meta.get("revalidated")},
      "identical_to_plain": cmp.identical if temperature == 0 else None,
      "backend": jax.default_backend(),
      **({} if tau_loop_iid is None else {"tau_loop_iid": tau_loop_iid,
                                          "predicted_speedup_iid": cmp.predicted(tau_loop_iid)}),
      **extra,
  }


def divergences(target, prompt_ids, plain_rows, spec_rows, limit: int = 8) -> list[dict]:
  """Where greedy speculative output left plain output (T = 0): per differing row (at most
  `limit`), the first differing position, both tokens, and the target's logit gap between
  them there (one uncached forward of the plain prefix) in units of the spacing of the
  served weights' dtype at that logit (`ulps`). Two tokens whose logits are within an ulp or
  two are a numerical tie: a verify pass of several rows and a one-row decode step sum in
  another order and may break it the other way (bf16 serving at batch > 1); a larger gap
  would be a real divergence."""
  dtype = jnp.bfloat16 if target.config.dtype == "bfloat16" else jnp.float32
  out = []
  for i, (a, b) in enumerate(zip(plain_rows, spec_rows)):
    if a == b or len(out) >= limit:
      continue
    j = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
    if j >= min(len(a), len(b)):
      out.append({"row": i, "position": j, "ulps": None, "note": "one output is longer"})
      continue
    seq = list(prompt_ids[i]) + list(a[:j])
    logits = np.asarray(target(jnp.asarray([seq]), jnp.arange(len(seq))[None], None)[0][0, -1])
    hi = float(max(abs(logits[a[j]]), abs(logits[b[j]])))
    spacing = float(jnp.finfo(dtype).eps) * 2.0 ** math.floor(math.log2(max(hi, 1e-30)))
    gap = float(abs(logits[a[j]] - logits[b[j]]))
    out.append({"row": i, "position": j, "plain": int(a[j]), "spec": int(b[j]),
                "logit_gap": gap, "ulps": gap / spacing})
  return out


def loop_fields(plain_rows, spec_rows) -> dict:
  """How much of the outputs are repetition loops (`metrics.loop_flags`): loop_fraction of
  the speculative run's tokens (where α and τ were measured), loop_fraction_plain, and
  rows_ending_in_loop / rows of the plain outputs (`metrics.ends_in_loop`)."""
  return {"loop_fraction": metrics.loop_fraction(spec_rows),
          "loop_fraction_plain": metrics.loop_fraction(plain_rows),
          "rows_ending_in_loop": sum(metrics.ends_in_loop(r) for r in plain_rows),
          "rows": len(plain_rows)}


def say(line: str) -> None:
  """A verdict line on the console, above the progress bar."""
  try:
    from tqdm import tqdm
    tqdm.write(line, file=sys.stderr)
  except ImportError:  # pragma: no cover
    print(line, file=sys.stderr)
