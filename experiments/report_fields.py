"""What every point reports about a `Comparison` (`speculative_row`): measured and predicted
speedups, acceptance, the calibration used, how much of the output is repetition loops
(`loop_fields`), and where a greedy speculative run left plain output (`divergences`);
`say(line)`: a verdict on the console.
"""

from __future__ import annotations

import math
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax.analysis import metrics

from specjax.experiments.comparison import Comparison


def speculative_row(cmp: Comparison, tau_loop: float, temperature: float,
                    cycle_name: Callable[[str, int, int], str] | None = None,
                    tau_loop_iid: float | None = None, target=None,
                    prompt_ids=None) -> dict:
  """The result fields every point reports about a `Comparison` measured with calibrated loop
  costs (`compare(..., loop_costs=...)`):

  plain_tok_s, spec_tok_s, speedup (measured); predicted_speedup = cmp.predicted(tau_loop)
  and efficiency = measured ÷ predicted; alpha, alpha_trial, alpha_ci, tau of the
  speculative run; tau_loop_predicted = tau_loop; loop_iterations (the most cycles of any
  row); depth_tried / depth_accepted (per draft depth, summed over rows); run_lengths (the
  histogram of accepted lengths); drafted_per_cycle (tree size); cycle_steps of the tree and
  t_step_ms (calibrated); calibration: every calibrated cycle in target steps (named by
  `cycle_name(key, N, D)`, by default its key), the fitted cost model in target steps, and
  whether the costs came from the cache; identical_to_plain (at T = 0, else None); backend.
  With `tau_loop_iid` (a chain's τ_loop under the i.i.d. acceptance model:
  `calibration.run_tokens_per_iteration(..., iid=True)`) also tau_loop_iid and
  predicted_speedup_iid, the prediction that model would make, reported beside.
  With `target` and `prompt_ids`, a T = 0 run that is not identical also reports
  `divergences` (where, and by how many ulps of the served dtype: `divergences`) and
  `only_ties` (every divergence within 2 ulps: numerical ties, not a broken rule).
  """
  costs = cmp.loop_costs
  extra = {}
  if temperature == 0 and target is not None and not cmp.identical:
    div = divergences(target, prompt_ids, cmp.plain.tokens, cmp.spec.tokens)
    extra = {"divergences": div,
             "only_ties": all(d["ulps"] is not None and d["ulps"] <= 2 for d in div)}
  summary, st = cmp.spec.summary(), cmp.spec.stats
  predicted = cmp.predicted(tau_loop)
  name = cycle_name or (lambda key, n, d: key)
  fit = costs.fitted
  return {
      "plain_tok_s": cmp.plain_tok_s, "spec_tok_s": cmp.spec_tok_s, "speedup": cmp.speedup,
      "speed_basis": "decode phase" if cmp.plain_prefill_s is not None else "end to end",
      "plain_tok_s_e2e": cmp.plain_tok_s_e2e, "spec_tok_s_e2e": cmp.spec_tok_s_e2e,
      "speedup_e2e": cmp.speedup_e2e,
      **loop_fields(cmp.plain.tokens, cmp.spec.tokens),
      "predicted_speedup": predicted, "efficiency": cmp.efficiency(predicted),
      "alpha": summary.alpha, "alpha_trial": summary.alpha_trial,
      "alpha_ci": list(summary.alpha_ci), "tau": summary.tau, "tau_loop_predicted": tau_loop,
      "loop_iterations": int(np.max(st["cycles"])),
      "depth_tried": st["depth_tried"].sum(axis=0).tolist(),
      "depth_accepted": st["depth_accepted"].sum(axis=0).tolist(),
      "run_lengths": st["hist"].sum(axis=0).tolist(),
      "drafted_per_cycle": cmp.tree.size,
      "cycle_steps": costs.cycle_steps(cmp.tree), "t_step_ms": 1e3 * costs.t_step,
      "calibration": {"cycle_steps": {name(key, n, d): sec / costs.t_step
                                      for key, (n, d, sec) in costs.cycles.items()},
                      "fit_steps": None if fit is None else {
                          "t_fixed": fit.t_fixed / costs.t_step,
                          "t_verify": fit.t_verify / costs.t_step,
                          "t_draft": fit.t_draft / costs.t_step, "rel_rms": fit.rel_rms},
                      "cached": bool(costs.meta.get("cached")), "key": costs.meta.get("key"),
                      "revalidated": costs.meta.get("revalidated")},
      "identical_to_plain": cmp.identical if temperature == 0 else None,
      "backend": jax.default_backend(),
      **({} if tau_loop_iid is None else {"tau_loop_iid": tau_loop_iid,
                                          "predicted_speedup_iid": cmp.predicted(tau_loop_iid)}),
      **extra,
  }


def divergences(target, prompt_ids, plain_rows, spec_rows, limit: int = 8) -> list[dict]:
  """Where greedy speculative output left plain output (T = 0): per differing row (at most
  `limit`), the first differing position, both tokens, and the target's logit gap between
  them there (one uncached forward of the plain prefix) in units of the spacing of the
  served weights' dtype at that logit (`ulps`). Two tokens whose logits are within an ulp or
  two are a numerical tie: a verify pass of several rows and a one-row decode step sum in
  another order and may break it the other way (bf16 serving at batch > 1); a larger gap
  would be a real divergence."""
  dtype = jnp.bfloat16 if target.config.dtype == "bfloat16" else jnp.float32
  out = []
  for i, (a, b) in enumerate(zip(plain_rows, spec_rows)):
    if a == b or len(out) >= limit:
      continue
    j = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
    if j >= min(len(a), len(b)):
      out.append({"row": i, "position": j, "ulps": None, "note": "one output is longer"})
      continue
    seq = list(prompt_ids[i]) + list(a[:j])
    logits = np.asarray(target(jnp.asarray([seq]), jnp.arange(len(seq))[None], None)[0][0, -1])
    hi = float(max(abs(logits[a[j]]), abs(logits[b[j]])))
    spacing = float(jnp.finfo(dtype).eps) * 2.0 ** math.floor(math.log2(max(hi, 1e-30)))
    gap = float(abs(logits[a[j]] - logits[b[j]]))
    out.append({"row": i, "position": j, "plain": int(a[j]), "spec": int(b[j]),
                "logit_gap": gap, "ulps": gap / spacing})
  return out


def loop_fields(plain_rows, spec_rows) -> dict:
  """How much of the outputs are repetition loops (`metrics.loop_flags`): loop_fraction of
  the speculative run's tokens (where α and τ were measured), loop_fraction_plain, and
  rows_ending_in_loop / rows of the plain outputs (`metrics.ends_in_loop`)."""
  return {"loop_fraction": metrics.loop_fraction(spec_rows),
          "loop_fraction_plain": metrics.loop_fraction(plain_rows),
          "rows_ending_in_loop": sum(metrics.ends_in_loop(r) for r in plain_rows),
          "rows": len(plain_rows)}


def say(line: str) -> None:
  """A verdict line on the console, above the progress bar."""
  try:
    from tqdm import tqdm
    tqdm.write(line, file=sys.stderr)
  except ImportError:  # pragma: no cover
    print(line, file=sys.stderr)
