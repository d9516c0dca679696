"""The EAGLE-3 head kind (`Eagle3Heads`): a head of the published EAGLE-3 structure
(`specjax.drafters.eagle3.Eagle3Head`: three-layer fusion, [normed embedding; normed hidden]
attention input, its own LM head over a reduced draft vocabulary) for the head trainer of
`heads.py`, and the kind an imported EAGLE-3 checkpoint is stored as
(`specjax.training.published.eagle3`).

Its spec holds what rebuilding the head needs besides the target: the captured layers, the
decoder-layer fields that differ from the target's (`eagle3.HEAD_FIELDS`) and the draft
vocabulary (`draft_ids`, target ids; None: the whole vocabulary), plus the training-time test's
steps and decay.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.drafters.eagle import check_layers, embed, frequent_vocab
from specjax.drafters.eagle3 import (HEAD_FIELDS, Eagle3Head, build_head, check_draft_ids,
                                     eagle3_layers)
from specjax.models.transformer import ModelConfig
from specjax.training.eagle import check_unroll
from specjax.drafters.eagle import lm_head_DV

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Eagle3Heads:
  """The EAGLE-3 head kind: one `Eagle3Head`, trained with the training-time test over
  `steps` unrolled drafting steps.

  loss = Σ_j decay^j · mean_t KL(p̃_target(· | x_≤t+1) ‖ q^j_t),  j = 0 .. steps-1,

  as `EagleHeads` but over the draft vocabulary: p̃ is the target's softmax restricted to
  draft_ids and renormalised (the head can put mass nowhere else; EAGLE-3 trains the same
  way), q^j the head's law over draft_ids. layers: captured target layers (None: the
  format's three, `eagle3_layers`); head: decoder-layer fields overriding the target's
  (a tuple of (name, value) pairs; None: the target's); draft_ids: the target id of each
  draft id (None: the whole vocabulary; `drafters.eagle.frequent_vocab` picks the frequent
  ones).
  """

  steps: int = 3
  decay: float = 0.8
  layers: tuple[int, ...] | None = None
  head: tuple[tuple[str, object], ...] | None = None
  draft_ids: tuple[int, ...] | None = None
  name = "eagle3"

  def __post_init__(self):
    object.__setattr__(self, "layers", check_unroll(self.steps, self.decay, self.layers))
    if self.head is not None:
      head = dict(self.head)
      unknown = sorted(set(head) - set(HEAD_FIELDS))
      if unknown:
        raise ValueError(f"head fields must be among {HEAD_FIELDS}, got {unknown}")
      object.__setattr__(self, "head", tuple(sorted(head.items())))
    if self.draft_ids is not None:
      ids = np.asarray(self.draft_ids)
      check_draft_ids(ids, int(ids.max()) + 1 if ids.size else 1)
      object.__setattr__(self, "draft_ids", tuple(int(i) for i in ids))

  @property
  def positions(self) -> int:
    return self.steps

  def spec(self) -> dict:
    return {"steps": self.steps, "decay": float(self.decay),
            "layers": None if self.layers is None else list(self.layers),
            "head": None if self.head is None else dict(self.head),
            "draft_ids": None if self.draft_ids is None else list(self.draft_ids)}

  @classmethod
  def from_spec(cls, spec: dict) -> "Eagle3Heads":
    layers, head, ids = spec.get("layers"), spec.get("head"), spec.get("draft_ids")
    return cls(steps=int(spec["steps"]), decay=float(spec["decay"]),
               layers=None if layers is None else tuple(int(i) for i in layers),
               head=None if head is None else tuple(sorted(head.items())),
               draft_ids=None if ids is None else tuple(int(i) for i in ids))

  def feature_layers(self, target: ModelConfig) -> tuple[int, ...]:
    return check_layers(target, eagle3_layers(target.n_layers) if self.layers is None
                        else self.layers)

  def with_frequent_vocab(self, tokens, size: int, vocab_size: int) -> "Eagle3Heads":
    """This kind with the draft vocabulary of the `size` most frequent ids of `tokens`
    (`drafters.eagle.frequent_vocab`, FR-Spec's choice and EAGLE-3's)."""
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= vocab_size:
      raise ValueError(f"draft vocabulary size must be an int in [1, {vocab_size}], got "
                       f"{size!r}")
    ids = frequent_vocab(tokens, size)
    return dataclasses.replace(self, draft_ids=tuple(int(i) for i in ids))

  def ids(self, target: ModelConfig) -> np.ndarray:
    """The draft vocabulary as target ids (checked against the target's vocabulary)."""
    if self.draft_ids is None:
      return np.arange(target.vocab_size, dtype=np.int32)
    return check_draft_ids(np.asarray(self.draft_ids), target.vocab_size)

  def module(self, target: ModelConfig, params=None, seed: int = 0) -> Eagle3Head:
    """The head for `target` holding `params` (None: random weights of `seed`)."""
    return build_head(target.replace(dtype="float32"), len(self.feature_layers(target)),
                      self.ids(target), None if self.head is None else dict(self.head),
                      params=params, seed=seed)

  def init(self, target: ModelConfig, key: Array):
    layers = self.feature_layers(target)
    head = Eagle3Head(target.replace(dtype="float32"), len(layers), self.ids(target),
                      head=None if self.head is None else dict(self.head), rngs=nnx.Rngs(key))
    return nnx.state(head, nnx.Param)

  def init_from_target(self, params, target):
    """The head's lm_head starts as the target's LM head at the draft ids (today's heads
    share the target's trained LM head; a random one learns far slower on a short budget),
    its norm as ones; `target` is the frozen target `LM`. Called once by the trainer."""
    w_DV = lm_head_DV(target.module()).astype(jnp.float32)
    params["lm_head"]["kernel"] = nnx.Param(jnp.take(w_DV, jnp.asarray(self.ids(target.config)),
                                                     axis=1))
    return params

  def _step_logits(self, params, tp) -> list[Array]:
    """Draft-vocabulary logits [B, T-1, Vd] of every unrolled step at t = 0..T-2."""
    target = tp.lm.module()
    head = self.module(tp.lm.config, params)
    t = tp.tokens.shape[1]
    pos = jnp.broadcast_to(jnp.arange(t - 1, dtype=jnp.int32), tp.tokens[:, 1:].shape)
    hs = head.unroll(tp.features[:, :-1], embed(target, tp.tokens[:, 1:]), pos, self.steps)
    return [head.lm_head(head.norm(h)) for h in hs]

  def loss(self, params, tp) -> tuple[Array, dict]:
    """Σ_j decay^j · KL over the draft vocabulary (class doc), step j averaged over its valid
    positions t >= j; metrics: per-step KL and top-1 agreement with the target's argmax
    (over the whole vocabulary: a target token outside the draft vocabulary is a miss)."""
    ids = jnp.asarray(self.ids(tp.lm.config))
    p = tp.logits[:, 1:]
    logp = jax.nn.log_softmax(jnp.take(p, ids, axis=-1), -1)
    best = jnp.argmax(p, -1)
    kls, agree = [], []
    for j, q in enumerate(self._step_logits(params, tp)):
      logq = jax.nn.log_softmax(q[:, j:], -1)
      lp = logp[:, j:]
      kls.append(tp.mean(jnp.sum(jnp.exp(lp) * (lp - logq), -1), 1 + j))
      agree.append(tp.mean(ids[jnp.argmax(q[:, j:], -1)] == best[:, j:], 1 + j))
    kl = jnp.stack(kls)
    weights = jnp.asarray([self.decay ** j for j in range(self.steps)], jnp.float32)
    return jnp.sum(weights * kl) / jnp.sum(weights), {"kl": kl, "agree": jnp.stack(agree)}

  def guesses(self, params, tp, ranks: int) -> Array:
    """int32 [B, T, J, R] target ids: step j + 1's top-R guesses for token t + 2 + j
    (computed at position t + j; rows past the window are padding), as `EagleHeads`."""
    ids = jnp.asarray(self.ids(tp.lm.config))
    b, t = tp.tokens.shape
    out = []
    for j, q in enumerate(self._step_logits(params, tp)):
      top = ids[jax.lax.top_k(q[:, j:], ranks)[1]]  # [B, T-1-j, R]
      out.append(jnp.concatenate([top, jnp.zeros((b, j + 1, ranks), jnp.int32)], axis=1))
    return jnp.stack(out, axis=2)
