"""What every resumable training run here shares: checkpoints, resume, interruption.

`CheckpointedRun` is the base of `trainer.Trainer` (language models, distilled drafts) and
`heads.HeadTrainer` (draft heads on a frozen target). A checkpoint holds params, optimizer
state and the step (orbax) and metadata naming the run; the batch of step s is a pure
function of (seed, s) (`specjax.data.batches`), so a run killed at any point restarts from
its newest checkpoint and reaches the same parameters as an uninterrupted run. A directory
holding checkpoints of another run is refused, naming every difference. SIGINT / SIGTERM
are deferred to between steps (a step's inputs are donated), then save a checkpoint and
raise KeyboardInterrupt.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import signal
import sys
import threading

import jax
import numpy as np

from specjax.checkpoints import orbax_io
from specjax.training.config import TrainConfig
from specjax import sharding


@contextlib.contextmanager
def _deferred_signals():
  """Within the block, SIGINT/SIGTERM only set a flag (checked between steps), so an
  interruption never lands inside a step whose inputs were donated; yields the flag reader."""
  received: list[int] = []
  if threading.current_thread() is not threading.main_thread():
    yield lambda: False
    return
  previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
  for sig in previous:
    signal.signal(sig, lambda signum, frame: received.append(signum))
  try:
    yield lambda: bool(received)
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)


def _log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


class CheckpointedRun:
  """The checkpoint and loop plumbing that `Trainer` and `heads.HeadTrainer` share.

  A checkpoint holds params, optimizer state and the step (orbax), the config `_ckpt_config`
  and metadata naming the run: its kind, train_config, data order (seed, step, corpus
  fingerprint), tokenizer and history (`_run_metadata`; a subclass's `metadata(...)` adds its
  own fields). A directory holding another run is refused, naming every difference
  (`_check_resumable`: the kind, the subclass's `_own_problems`, the train_config trajectory,
  corpus and tokenizer).

  A subclass sets tc, data, tokenizer, out_dir, params, opt_state, step, history,
  resumed_from and log, and defines `checkpoint_kind`, `_ckpt_config`, `_run_label` (how
  logs name the run), `metadata(**extra)` and `_own_problems(meta)`.
  """

  checkpoint_kind: str

  # -- checkpoints

  def _run_metadata(self) -> dict:
    return {"kind": self.checkpoint_kind, "train_config": dataclasses.asdict(self.tc),
            "data": {"seed": self.tc.seed, "step": self.step, "corpus": self.data.corpus_name,
                     "fingerprint": self.data.fingerprint},
            "tokenizer": self.tokenizer.to_spec(), "history": self.history}

  def _check_resumable(self, meta: dict) -> None:
    problems = []
    if meta.get("kind") != self.checkpoint_kind:
      problems.append(f"kind {meta.get('kind')!r} is not {self.checkpoint_kind!r}")
    problems += self._own_problems(meta)
    stored = TrainConfig(**meta["train_config"]).trajectory()
    for key, value in self.tc.trajectory().items():
      if stored.get(key) != value:
        problems.append(f"train_config.{key}: checkpoint={stored.get(key)!r}, now={value!r}")
    if meta["data"]["fingerprint"] != self.data.fingerprint:
      problems.append(f"corpus: checkpoint={meta['data']['corpus']} "
                      f"({meta['data']['fingerprint']}), now={self.data.corpus_name} "
                      f"({self.data.fingerprint})")
    if meta.get("tokenizer") != self.tokenizer.to_spec():
      problems.append(f"tokenizer: checkpoint={meta.get('tokenizer')}, "
                      f"now={self.tokenizer.to_spec()}")
    if problems:
      raise ValueError(f"checkpoint directory {str(self.out_dir)!r} holds a different run; "
                       "choose another output directory or delete it:\n  "
                       + "\n  ".join(problems))

  def _restore(self, ckpt: orbax_io.Checkpointer) -> None:
    if ckpt.latest_step() is None:
      return
    meta = ckpt.read_meta()["metadata"]
    self._check_resumable(meta)
    restored = ckpt.restore(params_target=self.params, config=self._ckpt_config,
                            opt_state_target=self.opt_state)
    self.params, self.opt_state = restored.params, restored.opt_state
    self.step = self.resumed_from = restored.step
    self.history = list(meta.get("history", []))
    self.log(f"resuming {self._run_label} from step {self.step} in {self.out_dir}")

  def _save(self, ckpt: orbax_io.Checkpointer | None, overwrite: bool = False,
            **extra) -> None:
    """Save the current step (unless already saved and not `overwrite`); extra goes to
    metadata()."""
    if ckpt is not None and (overwrite or self.step not in ckpt.all_steps()):
      ckpt.save(self.step, params=self.params, config=self._ckpt_config,
                opt_state=self.opt_state, metadata=self.metadata(**extra))

  @contextlib.contextmanager
  def _checkpointing(self):
    """Open the checkpointer (None without out_dir; the tokenizer saved beside it, where
    load_trained / load_tokenizer(out_dir) read it), resume from it, yield it, close it."""
    ckpt = None
    if self.out_dir is not None:
      ckpt = orbax_io.Checkpointer(self.out_dir, keep=self.tc.keep)
      if not (self.out_dir / "tokenizer.json").exists():
        self.tokenizer.save(self.out_dir)
    try:
      if ckpt is not None:
        self._restore(ckpt)
      yield ckpt
    finally:
      if ckpt is not None:
        ckpt.close()

  # -- loop

  def _last_step(self, stop_after: int | None) -> int:
    """Where this call stops: train_config.steps, or `stop_after` steps from here."""
    return self.tc.steps if stop_after is None else min(self.tc.steps,
                                                        self.step + stop_after)

  def _progress_bar(self):
    from tqdm.auto import tqdm
    return tqdm(total=self.tc.steps, initial=self.step, desc=f"train {self._run_label}",
                unit="step", disable=not self.progress, file=sys.stderr, dynamic_ncols=True,
                mininterval=1.0)

  @contextlib.contextmanager
  def _steps_saving_on_interrupt(self, ckpt: orbax_io.Checkpointer | None, bar):
    """Within the block signals are deferred (`_deferred_signals`; yields the flag reader);
    a KeyboardInterrupt closes the bar, saves a checkpoint and re-raises."""
    try:
      with _deferred_signals() as stop_requested:
        yield stop_requested
    except KeyboardInterrupt:
      bar.close()
      self.log(f"interrupted at step {self.step}; saving a checkpoint")
      self._save(ckpt)
      raise

  # Steps dispatched beyond the last finished one (`_bound_run_ahead`). Unbounded, XLA's
  # queue held up to 10 steps (the loss is read every 10): Ctrl-C on a CPU run of 60 s steps
  # then took 10 minutes to act, and the progress bar counted steps not yet run.
  RUN_AHEAD = 2

  def _bound_run_ahead(self, metrics) -> None:
    """Called with each dispatched step's outputs: blocks until at most RUN_AHEAD steps are
    unfinished, so an interrupt acts within RUN_AHEAD + 1 steps."""
    pending = self.__dict__.setdefault("_pending_steps", collections.deque())
    pending.append(metrics)
    while len(pending) > self.RUN_AHEAD:
      jax.block_until_ready(pending.popleft())

  # A ('data', 'model') mesh to train on, data-parallel (`_data_parallel`); None: one device.
  mesh = None

  def _data_parallel(self, mesh, *frozen):
    """Trains data-parallel over `mesh` (None: one device): params, optimizer state and the
    `frozen` trees (returned) replicated on every device, each step's rows split over
    `data` (the micro-batch must divide), gradients reduced by XLA. The `model` axis holds
    copies. A step computes the same sums in another order, so losses agree to rounding."""
    if mesh is None:  # explicit only: the CLI's default mesh is for decoding
      return frozen
    self.mesh = sharding.check_mesh(mesh)
    d = self.mesh.shape["data"]
    if self.tc.micro_batch % d:
      raise ValueError(f"mesh data={d} must divide the micro-batch ({self.tc.micro_batch} = "
                       f"batch_size / grad_accum): pick a data axis that divides it")
    self.params, self.opt_state, frozen = sharding.replicate(
        self.mesh, (self.params, self.opt_state, frozen))
    return frozen

  def _batch(self) -> np.ndarray:
    """The batch of this step: a pure function of (seed, step), int32 [A, B, T + 1] (rows
    split over the mesh's `data` axis when training data-parallel)."""
    tc = self.tc
    batch = self.data.train_batch(tc.seed, self.step, tc.batch_size, tc.seq_len, tc.grad_accum)
    if self.mesh is None:
      return batch
    return sharding.split_rows(self.mesh, batch, axis=1)

  def _batch_mask(self) -> np.ndarray | None:
    """The loss mask of this step's batch (`TokenData.train_batch_mask`), None without one
    (split over the mesh as `_batch` is)."""
    tc = self.tc
    mask = self.data.train_batch_mask(tc.seed, self.step, tc.batch_size, tc.seq_len,
                                      tc.grad_accum)
    if mask is None or self.mesh is None:
      return mask
    return sharding.split_rows(self.mesh, mask, axis=1)

  def _eval_due(self) -> bool:
    """A periodic evaluation is due (every eval_every steps, not at the last one)."""
    tc = self.tc
    return bool(tc.eval_every and self.step % tc.eval_every == 0 and self.step < tc.steps)

  def _save_if_due(self, ckpt: orbax_io.Checkpointer | None) -> None:
    """Save every ckpt_every steps."""
    if ckpt is not None and self.tc.ckpt_every and self.step % self.tc.ckpt_every == 0:
      self._save(ckpt)
