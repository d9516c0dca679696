"""The report of the real-model study (experiments/real_model.py): Spec-Bench's table per
temperature and category with a column per system, the calibrated predictions beside the
measured decode-phase speedups, and the checks at T = 0; `table` also lands in the run
directory as table.json (the per-question rows are the run's results.jsonl).

Aggregates over a category's questions: tokens/s = Σ new tokens ÷ Σ seconds (as a workload
sees it); speedup = that ÷ the same library's plain tokens/s over the same questions; τ, the
decode-phase speedup and the prediction are means over questions.
"""

from __future__ import annotations

import json
import math
import pathlib
import statistics


def _mean(values) -> float:
  values = [v for v in values if v is not None and not (isinstance(v, float)
                                                        and math.isnan(v))]
  return statistics.mean(values) if values else float("nan")


def _plain_of(name: str) -> str:
  return name.split(" ", 1)[0] + " plain"


def table(records: list[dict]) -> list[dict]:
  """One row per (temperature, category or "overall", system): questions, tau, tok_s,
  speedup, speedup_decode, predicted_speedup, efficiency, identical (at T = 0: how many of
  the questions gave the library's plain tokens; None at T > 0), acceptance_by_position
  (pooled counts: accepted ÷ tried per draft depth; empty where none were counted)."""
  ok = [r["metrics"] for r in records if r.get("metrics")]
  named = [f"specjax {s}" for s in (records[0].get("params") or {}).get("systems", [])]
  found = list(dict.fromkeys(n for m in ok for n in m["systems"]))
  # the columns: each library's plain first, specjax's systems in the order asked
  order = ["specjax plain", *named, "transformers plain"]
  systems = sorted(found, key=lambda n: (n.startswith("transformers"),
                                         order.index(n) if n in order else len(order), n))
  out = []
  for temp in sorted({m["temperature"] for m in ok}):
    at_t = [m for m in ok if m["temperature"] == temp]
    cats = list(dict.fromkeys(m["category"] for m in at_t))
    for cat in cats + ["overall"]:
      ms = at_t if cat == "overall" else [m for m in at_t if m["category"] == cat]
      rate = {}
      for name in systems:
        cells = [m["systems"][name] for m in ms if name in m["systems"]]
        if cells:
          rate[name] = (sum(c["new_tokens"] for c in cells) / sum(c["seconds"] for c in cells),
                        cells)
      for name, (tok_s, cells) in rate.items():
        plain = rate.get(_plain_of(name))
        same = [c.get("identical_to_plain") for c in cells]
        predicted = _mean(c.get("predicted_speedup") for c in cells)
        decode = _mean(c.get("speedup_decode") for c in cells)
        tried, accepted = _pooled(cells, "depth_tried"), _pooled(cells, "depth_accepted")
        out.append({"temperature": temp, "category": cat, "system": name,
                    "acceptance_by_position": [a / t if t else None
                                               for a, t in zip(accepted, tried)],
                    "questions": len(cells), "tau": _mean(c.get("tau") for c in cells),
                    "tok_s": tok_s, "speedup": tok_s / plain[0] if plain else float("nan"),
                    "speedup_decode": decode, "predicted_speedup": predicted,
                    "efficiency": decode / predicted if predicted > 0 else float("nan"),
                    "identical": (sum(bool(s) for s in same)
                                  if temp == 0 and None not in same else None)})
  return out


def _pooled(cells: list[dict], key: str) -> list[int]:
  """The per-depth counts `key` summed over cells (shorter lists padded with zeros)."""
  lists = [c.get(key) or [] for c in cells]
  return [sum(x[d] for x in lists if d < len(x)) for d in range(max(map(len, lists), default=0))]


def _fmt(x, spec: str, suffix: str = "") -> str:
  return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else \
      f"{x:{spec}}{suffix}"


