"""Calibrated loop costs: what a speculative cycle costs inside the compiled loop, measured
on the machine at hand, and the speedup predicted from it (docs/cost_model.md, "Calibrated
loop costs").

Standalone forward timings miss most of what a cycle costs when the models are small: the
acceptance, the cache bookkeeping, the draft's scan, loop control, small-shape kernels. So
this module times the compiled loops themselves, through the public host API:

- t_step: seconds per plain decode step, from `decoding.generate` run with max_new_tokens
  = M and = 1 (the prefill alone) and differenced: (T(M) − T(1)) / (M − 1);
- t_cycle(shape): seconds per speculative cycle of each calibration shape (a chain
  `trees.chain(k)` or a tree), from `decoding.speculative_generate` with the real drafter,
  differenced the same way and divided by the loop's iterations (the most cycles any row
  ran: a batched loop runs until its slowest row is done);

every call compiled first, then all of them alternated `repeats` times, medians (or the
fastest calls, `statistic="fastest"`: load on a shared machine only slows a call). A
difference lost in timing noise is re-measured, then falls back to whole calls, flagged in
`meta["prefill_differenced"]` (`timing.decode_seconds`): a fluctuation never fails a calibration. The
cycle times are then fitted (pure numpy, `cycle_fit.fit`) to

    cycle(N, D) = t_fixed + t_verify·(N + 1) + D·t_draft        (seconds, all ≥ 0)

N = drafted nodes (k for a chain), D = draft passes (the depth; k for a chain). Chains alone
cannot separate the three (N = D), so the fit needs a tree among the shapes.

Any drafter: `draft` may be a draft model or a `Drafter` object (prompt lookup, layer-skip,
Medusa or EAGLE heads, the controlled-α oracle...), which is timed as is in the real loop,
so whatever it costs lands in the fit without a per-kind model: t_draft is its cost per
tree level (≈ 0 for prompt lookup; the heads alone for Medusa, which adds nothing per level,
so its cost shows in t_fixed; one head layer per level for EAGLE; about m/L of a target step
for layer-skip with m of L layers), and `drafter_for(draft, tree)` picks a per-shape variant
(e.g. top-k candidates for trees). The cache key holds the drafter's class, its static
fields (n-gram sizes, captured layers, deterministic...) and a digest of its weights. In target-step
units (÷ t_step) a cycle costs `LoopCosts.cycle_steps(tree)`:

- a shape that was calibrated itself uses its own measured cycle time (the table);
- any other shape uses the fit.

Predicted speedup = τ ÷ cycle_steps(tree), τ the tokens one loop iteration emits: E[τ](α, k)
for a chain (`theory.expected_tokens`), a tree's expected tokens, or `tokens_per_iteration`
for a batch whose loop waits for its slowest row.

Calibrations are cached as JSON under $SPECJAX_CACHE_DIR/calibration/ (default
~/.cache/specjax), keyed by a fingerprint of the machine, the JAX version and backend, the
models' configs and weights, the drafters, the batch, the temperature, the prompts, the
budget, the cache length, the shapes and the statistic, so a re-run reuses them;
`recalibrate=True` measures again.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import platform
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from specjax.engine import decoding
from specjax.verify import sampling, trees
from specjax.calibration.cycle_fit import CycleFit, fit, identifiable
from specjax.models.lm import LM
from specjax.drafters.base import Drafter
from specjax.drafters.model import ModelDrafter
from specjax.calibration.timing import STATISTICS, decode_seconds
from specjax.models.one_row_bf16 import product_policies

VERSION = 4  # bump when what a cached calibration holds changes (4: one-row bf16 padded
# unless one row is clearly faster)
DEFAULT_CHAINS = (1, 2, 4, 6)

Tree = Any  # trees.TreeSpec | trees.DynamicTree


# ----------------------------------------------------------------------------- shapes


def shape_key(tree: Tree) -> str:
  """The table key of a shape (its exact structure, not only N and D)."""
  if isinstance(tree, trees.TreeSpec):
    return "chain(%d)" % tree.size if tree.is_chain else "tree%s" % (tree.parents,)
  return repr(tree)


def shape_of(tree: Tree) -> tuple[int, int]:
  """(N, D): drafted nodes and draft passes per cycle (one pass per level: the depth)."""
  return int(tree.size), int(tree.max_depth)


def _check_tree(name: str, tree) -> Tree:
  if not isinstance(tree, (trees.TreeSpec, trees.DynamicTree)):
    raise ValueError(f"{name} must be a trees.TreeSpec or trees.DynamicTree (e.g. "
                     f"trees.chain(4)), got {tree!r}")
  if tree.size < 1:
    raise ValueError(f"{name} must draft at least one node, got {tree!r}")
  return tree


# ----------------------------------------------------------------------------- costs


@dataclasses.dataclass(frozen=True)
class LoopCosts:
  """A calibration: seconds per plain step and per speculative cycle, inside the loop.

  t_step: seconds per plain decode step. cycles: {shape_key: (N, D, seconds per cycle)} of
  every calibrated shape. fitted: the `CycleFit` over them (None when the shapes do not
  identify it). meta: what was calibrated (batch, temperature, budget, fingerprint...)
  and "alpha", the first draft's acceptance over the calibrated chains' runs (None without
  a chain), and "depth_alpha", the first candidate's acceptance at each depth of those chains
  (`depth_alpha`): what the adaptive policy starts from (`AdaptivePolicy.from_costs`).
  """

  t_step: float
  cycles: Mapping[str, tuple[int, int, float]]
  fitted: CycleFit | None = None
  meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @classmethod
  def from_timings(cls, t_step: float, cycle_seconds: Mapping[Tree, float] | Sequence,
                   meta: Mapping[str, Any] | None = None) -> "LoopCosts":
    """Pure: costs from measured (or synthetic) seconds. cycle_seconds: {tree: seconds per
    cycle} or a sequence of (tree, seconds)."""
    if not (isinstance(t_step, (int, float, np.floating)) and math.isfinite(t_step)
            and t_step > 0):
      raise ValueError(f"t_step must be a finite number of seconds > 0, got {t_step!r}")
    items = cycle_seconds.items() if isinstance(cycle_seconds, Mapping) else cycle_seconds
    table = {}
    for i, (tree, sec) in enumerate(items):
      _check_tree(f"cycle_seconds[{i}] tree", tree)
      if not (isinstance(sec, (int, float, np.floating)) and math.isfinite(sec) and sec > 0):
        raise ValueError(f"cycle_seconds[{shape_key(tree)}] must be a finite number of "
                         f"seconds > 0, got {sec!r}")
      table[shape_key(tree)] = (*shape_of(tree), float(sec))
    if not table:
      raise ValueError("cycle_seconds must hold at least one (tree, seconds), got none")
    pts = [(n, d) for n, d, _ in table.values()]
    fitted = fit(list(table.values())) if identifiable(pts) else None
    return cls(t_step=float(t_step), cycles=table, fitted=fitted, meta=dict(meta or {}))

  def cycle_seconds(self, tree: Tree) -> float:
    """Seconds per cycle of `tree`: its own measurement when it was calibrated, else the fit."""
    _check_tree("tree", tree)
    key = shape_key(tree)
    if key in self.cycles:
      return self.cycles[key][2]
    if self.fitted is None:
      raise ValueError(f"tree {key} was not calibrated and the calibrated shapes "
                       f"{sorted(self.cycles)} do not identify the cost fit (add a tree "
                       f"and >= 3 shapes): calibrate with it among the shapes")
    return self.fitted.seconds(*shape_of(tree))

  def cycle_steps(self, tree: Tree) -> float:
    """A cycle of `tree` in plain target steps: cycle_seconds ÷ t_step."""
    return self.cycle_seconds(tree) / self.t_step

  def predicted_speedup(self, tree: Tree, tau: float) -> float:
    """Predicted speedup over plain decoding: τ ÷ cycle_steps(tree).

    tau: tokens one loop iteration emits (≥ 1): E[τ](α, k) for a chain, a tree's expected
    tokens, or `tokens_per_iteration` for a batch that waits for its slowest row.
    """
    if not (isinstance(tau, (int, float, np.floating)) and math.isfinite(tau) and tau >= 1):
      raise ValueError(f"tau must be a finite number >= 1 (tokens per cycle), got {tau!r}")
    return float(tau) / self.cycle_steps(tree)

  def to_dict(self) -> dict:
    return {"version": VERSION, "t_step": self.t_step,
            "cycles": {k: list(v) for k, v in self.cycles.items()},
            "fitted": None if self.fitted is None else dataclasses.asdict(self.fitted),
            "meta": dict(self.meta)}

  @classmethod
  def from_dict(cls, d: Mapping) -> "LoopCosts":
    if d.get("version") != VERSION:
      raise ValueError(f"calibration version {d.get('version')!r}, expected {VERSION}")
    cycles = {k: (int(v[0]), int(v[1]), float(v[2])) for k, v in d["cycles"].items()}
    fitted = None if d.get("fitted") is None else CycleFit(**d["fitted"])
    return cls(t_step=float(d["t_step"]), cycles=cycles, fitted=fitted, meta=d.get("meta", {}))

  def describe(self) -> str:
    """One line per calibrated shape and the fit, in target steps."""
    lines = [f"t_step {self.t_step * 1e3:.3f} ms"]
    for key, (n, d, sec) in self.cycles.items():
      lines.append(f"{key}: N={n} D={d} cycle {sec / self.t_step:.3f} steps")
    if self.fitted is not None:
      f = self.fitted
      lines.append(f"fit: t_fixed {f.t_fixed / self.t_step:.3f} + t_verify "
                   f"{f.t_verify / self.t_step:.3f}·(N+1) + t_draft "
                   f"{f.t_draft / self.t_step:.3f}·D steps (rms {100 * f.rel_rms:.1f}%)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- τ per iteration


def chain_length_probs(alpha: float, k: int) -> np.ndarray:
  """P(a chain cycle accepts n drafts), n = 0..k: αⁿ(1 − α) for n < k, α^k at n = k."""
  if not (isinstance(alpha, (int, float, np.floating)) and 0 <= alpha <= 1):
    raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}")
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
    raise ValueError(f"k must be an int >= 1, got {k!r}")
  n = np.arange(k + 1)
  p = alpha ** n * (1 - alpha)
  p[k] = alpha ** k
  return p


def length_probs_from_reach(reach: Sequence[float]) -> np.ndarray:
  """P(a cycle accepts a path of n nodes), n = 0..D, from reach[d − 1] = P(n ≥ d) (e.g.
  depth_accepted ÷ cycles, the loop's per-depth counters)."""
  r = np.concatenate([[1.0], np.asarray(reach, np.float64), [0.0]])
  if r.ndim != 1 or np.any(~np.isfinite(r)) or np.any(r < 0) or np.any(r > 1):
    raise ValueError(f"reach must be probabilities in [0, 1], got {reach!r}")
  r = np.minimum.accumulate(r)  # P(n >= d) cannot grow with d
  return r[:-1] - r[1:]


def tokens_per_iteration(length_probs: Sequence[float], batch: int, tokens: int,
                         samples: int = 2000, seed: int = 0) -> float:
  """Tokens per row per loop iteration when a batch of `batch` rows runs until every row
  has emitted `tokens` tokens through cycles (a cycle accepting n emits n + 1, the last one
  cut at the budget): tokens ÷ E[max over rows of the cycles a row needs], by Monte Carlo
  (`samples` batches, fixed `seed`: deterministic). With batch 1 and a long budget it tends
  to Σ (n + 1)·P(n) = E[τ]; a bigger batch waits for its slowest row, so it is lower.

  length_probs: one law over n = 0..D for every row, or one per row ([batch, D + 1]): rows
  of one batch accept at different rates (at T = 0 a prompt fixes its row's whole
  trajectory), and the slowest row sets the loop's length (`row_length_probs`).
  """
  p = np.asarray(length_probs, np.float64)
  for name, v in (("batch", batch), ("tokens", tokens), ("samples", samples)):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
      raise ValueError(f"{name} must be an int >= 1, got {v!r}")
  rows = p if p.ndim == 2 else p[None]
  if (p.ndim not in (1, 2) or rows.shape[-1] < 1 or np.any(rows < 0)
      or not np.allclose(rows.sum(axis=-1), 1, atol=1e-6)
      or (p.ndim == 2 and rows.shape[0] != batch)):
    raise ValueError(f"length_probs must be probabilities over n = 0..D summing to 1, one "
                     f"law or one per row ({batch} rows), got {length_probs!r}")
  rng = np.random.default_rng(seed)
  needed = np.empty((samples, batch), np.int64)
  for b in range(batch):
    law = rows[b if p.ndim == 2 else 0]
    emitted = rng.choice(law.size, size=(samples, tokens), p=law / law.sum()) + 1
    needed[:, b] = np.argmax(np.cumsum(emitted, axis=-1) >= tokens, axis=-1) + 1
  return tokens / float(np.mean(needed.max(axis=1)))


def tokens_per_iteration_in_batches(length_probs: Sequence[Sequence[float]], batch: int,
                                    tokens: int, samples: int = 2000, seed: int = 0) -> float:
  """`tokens_per_iteration` of a workload whose rows ([rows, D + 1] laws, rows a multiple of
  `batch`) are decoded as consecutive batches of `batch` rows, one batch after another:
  batch j runs tokens ÷ τ_j iterations, so the workload's tokens per row per iteration is
  the harmonic mean of the batches' τ_j (what a batch-1 figure over several prompts
  predicts: the slow prompts weigh more)."""
  p = np.asarray(length_probs, np.float64)
  if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
    raise ValueError(f"batch must be an int >= 1, got {batch!r}")
  if p.ndim != 2 or p.shape[0] < batch or p.shape[0] % batch:
    raise ValueError(f"length_probs must be one law per row, rows a multiple of batch "
                     f"{batch}, got shape {p.shape}")
  taus = [tokens_per_iteration(p[i:i + batch], batch, tokens, samples, seed)
          for i in range(0, p.shape[0], batch)]
  return len(taus) / sum(1.0 / t for t in taus)


def row_length_probs(stats: Mapping[str, np.ndarray], tree: Tree, *,
                     iid: bool = False) -> np.ndarray:
  """Each row's law of accepted path lengths, [B, D + 1], from the loop's own counters
  (`Generation.stats`): the row's measured reach P(n ≥ d) = depth_accepted ÷ cycles
  (`length_probs_from_reach`), for chains and trees alike: a drafter's acceptance is not the
  same at every draft position (a head's first draft is its weakest, the rows that loop
  accept everything deep), so one α per row misses the law's shape. iid=True gives a chain
  the i.i.d. model instead, the geometric law at the row's per-trial acceptance (accepted ÷
  drafts tried: `chain_length_probs`), what theory.expected_tokens assumes (kept to report
  beside the measured law; trees always use the reach). A row that ran no cycle gets the
  batch's pooled law."""
  cycles = np.asarray(stats["cycles"], np.float64)
  reached = np.asarray(stats["depth_accepted"], np.float64)
  tried = np.asarray(stats["depth_tried"], np.float64)
  pooled_alpha = reached.sum() / max(tried.sum(), 1.0)
  pooled_reach = reached.sum(axis=0) / max(cycles.sum(), 1.0)
  laws = []
  for b in range(cycles.size):
    if iid and tree.is_chain:
      alpha = reached[b].sum() / tried[b].sum() if tried[b].sum() > 0 else pooled_alpha
      laws.append(chain_length_probs(float(alpha), int(tree.max_depth)))
    else:
      reach = reached[b] / cycles[b] if cycles[b] > 0 else pooled_reach
      laws.append(length_probs_from_reach(reach))
  return np.stack(laws)


def run_tokens_per_iteration(stats: Mapping[str, np.ndarray], tree: Tree, batch: int,
                             tokens: int, *, iid: bool = False) -> float:
  """τ_loop of a measured run (`Generation.stats`) of `tree` over prompts decoded in
  consecutive batches of `batch` rows for `tokens` tokens each: every row's own law
  (`row_length_probs`, `iid` as there) through `tokens_per_iteration_in_batches` (each
  batch waits for its slowest row). What a calibrated prediction divides by the cycle's
  steps."""
  return tokens_per_iteration_in_batches(row_length_probs(stats, tree, iid=iid), batch,
                                         tokens)


# ----------------------------------------------------------------------------- measuring


def _default_drafter(draft, tree: Tree) -> Drafter:
  """A drafter object is used as is; a draft model drafts sampled candidates for chains and
  distinct top-k candidates for trees (the point-mass rule: i.i.d. siblings of a peaked
  draft are often duplicates)."""
  if isinstance(draft, Drafter):
    return draft
  return ModelDrafter.of(draft, deterministic=not tree.is_chain)


def _describe_drafter(d: Drafter) -> str:
  """The drafter's class and its static (non-array) fields, e.g. "ModelDrafter(deterministic=
  False)", "LookupDrafter(max_ngram=3, min_ngram=1)": with the weights' digest, what sets
  the loop that is timed (any drafter kind, no per-kind case)."""
  static = ([f.name for f in dataclasses.fields(d) if not f.metadata.get("pytree_node", True)
             and not (f.default is None and getattr(d, f.name) is None)]  # an unset optional
            if dataclasses.is_dataclass(d) else [])  # field (added later) keeps old keys
  return f"{type(d).__name__}({', '.join(f'{n}={getattr(d, n)!r}' for n in static)})"


def measure(target, draft, prompt_ids: Sequence[Sequence[int]], shapes: Sequence[Tree], *,
            max_new_tokens: int, repeats: int = 3, temperature: float = 0.0, seed: int = 0,
            cache_len: int | None = None, drafter_for: Callable | None = None,
            statistic: str = "median", batch: int | None = None,
            timer: Callable[[], float] = time.perf_counter) -> LoopCosts:
  """Times the compiled loops (module doc) and returns the calibration; no caching, no
  validation beyond the engine's (use `calibrate`). Every call reads one cache length
  (`cache_len`, default the largest the engine would pick for the shapes), so what is timed
  is what a run at that cache length costs. statistic: "median" of the alternated calls, or
  "fastest" (other load on a shared machine only slows a call down). batch: rows per call
  (default all prompts); fewer decode the prompts as consecutive batches inside each timed
  call (`decoding.in_batches`), a workload of several prompts at a small batch."""
  drafter_for = drafter_for or _default_drafter
  drafters = {shape_key(t): drafter_for(draft, t) for t in shapes}
  rows = len(prompt_ids) if batch is None else batch
  if cache_len is None:
    cache_len = default_cache_len(target, draft, prompt_ids, shapes, max_new_tokens,
                                  drafter_for)
  common = dict(sampler=sampling.make_sampler(temperature), seed=seed, cache_len=cache_len)
  fns: dict[str, Callable[[], Any]] = {}
  for n, tag in ((max_new_tokens, "M"), (1, "1")):
    fns[f"plain/{tag}"] = decoding.in_batches(
        lambda ids, n=n: decoding.generate(target, ids, max_new_tokens=n, **common),
        prompt_ids, rows)
    for t in shapes:
      fns[f"{shape_key(t)}/{tag}"] = decoding.in_batches(
          lambda ids, n=n, t=t: decoding.speculative_generate(
              target, drafters[shape_key(t)], ids, tree=t, max_new_tokens=n, **common),
          prompt_ids, rows)
  seconds, last, timing = decode_seconds(fns, ["plain", *drafters], repeats, timer, statistic)
  batches = len(prompt_ids) // rows
  t_step = seconds["plain"] / (batches * (max_new_tokens - 1))
  cycles = []
  for t in shapes:
    run = last[f"{shape_key(t)}/M"]
    cycles.append((t, seconds[shape_key(t)] / max(1, decoding.loop_iterations(run, rows))))
  chains = [last[f"{shape_key(t)}/M"].stats for t in shapes if t.is_chain]
  alphas = depth_alpha(chains)
  meta = {"batch": rows, "prompts": len(prompt_ids), "temperature": float(temperature),
          "alpha": alphas[0] if alphas else None, "depth_alpha": alphas,
          "max_new_tokens": max_new_tokens, "cache_len": cache_len, "repeats": repeats,
          "statistic": statistic, **timing,
          "drafters": {k: _describe_drafter(d) for k, d in drafters.items()}}
  return LoopCosts.from_timings(t_step, cycles, meta)


def depth_alpha(chain_stats: Sequence[Mapping[str, np.ndarray]]) -> list[float]:
  """The first candidate's acceptance at each depth d = 1, 2, ... of chains, given the chain
  got that far: Σ accepted at d ÷ Σ tried at d over every row of every chain run's stats
  (`Generation.stats`), up to the deepest depth tried. At d = 1 it is the first draft's α.
  Acceptance differs by position (BUILD_NOTES.md: the embedded draft at T = 0 on prose,
  0.91 at depth 1 and 0.24 at depth 2), which the adaptive policy's prior reads
  (`adaptive.AdaptivePolicy.from_costs`)."""
  depth = max([0] + [np.asarray(st["depth_tried"]).shape[1] for st in chain_stats])
  tried, accepted = np.zeros(depth), np.zeros(depth)
  for st in chain_stats:
    t, a = np.asarray(st["depth_tried"], np.float64), np.asarray(st["depth_accepted"], np.float64)
    tried[:t.shape[1]] += t.sum(axis=0)
    accepted[:a.shape[1]] += a.sum(axis=0)
  out = []
  for t, a in zip(tried, accepted):
    if not t > 0:
      break
    out.append(float(a / t))
  return out


def default_cache_len(target, draft, prompt_ids, shapes: Sequence[Tree],
                      max_new_tokens: int, drafter_for: Callable | None = None) -> int:
  """The largest cache length the engine would pick for any of the shapes, each drafted by
  `drafter_for(draft, shape)` (default: as `calibrate` drafts it): one length for every
  calibrated run, so they all read caches of one size."""
  longest = max(len(p) for p in prompt_ids)
  drafter_for = drafter_for or _default_drafter
  slots = max(max(t.n_nodes, drafter_for(draft, t).slots_needed(t)) for t in shapes)
  cfg = LM.of(target).config
  return decoding.cache_len_for(longest, max_new_tokens, slots,
                                limit=cfg.max_len if cfg.positions == "learned" else None)


# ----------------------------------------------------------------------------- the cache


def cache_root(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
  """Where calibrations live: `cache_dir`, else $SPECJAX_CACHE_DIR/calibration (default
  ~/.cache/specjax/calibration)."""
  if cache_dir is not None:
    return pathlib.Path(cache_dir)
  base = os.environ.get("SPECJAX_CACHE_DIR") or pathlib.Path.home() / ".cache" / "specjax"
  return pathlib.Path(base) / "calibration"


def _weights_digest(obj) -> str:
  h = hashlib.sha256()
  for leaf in jax.tree_util.tree_leaves(obj):
    if hasattr(leaf, "dtype") and hasattr(leaf, "shape"):
      a = np.asarray(leaf)
      h.update(str((a.dtype, a.shape)).encode())
      h.update(np.ascontiguousarray(a).tobytes())
  return h.hexdigest()[:16]


def fingerprint(target, drafters: Mapping[str, Drafter], prompt_ids, *, temperature: float,
                max_new_tokens: int, cache_len: int, repeats: int, seed: int,
                statistic: str = "median", batch: int | None = None) -> dict:
  """What a calibration depends on (machine, software, models, workload), as a dict."""
  devices = jax.devices()
  lm = LM.of(target)
  return {
      "version": VERSION, "machine": platform.machine(), "processor": platform.processor(),
      "node": platform.node(), "cpus": os.cpu_count(), "jax": jax.__version__,
      "backend": jax.default_backend(), "devices": [d.device_kind for d in devices],
      **product_policies(),
      "target": repr(lm.config),
      "target_weights": _weights_digest(lm.params),
      "drafters": {k: [_describe_drafter(d), repr(d.config), _weights_digest(d)]
                   for k, d in sorted(drafters.items())},
      "prompts": hashlib.sha256(json.dumps([list(map(int, p)) for p in prompt_ids]).encode()
                                ).hexdigest()[:16],
      "batch": len(prompt_ids) if batch is None else batch, "temperature": float(temperature),
      "max_new_tokens": max_new_tokens, "cache_len": cache_len, "repeats": repeats,
      "seed": seed, "statistic": statistic,
  }


def _check_int(name: str, v, lo: int) -> int:
  if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
    raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
  return int(v)


def _check_calibrate_args(shapes, prompt_ids, max_new_tokens, repeats, seed, temperature,
                          statistic, recalibrate, batch) -> tuple[list[Tree], int]:
  """`calibrate`'s checks: (its shapes, default chains, checked and each once; rows per call)."""
  shapes = [trees.chain(k) for k in DEFAULT_CHAINS] if shapes is None else shapes
  if isinstance(shapes, (str, bytes)) or not isinstance(shapes, Sequence) or not shapes:
    raise ValueError(f"shapes must be a non-empty list of trees (e.g. [trees.chain(1), "
                     f"trees.chain(4), trees.branching((2, 1))]), got {shapes!r}")
  shapes = [_check_tree(f"shapes[{i}]", t) for i, t in enumerate(shapes)]
  shapes = list({shape_key(t): t for t in shapes}.values())  # duplicates once
  if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence) or not (
      prompt_ids):
    raise ValueError(f"prompt_ids must be a non-empty list of token-id lists (one per row of "
                     f"the batch), got {prompt_ids!r}")
  _check_int("max_new_tokens", max_new_tokens, 2)
  _check_int("repeats", repeats, 1)
  _check_int("seed", seed, 0)
  if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.floating)) \
      or not math.isfinite(temperature) or temperature < 0:
    raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
  if statistic not in STATISTICS:
    raise ValueError(f"statistic must be one of {STATISTICS}, got {statistic!r}")
  if not isinstance(recalibrate, (bool, np.bool_)):
    raise ValueError(f"recalibrate must be True or False, got {recalibrate!r}")
  rows = len(prompt_ids) if batch is None else _check_int("batch", batch, 1)
  if len(prompt_ids) % rows:
    raise ValueError(f"batch must divide the {len(prompt_ids)} prompts, got {batch!r}")
  return shapes, rows


