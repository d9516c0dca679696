"""Language-model training and draft distillation with optax, resumable through orbax.

Jit boundary (see docs/architecture.md, "The jit boundary"): the model is split once,
`graphdef, params = nnx.split(model, nnx.Param)`; the jitted step takes (params, opt_state,
batch, teacher_params), merges inside, and donates params and optimizer state. The graphdef is closed over (static), so there is one
compile per (model config, train config). This measured as fast as nnx.jit for these sizes
and keeps the step a pure function of arrays, which is what resuming relies on.

Resume: a checkpoint holds params, optimizer state, the step and the data-order state (seed,
corpus fingerprint); the batch of step s is a pure function of (seed, s), see
`specjax.data.batches`. A run killed at any point restarts from its newest checkpoint and reaches
the same parameters as an uninterrupted run (XLA:CPU is deterministic). Checkpoints are written
every `ckpt_every` steps, at the end, and on KeyboardInterrupt / SIGTERM (the CLI turns SIGTERM
into KeyboardInterrupt).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
import pathlib
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from specjax.checkpoints.trained import TRAINED_KIND
from specjax.data.batches import TokenData, padded_chunks
from specjax.data.tokenizer import Tokenizer
from specjax.models.transformer import ModelConfig, Transformer, abstract_model, graphdef_for
from specjax.training import losses
from specjax.training.checkpointed import CheckpointedRun, _log
from specjax.training.config import TrainConfig



@dataclasses.dataclass
class Teacher:
  """A frozen model whose soft labels a student is distilled towards."""
  config: ModelConfig
  params: nnx.State

  @functools.cached_property
  def fingerprint(self) -> str:
    return params_fingerprint(self.params)


@dataclasses.dataclass
class TrainResult:
  model_config: ModelConfig
  params: nnx.State            # float32
  step: int
  completed: bool              # reached train_config.steps
  train_loss: float | None     # mean objective over the last logged steps
  val: dict | None             # last validation: {"bpb", "nll", "kl"?}
  seconds: float               # wall time of this call (compile included)
  tokens: int                  # tokens trained on in this call
  history: list[dict]
  checkpoint_dir: pathlib.Path | None
  resumed_from: int | None
  steady_tokens_per_s: float | None = None  # after the first (compiling) step

  @property
  def tokens_per_s(self) -> float:
    return self.tokens / max(self.seconds, 1e-9)

  def summary(self) -> str:
    c = self.model_config
    lines = [f"model: d_model={c.d_model} n_layers={c.n_layers} n_heads={c.n_heads} "
             f"d_ff={c.d_ff} vocab={c.vocab_size} ({param_total(self.params) / 1e6:.2f}M params)",
             f"steps: {self.step}" + ("" if self.completed else " (stopped early)")
             + (f", resumed from step {self.resumed_from}" if self.resumed_from else ""),
             f"time: {self.seconds:.1f} s (compilation and evaluation included), "
             f"{self.tokens:,} tokens"
             + (f", {self.steady_tokens_per_s:,.0f} tokens/s after compilation"
                if self.steady_tokens_per_s else "")]
    if self.train_loss is not None:
      lines.append(f"final train loss: {self.train_loss:.4f} nats/token")
    if self.val:
      val = f"validation: {self.val['bpb']:.4f} bits/byte ({self.val['nll']:.4f} nats/token)"
      if "kl" in self.val:
        val += f", KL to teacher {self.val['kl']:.4f} nats/token"
      lines.append(val)
    if self.checkpoint_dir is not None:
      lines.append(f"checkpoint: {self.checkpoint_dir}")
    return "\n".join(lines)


def param_total(params) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def params_fingerprint(params) -> str:
  """sha256 over the parameter bytes (names in tree order), 16 hex digits."""
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    h.update(jax.tree_util.keystr(path).encode())
    h.update(np.asarray(leaf).tobytes())
  return h.hexdigest()[:16]


def init_params(config: ModelConfig, seed: int) -> tuple[Any, nnx.State]:
  """(graphdef, float32 params) of a freshly initialised Transformer (initialised under jit:
  eager initialisation would compile every random op separately)."""
  config = config.replace(dtype="float32")
  graphdef, abstract = abstract_params(config)

  def make():
    model = Transformer(config, rngs=nnx.Rngs(seed))
    return nnx.split(model, nnx.Param, ...)[1:]

  params, rest = jax.jit(make)()
  if jax.tree.leaves(rest):
    raise ValueError("the model holds non-parameter state; the trainer only handles nnx.Param")
  return graphdef, params


def abstract_params(config: ModelConfig) -> tuple[Any, nnx.State]:
  """(graphdef, abstract float32 params) without allocating: the trainer keeps float32
  master weights whatever config.dtype says."""
  return abstract_model(config.replace(dtype="float32"))


def f32_graphdef(config: ModelConfig):
  """The (cached) graphdef of a float32 Transformer with this config."""
  return graphdef_for(config.replace(dtype="float32"))


def learning_rate(tc: TrainConfig, step: int) -> float:
  """Linear warmup 0 -> lr over warmup_steps, then cosine decay to lr * min_lr_ratio at steps:
  lr(s) = lr * s / warmup                                          for s < warmup
  lr(s) = lr * (m + (1 - m) * (1 + cos(pi * (s - warmup) / (steps - warmup))) / 2)  after."""
  if step < tc.warmup_steps:
    return tc.lr * step / tc.warmup_steps
  span = max(tc.steps - tc.warmup_steps, 1)
  progress = min(step - tc.warmup_steps, span) / span
  m = tc.min_lr_ratio
  return tc.lr * (m + (1 - m) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
  """Clip -> AdamW, weight decay on matrices only (not norms/biases).

  The learning rate is an injected hyper-parameter (part of the optimizer state), set by the
  step from `learning_rate(tc, step)` computed in Python: the compiled step then does not depend
  on steps, lr or the warmup, so runs differing only in those share one compilation.
  """
  decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
  adamw = optax.inject_hyperparams(optax.adamw, static_args=("mask",))
  return optax.chain(
      optax.clip_by_global_norm(tc.grad_clip),
      adamw(learning_rate=0.0, b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay,
            mask=decay_mask))


def _with_learning_rate(opt_state, lr):
  clip_state, adam_state = opt_state
  hyper = dict(adam_state.hyperparams)
  hyper["learning_rate"] = jnp.asarray(lr, hyper["learning_rate"].dtype)
  return (clip_state, adam_state._replace(hyperparams=hyper))


# ----------------------------------------------------------------------------- memory


def _available_memory_bytes() -> int | None:
  """Memory the default device can use: the accelerator's limit, or physical RAM on CPU."""
  device = jax.devices()[0]
  try:
    stats = device.memory_stats()
  except Exception:  # noqa: BLE001 (backends without memory stats)
    stats = None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None


