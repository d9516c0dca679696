"""Exactness at large sample sizes: the acceptance rule alone, and every drafter through the loop.

One point = a `case` and its sampler (temperature, top-p; top-k for the loop cases).

- case "rule": the acceptance rule alone on synthetic logits. A vocabulary size (`vocab`)
  and a draft kind (stochastic q or deterministic point masses); random target and draft
  logits (seeded by the vocabulary) are warped, `samples` independent drafts are verified
  with `acceptance.accept_chain`, and the emitted first tokens are compared with the warped
  target by a χ² goodness-of-fit test (zero-probability cells must stay empty; sparse cells
  pooled). Reported: the p-value, whether it passes at the stated false-alarm rate, and the
  power of the same test against the planted bug "residual = p" (noncentral χ²). The points
  of one (vocab, kind, samples) group run as one vectorised program spread over all local
  devices (`specjax.sweeps.parallel`).
- case "DRAFTER/SHAPE": the exactness tool (`specjax.exactness.check`) on `target` (or its
  older name `models`; "tiny": a random target on `vocab` tokens and a noisy copy as draft;
  or any target reference of experiments/references.py, e.g. the embedded "default"
  trained pair or a Hugging Face directory, much slower per row, with its `draft`)
  restricted by top-k: the real compiled loop
  on `samples` rows, the χ² test of the first `tokens` emitted tokens against the target's
  enumerated law, its power against any deviation of total variation >= `deviation`, and
  planted-bug controls; at temperature 0 greedy identity with plain decoding. DRAFTER: the
  separate draft model sampling its candidates ("model") or proposing its top candidates
  ("model-det"), the controlled-α drafter ("oracle", `alpha`; its only visible control is
  always-accept: its residual is p itself); SHAPE: a chain of 2, the static tree
  branching((2, 1)), a dynamic tree of 4 nodes (depth 2, width 2).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from specjax.experiments import measure, references
from specjax.verify import acceptance, sampling, trees
from specjax.exactness import checker as exactness
from specjax.sweeps import parallel, runner
from specjax.models.transformer import ModelConfig, Transformer
from specjax.drafters.model import ModelDrafter
from specjax.drafters.oracle import OracleDrafter
from specjax.sweeps import report as rep

KINDS = ("stochastic", "deterministic")
CASES = ("rule", "model/chain", "model-det/chain", "oracle/chain", "model/tree",
         "model-det/tree", "oracle/tree", "model/dynamic")
TINY = "tiny"  # the study's own random pair on `vocab` tokens (`_models`)


def validate(params: dict) -> None:
  case = measure.check_choice(params, "case", "rule", CASES)
  measure.check_int(params, "vocab", 8, 2, 4096)
  measure.check_choice(params, "kind", "stochastic", KINDS)
  measure.check_int(params, "samples", 100_000, 100)
  measure.check_number(params, "temperature", 1.0, 0)
  measure.check_number(params, "top_p", 1.0, 0, 1, lo_open=True)
  measure.check_number(params, "false_alarm", 1e-3, 0, 1, lo_open=True, hi_open=True)
  if case != "rule":
    which = references.target_ref(params.get("target"), params.get("models", TINY))
    if which != TINY:
      references.target_config(which)
    references.check_draft(params)
    top_k = measure.check_int(params, "top_k", 4, 0)
    tokens = measure.check_int(params, "tokens", 3, 2, 8)
    measure.check_number(params, "deviation", 0.05, 0, 1, lo_open=True)
    measure.check_number(params, "alpha", 0.5, 0, 1)
    if params.get("temperature", 1.0) > 0 and not 0 < top_k ** tokens <= exactness.MAX_CELLS:
      raise ValueError(f"top_k^tokens must be in [1, {exactness.MAX_CELLS}] for case {case!r} "
                       f"at temperature > 0 (the law of the first tokens is enumerated), got "
                       f"{top_k}^{tokens}: set top_k >= 1 and lower it or tokens")


def memory(params: dict) -> int:
  if params.get("case", "rule") != "rule":  # the tool runs its rows in chunks of this size
    return exactness.ROW_BYTES_BUDGET + 64 * 2 ** 20
  return 4 * params.get("samples", 100_000) * params.get("vocab", 8) * 4  # p, q, noise


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
  if first.get("case", "rule") != "rule":  # one compiled loop serves the group: runtime sampler
    return [point(**p) for p in params_list]
  vocab, kind = first.get("vocab", 8), first.get("kind", "stochastic")
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


@functools.lru_cache(maxsize=4)
def _models(which: str, vocab: int, draft: str = "default"):
  """(target, draft): any target reference with its draft (`measure.models`: "default" is
  the embedded trained pair; `draft` a draft model reference), or ("tiny") a random 2-layer
  Llama-style target on `vocab` tokens, its blocks' outputs scaled up so that the context
  matters, and as draft a copy with Gaussian noise on every weight (a related but imperfect
  draft: 0 < α < 1, so planted bugs show)."""
  if which != TINY:
    target, draft_model, _, _ = measure.models(which, "float32", draft)
    return target, draft_model
  from flax import nnx

  cfg = ModelConfig.llama(vocab_size=vocab, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                          d_ff=64, max_len=64)
  target = Transformer(cfg, rngs=nnx.Rngs(0))
  for block in target.blocks:
    block.attn.o.kernel[...] = block.attn.o.kernel[...] * 20.0
    block.mlp.down.kernel[...] = block.mlp.down.kernel[...] * 20.0
  target.final_norm.scale[...] = target.final_norm.scale[...] * 4.0  # sharper laws
  graphdef, state = nnx.split(target)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  noisy = [x + 0.5 * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype)
           for x, k in zip(leaves, keys)]
  return target, nnx.merge(graphdef, jax.tree.unflatten(treedef, noisy))


def _drafter(name: str, target, draft, alpha: float):
  if name == "oracle":
    return OracleDrafter.of(target, alpha)
  return ModelDrafter.of(draft, deterministic=name == "model-det")


def _shape(name: str) -> dict:
  return {"chain": dict(k=2), "tree": dict(tree=trees.branching((2, 1))),
          "dynamic": dict(tree=trees.DynamicTree(4, 2, 2))}[name]


def _loop_point(params: dict) -> dict:
  """One drafter and shape through `exactness.check` (module doc)."""
  drafter_name, shape = params["case"].split("/")
  target, draft = _models(references.target_ref(params["target"], params["models"]),
                          params["vocab"], params["draft"])
  t = params["temperature"]
  sampler = sampling.make_sampler(t, params["top_k"], params["top_p"])
  controls = ["always_accept"] if drafter_name == "oracle" or t == 0 else None
  report = exactness.check(
      target, _drafter(drafter_name, target, draft, params["alpha"]), **_shape(shape),
      sampler=sampler, tokens=params["tokens"] if t > 0 else None, samples=params["samples"],
      false_alarm=params["false_alarm"], deviation=params["deviation"], controls=controls,
      seed=runner.point_seed(params, "loop"))
  d = report.to_dict()
  test = d["test"] or {}
  return {"passed": report.passed, "mode": report.mode, "verdict": report.verdict,
          "p_value": test.get("p_value"), "dof": test.get("dof"), "tv": test.get("tv"),
          "cells": report.cells, "power": report.power, "detectable_tv": report.detectable_tv,
          "rows": report.rows, "identical_rows": report.identical_rows,
          "acceptance": report.acceptance,
          "controls": {c["bug"]: {"rejected": c["rejected"],
                                  "p_value": (c["test"] or {}).get("p_value"),
                                  "differing_rows": c["differing_rows"]}
                       for c in d["controls"]},
          "controls_rejected": all(c.rejected for c in report.controls),
          "seconds": report.seconds}


def point(vocab: int = 8, temperature: float = 1.0, top_p: float = 1.0,
          kind: str = "stochastic", samples: int = 100_000, false_alarm: float = 1e-3,
          seed: int = 0, case: str = "rule", models: str = TINY, top_k: int = 4,
          tokens: int = 3, deviation: float = 0.05, alpha: float = 0.5,
          target: str | None = None, draft: str = "default") -> dict:
  params = dict(vocab=vocab, temperature=temperature, top_p=top_p, kind=kind, samples=samples,
                false_alarm=false_alarm, seed=seed, case=case, models=models, top_k=top_k,
                tokens=tokens, deviation=deviation, alpha=alpha, target=target, draft=draft)
  if case != "rule":
    return _loop_point(params)
  return group([params])[0]


def report(records: list[dict], run_dir) -> str:
  rule = [r for r in records if r["params"].get("case", "rule") == "rule"]
  loop = [r for r in records if r["params"].get("case", "rule") != "rule"]
  text = "## Exactness\n\n"
  if rule:
    fig, ax = rep.new_figure(figsize=(5, 3.2))
    ax.hist([r["metrics"]["p_value"] for r in rule], bins=20, range=(0, 1))
    ax.set_xlabel("χ² p-value")
    ax.set_ylabel("points")
    ax.set_title("The rule alone: p-values (uniform if exact)")
    name = rep.save(fig, run_dir / "exactness_pvalues.png")
    passed = sum(r["metrics"]["passed"] for r in rule)
    power = min(r["metrics"]["power_vs_residual_p_bug"] for r in rule)
    text += (f"The rule alone: {passed}/{len(rule)} points pass at their false-alarm rate; "
             f"minimum power against the 'residual = p' bug: {power:.3f}.\n\n"
             f"![p-values]({name})\n\n")
  if loop:
    passed = sum(r["metrics"]["passed"] for r in loop)
    rows = [{**r["params"], **r["metrics"]} for r in loop]
    text += (f"Every drafter through the loop (`specjax.exactness.check`): {passed}/{len(loop)} "
             f"points PASS (the real run passes and every planted bug is rejected).\n\n"
             + rep.markdown_table(rows, ["case", "temperature", "top_p", "mode", "p_value",
                                         "power", "detectable_tv", "acceptance",
                                         "controls_rejected", "passed"]))
  return text
