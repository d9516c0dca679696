"""Cheap quality figures for trained pairs: validation bits/byte and greedy (T=0) acceptance.

Two greedy acceptance estimates that need no speculative engine:

1. Teacher-forced agreement on real text: at every position of validation windows, does the
   draft's argmax equal the target's argmax given the same (true) prefix?
       alpha_tf = #agree / #positions.
2. Greedy chain simulation: at T=0 speculative decoding emits exactly the target's greedy
   continuation g, and drafted token i is accepted iff argmax q(. | g_<i) = g_i while all
   earlier drafts of the cycle were accepted. So one teacher-forced draft pass over g gives the
   agreement vector a_i, and walking it in cycles of k (accept the leading run of ones, emit
   one target token more, restart after it) reproduces the engine's counts:
       alpha                  = accepted drafted tokens / drafted tokens  (k drafted per cycle;
                                the name as in docs/conventions.md)
       alpha_trial            = accepted / (accepted + rejections): the per-token acceptance
                                probability of the i.i.d. model E[tau] = (1-a^(k+1))/(1-a)
       tau                    = tokens emitted per verification, bonus included.
Intervals: Wilson (treats tokens as independent: too narrow, acceptance is bursty) and a
percentile bootstrap over rows (windows or prompts), which respects the autocorrelation within a
row.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models.transformer import ModelConfig
from specjax.training import losses
from specjax.training.trainer import f32_graphdef


def wilson_interval(successes: float, n: float, confidence: float = 0.95) -> tuple[float, float]:
  """Wilson score interval for a binomial proportion."""
  if n <= 0:
    return (0.0, 1.0)
  from scipy.stats import norm
  z = float(norm.ppf(0.5 + confidence / 2))
  p = successes / n
  denom = 1 + z * z / n
  centre = (p + z * z / (2 * n)) / denom
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
  return (max(0.0, centre - half), min(1.0, centre + half))


def bootstrap_ratio(num_R: np.ndarray, den_R: np.ndarray, *, draws: int = 2000, seed: int = 0,
                    confidence: float = 0.95) -> tuple[float, float]:
  """Percentile bootstrap over rows of sum(num) / sum(den)."""
  rng = np.random.default_rng(seed)
  idx = rng.integers(0, len(num_R), size=(draws, len(num_R)))
  ratios = num_R[idx].sum(1) / np.maximum(den_R[idx].sum(1), 1e-12)
  lo, hi = np.quantile(ratios, [(1 - confidence) / 2, (1 + confidence) / 2])
  return (float(lo), float(hi))


@dataclasses.dataclass(frozen=True)
class Estimate:
  value: float
  n: int
  wilson: tuple[float, float]
  bootstrap: tuple[float, float]

  def __str__(self) -> str:
    return (f"{self.value:.3f} (n={self.n}; Wilson 95% [{self.wilson[0]:.3f}, "
            f"{self.wilson[1]:.3f}], row bootstrap 95% [{self.bootstrap[0]:.3f}, "
            f"{self.bootstrap[1]:.3f}])")

  def to_dict(self) -> dict:
    return {"value": self.value, "n": self.n, "wilson": list(self.wilson),
            "bootstrap": list(self.bootstrap)}


def _estimate(num_R: np.ndarray, den_R: np.ndarray) -> Estimate:
  num, den = float(num_R.sum()), float(den_R.sum())
  return Estimate(num / max(den, 1.0), int(den), wilson_interval(num, den),
                  bootstrap_ratio(num_R.astype(np.float64), den_R.astype(np.float64)))


@partial(jax.jit, static_argnums=(0,))
def _argmax_tokens(config: ModelConfig, params, tokens_NT):
  graphdef = f32_graphdef(config)
  return jnp.argmax(losses.forward_logits(graphdef, params, tokens_NT), axis=-1)


def _batched_argmax(config, params, tokens_NT: np.ndarray, batch: int) -> np.ndarray:
  out = []
  for i in range(0, len(tokens_NT), batch):
    chunk = tokens_NT[i:i + batch]
    pad = batch - len(chunk)
    if pad:
      chunk = np.concatenate([chunk, np.repeat(chunk[:1], pad, axis=0)])
    out.append(np.asarray(_argmax_tokens(config, params, jnp.asarray(chunk)))[:batch - pad])
  return np.concatenate(out)


def teacher_forced_agreement(target: tuple[ModelConfig, nnx.State],
                             draft: tuple[ModelConfig, nnx.State], windows_NT: np.ndarray,
                             batch: int = 16) -> Estimate:
  """alpha_tf: fraction of positions where draft and target argmax agree on real text."""
  t_NT = _batched_argmax(*target, windows_NT, batch)
  d_NT = _batched_argmax(*draft, windows_NT, batch)
  agree_NT = (t_NT == d_NT)
  return _estimate(agree_NT.sum(1), np.full((len(agree_NT),), agree_NT.shape[1]))


@partial(jax.jit, static_argnums=(0, 3))
def _greedy_continue(config: ModelConfig, params, buf_NL, prompt_len: int):
  """Fill buf[:, prompt_len:] with the target's greedy tokens (full recompute per step)."""
  graphdef = f32_graphdef(config)

  def body(i, buf):
    logits = losses.forward_logits(graphdef, params, buf)
    nxt = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, i - 1, axis=1, keepdims=False), -1)
    return jax.lax.dynamic_update_index_in_dim(buf, nxt.astype(buf.dtype), i, axis=1)

  return jax.lax.fori_loop(prompt_len, buf_NL.shape[1], body, buf_NL)