def estimate_train_memory(config: ModelConfig, micro_batch: int, seq_len: int,
                          teacher: ModelConfig | None = None) -> int:
  """Rough peak bytes of one training step (an upper-side estimate, float32).

  params + grads + two Adam moments (16 B/param), plus activations kept for the backward pass:
  per layer ~ (12 d + 3 d_ff) floats per token and 3 H T floats per token for the attention
  scores, probabilities and mask, plus ~4 V floats per token for logits, softmax and gradient.
  """
  def acts(c: ModelConfig) -> int:
    per_token = c.n_layers * (12 * c.d_model + 3 * c.d_ff + 3 * c.n_heads * seq_len)
    per_token += 4 * c.vocab_size
    return 4 * micro_batch * seq_len * per_token

  n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params(config)[1]))
  total = 16 * n_params + acts(config)
  if teacher is not None:
    t_params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params(teacher)[1]))
    total += 4 * t_params + acts(teacher) // 2
  return total


def check_memory(config: ModelConfig, tc: TrainConfig, teacher: ModelConfig | None = None,
                 available: int | None = None) -> None:
  """ValueError when the step clearly cannot fit (estimate > 80% of the device's memory)."""
  available = _available_memory_bytes() if available is None else available
  if available is None:
    return
  need = estimate_train_memory(config, tc.micro_batch, tc.seq_len, teacher)
  if need > 0.8 * available:
    raise ValueError(
        f"batch_size={tc.batch_size} (micro-batch {tc.micro_batch}) x seq_len={tc.seq_len} "
        f"needs about {need / 2**30:.1f} GiB per step but the device has "
        f"{available / 2**30:.1f} GiB: lower batch_size or seq_len, or raise grad_accum")


