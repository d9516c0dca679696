"""Loss functions (pure, jittable). Shapes: B windows, T positions, V vocabulary.

Cross-entropy:   CE = -log q(x_{t+1} | x_<=t), averaged over positions.
Distillation:    KL(p || q) = sum_v p(v) (log p(v) - log q(v)), p the teacher's softmax at
                 temperature 1 (soft labels), q the student's; averaged over positions.
Bits per byte:   sum of CE in nats / ln 2 / number of text bytes the target tokens stand for
                 (special tokens count 0 bytes; their nats still count).
Loss masks:      a window's mask (`data.batches`: 1 on tokens to learn) weights each term
                 by the mask of the token it predicts (`masked_mean`, `predicted_weights`);
                 no mask: the plain mean.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models.transformer import cast_floats

Array = jax.Array


def positions_for(tokens_BT: Array) -> Array:
  b, t = tokens_BT.shape
  return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))


def forward_logits(graphdef, params, inputs_BT: Array, dtype=jnp.float32) -> Array:
  """[B, T, V] float32 logits of the model (graphdef, params) on inputs_BT."""
  model = nnx.merge(graphdef, cast_floats(params, dtype))
  logits_BTV, _, _ = model(inputs_BT, positions_for(inputs_BT))
  return logits_BTV.astype(jnp.float32)


def masked_mean(x: Array, weights: Array | None = None) -> Array:
  """mean(x) without weights; else sum(x * w) / sum(w) (0 where every weight is 0)."""
  if weights is None:
    return jnp.mean(x)
  w = weights.astype(jnp.float32)
  return jnp.sum(x * w) / jnp.maximum(jnp.sum(w), 1e-9)


def predicted_weights(mask_BT: Array | None) -> Array | None:
  """[B, T] float32: the weight of position t's prediction, the mask of token t + 1 (the
  last position, whose next token is outside the window, repeats its own)."""
  if mask_BT is None:
    return None
  m = mask_BT.astype(jnp.float32)
  return jnp.concatenate([m[:, 1:], m[:, -1:]], axis=1)


def token_nll(logits_BTV: Array, targets_BT: Array) -> Array:
  """[B, T] negative log-likelihood in nats."""
  logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
  return -jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]


def kl_teacher_student(teacher_logits_BTV: Array, student_logits_BTV: Array) -> Array:
  """[B, T] KL(p_teacher || q_student) in nats at temperature 1."""
  logp_BTV = jax.nn.log_softmax(teacher_logits_BTV, axis=-1)
  logq_BTV = jax.nn.log_softmax(student_logits_BTV, axis=-1)
  return jnp.sum(jnp.exp(logp_BTV) * (logp_BTV - logq_BTV), axis=-1)


def bits_per_byte(nats_sum: float, bytes_sum: float) -> float:
  return float(nats_sum) / math.log(2.0) / max(float(bytes_sum), 1.0)
