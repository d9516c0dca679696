"""The prepared accelerator check runs on a CPU: its GPU phases are skipped and recorded as
such, and the scaled-down CPU check (benchmarks/bench_scaled_cpu.py) runs end to end on a
tiny shape (figures are never asserted: benchmarks measure, tests check the plumbing)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _env():
  env = dict(os.environ)
  env["PYTHON"] = sys.executable
  return env


SCALE_PHASES = ["scale", "alpha_k_scale", "breakeven_scale", "eagle_scale", "tree_scale",
                "scale_flags"]


def test_the_scale_phases_are_skipped_on_a_cpu(tmp_path):
  env = _env()
  env.pop("DEVICE_CHECK_PHASES", None)  # the default phases: the six scale phases
  proc = subprocess.run(["bash", "benchmarks/device_check.sh", str(tmp_path / "out")],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr
  summary = json.loads((tmp_path / "out" / "device_check.json").read_text())
  assert summary["environment"]["backend"] == "cpu"
  assert summary["phases"] == [{"phase": p, "skipped": "backend cpu is not a GPU"}
                               for p in SCALE_PHASES]
  assert all(summary[p] is None for p in SCALE_PHASES + ["quickstart"])


@pytest.mark.slow
def test_the_scale_phases_run_on_a_tiny_shape_when_forced(tmp_path):
  """The GPU phases' commands, run on a CPU on a tiny shape (DEVICE_CHECK_FORCE=1): each
  phase ends with rc 0 and leaves its rows in the summary."""
  env = dict(_env(), DEVICE_CHECK_FORCE="1", DEVICE_CHECK_TARGET="tiny-llama",
             DEVICE_CHECK_DRAFT="tiny-llama", DEVICE_CHECK_CONTEXT="64", DEVICE_CHECK_VOCAB="512",
             DEVICE_CHECK_CACHE_LEN="256", DEVICE_CHECK_PHASES=" ".join(SCALE_PHASES),
             DEVICE_CHECK_LIMIT_SCALE="6")  # the GPU limits, not a loaded 2-core CPU's
  proc = subprocess.run(["bash", "benchmarks/device_check.sh", str(tmp_path / "out")],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
  assert proc.returncode == 0, proc.stderr[-2000:]
  summary = json.loads((tmp_path / "out" / "device_check.json").read_text())
  assert [(p["phase"], p["rc"]) for p in summary["phases"]] == [(p, 0) for p in SCALE_PHASES]
  scale = summary["scale"]["runs"][0]
  assert scale["target"] == "tiny-llama" and set(scale["plain_by_batch"]) == {"1", "8"}
  points = summary["alpha_k_scale"]
  assert sorted((r["params"]["alpha"], r["params"]["k"]) for r in points) == [
      (a, k) for a in (0.6, 0.8, 0.9) for k in (2, 4, 8)]
  assert sorted(r["params"]["batch"] for r in summary["breakeven_scale"]) == [1, 8, 64]
  flags = summary["scale_flags"]["runs"][0]
  assert set(flags["plain_by_batch"]) == {"1"} and "forward_ms" not in flags
  assert sorted(r["params"]["alpha"] for r in summary["eagle_scale"]) == [0.6, 0.8, 0.9]
  assert all(r["params"]["draft"] == "eagle" for r in summary["eagle_scale"])
  assert [r["metrics"]["shape"] for r in summary["tree_scale"]] == ["tree 14 nodes, depth 4"] * 3
  for row in points + summary["breakeven_scale"] + summary["eagle_scale"] + summary["tree_scale"]:
    assert row["params"]["target"] == "random:tiny-llama:vocab_size=512"
    assert row["status"] == "ok" and row["metrics"]["predicted_from"] == "calibrated"
    assert row["metrics"]["speedup"] > 0 and row["metrics"]["speedup_formula"] > 0


def test_a_bad_limit_scale_is_refused_by_name(tmp_path):
  env = dict(_env(), DEVICE_CHECK_LIMIT_SCALE="0.5")
  proc = subprocess.run(["bash", "benchmarks/device_check.sh", str(tmp_path / "out")],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2
  assert "DEVICE_CHECK_LIMIT_SCALE=0.5" in proc.stderr


@pytest.mark.slow
def test_the_scaled_cpu_check_runs_on_a_tiny_shape(tmp_path):
  out = tmp_path / "scaled.json"
  proc = subprocess.run(
      [sys.executable, "benchmarks/bench_scaled_cpu.py", "--target", "tiny-gpt2",
       "--context", "16", "--new-tokens", "24", "--cache-len", "64", "--repeats", "1",
       "--out", str(out)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  run = json.loads(out.read_text())["run"]
  assert run["target"] == "tiny-gpt2" and run["alpha"] == 0.8 and run["k"] == 4
  for key in ("fraction_of_matmul_chain", "efficiency", "efficiency_at_run_tau"):
    assert run[key] > 0, key
  assert 1 <= run["measured"]["tau"] <= run["k"] + 1
  assert set(run["goals"]) == {"fraction_of_matmul_chain >= 0.9", "efficiency in [0.9, 1.1]"}


def test_the_scaled_cpu_check_refuses_a_cache_too_short():
  proc = subprocess.run(
      [sys.executable, "benchmarks/bench_scaled_cpu.py", "--target", "tiny-gpt2",
       "--context", "64", "--new-tokens", "128", "--cache-len", "64"], cwd=ROOT, env=_env(),
      capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2 and "--cache-len 64 must hold" in proc.stderr