# ----------------------------------------------------------------------------- steps


def build_train_step(graphdef, tc: TrainConfig, teacher_graphdef=None) -> Callable:
  """Jitted train_step(params, opt_state, batch_ABT1, teacher_params, lr, mask_ABT1=None)
  -> (params, opt_state, metrics); params and opt_state are donated. mask_ABT1: the
  batch's loss mask (`losses.masked_mean` over the predicted tokens), None: every token."""
  dtype = jnp.dtype(tc.dtype)
  distill = tc.objective == "distill"
  tx = make_optimizer(tc)

  def loss_fn(params, batch_BT1, teacher_params, mask_BT1):
    inputs_BT, targets_BT = batch_BT1[:, :-1], batch_BT1[:, 1:]
    weights = None if mask_BT1 is None else mask_BT1[:, 1:]  # the predicted tokens' mask
    logits_BTV = losses.forward_logits(graphdef, params, inputs_BT, dtype)
    ce = losses.masked_mean(losses.token_nll(logits_BTV, targets_BT), weights)
    if not distill:
      return ce, ce
    teacher_BTV = jax.lax.stop_gradient(
        losses.forward_logits(teacher_graphdef, teacher_params, inputs_BT, dtype))
    kl = losses.masked_mean(losses.kl_teacher_student(teacher_BTV, logits_BTV), weights)
    return kl + tc.distill_ce_weight * ce, ce

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def train_step(params, opt_state, batch_ABT1, teacher_params, lr, mask_ABT1=None):
    if batch_ABT1.shape[0] == 1:
      (loss, ce), grads = grad_fn(params, batch_ABT1[0], teacher_params,
                                  None if mask_ABT1 is None else mask_ABT1[0])
    else:  # gradient accumulation: mean of micro-batch gradients, one update
      def micro(carry, xs):
        (loss, ce), grads = grad_fn(params, xs[0], teacher_params, xs[1])
        acc = jax.tree.map(jnp.add, carry[2], grads)
        return (carry[0] + loss, carry[1] + ce, acc), None
      zeros = jax.tree.map(jnp.zeros_like, params)
      (loss, ce, grads), _ = jax.lax.scan(micro, (0.0, 0.0, zeros), (batch_ABT1, mask_ABT1))
      n = batch_ABT1.shape[0]
      loss, ce = loss / n, ce / n
      grads = jax.tree.map(lambda g: g / n, grads)
    updates, opt_state = tx.update(grads, _with_learning_rate(opt_state, lr), params)
    params = optax.apply_updates(params, updates)
    metrics = {"loss": loss, "ce": ce, "grad_norm": optax.tree.norm(grads)}
    return params, opt_state, metrics

  return jax.jit(train_step, donate_argnums=(0, 1))


