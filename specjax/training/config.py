"""Training hyper-parameters (a frozen dataclass, JSON-able, stored in every checkpoint)."""

from __future__ import annotations

import dataclasses

OBJECTIVES = ("lm", "distill")
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """How to train one model.

  batch_size is the number of windows per optimizer step; with grad_accum > 1 it is split into
  grad_accum micro-batches of batch_size // grad_accum (gradients averaged, one update).
  Learning rate: linear warmup from 0 to `lr` over warmup_steps, then cosine decay to
  lr * min_lr_ratio at `steps`. AdamW (b1, b2, weight_decay on matrices only), global-norm
  clipping at grad_clip. dtype is the compute dtype: parameters and optimizer state stay float32
  (bf16 casts the weights inside the step; matmuls accumulate in float32).
  objective: 'lm' (next-token cross-entropy) or 'distill' (KL(p_teacher || q_student) at
  temperature 1 on every position, plus distill_ce_weight * cross-entropy).
  """
  steps: int = 300
  batch_size: int = 32
  seq_len: int = 128
  grad_accum: int = 1
  lr: float = 3e-3
  warmup_steps: int = 30
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  grad_clip: float = 1.0
  dtype: str = "float32"
  objective: str = "lm"
  distill_ce_weight: float = 0.0
  seed: int = 0
  eval_every: int = 100        # validation loss every N steps (0: only at the end)
  eval_windows: int = 64       # validation windows of seq_len tokens per evaluation
  ckpt_every: int = 100        # checkpoint every N steps (0: only at the end / on exit)
  keep: int = 2                # checkpoints kept (the latest N)

  def __post_init__(self):
    positive = ("steps", "batch_size", "seq_len", "grad_accum", "eval_windows", "keep")
    for name in positive:
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"TrainConfig.{name} must be a positive int, got {value!r}")
    for name in ("warmup_steps", "eval_every", "ckpt_every", "seed"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"TrainConfig.{name} must be an int >= 0, got {value!r}")
    if self.batch_size % self.grad_accum:
      raise ValueError(f"TrainConfig.batch_size ({self.batch_size}) must be divisible by "
                       f"grad_accum ({self.grad_accum})")
    if not self.lr > 0:
      raise ValueError(f"TrainConfig.lr must be > 0, got {self.lr}")
    if not 0.0 <= self.min_lr_ratio <= 1.0:
      raise ValueError(f"TrainConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
    for name in ("b1", "b2"):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f"TrainConfig.{name} must be in [0, 1), got {getattr(self, name)}")
    if self.weight_decay < 0 or self.grad_clip <= 0 or self.distill_ce_weight < 0:
      raise ValueError("TrainConfig.weight_decay and distill_ce_weight must be >= 0 and "
                       f"grad_clip > 0, got {self.weight_decay}, {self.distill_ce_weight}, "
                       f"{self.grad_clip}")
    if self.dtype not in DTYPES:
      raise ValueError(f"TrainConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
    if self.objective not in OBJECTIVES:
      raise ValueError(f"TrainConfig.objective must be one of {OBJECTIVES}, got "
                       f"{self.objective!r}")

  def replace(self, **changes) -> "TrainConfig":
    return dataclasses.replace(self, **changes)

  @property
  def micro_batch(self) -> int:
    return self.batch_size // self.grad_accum

  def compile_key(self) -> "TrainConfig":
    """The fields the compiled train step depends on (steps, lr, warmup, seed and the
    bookkeeping fields are runtime values), normalised so equal keys share a compilation."""
    return self.replace(steps=1, lr=1.0, warmup_steps=0, min_lr_ratio=0.0, seed=0,
                        eval_every=0, eval_windows=1, ckpt_every=0, keep=1)

  def trajectory(self) -> dict:
    """The fields that decide the parameters reached (a resumed run must match these)."""
    skip = {"eval_every", "eval_windows", "ckpt_every", "keep"}
    return {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}
