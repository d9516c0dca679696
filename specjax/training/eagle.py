"""The EAGLE head kind (`EagleHeads`): what training an EAGLE head on a frozen target means
(its spec, the target layers it reads, init, loss, guesses), for the head trainer of
`heads.py`. The head itself (`EagleHead`, its unrolled training-time test, `head_logits`)
and its drafter live in `specjax.drafters.eagle`; this module is only imported to train or
load a head.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.drafters.eagle import (STRUCTURES, EagleHead, check_layers, default_layers, embed,
                                    head_from_params, head_logits)
from specjax.models.transformer import ModelConfig

Array = jax.Array


def check_unroll(steps, decay, layers) -> tuple[int, ...] | None:
  """The training-time test's fields both EAGLE head kinds share: `steps` unrolled drafting
  steps (int >= 1), loss weight `decay` per step in (0, 1], and the target `layers` the head
  reads (None, or a non-empty sequence of indices >= 0, returned as a tuple of ints)."""
  if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
    raise ValueError(f"steps must be an int >= 1 (unrolled drafting steps), got {steps!r}")
  if not (isinstance(decay, (int, float)) and 0.0 < decay <= 1.0):
    raise ValueError(f"decay must be in (0, 1], got {decay!r}")
  if layers is None:
    return None
  if not isinstance(layers, (tuple, list)) or not layers or not all(
      isinstance(i, (int, np.integer)) and not isinstance(i, bool) and i >= -1 for i in layers):
    raise ValueError(f"layers must be a non-empty sequence of layer indices >= -1 (-1: the "
                     f"embedding output), got {layers!r}")
  return tuple(int(i) for i in layers)


@dataclasses.dataclass(frozen=True)
class EagleHeads:
  """The EAGLE head kind for `specjax.training.heads`: one head, trained with
  training-time test over `steps` unrolled drafting steps.

  loss = Σ_j decay^j · mean_t KL(p_target(· | x_≤t+1) ‖ q^j_t),  j = 0 .. steps-1,

  q^j_t the head's law at position t on drafting step j + 1 (`EagleHead.unroll`: step 1
  reads the target's fused features, step j + 1 the head's own h of step j one position
  earlier, attending as it will at run time), p_target the target's softmax for the same
  token t + 2 (the frozen pass's logits at t + 1). Tokens are the text's (teacher forcing);
  only the features are the head's own. KL to the target, like the Medusa kind, because
  verification compares with the target. layers: the captured target layers (None: a low,
  a middle and a high one, `default_layers`). width: the head's decoder-layer width (None:
  the target's d_model; else a multiple of its head_dim, `head_config`). structure: the
  head's (`drafters.eagle.STRUCTURES`; "eagle", the published EAGLE-1/2 head, reads the
  final norm's output alone, with a bias on its fc when `bias`: what imported heads are,
  `checkpoints.published.eagle`).
  """

  steps: int = 3
  decay: float = 0.8
  layers: tuple[int, ...] | None = None
  width: int | None = None
  structure: str = "specjax"
  bias: bool = False
  name = "eagle"

  def __post_init__(self):
    object.__setattr__(self, "layers", check_unroll(self.steps, self.decay, self.layers))
    if self.structure not in STRUCTURES:
      raise ValueError(f"structure must be one of {STRUCTURES}, got {self.structure!r}")
    if self.width is not None and (isinstance(self.width, bool)
                                   or not isinstance(self.width, int) or self.width < 1):
      raise ValueError(f"width must be None (the target's d_model) or an int >= 1, got "
                       f"{self.width!r}")

  @property
  def positions(self) -> int:
    return self.steps

  def spec(self) -> dict:
    spec = {"steps": self.steps, "decay": float(self.decay),
            "layers": None if self.layers is None else list(self.layers)}
    if self.width is not None:  # absent = full width (heads saved before widths existed)
      spec["width"] = self.width
    if self.structure != "specjax":  # absent = today's structure
      spec["structure"], spec["bias"] = self.structure, bool(self.bias)
    return spec

  @classmethod
  def from_spec(cls, spec: dict) -> "EagleHeads":
    layers, width = spec.get("layers"), spec.get("width")
    return cls(steps=int(spec["steps"]), decay=float(spec["decay"]),
               layers=None if layers is None else tuple(int(i) for i in layers),
               width=None if width is None else int(width),
               structure=str(spec.get("structure", "specjax")), bias=bool(spec.get("bias")))

  def feature_layers(self, target: ModelConfig) -> tuple[int, ...]:
    if self.layers is None and self.structure == "eagle":  # the final norm's output
      return (target.n_layers,)
    return check_layers(target, default_layers(target.n_layers) if self.layers is None
                        else self.layers)

  def init(self, target: ModelConfig, key: Array):
    layers = self.feature_layers(target)
    head = EagleHead(target.replace(dtype="float32"), len(layers), width=self.width,
                     structure=self.structure, bias=self.bias, rngs=nnx.Rngs(key))
    return nnx.state(head, nnx.Param)

  def _step_logits(self, params, tp) -> list[Array]:
    """Logits [B, T-1, V] of every unrolled step at positions t = 0..T-2."""
    target = tp.lm.module()
    head = head_from_params(tp.lm.config, params)
    t = tp.tokens.shape[1]
    pos = jnp.broadcast_to(jnp.arange(t - 1, dtype=jnp.int32), tp.tokens[:, 1:].shape)
    hs = head.unroll(tp.features[:, :-1], embed(target, tp.tokens[:, 1:]), pos, self.steps)
    return [head_logits(head, target, h) for h in hs]

  def loss(self, params, tp) -> tuple[Array, dict]:
    """Σ_j decay^j · KL (class doc), step j averaged over its valid positions t >= j;
    metrics: per-step KL and top-1 agreement with the target's argmax."""
    p = tp.logits[:, 1:]
    logp = jax.nn.log_softmax(p, -1)
    kls, agree = [], []
    for j, q in enumerate(self._step_logits(params, tp)):
      logq = jax.nn.log_softmax(q[:, j:], -1)
      lp = logp[:, j:]
      kls.append(tp.mean(jnp.sum(jnp.exp(lp) * (lp - logq), -1), 1 + j))
      agree.append(tp.mean(jnp.argmax(q[:, j:], -1) == jnp.argmax(p[:, j:], -1), 1 + j))
    kl = jnp.stack(kls)
    weights = jnp.asarray([self.decay ** j for j in range(self.steps)], jnp.float32)
    return jnp.sum(weights * kl) / jnp.sum(weights), {"kl": kl, "agree": jnp.stack(agree)}

  def guesses(self, params, tp, ranks: int) -> Array:
    """int32 [B, T, J, R]: for the chain rooted at token t + 1, step j + 1's top-R guesses
    for token t + 2 + j (computed at position t + j; rows past the window are padding)."""
    b, t = tp.tokens.shape
    out = []
    for j, q in enumerate(self._step_logits(params, tp)):
      top = jax.lax.top_k(q[:, j:], ranks)[1].astype(jnp.int32)  # [B, T-1-j, R]
      out.append(jnp.concatenate([top, jnp.zeros((b, j + 1, ranks), jnp.int32)], axis=1))
    return jnp.stack(out, axis=2)