def build_eval_step(graphdef, dtype: str = "float32", teacher_graphdef=None) -> Callable:
  """Jitted eval_step(params, windows_NT1, weight_N, byte_len_V, teacher_params,
  masks_NT1=None) -> sums of nats, bytes, tokens (and KL to the teacher) over the weighted
  windows (and, with masks, over the predicted tokens the masks keep)."""
  dtype = jnp.dtype(dtype)

  def eval_step(params, windows_NT1, weight_N, byte_len_V, teacher_params, masks_NT1=None):
    inputs_NT, targets_NT = windows_NT1[:, :-1], windows_NT1[:, 1:]
    logits_NTV = losses.forward_logits(graphdef, params, inputs_NT, dtype)
    nll_NT = losses.token_nll(logits_NTV, targets_NT)
    w_NT = jnp.broadcast_to(weight_N[:, None], nll_NT.shape)
    if masks_NT1 is not None:  # only the predicted tokens the mask keeps
      w_NT = w_NT * masks_NT1[:, 1:].astype(jnp.float32)
    sums = {"nats": jnp.sum(nll_NT * w_NT),
            "bytes": jnp.sum(byte_len_V[targets_NT].astype(jnp.float32) * w_NT),
            "tokens": jnp.sum(w_NT)}
    if teacher_graphdef is not None:
      teacher_NTV = losses.forward_logits(teacher_graphdef, teacher_params, inputs_NT, dtype)
      sums["kl"] = jnp.sum(losses.kl_teacher_student(teacher_NTV, logits_NTV) * w_NT)
    return sums

  return jax.jit(eval_step)


@functools.lru_cache(maxsize=16)
def _train_step_for(config: ModelConfig, compile_key: TrainConfig,
                    teacher_config: ModelConfig | None) -> Callable:
  teacher_graphdef = None if teacher_config is None else f32_graphdef(teacher_config)
  return build_train_step(f32_graphdef(config), compile_key, teacher_graphdef)


@functools.lru_cache(maxsize=16)
def _eval_step_for(config: ModelConfig, dtype: str, teacher_config: ModelConfig | None):
  teacher_graphdef = None if teacher_config is None else f32_graphdef(teacher_config)
  return build_eval_step(f32_graphdef(config), dtype, teacher_graphdef)


def compiled_steps(config: ModelConfig, tc: TrainConfig,
                   teacher_config: ModelConfig | None = None) -> tuple[Callable, Callable]:
  """(train_step, eval_step) memoised on what the compiled code depends on, so trainers in one
  process (resume, the default-pair build, evaluations, tests) share compilations."""
  config = config.replace(dtype="float32")
  teacher_config = None if teacher_config is None else teacher_config.replace(dtype="float32")
  return (_train_step_for(config, tc.compile_key(), teacher_config),
          _eval_step_for(config, tc.dtype, teacher_config))


def validation_metrics(config: ModelConfig, params, data: TokenData, tokenizer: Tokenizer,
                       tc: TrainConfig, teacher: Teacher | None = None) -> dict:
  """{"bpb", "nll"} (+ "kl" to the teacher) of any params on data's validation windows."""
  _, eval_step = compiled_steps(config, tc, None if teacher is None else teacher.config)
  windows = data.validation_windows(tc.seq_len, tc.eval_windows)
  return evaluate(eval_step, params, windows, tc.micro_batch,
                  np.asarray(tokenizer.token_byte_lengths(), np.int32),
                  None if teacher is None else teacher.params,
                  data.validation_masks(tc.seq_len, tc.eval_windows))


def evaluate(eval_step, params, windows_NT1: np.ndarray, batch: int, byte_len_V: np.ndarray,
             teacher_params=None, masks_NT1: np.ndarray | None = None) -> dict:
  """Validation over fixed windows in equal-size chunks (the last one padded, weight 0);
  masks_NT1: the windows' loss masks (None: every token counts)."""
  totals: dict[str, float] = {}
  for windows, weight, masks in padded_chunks(batch, windows_NT1, masks_NT1):
    sums = eval_step(params, windows, weight, byte_len_V, teacher_params,
                     *(() if masks is None else (masks,)))
    for key, value in sums.items():
      totals[key] = totals.get(key, 0.0) + float(value)
  out = {"nll": totals["nats"] / totals["tokens"],
         "bpb": losses.bits_per_byte(totals["nats"], totals["bytes"])}
  if "kl" in totals:
    out["kl"] = totals["kl"] / totals["tokens"]
  return out