def report(records: list[dict], run_dir) -> str:
  ok = [r for r in records if r.get("metrics")]
  if not ok:
    return "## Spec-Bench on a real model\n\nNo point finished."
  rows = table(ok)
  if run_dir is not None:
    (pathlib.Path(run_dir) / "table.json").write_text(json.dumps(rows, indent=1))
  params = ok[0]["params"]
  ms = [r["metrics"] for r in ok]
  loads = [x for m in ms for x in m["loadavg"]]
  per_cat = {}
  for m in ms:
    per_cat.setdefault((m["temperature"], m["category"]), set()).add(m["question_id"])
  lines = ["## Spec-Bench on a real model", "",
           f"Target `{params.get('target')}`, "
           + (f"transformers on `{params.get('hf_model') or params.get('target')}` (same "
              f"float32 weights), " if params.get("hf_systems") else "no transformers, ")
           + f"prompts `{params.get('prompts')}` "
           f"({max(len(v) for v in per_cat.values())} per category at most), chat template, "
           f"batch 1, {params.get('max_new_tokens')} new tokens at most, median of "
           f"{params.get('repeats')} alternated calls, torch threads "
           f"{ms[0].get('torch_threads')}. Load average during the run: "
           f"{min(loads):.2f} to {max(loads):.2f} on {_cores()} cores"
           + (" (a loaded machine: timings are indicative)." if max(loads) > 0.5 else "."),
           "", "Cells: τ (mean accepted tokens per verification) · speedup over the same "
           "library's plain decoding (end to end, prefill included) · tokens/s."]
  systems = list(dict.fromkeys(r["system"] for r in rows))
  for temp in sorted({r["temperature"] for r in rows}):
    at_t = [r for r in rows if r["temperature"] == temp]
    lines += ["", f"### T = {temp:g}", "",
              "| category | questions | " + " | ".join(systems) + " |",
              "|---|---|" + "---|" * len(systems)]
    for cat in dict.fromkeys(r["category"] for r in at_t):
      cells = {r["system"]: r for r in at_t if r["category"] == cat}
      n = max(c["questions"] for c in cells.values())
      lines.append(f"| {cat} | {n} | " + " | ".join(
          f"{_fmt(cells[s]['tau'], '.2f')} · {_fmt(cells[s]['speedup'], '.2f', '×')} · "
          f"{_fmt(cells[s]['tok_s'], '.1f')}" if s in cells else "-" for s in systems) + " |")
    spec = [s for s in systems if s.startswith("specjax") and s != "specjax plain"]
    if spec:
      lines += ["", f"Decode-phase speedup, measured / calibrated prediction (T = {temp:g}):",
                "", "| category | " + " | ".join(spec) + " |", "|---|" + "---|" * len(spec)]
      for cat in dict.fromkeys(r["category"] for r in at_t):
        cells = {r["system"]: r for r in at_t if r["category"] == cat}
        lines.append(f"| {cat} | " + " | ".join(
            f"{_fmt(cells[s]['speedup_decode'], '.2f')} / "
            f"{_fmt(cells[s]['predicted_speedup'], '.2f')}" if s in cells else "-"
            for s in spec) + " |")
    by_pos = [r for r in at_t if r["category"] == "overall" and r["acceptance_by_position"]]
    if by_pos:
      lines += ["", f"Acceptance by draft position, all questions pooled (T = {temp:g}): "
                "cycles that accepted the depth-d draft ÷ cycles that tried one", ""]
      lines += [f"- {r['system']}: " + " / ".join(_fmt(a, ".3f")
                                                  for a in r["acceptance_by_position"])
                for r in by_pos]
  lines += ["", *_checks(ms, [r for r in rows if r["category"] == "overall"])]
  return "\n".join(lines)


def _cores() -> int:
  import os
  return os.cpu_count() or 1


def _checks(ms: list[dict], overall: list[dict]) -> list[str]:
  """The T = 0 checks: each system's tokens against its library's plain, and specjax plain
  against transformers' greedy tokens, every mismatch listed."""
  t0 = [m for m in ms if m["temperature"] == 0]
  if not t0:
    return []
  out = ["### Checks at T = 0", ""]
  for r in overall:
    if r["temperature"] == 0 and r["identical"] is not None and not r["system"].endswith(
        " plain"):
      out.append(f"- {r['system']}: identical to {_plain_of(r['system'])} on "
                 f"{r['identical']}/{r['questions']} questions")
  for m in t0:
    for name, c in m["systems"].items():
      for d in c.get("divergences", []):
        out.append(f"  - question {m['question_id']}: {name} left plain at token "
                   f"{d['position']} ({_fmt(d.get('ulps'), '.1f')} ulps"
                   f"{', a numerical tie' if (d.get('ulps') or 99) <= 2 else ''})")
  agree = [m for m in t0 if "agree_with_transformers" in m]
  if agree:
    same = sum(m["agree_with_transformers"]["identical"] for m in agree)
    out.append(f"- specjax plain vs transformers plain (greedy, float32): identical tokens on "
               f"{same}/{len(agree)} questions")
    for m in agree:
      a = m["agree_with_transformers"]
      if not a["identical"]:
        d = a.get("divergence") or {}
        out.append(f"  - question {m['question_id']} ({m['category']}): first difference at "
                   f"token {d.get('position', '?')} ({_fmt(d.get('ulps'), '.1f')} ulps apart "
                   f"in specjax's logits{'; ' + d['note'] if 'note' in d else ''})")
  return out