REVALIDATE = 0.15  # a cached calibration off by more than this on the day is measured again
# (the probe's own spread on the 2-core development host reached 12-15%)
PROBE_REPEATS = 3
PROBE_BATCHES = 4  # the probe decodes the first 4 batches (one prompt's ratio moved by ±15%)
# Calibrations this process measured (None) or re-validated (the probe's record), by path:
# not probed again in the same process (minutes apart, a second probe would measure noise).
_CHECKED: dict[str, dict | None] = {}


def _cached(path, drafters, revalidate: float | None, probe: Callable[[], dict],
            probed: str):
  """(the calibration cached at `path` if it holds every shape of `drafters` and, with
  `revalidate`, passes the day's probe (`probe()`: the shape `probed` and a plain step
  measured now, PROBE_REPEATS alternated calls over the first PROBE_BATCHES batches: a probe
  of the machine's balance, not a calibration), else None; the probe's record when it
  failed, else None). Unreadable: (None, None)."""
  try:
    costs = LoopCosts.from_dict(json.loads(path.read_text()))
    # "depth_alpha": calibrations stored before it was measured are measured again
    if set(costs.cycles) == set(drafters) and "depth_alpha" in costs.meta:
      check = None
      if revalidate is not None and str(path) in _CHECKED:
        check = _CHECKED[str(path)]
      elif revalidate is not None:
        now = probe()
        steps = {name: c.cycles[probed][2] / c.t_step for name, c in (("probe", now),
                                                                      ("cached", costs))}
        check = {"shape": probed, "probe_cycle_steps": steps["probe"],
                 "cached_cycle_steps": steps["cached"],
                 "ratio": steps["probe"] / steps["cached"], "probe_t_step": now.t_step,
                 "cached_t_step": costs.t_step, "tolerance": revalidate}
      if check is None or abs(check["ratio"] - 1) <= revalidate:
        if revalidate is not None:
          _CHECKED[str(path)] = check
        return dataclasses.replace(costs, meta={**costs.meta, "cached": True,
                                                "revalidated": check}), None
      return None, {**check, "recalibrated": True}
  except (ValueError, KeyError, TypeError, OSError):  # unreadable: measure again
    pass
  return None, None