# ----------------------------------------------------------------------------- trainer


class Trainer(CheckpointedRun):
  """Train one model (target LM or distilled/plain draft) on a TokenData, optionally resumable.

  out_dir: checkpoint directory (None: no checkpoints, no resume). A directory that already
  holds checkpoints of the same run is resumed; one of a different run is refused.
  mesh: a ('data', 'model') mesh to train on data-parallel (`CheckpointedRun._data_parallel`).
  """

  def __init__(self, model_config: ModelConfig, train_config: TrainConfig, data: TokenData,
               tokenizer: Tokenizer, *, out_dir: str | pathlib.Path | None = None,
               teacher: Teacher | None = None, role: str = "model", progress: bool = True,
               log: Callable[[str], None] = _log, check_memory_fit: bool = True,
               mesh=None) -> None:
    tc = train_config
    if model_config.vocab_size < tokenizer.vocab_size:  # more rows (a teacher's padding): fine
      raise ValueError(f"model vocab_size {model_config.vocab_size} < tokenizer vocab_size "
                       f"{tokenizer.vocab_size}: the tokenizer's ids must have embedding rows")
    if tc.seq_len > model_config.max_len:
      raise ValueError(f"seq_len {tc.seq_len} exceeds the model's max_len "
                       f"{model_config.max_len}")
    if (tc.objective == "distill") != (teacher is not None):
      raise ValueError("objective 'distill' needs a teacher and 'lm' takes none; got objective "
                       f"{tc.objective!r} with teacher={'set' if teacher else 'None'}")
    if teacher is not None and teacher.config.vocab_size != model_config.vocab_size:
      raise ValueError(f"teacher vocab_size {teacher.config.vocab_size} != student vocab_size "
                       f"{model_config.vocab_size}")
    if teacher is not None and tc.seq_len > teacher.config.max_len:
      raise ValueError(f"seq_len {tc.seq_len} exceeds the teacher's max_len "
                       f"{teacher.config.max_len}")
    data.check_fits(tc.seq_len)
    if check_memory_fit:
      check_memory(model_config, tc, teacher.config if teacher else None)
    self.model_config, self.tc, self.data, self.tokenizer = model_config, tc, data, tokenizer
    self.teacher, self.role, self.progress, self.log = teacher, role, progress, log
    self.out_dir = None if out_dir is None else pathlib.Path(out_dir)
    self.tx = make_optimizer(tc)
    self.graphdef, params = init_params(model_config, tc.seed)
    self.params, self.opt_state = params, jax.jit(self.tx.init)(params)
    self.teacher_params = None if teacher is None else teacher.params
    self.teacher_params, = self._data_parallel(mesh, self.teacher_params)
    self.train_step, self.eval_step = compiled_steps(
        model_config.replace(dtype="float32"), tc,
        None if teacher is None else teacher.config.replace(dtype="float32"))
    self.byte_len_V = np.asarray(tokenizer.token_byte_lengths(), np.int32)
    self.val_windows = data.validation_windows(tc.seq_len, tc.eval_windows)
    self.val_masks = data.validation_masks(tc.seq_len, tc.eval_windows)
    self.step, self.history, self.resumed_from = 0, [], None

  # -- checkpoints

  checkpoint_kind = TRAINED_KIND

  @property
  def _ckpt_config(self) -> ModelConfig:
    return self.model_config

  @property
  def _run_label(self) -> str:
    return self.role

  def metadata(self) -> dict:
    meta = {**self._run_metadata(), "role": self.role}
    if self.teacher is not None:
      meta["teacher"] = {"config": self.teacher.config.to_dict(),
                         "fingerprint": self.teacher.fingerprint}
    return meta

  def _own_problems(self, meta: dict) -> list[str]:
    teacher = meta.get("teacher")
    now = None if self.teacher is None else self.teacher.fingerprint
    if (teacher or {}).get("fingerprint") != now:
      return [f"teacher: checkpoint={(teacher or {}).get('fingerprint')}, now={now}"]
    return []

  # -- loop

  def evaluate(self) -> dict:
    teacher_params = self.teacher_params
    return evaluate(self.eval_step, self.params, self.val_windows, self.tc.micro_batch,
                    self.byte_len_V, teacher_params, self.val_masks)

  def run(self, stop_after: int | None = None, final_eval: bool = True) -> TrainResult:
    """Train to train_config.steps (or stop after `stop_after` more steps, as if killed then,
    having saved a checkpoint). KeyboardInterrupt saves a checkpoint and re-raises.
    final_eval: measure validation loss at the end (recorded in the checkpoint's history)."""
    tc, start = self.tc, time.perf_counter()
    with self._checkpointing() as ckpt:
      first, last = self.step, self._last_step(stop_after)
      teacher_params = self.teacher_params
      tokens_per_step = tc.batch_size * tc.seq_len
      losses_window: list[float] = []
      bar = self._progress_bar()
      t_loop, first_timed = time.perf_counter(), first
      with self._steps_saving_on_interrupt(ckpt, bar) as stop_requested:
        while self.step < last:
          if stop_requested():
            raise KeyboardInterrupt
          batch, lr = self._batch(), np.float32(learning_rate(tc, self.step))
          mask = self._batch_mask()
          try:
            self.params, self.opt_state, metrics = self.train_step(
                self.params, self.opt_state, batch, teacher_params, lr,
                *(() if mask is None else (mask,)))
          except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
              raise
            raise ValueError(
                f"batch_size={tc.batch_size} (micro-batch {tc.micro_batch}) x seq_len="
                f"{tc.seq_len} does not fit in the device's memory: lower batch_size or "
                f"seq_len, or raise grad_accum ({str(e).splitlines()[0]})") from e
          self._bound_run_ahead(metrics)
          self.step += 1
          if self.step == first + 1:  # tokens/s from here on: the first step compiles
            float(metrics["loss"])
            t_loop, first_timed = time.perf_counter(), self.step
          elif self.step % 10 == 0 or self.step == last:
            losses_window.append(float(metrics["loss"]))
            losses_window = losses_window[-5:]
            rate = ((self.step - first_timed) * tokens_per_step
                    / max(time.perf_counter() - t_loop, 1e-9))
            bar.set_postfix(loss=f"{losses_window[-1]:.3f}", tok_s=f"{rate:,.0f}",
                            refresh=False)
          bar.update(1)
          if self._eval_due():
            self.history.append({"step": self.step, **self.evaluate()})
            bar.set_postfix(loss=f"{float(metrics['loss']):.3f}",
                            val_bpb=f"{self.history[-1]['bpb']:.3f}", refresh=False)
          self._save_if_due(ckpt)
      bar.close()
      steady = None
      if self.step > first_timed:
        steady = ((self.step - first_timed) * tokens_per_step
                  / max(time.perf_counter() - t_loop, 1e-9))
      completed = self.step >= tc.steps
      val = None
      if final_eval and (completed or stop_after is not None):
        if not self.history or self.history[-1]["step"] != self.step:
          self.history.append({"step": self.step, **self.evaluate()})
        val = {k: v for k, v in self.history[-1].items() if k != "step"}
      self._save(ckpt)
    trained = self.step - (self.resumed_from or 0)
    return TrainResult(
        self.model_config, self.params, self.step, completed,
        float(np.mean(losses_window)) if trained and losses_window else None, val,
        time.perf_counter() - start, trained * tc.batch_size * tc.seq_len, self.history,
        self.out_dir, self.resumed_from, steady)


def train(model_config: ModelConfig, train_config: TrainConfig, data: TokenData,
          tokenizer: Tokenizer, **kwargs) -> TrainResult:
  """One-call form of Trainer(...).run() (kwargs: out_dir, teacher, role, progress, ...)."""
  stop_after = kwargs.pop("stop_after", None)
  return Trainer(model_config, train_config, data, tokenizer, **kwargs).run(stop_after)
