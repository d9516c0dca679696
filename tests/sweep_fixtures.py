"""Point functions for runner tests (imported by gin configs written inside the tests)."""

import os
import pathlib
import time


def point(x: int, y: str = "a", scale: float = 1.0) -> dict:
  """Fails at x == 13; hard-kills the process at x == KILL_AT until the marker file exists;
  sleeps SWEEP_SLEEP seconds per point; waits while the file SWEEP_HOLD exists (at most 300
  s); x == 2 gives non-finite metrics."""
  if x == 13:
    raise ValueError("x = 13 is unlucky")
  kill_at = os.environ.get("SWEEP_KILL_AT")
  marker = os.environ.get("SWEEP_KILL_MARKER")
  if kill_at is not None and x == int(kill_at) and marker and not pathlib.Path(marker).exists():
    pathlib.Path(marker).write_text("killed once")
    os._exit(137)  # like SIGKILL: no cleanup, no exception handling
  sleep = os.environ.get("SWEEP_SLEEP")
  if sleep:
    time.sleep(float(sleep))
  hold = os.environ.get("SWEEP_HOLD")
  deadline = time.time() + 300
  while hold and pathlib.Path(hold).exists() and time.time() < deadline:
    time.sleep(0.05)
  return {"value": x * scale, "label": f"{y}{x}",
          # not JSON numbers: the record must still be standard JSON
          "ratio": float("inf") if x == 2 else 1.0, "spread": float("nan") if x == 2 else 0.0}


def validate(params: dict) -> None:
  if not isinstance(params["x"], int):
    raise ValueError(f"x must be an int, got {params['x']!r}")
  if params.get("scale", 1.0) <= 0:
    raise ValueError(f"scale must be > 0, got {params['scale']!r}")


def report(records, run_dir) -> str:
  from specjax.sweeps import report as rep
  fig, ax = rep.new_figure()
  ax.plot([r["params"]["x"] for r in records], [r["metrics"]["value"] for r in records], "o")
  return f"![values]({rep.save(fig, run_dir / 'values.png')})\n"


def read_point(x: int, prompts: str = "", draft: str = "") -> dict:
  """Reads what its paths name (a prompt file; a draft reference KIND:DIR whose DIR holds
  weights.bin): results that change with the contents, not the paths."""
  text = pathlib.Path(prompts).read_text() if prompts else ""
  weights = draft.partition(":")[2] or draft
  blob = (pathlib.Path(weights) / "weights.bin").read_bytes() if draft else b""
  return {"text": text, "weights": blob.hex(), "x": x}
