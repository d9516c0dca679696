"""Training draft heads (Medusa, EAGLE, ...) on a frozen target, resumable through orbax,
and the per-position acceptance of a head against the target's greedy tokens.

A *head kind* says what a head is and how it learns; this module does the rest for every
kind (optimizer, data, progress, checkpoints, resume, binding to the target, evaluation).

    kind = MedusaHeads(heads=4)                         # specjax.training.medusa
    result = HeadTrainer(kind, target_config, target_params, TrainConfig(...), data,
                         tokenizer, out_dir=DIR).run()
    head = load_head(DIR, target=(target_config, target_params))   # refused for another target
    head.acceptance.top1, head.acceptance.tree(budget=16)

The head-kind contract (duck-typed; `HeadKind` documents it). A kind is a frozen, hashable
dataclass (static under jit) with:

    name: str                                   its name ("medusa"), stored in checkpoints
    spec() -> dict / from_spec(dict)            JSON hyper-parameters (stored in checkpoints)
    positions: int                              J: draft positions it predicts (K heads, ...)
    feature_layers(target_config) -> tuple      the target layers it reads (`capture`)
    init(target_config, key) -> params          a pytree of float32 arrays
    loss(params, tp: TargetPass) -> (loss, metrics)        scalar loss, dict of arrays
    guesses(params, tp: TargetPass, ranks) -> int32 [B, T, J, R]

`TargetPass` is the frozen target's one forward over the batch (tokens, logits and the
captured features, gradients stopped), computed inside the jitted step: features are never
stored. Position convention for `guesses` (one for every kind): at position t the root is
token t + 1 (the target's own token), and guesses[b, t, j, r] is the kind's rank-r guess for
token t + 2 + j.

Optimizer and schedule are the LM trainer's (`trainer.make_optimizer`, `learning_rate`:
AdamW, warmup then cosine, clipping), configured by the same `TrainConfig` (its `objective`
is unused). Data are `TokenData` windows, the batch of step s a pure function of (seed, s).

Binding. A head checkpoint stores the target's ModelConfig (as the orbax config) and the
target's parameter fingerprint. `load_head(dir, target=...)` compares both before reading
any array and raises ValueError listing every differing field (hidden size, layer count,
vocabulary, ..., parameter fingerprint).

Resume. Checkpoints hold head params, optimizer state, step, data order (seed, corpus
fingerprint), tokenizer, kind spec and binding; a run killed at any point resumes from the
newest one and reaches the same parameters as an uninterrupted run (XLA:CPU is
deterministic). Saved every `ckpt_every` steps, at the end, and on KeyboardInterrupt /
SIGTERM (deferred to between steps).

Acceptance (`head_acceptance`): on held-out windows, teacher-forced. g_t = argmax of the
target at position t; head position j's rank-r guess at t is a hit when it equals g_{t+1+j}
(the target's greedy token for t + 2 + j given the true prefix). top1[j] = hit rate of rank
0; rank_probs[j, r] = hit rate of rank r (the input of `trees.optimal`, per depth);
chain[j] = P(positions 0..j all hit | 0..j-1 all hit), the greedy chain's per-depth
acceptance. Real decoding differs only in that the intermediate tokens are the target's own
rather than the text's.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import time
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from specjax.verify import trees
from specjax.checkpoints import orbax_io
from specjax.data.batches import TokenData, padded_chunks
from specjax.data.tokenizer import Tokenizer
from specjax.models.lm import LM
from specjax.models.transformer import ModelConfig, cast_floats
from specjax.training.config import TrainConfig
from specjax.training.losses import masked_mean, positions_for, predicted_weights
from specjax.training.checkpointed import CheckpointedRun, _log
from specjax.training.eagle import EagleHeads
from specjax.training.eagle3 import Eagle3Heads
from specjax.training.medusa import MedusaHeads
from specjax.training.trainer import (_with_learning_rate, f32_graphdef, learning_rate,
                                      make_optimizer, params_fingerprint, param_total)
from specjax.checkpoints.hf import recorded_tokenizer
from specjax.files import assembling, prepare_output_dir

Array = jax.Array

HEAD_KIND = "specjax-head"  # metadata "kind" of a head checkpoint

# The one name -> class table of the head kinds: it resolves a name that comes from outside
# (a checkpoint's metadata, `kind_from_spec` for the default heads). Code that knows the kind
# imports its class.
KINDS: dict[str, type] = {kind.name: kind for kind in (MedusaHeads, EagleHeads,
                                                         Eagle3Heads)}


class HeadKind(Protocol):
  """The contract of a head kind (module doc)."""

  name: str
  positions: int

  def spec(self) -> dict: ...
  def feature_layers(self, target: ModelConfig) -> tuple[int, ...]: ...
  def init(self, target: ModelConfig, key: Array) -> Any: ...
  def loss(self, params: Any, tp: "TargetPass") -> tuple[Array, dict]: ...
  def guesses(self, params: Any, tp: "TargetPass", ranks: int) -> Array: ...


def spec_text(spec: dict) -> str:
  """A head spec for one line of output: a long id list (an eagle3 head's draft vocabulary)
  shown as its length."""
  return str({k: f"<{len(v)} ids>" if isinstance(v, list) and len(v) > 8 else v
              for k, v in spec.items()})


def kind_class(name: str) -> type:
  """The head kind class named `name` (ValueError for an unknown name)."""
  if name not in KINDS:
    raise ValueError(f"head kind must be one of {sorted(KINDS)}, got {name!r}")
  return KINDS[name]


def kind_from_spec(name: str, spec: dict) -> HeadKind:
  return kind_class(name).from_spec(spec)


# ----------------------------------------------------------------------------- the target


@struct.dataclass
class TargetPass:
  """The frozen target's forward over a token batch (gradients stopped).

  lm: the target (its embeddings and LM head are what the heads reuse);
  tokens int32 [B, T]; logits float32 [B, T, V]; features float32 [B, T, C, D], the
  outputs of `kind.feature_layers(config)` in that order (`Transformer.__call__`'s capture);
  weights float32 [B, T] or None: the weight of the target's prediction at each position
  (`losses.predicted_weights` of the batch's loss mask; None: every position counts). A
  kind averages a term over the positions whose target logits it learns with `mean`.
  """

  lm: LM
  tokens: Array
  logits: Array
  features: Array
  weights: Array | None = None

  def mean(self, x_BN: Array, start: int) -> Array:
    """The (masked) mean of x_BN, a term per position whose column n learns the target's
    logits at position start + n (`losses.masked_mean`)."""
    if self.weights is None:
      return jnp.mean(x_BN)
    n = x_BN.shape[1]
    return masked_mean(x_BN, self.weights[:, start:start + n])


def frozen_target(config: ModelConfig, params) -> LM:
  """The target as a float32 `LM` (a jit argument; its config and graph static)."""
  config = config.replace(dtype="float32")
  return LM(graphdef=f32_graphdef(config), config=config,
            params=cast_floats(params, jnp.float32))


def target_pass(kind: HeadKind, target: LM, tokens_BT: Array,
                mask_BT: Array | None = None) -> TargetPass:
  """One target forward with the kind's feature layers captured (inside jit); mask_BT: the
  tokens' loss mask (`TargetPass.weights`)."""
  layers = tuple(kind.feature_layers(target.config))
  logits, hidden, _, *rest = target(tokens_BT, positions_for(tokens_BT), capture=layers)
  features = rest[0] if layers else hidden[:, :, None]
  return TargetPass(lm=target, tokens=tokens_BT, logits=jax.lax.stop_gradient(logits),
                    features=jax.lax.stop_gradient(features),
                    weights=predicted_weights(mask_BT))


@dataclasses.dataclass(frozen=True)
class TargetBinding:
  """What ties a head to its target: the target's ModelConfig and parameter fingerprint."""

  config: ModelConfig
  fingerprint: str

  @classmethod
  def of(cls, config: ModelConfig, params) -> "TargetBinding":
    return cls(config, params_fingerprint(cast_floats(params, jnp.float32)))

  def to_dict(self) -> dict:
    return {"config": self.config.to_dict(), "fingerprint": self.fingerprint}

  def differences(self, stored: dict) -> list[str]:
    """'field: head=X, target=Y' for each field of `stored` (a to_dict()) that differs."""
    mine = self.config.to_dict()
    theirs = dict(stored.get("config") or {})
    lines = [f"{k}: head={theirs.get(k, '<missing>')!r}, target={mine.get(k, '<missing>')!r}"
             for k in sorted(set(mine) | set(theirs)) if theirs.get(k) != mine.get(k)]
    if stored.get("fingerprint") != self.fingerprint:
      lines.append(f"parameter fingerprint: head={stored.get('fingerprint')}, "
                   f"target={self.fingerprint}")
    return lines


def _as_binding(target) -> TargetBinding:
  """A TargetBinding from (config, params), an LM, a Transformer or a binding."""
  if isinstance(target, TargetBinding):
    return target
  if isinstance(target, tuple) and len(target) == 2:
    return TargetBinding.of(*target)
  if isinstance(target, LM):
    return TargetBinding.of(target.config, target.params)
  from flax import nnx
  return TargetBinding.of(target.config, nnx.state(target, nnx.Param))


# ----------------------------------------------------------------------------- steps


@functools.lru_cache(maxsize=16)
def _train_step_for(kind: HeadKind, compile_key: TrainConfig) -> Callable:
  """Jitted step(params, opt_state, batch_ABT, target, lr, mask_ABT=None) -> (params,
  opt_state, metrics); params and opt_state donated; mask_ABT: the batch's loss mask
  (`TargetPass.weights`). One compile per (kind, target shape, compile key, mask or not)."""
  tx = make_optimizer(compile_key)

  def loss_fn(params, target, tokens_BT, mask_BT):
    return kind.loss(params, target_pass(kind, target, tokens_BT, mask_BT))

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def step(params, opt_state, batch_ABT, target, lr, mask_ABT=None):
    if batch_ABT.shape[0] == 1:
      (loss, metrics), grads = grad_fn(params, target, batch_ABT[0],
                                       None if mask_ABT is None else mask_ABT[0])
    else:  # gradient accumulation: mean of micro-batch gradients and metrics, one update
      def micro(carry, xs):
        out, grads = grad_fn(params, target, *xs)
        return jax.tree.map(jnp.add, carry, (out, grads)), None
      first = None if mask_ABT is None else mask_ABT[0]
      (zero_out, _) = jax.eval_shape(grad_fn, params, target, batch_ABT[0], first)
      zeros = (jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zero_out),
               jax.tree.map(jnp.zeros_like, params))
      ((loss, metrics), grads), _ = jax.lax.scan(micro, zeros, (batch_ABT, mask_ABT))
      n = batch_ABT.shape[0]
      loss, metrics, grads = jax.tree.map(lambda x: x / n, (loss, metrics, grads))
    updates, opt_state = tx.update(grads, _with_learning_rate(opt_state, lr), params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), **metrics}

  return jax.jit(step, donate_argnums=(0, 1))


@functools.lru_cache(maxsize=16)
def _hits_for(kind: HeadKind, ranks: int) -> Callable:
  """Jitted hits(params, target, tokens_NT, weight_N, masks_NT=None) -> (hits [J, R],
  tried [J], chain_hits [J]) summed over the windows (module doc, "Acceptance"); with
  masks, a guess counts where the token it guesses is one the mask keeps."""

  def hits(params, target, tokens_NT, weight_N, masks_NT=None):
    tp = target_pass(kind, target, tokens_NT, masks_NT)
    g_NT = jnp.argmax(tp.logits, axis=-1)
    guess_NTJR = kind.guesses(params, tp, ranks)
    n, t = tokens_NT.shape
    J = guess_NTJR.shape[2]
    idx = jnp.arange(t)[:, None] + 1 + jnp.arange(J)[None, :]  # [T, J]: g index t + 1 + j
    valid_TJ = idx < t
    truth_NTJ = g_NT[:, jnp.minimum(idx, t - 1)]
    hit_NTJR = (guess_NTJR == truth_NTJ[..., None]) & valid_TJ[None, :, :, None]
    w = weight_N[:, None, None]
    if tp.weights is not None:  # the weight of the target's prediction at t + 1 + j
      w = w * tp.weights[:, jnp.minimum(idx, t - 1)]
    all_hit_NTJ = jnp.cumprod(hit_NTJR[..., 0].astype(jnp.int32), axis=2) > 0
    return (jnp.sum(hit_NTJR * w[..., None], axis=(0, 1)),
            jnp.sum(valid_TJ[None] * w, axis=(0, 1)),
            jnp.sum((all_hit_NTJ & valid_TJ[None]) * w, axis=(0, 1)))

  return jax.jit(hits)


@functools.lru_cache(maxsize=16)
def _loss_for(kind: HeadKind) -> Callable:
  """Jitted loss(params, target, tokens_NT, masks_NT=None) -> the kind's loss on a chunk."""
  return jax.jit(lambda params, target, tokens, masks=None: kind.loss(
      params, target_pass(kind, target, tokens, masks))[0])


def validation_loss(kind: HeadKind, params, target: LM, windows_NT: np.ndarray,
                    batch: int = 16, masks_NT: np.ndarray | None = None) -> float:
  """The kind's loss averaged over held-out windows (whole chunks of `batch` windows;
  masks_NT: their loss masks)."""
  loss_fn, size = _loss_for(kind), min(batch, len(windows_NT))
  extra = lambda i: () if masks_NT is None else (jnp.asarray(masks_NT[i:i + size]),)  # noqa: E731
  return float(np.mean([float(loss_fn(params, target, jnp.asarray(windows_NT[i:i + size]),
                                      *extra(i)))
                        for i in range(0, len(windows_NT) - size + 1, size)]))


# ----------------------------------------------------------------------------- acceptance


@dataclasses.dataclass(frozen=True)
class HeadAcceptance:
  """Teacher-forced acceptance per head position (module doc): top1 [J], rank_probs [J][R],
  chain [J] (conditional on the earlier positions), positions = predictions per head."""

  top1: tuple[float, ...]
  rank_probs: tuple[tuple[float, ...], ...]
  chain: tuple[float, ...]
  positions: int

  def to_dict(self) -> dict:
    return {"top1": list(self.top1), "rank_probs": [list(r) for r in self.rank_probs],
            "chain": list(self.chain), "positions": self.positions}

  @classmethod
  def from_dict(cls, d: dict) -> "HeadAcceptance":
    return cls(tuple(d["top1"]), tuple(tuple(r) for r in d["rank_probs"]), tuple(d["chain"]),
               int(d["positions"]))

  def tree(self, budget: int, max_depth: int | None = None) -> trees.TreeSpec:
    """The static tree of at most `budget` nodes with the largest E[τ] under these rank
    probabilities (`trees.optimal`, one row per depth = head position)."""
    depth = len(self.rank_probs) if max_depth is None else min(max_depth, len(self.rank_probs))
    return trees.optimal(budget, np.asarray(self.rank_probs)[:depth], max_depth=depth)

  def __str__(self) -> str:
    return ("top-1 per head position " + " ".join(f"{a:.3f}" for a in self.top1)
            + "; chain per depth " + " ".join(f"{a:.3f}" for a in self.chain))


def head_acceptance(kind: HeadKind, params, target: LM, windows_NT: np.ndarray, *,
                    ranks: int = 4, batch: int = 16,
                    masks_NT: np.ndarray | None = None) -> HeadAcceptance:
  """Per-position acceptance of the head's guesses vs the target's greedy tokens on
  held-out windows (module doc), in equal-size chunks (the last padded, weight 0); masks_NT:
  the windows' loss masks (only guesses of tokens the mask keeps count)."""
  hits_fn = _hits_for(kind, ranks)
  hits = tried = chain = 0.0
  for windows, weight, masks in padded_chunks(batch, windows_NT, masks_NT):
    h, t, c = hits_fn(params, target, jnp.asarray(windows), weight,
                      *(() if masks is None else (jnp.asarray(masks),)))
    hits, tried, chain = hits + np.asarray(h, np.float64), tried + np.asarray(t), \
        chain + np.asarray(c, np.float64)
  probs = hits / np.maximum(tried, 1.0)[:, None]
  prev = np.concatenate([tried[:1], chain[:-1]])
  cond = np.where(prev > 0, chain / np.maximum(prev, 1.0), 0.0)
  return HeadAcceptance(tuple(float(x) for x in probs[:, 0]),
                        tuple(tuple(float(x) for x in row) for row in probs),
                        tuple(float(x) for x in cond), int(tried[0]))


# ----------------------------------------------------------------------------- training


@dataclasses.dataclass
class HeadResult:
  kind: HeadKind
  params: Any
  step: int
  completed: bool
  train_loss: float | None          # mean loss over the last logged steps
  acceptance: HeadAcceptance | None  # at the end (held-out windows)
  seconds: float                    # wall time of this call (compile and evaluation included)
  history: list[dict]
  checkpoint_dir: pathlib.Path | None
  resumed_from: int | None

  def summary(self) -> str:
    lines = [f"{self.kind.name} head {spec_text(self.kind.spec())}: "
             f"{param_total(self.params) / 1e6:.3f}M "
             f"params, {self.step} steps" + ("" if self.completed else " (stopped early)")
             + (f", resumed from step {self.resumed_from}" if self.resumed_from else ""),
             f"time: {self.seconds:.1f} s (compilation and evaluation included)"]
    if self.train_loss is not None:
      lines.append(f"final train loss: {self.train_loss:.4f}")
    if self.acceptance is not None:
      lines.append(f"held-out acceptance: {self.acceptance}")
    if self.checkpoint_dir is not None:
      lines.append(f"checkpoint: {self.checkpoint_dir}")
    return "\n".join(lines)


class HeadTrainer(CheckpointedRun):
  """Train one head of `kind` on a frozen target, optionally resumable.

  target_params: the target's parameters (any float dtype; used in float32, never updated).
  out_dir: checkpoint directory (None: no checkpoints, no resume); one holding checkpoints of
  the same run is resumed, one of a different run (kind, target, schedule, corpus,
  tokenizer) is refused naming the differences.
  mesh: a ('data', 'model') mesh to train on data-parallel (`CheckpointedRun._data_parallel`).
  """

  def __init__(self, kind: HeadKind, target_config: ModelConfig, target_params,
               train_config: TrainConfig, data: TokenData, tokenizer: Tokenizer, *,
               out_dir: str | pathlib.Path | None = None, progress: bool = True,
               log: Callable[[str], None] = _log, eval_ranks: int = 4, mesh=None) -> None:
    tc = train_config
    if tokenizer.vocab_size > target_config.vocab_size:  # fewer: padded embedding rows
      raise ValueError(f"tokenizer vocab_size {tokenizer.vocab_size} exceeds the target's "
                       f"vocab_size {target_config.vocab_size}: use the target's own tokenizer")
    if tc.seq_len + 1 > target_config.max_len:
      raise ValueError(f"seq_len {tc.seq_len} (+1) exceeds the target's max_len "
                       f"{target_config.max_len}")
    if not isinstance(eval_ranks, int) or eval_ranks < 1:
      raise ValueError(f"eval_ranks must be an int >= 1, got {eval_ranks!r}")
    data.check_fits(tc.seq_len)
    self.kind, self.tc, self.data, self.tokenizer = kind, tc, data, tokenizer
    self.progress, self.log, self.eval_ranks = progress, log, eval_ranks
    self.out_dir = None if out_dir is None else pathlib.Path(out_dir)
    self.target = frozen_target(target_config, target_params)
    self.binding = TargetBinding(target_config, params_fingerprint(self.target.params))
    self.tx = make_optimizer(tc)
    self.params = jax.jit(kind.init, static_argnums=0)(self.target.config,
                                                       jax.random.key(tc.seed))
    if hasattr(kind, "init_from_target"):  # a kind that starts from the target's own weights
      self.params = kind.init_from_target(self.params, self.target)
    self.opt_state = jax.jit(self.tx.init)(self.params)
    self.target, = self._data_parallel(mesh, self.target)
    self.train_step = _train_step_for(kind, tc.compile_key())
    self.val_windows = data.validation_windows(tc.seq_len, tc.eval_windows)
    self.val_masks = data.validation_masks(tc.seq_len, tc.eval_windows)
    self.step, self.history, self.resumed_from = 0, [], None

  # -- checkpoints

  checkpoint_kind = HEAD_KIND

  @property
  def _ckpt_config(self) -> ModelConfig:
    return self.binding.config

  @property
  def _run_label(self) -> str:
    return f"the {self.kind.name} head"

  def metadata(self, acceptance: HeadAcceptance | None = None) -> dict:
    meta = {**self._run_metadata(), "head": {"kind": self.kind.name, "spec": self.kind.spec()},
            "target": self.binding.to_dict()}
    if acceptance is not None:
      meta["acceptance"] = acceptance.to_dict()
    return meta

  def _own_problems(self, meta: dict) -> list[str]:
    problems = []
    head = meta.get("head") or {}
    if head.get("kind") != self.kind.name or head.get("spec") != self.kind.spec():
      problems.append(f"head: checkpoint={head}, now={{'kind': {self.kind.name!r}, "
                      f"'spec': {self.kind.spec()}}}")
    return problems + [f"target {line}"
                       for line in self.binding.differences(meta.get("target", {}))]

  # -- loop

  def evaluate(self, params=None) -> HeadAcceptance:
    """Acceptance of `params` (default: the current head) on the held-out windows."""
    return head_acceptance(self.kind, self.params if params is None else params, self.target,
                           self.val_windows, ranks=self.eval_ranks,
                           batch=min(self.tc.micro_batch, len(self.val_windows)),
                           masks_NT=self.val_masks)

  def validation_loss(self, params=None) -> float:
    """The kind's loss of `params` (default: the current head) on the held-out windows."""
    return validation_loss(self.kind, self.params if params is None else params, self.target,
                           self.val_windows, batch=min(self.tc.micro_batch,
                                                       len(self.val_windows)),
                           masks_NT=self.val_masks)

  def run(self, stop_after: int | None = None, final_eval: bool = True) -> HeadResult:
    """Train to train_config.steps (or stop after `stop_after` more steps, as if killed then,
    having saved a checkpoint). KeyboardInterrupt saves a checkpoint and re-raises.
    final_eval: measure held-out acceptance at the end (stored in the checkpoint)."""
    tc, start = self.tc, time.perf_counter()
    acceptance = None
    with self._checkpointing() as ckpt:
      last = self._last_step(stop_after)
      window: list[float] = []
      bar = self._progress_bar()
      with self._steps_saving_on_interrupt(ckpt, bar) as stop_requested:
        while self.step < last:
          if stop_requested():
            raise KeyboardInterrupt
          lr = np.float32(learning_rate(tc, self.step))
          mask = self._batch_mask()
          self.params, self.opt_state, metrics = self.train_step(
              self.params, self.opt_state, jnp.asarray(self._batch()), self.target, lr,
              *(() if mask is None else (jnp.asarray(mask),)))
          self._bound_run_ahead(metrics)
          self.step += 1
          if self.step % 10 == 0 or self.step == last:
            window = (window + [float(metrics["loss"])])[-5:]
            bar.set_postfix(loss=f"{window[-1]:.3f}", refresh=False)
          bar.update(1)
          if self._eval_due():
            acc = self.evaluate()
            self.history.append({"step": self.step, "top1": list(acc.top1)})
          self._save_if_due(ckpt)
      bar.close()
      completed = self.step >= tc.steps
      if final_eval and (completed or stop_after is not None):
        acceptance = self.evaluate()
        self.history.append({"step": self.step, "top1": list(acceptance.top1)})
      self._save(ckpt, overwrite=acceptance is not None, acceptance=acceptance)
    return HeadResult(self.kind, self.params, self.step, self.step >= tc.steps,
                      float(np.mean(window)) if window else None, acceptance,
                      time.perf_counter() - start, self.history, self.out_dir,
                      self.resumed_from)


def train_head(kind: HeadKind, target_config: ModelConfig, target_params,
               train_config: TrainConfig, data: TokenData, tokenizer: Tokenizer,
               **kwargs) -> HeadResult:
  """One-call form of HeadTrainer(...).run() (kwargs: out_dir, progress, stop_after, ...)."""
  stop_after = kwargs.pop("stop_after", None)
  return HeadTrainer(kind, target_config, target_params, train_config, data, tokenizer,
                     **kwargs).run(stop_after)


# ----------------------------------------------------------------------------- loading


@dataclasses.dataclass
class TrainedHead:
  kind: HeadKind
  params: Any
  target: TargetBinding             # what it was trained for
  acceptance: HeadAcceptance | None  # measured at the end of training
  tokenizer: Tokenizer
  metadata: dict
  step: int


def read_head_meta(directory: str | pathlib.Path, step: int | None = None) -> dict:
  """The metadata of a head checkpoint (ValueError if `directory` holds none)."""
  directory = pathlib.Path(directory)
  if orbax_io.latest_step(directory) is None:
    raise ValueError(f"no head checkpoint found in {str(directory)!r}")
  meta = orbax_io.read_meta(directory, step)["metadata"]
  if meta.get("kind") != HEAD_KIND:
    raise ValueError(f"{str(directory)!r} is not a specjax head checkpoint (kind "
                     f"{meta.get('kind')!r})")
  return meta


def load_head(directory: str | pathlib.Path, *, target=None, kind: str | None = None,
              step: int | None = None) -> TrainedHead:
  """Restore a head checkpoint (latest step by default).

  target: the target it will draft for, as (config, params), an LM or a Transformer; a head
  trained for another target is refused (ValueError listing the differing fields) before
  any array is read. kind: if given, the head must be of this kind.
  """
  directory = pathlib.Path(directory)
  meta = read_head_meta(directory, step)
  name = meta["head"]["kind"]
  if kind is not None and name != kind:
    raise ValueError(f"{str(directory)!r} holds a {name!r} head, not a {kind!r} head")
  if target is not None:
    diff = _as_binding(target).differences(meta["target"])
    if diff:
      raise ValueError(f"the {name} head in {str(directory)!r} was trained for another "
                       "target; differing fields:\n  " + "\n  ".join(diff))
  head_kind = kind_from_spec(name, meta["head"]["spec"])
  target_cfg = ModelConfig.from_dict(meta["target"]["config"])
  abstract = jax.eval_shape(lambda: head_kind.init(target_cfg.replace(dtype="float32"),
                                                   jax.random.key(0)))
  restored = orbax_io.restore(directory, params_target=abstract, config=target_cfg, step=step)
  acc = meta.get("acceptance")
  return TrainedHead(head_kind, restored.params, TargetBinding(target_cfg,
                                                               meta["target"]["fingerprint"]),
                     None if acc is None else HeadAcceptance.from_dict(acc),
                     _head_tokenizer(meta.get("tokenizer"), directory), meta, restored.step)


def _head_tokenizer(spec: dict | None, directory: pathlib.Path):
  """The tokenizer a head directory records (None where it records none; a Hugging Face
  tokenizer is read back from the tokenizer.json `save_head` wrote beside it)."""
  return None if spec is None else recorded_tokenizer(spec, directory)


def save_head(directory: str | pathlib.Path, kind: HeadKind, params, target, tokenizer=None,
              *, metadata: dict | None = None, overwrite: bool = False) -> pathlib.Path:
  """Write `params` of a `kind` head as a head directory `load_head` reads (step 0, bound
  to `target`: (config, params), an LM or a Transformer), all or nothing; for heads made
  elsewhere (`checkpoints.published`: imported heads). metadata: extra fields (where the
  head came from). A non-empty `directory` is refused unless `overwrite`."""
  out = prepare_output_dir(directory, overwrite)
  binding = _as_binding(target)
  meta = {**(metadata or {}), "kind": HEAD_KIND,
          "head": {"kind": kind.name, "spec": kind.spec()}, "target": binding.to_dict(),
          "tokenizer": None if tokenizer is None else tokenizer.to_spec()}
  with assembling(out) as tmp:
    orbax_io.save(tmp, 0, params=params, config=binding.config, metadata=meta)
    if tokenizer is not None:
      text = tokenizer.to_json() if hasattr(tokenizer, "to_json") else None
      if text is not None:
        (tmp / "tokenizer.json").write_text(text)
      else:
        tokenizer.save(tmp)
  return out