def calibrate(target, draft, prompt_ids: Sequence[Sequence[int]],
              shapes: Sequence[Tree] | None = None, *, max_new_tokens: int = 64,
              repeats: int = 3, temperature: float = 0.0, seed: int = 0,
              cache_len: int | None = None, drafter_for: Callable | None = None,
              recalibrate: bool = False, cache_dir: str | os.PathLike | None = None,
              statistic: str = "median", batch: int | None = None,
              timer: Callable[[], float] = time.perf_counter,
              revalidate: float | None = None) -> LoopCosts:
  """The calibration of `target` with `draft` (a draft model or a `Drafter`) at this batch
  (`batch` rows per call, default len(prompt_ids); fewer rows decode the prompts as
  consecutive batches, `measure`) and temperature: cached under `cache_root(cache_dir)` by
  `fingerprint`, else measured (`measure`) and stored. shapes: default chains k ∈ {1, 2, 4,
  6} (add the trees you will predict; the fit needs one). recalibrate: measure even when cached.
  drafter_for(draft, tree) -> Drafter: the drafter of each shape (default: the draft
  model, sampled candidates for chains, top-k candidates for trees). statistic: "median"
  or "fastest" call (`measure`). revalidate: a fraction (`REVALIDATE`, 0.15): a cached
  calibration is checked on the day by a short probe (the widest shape's cycle in plain
  steps, `measure`d now over the first PROBE_BATCHES batches) and measured again when
  that ratio is off by more (the balance of draft, verify and step moved since), once per
  process; None (default): trusted as cached. meta["revalidated"] records it.
  """
  shapes, rows = _check_calibrate_args(shapes, prompt_ids, max_new_tokens, repeats, seed,
                                       temperature, statistic, recalibrate, batch)
  if cache_len is None:
    cache_len = default_cache_len(target, draft, prompt_ids, shapes, max_new_tokens,
                                  drafter_for)
  cache_len = _check_int("cache_len", cache_len, 2)
  drafters = {shape_key(t): (drafter_for or _default_drafter)(draft, t) for t in shapes}
  fp = fingerprint(target, drafters, prompt_ids, temperature=float(temperature),
                   max_new_tokens=max_new_tokens, cache_len=cache_len, repeats=repeats,
                   seed=seed, statistic=statistic, batch=rows)
  key = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:24]
  path = cache_root(cache_dir) / f"{key}.json"
  revalidated = None  # the probe's record when a cached calibration failed it
  if not recalibrate and path.exists():
    widest = max(shapes, key=lambda t: t.n_nodes)  # the costliest cycle, the probe's shape
    some = prompt_ids[:rows * min(PROBE_BATCHES, len(prompt_ids) // rows)]
    probe = functools.partial(measure, target, draft, some, [widest],
                              max_new_tokens=max_new_tokens, repeats=PROBE_REPEATS,
                              temperature=temperature, seed=seed, cache_len=cache_len,
                              drafter_for=lambda _d, t: drafters[shape_key(t)],
                              statistic=statistic, batch=rows, timer=timer)
    cached, revalidated = _cached(path, drafters, revalidate, probe, shape_key(widest))
    if cached is not None:
      return cached
  costs = measure(target, draft, prompt_ids, shapes, max_new_tokens=max_new_tokens,
                  repeats=repeats, temperature=temperature, seed=seed, cache_len=cache_len,
                  drafter_for=lambda _d, t: drafters[shape_key(t)], statistic=statistic,
                  batch=rows, timer=timer)
  costs = dataclasses.replace(costs, meta={**costs.meta, "fingerprint": fp, "key": key,
                                           "cached": False,
                                           "revalidated": revalidated})
  if not costs.meta.get("prefill_differenced", True):
    return costs  # whole calls (the decode phase was lost in noise): measured again next time
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(costs.to_dict(), indent=1))
    os.replace(tmp, path)
    _CHECKED[str(path)] = None
  except OSError:  # an unwritable cache only costs a re-calibration
    pass
  return costs
