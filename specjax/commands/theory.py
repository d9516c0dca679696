"""`specjax theory ...`: the analytic model from the command line.

Every subcommand prints an aligned table, or one JSON document with --json. --plot FILE.png
(table, roofline) draws with matplotlib's Agg backend, imported only then.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import sys
from typing import Any

from specjax.engine.adaptive import roofline_k as adaptive_k
from specjax.analysis import roofline, theory
from specjax.commands import theory_flags as flags

_DEFAULT_ALPHAS = "0.6,0.7,0.8,0.9"
_DEFAULT_BATCHES = "1,8,16,32,36,64,128,164,256,324,512"


def add_parser(subparsers) -> None:
  p = subparsers.add_parser("theory", help="closed forms and the roofline cost model",
                            description=__doc__)
  sub = p.add_subparsers(dest="theory_command", metavar="SUBCOMMAND")
  sub.required = True
  for add in (_add_table, _add_optimal_k, _add_roofline, _add_adaptive, _add_long_context,
              _add_sample_size, _add_draft_kv, _add_burstiness, _add_tree):
    add(sub)  # in this order: the order `specjax theory --help` lists them


def _add_table(sub) -> None:
  s = _sub(sub, "table", "speedup over the α × k grid, best k per row", _table)
  s.add_argument("--alphas", default=_DEFAULT_ALPHAS, help="comma-separated α values")
  s.add_argument("--c", type=float, default=0.15, help="draft cost per token (target steps)")
  s.add_argument("--k-max", type=int, default=8, help="columns k = 1..K")
  s.add_argument("--k-search", type=int, default=16, help="best k searched over 1..K")
  s.add_argument("--plot", metavar="FILE.png", help="speedup vs k, one curve per α")


def _add_optimal_k(sub) -> None:
  s = _sub(sub, "optimal-k", "the k maximising E[τ]/(1 + k·c), per α", _optimal_k)
  s.add_argument("--alpha", default=_DEFAULT_ALPHAS, help="comma-separated α values")
  s.add_argument("--c", type=float, default=0.15)
  s.add_argument("--k-max", type=int, default=16)


def _add_roofline(sub) -> None:
  s = _sub(sub, "roofline", "gain vs batch, break-even batch, best k per batch", _roofline)
  flags.add_model_args(s)
  flags.add_spec_args(s)
  s.add_argument("--batches", default=_DEFAULT_BATCHES, help="comma-separated batch sizes")
  s.add_argument("--k-max", type=int, default=8, help="best k searched over 0..K")
  s.add_argument("--draft-cost", choices=roofline.DRAFT_COSTS, default="full",
                 help="convention for best k and the adaptive policy (all three gains shown)")
  s.add_argument("--plot", metavar="FILE.png", help="gain vs batch, break-even marked")


def _add_adaptive(sub) -> None:
  s = _sub(sub, "adaptive", "the shape the engine's adaptive policy would choose on this "
           "machine, per α and batch, from its calibration (or from --c without one)",
           _adaptive)
  s.add_argument("--calibration", default=None, metavar="FILE|DIR",
                 help="a calibration JSON (calibration.LoopCosts) or a directory of them, one "
                 "per batch (default: this machine's calibration cache, if it holds any)")
  s.add_argument("--menu", default="0,1,2,4,6", help="chain lengths k (0 = plain step)")
  s.add_argument("--temperature", type=float, default=0.0,
                 help="use the calibrations made at this temperature (default %(default)s)")
  s.add_argument("--lazy-slots", type=int, default=None, metavar="P",
                 help="plain steps per draft catch-up pass, as the engine runs a drafter that "
                 "catches up lazily (default: the loop's bound, 32); 0: a pass every plain step")
  s.add_argument("--alphas", default=_DEFAULT_ALPHAS, help="comma-separated α values")
  s.add_argument("--batches", default="1,2,4,8,16,32,64", help="comma-separated batch sizes")
  s.add_argument("--c", type=float, default=0.15,
                 help="without a calibration: a draft pass in target steps")
  s.add_argument("--v", type=float, default=0.0,
                 help="without a calibration: one more verified node in target steps")


def _add_long_context(sub) -> None:
  s = _sub(sub, "long-context", "max batch at a long context and how memory-bound it is",
           _long_context)
  flags.add_model_args(s, context_default=16384)
  flags.add_spec_args(s)
  s.add_argument("--memory-budget-gb", type=float, default=None,
                 help="cache memory (default: 0.95·memory − weights)")


def _add_sample_size(sub) -> None:
  s = _sub(sub, "sample-size", "drafted tokens needed to measure α to ± half-width",
           _sample_size)
  s.add_argument("--alpha", type=float, default=0.8)
  s.add_argument("--half-width", type=float, default=0.01)
  s.add_argument("--confidence", type=float, default=0.95)
  s.add_argument("--rho", type=float, default=0.0, help="lag-1 autocorrelation of accepts")
  s.add_argument("--method", choices=("wald", "wilson"), default="wald")


def _add_draft_kv(sub) -> None:
  s = _sub(sub, "draft-kv", "concurrency a separate draft's weights and cache take away",
           _draft_kv)
  flags.add_model_args(s)
  flags.add_spec_args(s)
  s.add_argument("--draft-fraction", type=float, default=0.1,
                 help="draft params / target params: scales weights and KV per token")
  s.add_argument("--draft-kv-bytes-per-token", type=float, default=None)
  s.add_argument("--draft-weight-gb", type=float, default=None)
  s.add_argument("--memory-budget-gb", type=float, default=None)
  s.add_argument("--draft-cost", choices=roofline.DRAFT_COSTS, default="full")


def _add_burstiness(sub) -> None:
  s = _sub(sub, "burstiness", "τ under bursty (Markov) acceptance: exact and Monte Carlo",
           _burstiness)
  s.add_argument("--alpha", type=float, default=0.8)
  s.add_argument("--k", type=int, default=4)
  s.add_argument("--rhos", default="0,0.3,0.6,0.9", help="lag-1 autocorrelations")
  s.add_argument("--cycles", type=int, default=200_000)
  s.add_argument("--seed", type=int, default=0)


def _add_tree(sub) -> None:
  s = _sub(sub, "tree", "E[τ] of a token tree under Sequoia's acceptance-by-rank model", _tree)
  s.add_argument("--parents", required=True, help="e.g. -1,-1,0,0,1 (topological order)")
  s.add_argument("--rank-probs", required=True, help="P(rank-r child accepted), e.g. 0.6,0.2")
  s.add_argument("--samples", type=int, default=0, help="also simulate this many cycles")
  s.add_argument("--seed", type=int, default=0)

def _sub(sub, name: str, help_: str, func) -> argparse.ArgumentParser:
  s = sub.add_parser(name, help=help_, description=help_)
  s.add_argument("--json", action="store_true", help="one JSON document on stdout")
  s.set_defaults(func=func)
  return s


# ----------------------------------------------------------------------------- output


def _clean(x: Any) -> Any:
  """JSON-safe: inf/nan become strings (JSON has no literal for them)."""
  if isinstance(x, float) and not math.isfinite(x):
    return str(x)
  if isinstance(x, dict):
    return {k: _clean(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_clean(v) for v in x]
  return x


def _emit_json(doc: dict) -> int:
  json.dump(_clean(doc), sys.stdout, indent=2, allow_nan=False)
  sys.stdout.write("\n")
  return 0


def _print_table(headers: list[str], rows: list[list[Any]], title: str | None = None) -> None:
  def fmt(v: Any) -> str:
    if isinstance(v, float):
      return "inf" if math.isinf(v) else f"{v:.0f}" if abs(v) >= 1e4 else f"{v:.3f}"
    return str(v)

  cells = [[fmt(v) for v in row] for row in rows]
  widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
            for i, h in enumerate(headers)]
  if title:
    print(title)
  print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
  print("  ".join("-" * w for w in widths))
  for r in cells:
    print("  ".join(v.rjust(w) for v, w in zip(r, widths)))


def _savefig(fig, path: str) -> None:
  if os.path.isdir(path):  # matplotlib would write PATH.png beside it instead
    raise IsADirectoryError(errno.EISDIR, "is a directory; give a FILE.png path", f"--plot {path}")
  try:
    fig.savefig(path, dpi=120)
  except OSError as e:
    raise flags.path_error("--plot", path, e, "give a writable FILE.png") from None


def _pyplot():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


# ----------------------------------------------------------------------------- subcommands


def _table(args) -> int:
  alphas = flags.floats("--alphas", args.alphas)
  for a in alphas:
    flags.check_alpha("--alphas", a)
  flags.check_flag("--c", args.c, flags.finite(args.c) and args.c >= 0, "a finite number >= 0")
  flags.check_k("--k-max", args.k_max)
  flags.check_k("--k-search", args.k_search)
  flags.check_size("--k-max", args.k_max, theory.MAX_K, "every k = 1..K is a column")
  flags.check_size("--k-search", args.k_search, theory.MAX_K, "every k = 1..K is evaluated")
  flags.check_size("number of --alphas × --k-max", len(alphas) * args.k_max,
                   theory.MAX_TABLE_CELLS, "table entries")
  grid = theory.speedup_table(alphas, args.c, args.k_max)
  best = [theory.optimal_k(a, args.c, args.k_search) for a in alphas]
  if args.plot:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ks = list(range(1, args.k_max + 1))
    for a, row, (kb, sb) in zip(alphas, grid, best):
      (line,) = ax.plot(ks, row, marker="o", label=f"α = {a:g}")
      if kb <= args.k_max:
        ax.plot([kb], [sb], marker="*", markersize=14, color=line.get_color())
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(xlabel="k (drafted tokens per cycle)", ylabel="speedup E[τ]/(1 + k·c)",
           title=f"speedup vs k at c = {args.c:g} (★ best k)")
    ax.legend()
    fig.tight_layout()
    _savefig(fig, args.plot)
    plt.close(fig)
  if args.json:
    return _emit_json({
        "c": args.c, "k": list(range(1, args.k_max + 1)),
        "rows": [{"alpha": a, "speedup": [float(x) for x in row], "best_k": kb,
                  "best_speedup": sb, "expected_tokens_at_best_k": theory.expected_tokens(a, kb)}
                 for a, row, (kb, sb) in zip(alphas, grid, best)],
        "plot": args.plot})
  headers = ["alpha", *[f"k={k}" for k in range(1, args.k_max + 1)], "best k", "best"]
  rows = [[f"{a:g}", *[float(x) for x in row], kb, sb]
          for a, row, (kb, sb) in zip(alphas, grid, best)]
  _print_table(headers, rows, f"speedup = E[τ]/(1 + k·c), c = {args.c:g}; "
               f"best k over 1..{args.k_search}")
  if args.plot:
    print(f"wrote {args.plot}")
  return 0


def _optimal_k(args) -> int:
  alphas = flags.floats("--alpha", args.alpha)
  for a in alphas:
    flags.check_alpha("--alpha", a)
  flags.check_flag("--c", args.c, flags.finite(args.c) and args.c >= 0, "a finite number >= 0")
  flags.check_k("--k-max", args.k_max)
  flags.check_size("--k-max", args.k_max, theory.MAX_K, "every k = 1..K is evaluated")
  rows = []
  for a in alphas:
    k, s = theory.optimal_k(a, args.c, args.k_max)
    rows.append({"alpha": a, "k": k, "speedup": s,
                 "expected_tokens": theory.expected_tokens(a, k)})
  if args.json:
    return _emit_json({"c": args.c, "k_max": args.k_max, "rows": rows})
  _print_table(["alpha", "best k", "speedup", "E[tau]"],
               [[f"{r['alpha']:g}", r["k"], r["speedup"], r["expected_tokens"]] for r in rows],
               f"optimal k over 1..{args.k_max} at c = {args.c:g}")
  return 0


def _calibrations(path: str | None, temperature: float) -> dict:
  """{batch: LoopCosts} from a calibration file or directory (newest file per batch among
  those made at `temperature`)."""
  import pathlib

  from specjax.calibration import loop_costs as calibration  # lazy: imports JAX

  root = calibration.cache_root() if path is None else pathlib.Path(path)
  if path is not None and not root.exists():
    raise ValueError(f"--calibration {path!r} does not exist")
  files = sorted(root.glob("*.json"), key=lambda f: f.stat().st_mtime) if root.is_dir() else (
      [root] if root.exists() else [])
  out = {}
  for f in files:
    try:
      costs = calibration.LoopCosts.from_dict(json.loads(f.read_text()))
    except (ValueError, KeyError, TypeError, OSError) as e:
      if path is not None and f == root:
        raise ValueError(f"--calibration {path!r} is not a calibration: {e}") from None
      continue
    if float(costs.meta.get("temperature", temperature)) == temperature:
      out[int(costs.meta.get("batch", 1))] = costs
  return out


def _adaptive(args) -> int:
  import numpy as np

  from specjax.engine.adaptive import policy as adaptive  # lazy: imports JAX
  from specjax.engine import loop

  alphas = flags.floats("--alphas", args.alphas)
  for a in alphas:
    if not 0 <= a <= 1:
      raise ValueError(f"--alphas must lie in [0, 1], got {a}")
  batches = flags.ints("--batches", args.batches)
  for b in batches:
    flags.check_k("--batches", b)
  menu = flags.ints("--menu", args.menu)
  flags.check_size("number of --menu entries × (largest k)²", len(menu) * max(menu) ** 2,
                   theory.MAX_TABLE_CELLS, "the policy tabulates every entry's node pairs")
  lazy = loop.LAZY_SLOTS if args.lazy_slots is None else args.lazy_slots
  if lazy < 0:
    raise ValueError(f"--lazy-slots must be an int >= 0, got {lazy}")
  costs = _calibrations(args.calibration, args.temperature)
  if costs:
    policy = adaptive.AdaptivePolicy.from_costs(menu, costs, lazy_slots=lazy)
    source = f"calibrated at batch {sorted(costs)}, T = {args.temperature:g}"
  else:
    policy = adaptive.AdaptivePolicy.from_model(menu, c=args.c, v=args.v, lazy_slots=lazy)
    source = f"uncalibrated: cycle = 1 + {args.v:g}·N + {args.c:g}·D steps"
  rows = policy.table(alphas, batches)
  # a fresh request: no observation yet, the prior (α₀ and, per depth, the calibration's
  # first-candidate profile) is what the first cycle's choice reads
  prior = {"alpha": float(policy.prior_alpha),
           "depth_alpha": [float(x) for x in np.asarray(policy.prior_depth)]}
  first = {int(b): policy.names[policy.choose(prior["alpha"], int(b),
                                               depth_rates=prior["depth_alpha"])]
           for b in batches}
  if args.json:
    return _emit_json({"source": source, "menu": policy.names, "rows": rows,
                       "prior": prior, "first_choice": first})
  print(f"adaptive policy, menu {policy.names}, costs {source}")
  for b, c in sorted(costs.items()):
    print(f"batch {b}: " + c.describe().replace("\n", "; "))
  _print_table(["alpha", "batch", "choice", "predicted speedup"],
               [[r["alpha"], r["batch"], r["choice"], r["speedup"]] for r in rows],
               "what the engine would choose (all rows accepting at α)")
  depths = ", ".join(f"{x:.2f}" for x in prior["depth_alpha"])
  print(f"a fresh request starts from α₀ = {prior['alpha']:.2f}, first candidate per depth "
        f"[{depths}]: first choice " + ", ".join(f"batch {b}: {n}" for b, n in first.items()))
  return 0


def _model_doc(hw: roofline.Hardware, wl: roofline.Workload) -> dict:
  return {"hardware": hw.to_dict(), "workload": wl.to_dict()}


def _roofline(args) -> int:
  flags.check_spec(args)
  batches = flags.ints("--batches", args.batches)
  for b in batches:
    flags.check_k("--batches", b)
  # the adaptive-k policy tabulates cycle times for every batch 1..max(4096, B) and k, and
  # its menu's node tables grow as (k_max + 1)·k_max²
  flags.check_size("--k-max", args.k_max, flags.max_policy_k(),
                   f"the adaptive-k policy's tables hold (k + 1)·k² <= "
                   f"{theory.MAX_TABLE_CELLS:,} entries")
  flags.check_size("largest --batches", max(batches),
                   theory.MAX_TABLE_CELLS // (args.k_max + 1),
                   f"the adaptive-k policy tabulates every batch 1..B × k = 0..{args.k_max}, "
                   f"at most {theory.MAX_TABLE_CELLS:,} entries")
  hw, wl = flags.hardware(args), flags.workload(args)
  a, k, c = args.alpha, args.k, args.c
  policy = adaptive_k.AdaptiveKPolicy(hw, wl, a, c, k_max=args.k_max, draft_cost=args.draft_cost,
                                      max_batch=max(4096, max(batches)))
  rows = []
  for b in batches:
    kb, gb = roofline.best_k(hw, wl, b, a, c, args.k_max, args.draft_cost)
    rows.append({
        "batch": b,
        "t_plain_ms": 1e3 * roofline.step_time(hw, wl, b, 1),
        "t_verify_ms": 1e3 * roofline.step_time(hw, wl, b, k + 1),
        "memory_bound_verify": roofline.memory_bound_factor(hw, wl, b, k + 1),
        "gain": {dc: roofline.gain(hw, wl, b, a, k, c, dc) for dc in roofline.DRAFT_COSTS},
        "best_k": kb, "best_gain": gb, "policy_k": policy.k_for_batch(b)})
  be = {dc: roofline.break_even_batch(hw, wl, a, k, c, dc) for dc in roofline.DRAFT_COSTS}
  if args.plot:
    _plot_roofline(args.plot, hw, wl, a, k, c, be, max(batches))
  if args.json:
    return _emit_json({**_model_doc(hw, wl), "alpha": a, "k": k, "c": c,
                       "expected_tokens": theory.expected_tokens(a, k),
                       "max_batch_in_memory": roofline.max_batch(
                           wl, roofline.cache_budget(hw, wl)),
                       "break_even_batch": be, "rows": rows,
                       "policy": {"draft_cost": args.draft_cost, "k_max": args.k_max,
                                  "breakpoints": policy.breakpoints()},
                       "plot": args.plot})
  print(f"{hw.name}: {hw.bandwidth / 1e12:g} TB/s, {hw.flops / 1e12:g} TFLOP/s usable, "
        f"{hw.memory / 1e9:g} GB | {wl.name}: W = {wl.weight_bytes / 1e9:g} GB, "
        f"F = {wl.flops() / 1e9:g} GFLOP/token, KV = {wl.kv_bytes_per_token:g} B/token, "
        f"L = {wl.context_len}")
  print(f"alpha = {a:g}, k = {k}, c = {c:g}, E[tau] = {theory.expected_tokens(a, k):.4f}")
  _print_table(
      ["batch", "t_plain ms", "t_verify ms", "mem/comp verify", "gain full", "verify-only",
       "memory-only", f"best k ({args.draft_cost})", "best gain", "policy k"],
      [[r["batch"], r["t_plain_ms"], r["t_verify_ms"], r["memory_bound_verify"],
        r["gain"]["full"], r["gain"]["verify_only"], r["gain"]["memory_only"], r["best_k"],
        r["best_gain"], r["policy_k"]] for r in rows])
  print("break-even batch (gain = 1): " +
        ", ".join(f"{dc} {v:.1f}" for dc, v in be.items()))
  print("adaptive k (first batch: k): " +
        ", ".join(f"{b}: {kk}" for b, kk in policy.breakpoints()))
  if args.plot:
    print(f"wrote {args.plot}")
  return 0


def _plot_roofline(path, hw, wl, a, k, c, be, b_max) -> None:
  import numpy as np
  plt = _pyplot()
  b_hi = max(b_max, *(v * 1.5 for v in be.values() if math.isfinite(v)))
  bs = np.unique(np.geomspace(1, b_hi, 200))
  fig, ax = plt.subplots(figsize=(6.5, 4))
  labels = {"full": "draft counted (full)", "verify_only": "verification only",
            "memory_only": "draft counted while memory-bound"}
  for dc, style in zip(roofline.DRAFT_COSTS, ("-", "--", ":")):
    g = [roofline.gain(hw, wl, float(b), a, k, c, dc) for b in bs]
    (line,) = ax.plot(bs, g, style, label=labels[dc])
    if math.isfinite(be[dc]):
      ax.axvline(be[dc], color=line.get_color(), lw=0.8, alpha=0.7)
      ax.annotate(f"B = {be[dc]:.0f}", (be[dc], 1.0), rotation=90, fontsize=8,
                  xytext=(2, 4), textcoords="offset points", color=line.get_color())
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.set_xscale("log")
  ax.set(xlabel="batch size B", ylabel="gain over plain decoding",
         title=f"{hw.name}, {wl.name}, L = {wl.context_len}: α = {a:g}, k = {k}, c = {c:g}")
  ax.legend(fontsize=8)
  fig.tight_layout()
  _savefig(fig, path)
  plt.close(fig)


def _long_context(args) -> int:
  flags.check_spec(args)
  hw, wl = flags.hardware(args), flags.workload(args)
  budget = None if args.memory_budget_gb is None else args.memory_budget_gb * 1e9
  lc = roofline.long_context(hw, wl, args.context_len, args.alpha, args.k, args.c, budget)
  if args.json:
    return _emit_json({**_model_doc(hw, wl), "alpha": args.alpha, "k": args.k, "c": args.c,
                       **lc.to_dict()})
  per_seq_gb = wl.kv_bytes_per_seq(lc.context_len) / 1e9
  print(f"{hw.name}, {wl.name}: context {lc.context_len}, cache budget "
        f"{lc.memory_budget / 1e9:g} GB, KV per sequence {per_seq_gb:.4g} GB")
  _print_table(["max batch", "mem/comp T=1", f"mem/comp T={args.k + 1}", "gain full",
                "verify-only", "memory-only"],
               [[lc.batch, lc.memory_bound_plain, lc.memory_bound_verify, lc.gain["full"],
                 lc.gain["verify_only"], lc.gain["memory_only"]]])
  return 0


def _sample_size(args) -> int:
  flags.check_alpha("--alpha", args.alpha)
  if args.method == "wald" and args.alpha in (0.0, 1.0):
    raise ValueError(
        f"--alpha {args.alpha:g} with --method wald: the Wald interval has zero width at "
        f"α = 0 or 1, so it would answer 0 tokens; give --alpha in (0, 1) (your best guess "
        f"of α) or use --method wilson, which stays positive there")
  flags.check_flag("--half-width", args.half_width,
                   flags.finite(args.half_width)
                   and theory.MIN_HALF_WIDTH <= args.half_width <= 0.5,
                   f"in [{theory.MIN_HALF_WIDTH:g}, 0.5] (narrower needs over 10^17 drafted "
                   f"tokens)")
  flags.check_flag("--confidence", args.confidence,
                   flags.finite(args.confidence) and 0 < args.confidence < 1, "in (0, 1)")
  flags.check_flag("--rho", args.rho, flags.finite(args.rho) and -1 < args.rho < 1, "in (-1, 1)")
  n = theory.alpha_sample_size(args.alpha, args.half_width, args.confidence, rho=args.rho,
                               method=args.method)
  n_iid = theory.alpha_sample_size(args.alpha, args.half_width, args.confidence,
                                   method=args.method)
  doc = {"alpha": args.alpha, "half_width": args.half_width, "confidence": args.confidence,
         "rho": args.rho, "method": args.method, "drafted_tokens": n,
         "drafted_tokens_if_independent": n_iid}
  if args.json:
    return _emit_json(doc)
  _print_table(["alpha", "± half-width", "confidence", "rho", "method", "drafted tokens",
                "(independent)"],
               [[f"{args.alpha:g}", f"{args.half_width:g}", f"{args.confidence:g}",
                 f"{args.rho:g}", args.method, n, n_iid]])
  return 0


def _draft_kv(args) -> int:
  flags.check_spec(args)
  hw, wl = flags.hardware(args), flags.workload(args)
  f = args.draft_fraction
  if not (math.isfinite(f) and f >= 0):
    raise ValueError(f"--draft-fraction must be >= 0, got {f}")
  dkv = (f * wl.kv_bytes_per_token if args.draft_kv_bytes_per_token is None
         else args.draft_kv_bytes_per_token)
  dw = f * wl.weight_bytes if args.draft_weight_gb is None else args.draft_weight_gb * 1e9
  budget = None if args.memory_budget_gb is None else args.memory_budget_gb * 1e9
  r = roofline.draft_kv_cost(hw, wl, args.alpha, args.k, args.c, dkv, dw, budget,
                             args.draft_cost)
  doc = {**_model_doc(hw, wl), "alpha": args.alpha, "k": args.k, "c": args.c,
         "draft_kv_bytes_per_token": dkv, "draft_weight_bytes": dw,
         "draft_cost": args.draft_cost, **r.to_dict()}
  if args.json:
    return _emit_json(doc)
  print(f"{hw.name}, {wl.name}, L = {wl.context_len}: cache budget {r.memory_budget / 1e9:g} GB; "
        f"draft weights {dw / 1e9:g} GB, draft KV {dkv:g} B/token")
  _print_table(["batch plain", "batch spec", "concurrency lost", "tok/s plain", "tok/s spec",
                "gain at capacity"],
               [[r.batch_plain, r.batch_spec, r.concurrency_lost, r.tokens_per_s_plain,
                 r.tokens_per_s_spec, r.gain_at_capacity]])
  return 0


def _burstiness(args) -> int:
  flags.check_alpha("--alpha", args.alpha)
  flags.check_k("--k", args.k)
  flags.check_k("--cycles", args.cycles)
  flags.check_k("--seed", args.seed, 0)
  rhos = flags.floats("--rhos", args.rhos)
  for rho in rhos:
    flags.check_flag("--rhos", rho, flags.finite(rho) and 0 <= rho < 1, "numbers in [0, 1)")
  flags.check_size("--k", args.k, theory.MAX_K, "chain length")
  flags.check_size("--cycles × --k",
                   max(theory.chain_draws(args.cycles, args.k, rho) for rho in rhos),
                   theory.MAX_DRAWS, "uniforms one simulation draws; bursty rows: 1000 streams "
                   "with 20 burn-in cycles each")
  rows = []
  for rho in rhos:
    sim = theory.simulate_chain(args.alpha, args.k, cycles=args.cycles, seed=args.seed, rho=rho)
    rows.append({"rho": rho, "tau_exact": theory.bursty_expected_tokens(args.alpha, args.k, rho),
                 "tau_mc": sim.tau, "tau_mc_se": sim.tau_se, "alpha_measured": sim.alpha_hat,
                 "tau_iid_at_measured_alpha": theory.expected_tokens(sim.alpha_hat, args.k)})
  if args.json:
    return _emit_json({"alpha": args.alpha, "k": args.k, "cycles": args.cycles,
                       "seed": args.seed, "tau_iid": theory.expected_tokens(args.alpha, args.k),
                       "rows": rows})
  _print_table(["rho", "tau exact", "tau MC", "± se", "alpha measured", "iid tau(measured)"],
               [[f"{r['rho']:g}", r["tau_exact"], r["tau_mc"], r["tau_mc_se"],
                 r["alpha_measured"], r["tau_iid_at_measured_alpha"]] for r in rows],
               f"latent alpha = {args.alpha:g}, k = {args.k}; independent E[tau] = "
               f"{theory.expected_tokens(args.alpha, args.k):.4f}")
  return 0


def _tree(args) -> int:
  parents = flags.ints("--parents", args.parents)
  probs = flags.floats("--rank-probs", args.rank_probs)
  tau = theory.tree_expected_tokens(parents, probs)
  if args.samples:
    flags.check_k("--samples", args.samples, 2)
    depth = int(theory.node_depths(parents).max())
    flags.check_size("--samples × tree depth", args.samples * depth, theory.MAX_DRAWS,
                     f"uniforms one simulation draws; the tree is {depth} deep")
  doc = {"parents": parents, "rank_probs": probs, "expected_tokens": tau,
         "node_probs": [float(x) for x in theory.tree_node_probs(parents, probs)]}
  if args.samples:
    sim = theory.simulate_tree(parents, probs, samples=args.samples, seed=args.seed)
    doc.update(tau_mc=sim.tau, tau_mc_se=sim.tau_se)
  if args.json:
    return _emit_json(doc)
  _print_table(["node", "parent", "depth", "rank", "P(on accepted path)"],
               [[i, p, int(d), int(r), float(q)] for i, (p, d, r, q) in enumerate(zip(
                   parents, theory.node_depths(parents), theory.sibling_ranks(parents),
                   doc["node_probs"]))],
               f"E[tau] = {tau:.4f}" + (f" (MC {doc['tau_mc']:.4f} ± {doc['tau_mc_se']:.4f})"
                                        if args.samples else ""))
  return 0
