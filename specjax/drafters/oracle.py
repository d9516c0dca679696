"""The controlled-α drafter: acceptance rate set by a dial, on a real target.

At every drafted node it computes the target's own warped law p there (by running the
target itself as the draft model, with its own cache, exactly like `ModelDrafter`) and
samples the node's children from

    q = λ·p + (1 − λ)·δ_y,    y = argmin_x p(x),    λ = clip((α − p(y)) / (1 − p(y)), 0, 1).

Why this gives acceptance α exactly: the stochastic rule accepts a draft x ~ q with
probability min(1, p(x)/q(x)), so P(accept) = Σ_x min(p(x), q(x)). For x ≠ y,
q(x) = λ·p(x) ≤ p(x), contributing λ·(1 − p(y)); at y, q(y) = λ·p(y) + 1 − λ ≥ p(y),
contributing p(y). The total is p(y) + λ·(1 − p(y)) = α whenever α ≥ p(y). The point mass
sits on the least likely token, so p(y) is 0 under top-k / top-p / greedy and tiny under a
full softmax: every α in [p(y), 1] is reachable, and `achieved_alpha` reports max(α, p(y))
where it is not. At T = 0 p is one-hot: q puts α on the target's argmax, so a draft is
accepted with probability α and the output stays the greedy one.

Since the rule sees the same q it sampled from, the emitted tokens are exactly distributed
as the target's (speculative decoding is exact for any q); every accept/reject is an
independent Bernoulli(α) trial given the past, so the accepted run length of a chain has
E[τ] = (1 − α^{k+1}) / (1 − α) exactly: α is swept on a real target without training
drafts of graded quality.

α is a runtime value (a float32 leaf, a scalar or one per batch row), so sweeping it does
not recompile, and one batch can hold several α values. Cost: drafting runs the target, so
wall time says nothing about a real draft; experiments model the draft cost by c or time
a real draft model of a chosen size alongside (experiments/alpha_k_sweep.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.verify import sampling
from specjax.models.lm import LM
from specjax.drafters.model import ModelDrafter

Array = jax.Array


def _alpha_like(alpha: Array, p: Array) -> Array:
  """α (scalar or [B]) broadcast against p[..., 0] (p is [B, V] or [B, R, V])."""
  alpha = jnp.asarray(alpha, jnp.float32)
  return alpha.reshape(alpha.shape + (1,) * (p.ndim - 1 - alpha.ndim))


def controlled_law(p: Array, alpha) -> Array:
  """q = λ p + (1 − λ) δ_argmin p with Σ min(p, q) = max(α, min p) (module doc)."""
  p = p.astype(jnp.float32)
  a = _alpha_like(alpha, p)
  p_min = jnp.min(p, axis=-1)
  y = jnp.argmin(p, axis=-1)
  lam = jnp.clip((a - p_min) / jnp.maximum(1.0 - p_min, 1e-12), 0.0, 1.0)
  point = jax.nn.one_hot(y, p.shape[-1], dtype=jnp.float32)
  return lam[..., None] * p + (1.0 - lam)[..., None] * point


def achieved_alpha(p: Array, alpha) -> Array:
  """Σ_x min(p, q) for q = controlled_law(p, α): max(α, min p), per row of p."""
  return jnp.maximum(jnp.broadcast_to(_alpha_like(alpha, p), p.shape[:-1]),
                     jnp.min(p.astype(jnp.float32), axis=-1))


def check_alpha(alpha) -> np.ndarray:
  a = np.asarray(alpha)
  if a.dtype == object or not (np.issubdtype(a.dtype, np.floating) or
                               np.issubdtype(a.dtype, np.integer)) or a.dtype == bool:
    raise ValueError(f"alpha must be a number or a 1-D array of numbers in [0, 1], got "
                     f"{alpha!r}")
  if a.ndim > 1:
    raise ValueError(f"alpha must be a scalar or one value per batch row [B], got shape "
                     f"{a.shape}")
  if not np.all(np.isfinite(a)) or np.any(a < 0) or np.any(a > 1):
    raise ValueError(f"alpha must lie in [0, 1], got {alpha!r}")
  return a.astype(np.float32)


@struct.dataclass
class OracleDrafter(ModelDrafter):
  """Drafts from the target's own law mixed with a point mass so that acceptance is α.

  `alpha`: float32 scalar or [B] (one per batch row), a runtime leaf. Stochastic drafting
  only (chains and static trees; sibling candidates are i.i.d. samples of q, each accepted
  with probability α against the residual as usual).
  """

  alpha: Array | None = None

  @classmethod
  def of(cls, target, alpha=1.0) -> "OracleDrafter":  # noqa: D102 (signature differs)
    return cls(lm=LM.of(target), deterministic=False, alpha=jnp.asarray(check_alpha(alpha)))

  def with_alpha(self, alpha) -> "OracleDrafter":
    """The same drafter with another α (no recompile: α is a leaf)."""
    return self.replace(alpha=jnp.asarray(check_alpha(alpha)))

  def draft_law(self, logits: Array, sampler) -> Array:
    return controlled_law(sampling.warp(logits, sampler), self.alpha)

  def validate(self, tree, batch: int) -> None:
    """Sampled candidates only, and α a scalar or one value per batch row."""
    if tree.deterministic_candidates:
      raise ValueError("the controlled-α drafter samples its candidates; dynamic trees use "
                       "deterministic top-k candidates: use a chain or a static TreeSpec")
    if self.alpha.ndim == 1 and self.alpha.shape[0] != batch:
      raise ValueError(f"alpha has {self.alpha.shape[0]} values for a batch of "
                       f"{batch} rows: pass a scalar or one per row")
