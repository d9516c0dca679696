"""Markdown tables and matplotlib plots for run reports (Agg backend, no display needed)."""

from __future__ import annotations

import math
import pathlib
from typing import Any, Sequence


def _fmt(v: Any) -> str:
  if isinstance(v, bool) or v is None:
    return str(v)
  if isinstance(v, float):
    if math.isnan(v):
      return "nan"
    return f"{v:.4g}"
  if isinstance(v, (list, tuple)):
    return "[" + ", ".join(_fmt(x) for x in v) + "]"
  return cell(v)


def cell(v: Any) -> str:
  """`v` as the text of one markdown table cell: whitespace runs (newlines included) as one
  space, pipes escaped."""
  return " ".join(str(v).split()).replace("|", "\\|")


def markdown_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
  head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
  body = "".join("| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |\n" for r in rows)
  return head + body


def results_table(name: str, records: Sequence[dict], axes: Sequence[str]) -> str:
  """Every point: its swept parameters, status, and scalar metrics.

  `records` are result records as `runner.read_results` returns them (the one reader of
  results.jsonl, which skips corrupt lines); a record lacking "params" or "metrics" (one
  built by hand) shows empty cells instead of failing the report."""
  ok = [r for r in records if r.get("status") == "ok"]
  failed = [r for r in records if r.get("status") != "ok"]
  metric_names: list[str] = []
  for r in ok:
    for k, v in (r.get("metrics") or {}).items():
      scalar = v is None or isinstance(v, (int, float, bool, str))
      if scalar and k not in metric_names:
        metric_names.append(k)
  rows = [{**{a: (r.get("params") or {}).get(a) for a in axes}, **(r.get("metrics") or {})}
          for r in sorted(ok, key=_index)]
  metric_names = [m for m in metric_names if not _repeats_axis(m, axes, rows)]
  text = f"# {name}\n\n{len(ok)} points finished, {len(failed)} failed.\n\n"
  if rows:
    text += markdown_table(rows, list(axes) + metric_names) + "\n"
  if failed:
    text += "## Failed points\n\n" + markdown_table(
        [{**(r.get("params") or {}), "error": r.get("error", "")} for r in failed],
        list(axes) + ["error"]) + "\n"
  return text


def _repeats_axis(metric: str, axes: Sequence[str], rows: Sequence[dict]) -> bool:
  """Whether `metric` only repeats an axis named like it (specbench's `question_id` beside
  its `question` axis): equal to the axis value in every row, so not shown twice."""
  return any(metric != a and metric.startswith(a) and all(
      row.get(a) == row.get(metric) for row in rows) for a in axes)


def _index(record: dict) -> int:
  """A record's position in the sweep (0 when it has none usable)."""
  index = record.get("index", 0)
  return index if isinstance(index, int) else 0


def new_figure(**kwargs):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt.subplots(**kwargs)


def save(fig, path: str | pathlib.Path) -> str:
  path = pathlib.Path(path)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  import matplotlib.pyplot as plt
  plt.close(fig)
  return path.name
