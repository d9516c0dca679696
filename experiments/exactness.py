"""The statistical exactness check of the acceptance rule at large sample sizes.

One point = a vocabulary size, a draft kind (stochastic q or deterministic point masses),
a temperature and a top-p. Random target and draft logits (seeded by the vocabulary) are
warped, `samples` independent drafts are verified with `acceptance.accept_chain`, and the
emitted first tokens are compared with the warped target by a χ² goodness-of-fit test
(zero-probability cells must stay empty; sparse cells pooled). Reported: the p-value,
whether it passes at the stated false-alarm rate, and the power of the same test against
the planted bug "residual = p" (noncentral χ²), so a pass means something.

Temperature and top-p are runtime values: the points of one (vocab, kind, samples) group
run as one vectorised program spread over all local devices (`specjax.sweeps.parallel`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from experiments import measure
from specjax import acceptance, sampling
from specjax.sweeps import parallel, runner

KINDS = ("stochastic", "deterministic")


def validate(params: dict) -> None:
  measure.check_int(params, "vocab", None, 2, 4096)
  measure.check_choice(params, "kind", "stochastic", KINDS)
  measure.check_int(params, "samples", 100_000, 100)
  measure.check_number(params, "temperature", 1.0, 0)
  measure.check_number(params, "top_p", 1.0, 0, 1, lo_open=True)
  measure.check_number(params, "false_alarm", 1e-3, 0, 1, lo_open=True, hi_open=True)


def memory(params: dict) -> int:
  return 4 * params.get("samples", 100_000) * params["vocab"] * 4  # p (2 rows) + q + noise


def _logits(vocab: int):
  """Target logits and correlated draft logits (a draft is an imperfect copy of the target)."""
  rng = np.random.default_rng(vocab)
  target = rng.normal(size=vocab) * 2.0
  return target.astype(np.float32), (target + rng.normal(size=vocab)).astype(np.float32)


def _emitted_counts(logits_p, logits_q, temperature, top_p, key, *, samples: int, kind: str):
  """Counts of the first emitted token over `samples` verified drafts, and the warped p."""
  sampler = sampling.SamplerParams(temperature=temperature, top_k=jnp.asarray(0, jnp.int32),
                                   top_p=top_p)
  p_V, q_V = sampling.warp(logits_p, sampler), sampling.warp(logits_q, sampler)
  draft_key, accept_key = jax.random.split(key)
  v = p_V.shape[-1]
  drafts = sampling.sample(draft_key, jnp.broadcast_to(q_V, (samples, v)))
  p_BKV1 = jnp.broadcast_to(p_V, (samples, 2, v))
  q_BKV = None if kind == "deterministic" else jnp.broadcast_to(q_V, (samples, 1, v))
  result = acceptance.accept_chain(accept_key, drafts[:, None], p_BKV1, q_BKV)
  first = jnp.where(result.n_accepted > 0, drafts, result.next_token)
  return jnp.bincount(first, length=v), p_V, q_V


@functools.lru_cache(maxsize=None)
def _row_fn(samples: int, kind: str):
  return functools.partial(_emitted_counts, samples=samples, kind=kind)


def _chi2(counts: np.ndarray, p: np.ndarray):
  """(p-value, dof, kept mask); zero-probability cells must be empty (else p-value 0)."""
  n = counts.sum()
  if counts[p == 0].sum() > 0:
    return 0.0, 0, p > 0
  c, e = counts[p > 0].astype(float), n * p[p > 0]
  if len(c) == 1:  # a point mass (e.g. greedy): exact iff every sample hit it, checked above
    return 1.0, 0, p > 0
  small = e < 5
  if small.any():
    c, e = np.append(c[~small], c[small].sum()), np.append(e[~small], e[small].sum())
  e = e * c.sum() / e.sum()
  return float(stats.chisquare(c, e).pvalue), len(c) - 1, p > 0


def _power_vs_residual_p_bug(p, q, kind, n, dof, false_alarm):
  """Power of the χ² test against the planted bug 'residual = p' at this sample size."""
  if kind == "deterministic":  # x ~ q, accepted with p(x), else resample p (x not removed)
    bug = q * p + p * (1.0 - np.sum(q * p))
  else:
    m = np.minimum(p, q)
    bug = m + (1.0 - m.sum()) * p
  support = p > 0
  nc = n * np.sum((bug[support] - p[support]) ** 2 / p[support])
  if dof < 1:
    return 1.0
  crit = stats.chi2.ppf(1.0 - false_alarm, dof)
  return float(stats.ncx2.sf(crit, dof, nc)) if nc > 0 else false_alarm


def group(params_list: list[dict]) -> list[dict]:
  first = params_list[0]
  vocab, kind = first["vocab"], first.get("kind", "stochastic")
  samples = first.get("samples", 100_000)
  lp, lq = _logits(vocab)
  n = len(params_list)
  temps = jnp.asarray([p.get("temperature", 1.0) for p in params_list], jnp.float32)
  top_ps = jnp.asarray([p.get("top_p", 1.0) for p in params_list], jnp.float32)
  # each point's key from its own complete parameters: the same samples alone or in a group
  keys = parallel.point_keys([runner.point_seed(runner.with_defaults(point, p), "samples")
                              for p in params_list])
  counts, p_V, q_V = parallel.device_map(
      _row_fn(samples, kind), jnp.broadcast_to(lp, (n, vocab)), jnp.broadcast_to(lq, (n, vocab)),
      temps, top_ps, keys)
  out = []
  for i, params in enumerate(params_list):
    fa = params.get("false_alarm", 1e-3)
    c, p, q = np.asarray(counts[i]), np.asarray(p_V[i], np.float64), np.asarray(q_V[i], np.float64)
    pvalue, dof, _ = _chi2(c, p)
    power = _power_vs_residual_p_bug(p, q, kind, samples, dof, fa)
    out.append({"counts": c.tolist(), "p_value": pvalue, "passed": pvalue > fa, "dof": dof,
                "samples": samples, "false_alarm": fa, "power_vs_residual_p_bug": power,
                "acceptance": float(np.minimum(p, q).sum()) if kind == "stochastic"
                else float(np.sum(p * q))})
  return out


def point(vocab: int, temperature: float = 1.0, top_p: float = 1.0, kind: str = "stochastic",
          samples: int = 100_000, false_alarm: float = 1e-3, seed: int = 0) -> dict:
  return group([dict(vocab=vocab, temperature=temperature, top_p=top_p, kind=kind,
                     samples=samples, false_alarm=false_alarm, seed=seed)])[0]


def report(records: list[dict], run_dir) -> str:
  from specjax.sweeps import report as rep
  fig, ax = rep.new_figure(figsize=(5, 3.2))
  pv = [r["metrics"]["p_value"] for r in records]
  ax.hist(pv, bins=20, range=(0, 1))
  ax.set_xlabel("χ² p-value")
  ax.set_ylabel("points")
  ax.set_title("Exactness: p-values (uniform if exact)")
  name = rep.save(fig, run_dir / "exactness_pvalues.png")
  passed = sum(r["metrics"]["passed"] for r in records)
  power = min(r["metrics"]["power_vs_residual_p_bug"] for r in records)
  return (f"## Exactness\n\n{passed}/{len(records)} points pass at their false-alarm rate; "
          f"minimum power against the 'residual = p' bug: {power:.3f}.\n\n![p-values]({name})\n")