def greedy_continuations(target: tuple[ModelConfig, nnx.State], prompts_NP: np.ndarray,
                         new_tokens: int, batch: int = 16) -> np.ndarray:
  """[N, P + new_tokens] prompts followed by the target's greedy continuation."""
  n, p = prompts_NP.shape
  if p + new_tokens > target[0].max_len:
    raise ValueError(f"prompt length {p} + new_tokens {new_tokens} exceeds max_len "
                     f"{target[0].max_len}")
  out = []
  for i in range(0, n, batch):
    chunk = prompts_NP[i:i + batch]
    pad = batch - len(chunk)
    if pad:
      chunk = np.concatenate([chunk, np.repeat(chunk[:1], pad, axis=0)])
    buf = np.concatenate([chunk, np.zeros((batch, new_tokens), chunk.dtype)], axis=1)
    out.append(np.asarray(_greedy_continue(target[0], target[1], jnp.asarray(buf), p))
               [:batch - pad])
  return np.concatenate(out)


def chain_counts(agree_N: np.ndarray, k: int) -> tuple[int, int, int, int]:
  """Walk one row's agreement vector in T=0 chain cycles of k drafts.

  Returns (cycles, drafted, accepted, tested) over the complete cycles that fit: a cycle at j
  accepts the leading run of ones in agree[j:j+k], emits it plus one target token, and the next
  cycle starts after that token. tested = accepted + rejections.
  """
  cycles = drafted = accepted = tested = 0
  j, n = 0, len(agree_N)
  while j + k <= n:
    run = 0
    while run < k and agree_N[j + run]:
      run += 1
    cycles, drafted, accepted = cycles + 1, drafted + k, accepted + run
    tested += run + (run < k)
    j += run + 1
  return cycles, drafted, accepted, tested


def greedy_chain(target: tuple[ModelConfig, nnx.State], draft: tuple[ModelConfig, nnx.State],
                 prompts_NP: np.ndarray, *, new_tokens: int, k: int = 4,
                 batch: int = 16) -> dict:
  """T=0 chain speculation simulated on the target's greedy continuations of the prompts.

  Returns {"alpha", "alpha_trial", "tau"}: Estimates, plus counts.
  """
  if k < 1:
    raise ValueError(f"k must be >= 1, got {k}")
  p = prompts_NP.shape[1]
  seq_NL = greedy_continuations(target, prompts_NP, new_tokens, batch)
  d_NL = _batched_argmax(*draft, seq_NL[:, :-1], batch)       # predicts seq[:, 1:]
  agree_NG = d_NL[:, p - 1:] == seq_NL[:, p:]                 # [N, new_tokens]
  rows = np.asarray([chain_counts(row, k) for row in agree_NG], np.float64)
  cycles, drafted, accepted, tested = rows.T
  return {"alpha": _estimate(accepted, drafted), "alpha_trial": _estimate(accepted, tested),
          "tau": float((accepted.sum() + cycles.sum()) / max(cycles.sum(), 1)),
          "cycles": int(cycles.sum()), "drafted": int(drafted.sum()),
          "accepted": int(accepted.sum()), "k": k, "prompts": int(len(prompts_NP)),
          "new_tokens": new_tokens, "agreement_rate": float(agree_NG.mean())}
