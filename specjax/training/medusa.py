"""The Medusa head kind (`MedusaHeads`): what training Medusa-1 heads on a frozen target means
(spec, init, loss, guesses), for the head trainer of `heads.py`. The head math
(`head_states`, `head_logits`) and the drafter live in `specjax.drafters.medusa`.

Training (`MedusaHeads.loss`, run by `specjax.training.heads`): for every position t of a
text window, head j is fitted to the target's own distribution for token t + 2 + j,

    loss = Σ_j w_j · mean_t KL(p_target(· | x_≤t+1+j) ‖ softmax(logits_j(h_t))),
    w_j = decay^j (Medusa's λ_j = 0.8^j by default).

KL to the target rather than cross-entropy to the text: verification compares candidates
with the target, not with the corpus, so the target's law is the label that matters; it
carries the whole distribution per position (lower-variance gradients than one sampled
token) and comes from the same frozen forward that produces h, at no extra cost. Its
minimiser is the same in expectation as cross-entropy on text the target itself generated.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.drafters.medusa import head_logits
from specjax.models.transformer import ModelConfig

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class MedusaHeads:
  """The Medusa head kind for `specjax.training.heads` (module doc): K heads, loss weights
  decay^j. blocks (R) and own_lm describe the published Medusa-1 structure
  (`drafters.medusa`): R residual blocks per head, each head's own LM projection (own_lm
  starts at zeros here: imported heads carry theirs); the defaults are our heads."""

  heads: int = 4
  decay: float = 0.8
  blocks: int = 1
  own_lm: bool = False
  name = "medusa"

  def __post_init__(self):
    if not isinstance(self.heads, int) or isinstance(self.heads, bool) or self.heads < 1:
      raise ValueError(f"heads must be an int >= 1, got {self.heads!r}")
    if not (isinstance(self.decay, (int, float)) and 0.0 < self.decay <= 1.0):
      raise ValueError(f"decay must be in (0, 1], got {self.decay!r}")
    if not isinstance(self.blocks, int) or isinstance(self.blocks, bool) or self.blocks < 1:
      raise ValueError(f"blocks must be an int >= 1 (residual blocks per head), got "
                       f"{self.blocks!r}")

  @property
  def positions(self) -> int:
    return self.heads

  def spec(self) -> dict:
    spec = {"heads": self.heads, "decay": float(self.decay)}
    if self.blocks != 1 or self.own_lm:  # absent: our structure
      spec.update(blocks=self.blocks, own_lm=bool(self.own_lm))
    return spec

  @classmethod
  def from_spec(cls, spec: dict) -> "MedusaHeads":
    return cls(heads=int(spec["heads"]), decay=float(spec["decay"]),
               blocks=int(spec.get("blocks", 1)), own_lm=bool(spec.get("own_lm", False)))

  def feature_layers(self, target: ModelConfig) -> tuple[int, ...]:
    return (target.n_layers,)

  def init(self, target: ModelConfig, key: Array) -> dict:
    """W_j = 0, b_j = 0: every head starts as the target's LM head."""
    del key
    d = target.d_model
    if self.blocks == 1 and not self.own_lm:
      return {"w": jnp.zeros((self.heads, d, d), jnp.float32),
              "b": jnp.zeros((self.heads, d), jnp.float32)}
    params = {"w": jnp.zeros((self.heads, self.blocks, d, d), jnp.float32),
              "b": jnp.zeros((self.heads, self.blocks, d), jnp.float32)}
    if self.own_lm:
      params["lm"] = jnp.zeros((self.heads, d, target.vocab_size), jnp.float32)
    return params

  def loss(self, params: dict, tp) -> tuple[Array, dict]:
    """Σ_j decay^j · KL(target at t+1+j ‖ head j at t), averaged over positions; metrics:
    per-head KL and teacher-forced top-1 agreement with the target's argmax."""
    logits_BTKV = head_logits(params, tp.lm, tp.features[:, :, 0])
    t = tp.tokens.shape[1]
    kls, agree = [], []
    for j in range(self.heads):
      q = logits_BTKV[:, :t - 1 - j, j]
      p = tp.logits[:, 1 + j:]
      logp, logq = jax.nn.log_softmax(p, -1), jax.nn.log_softmax(q, -1)
      kls.append(tp.mean(jnp.sum(jnp.exp(logp) * (logp - logq), -1), 1 + j))
      agree.append(tp.mean(jnp.argmax(q, -1) == jnp.argmax(p, -1), 1 + j))
    kl = jnp.stack(kls)
    weights = jnp.asarray([self.decay ** j for j in range(self.heads)], jnp.float32)
    return jnp.sum(weights * kl), {"kl": kl, "agree": jnp.stack(agree)}

  def guesses(self, params: dict, tp, ranks: int) -> Array:
    """int32 [B, T, K, R]: head j's top-R tokens at t, guesses for token t + 2 + j."""
    logits_BTKV = head_logits(params, tp.lm, tp.features[:, :, 0])
    return jax.lax.top_k(logits_BTKV, ranks)[1].astype(jnp.int32)
