"""Experiment runner: gin parsing and errors, resume after a kill, failing points, shards,
merge, reports, and a multi-device sweep equal to a serial one."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from specjax.cli import main
from specjax.sweeps import launch, runner

TESTS = pathlib.Path(__file__).parent

CONFIG = """
from __gin__ import dynamic_registration
import specjax.sweeps as sweeps
import sweep_fixtures as fx

sweeps.Sweep:
  name = "toy"
  point_fn = @fx.point
  validate_fn = @fx.validate
  report_fn = @fx.report
  axes = {"x": [1, 2, 3, 4, 5], "y": ["a", "b"]}
  fixed = {"scale": 2.0}
"""


@pytest.fixture
def config(tmp_path):
  path = tmp_path / "toy.gin"
  path.write_text(CONFIG)
  return path


def _run(args, env=None):
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
         **(env or {})}
  return subprocess.run([sys.executable, "-m", "specjax.cli", *args], env=env,
                        capture_output=True, text=True, timeout=600)


def test_sweep_runs_every_point_and_writes_report(config, tmp_path):
  s = launch.run(str(config), out=str(tmp_path / "run"), progress=False)
  assert (s.total, s.ok, s.failed, s.skipped) == (10, 10, 0, 0)
  records = runner.read_results(tmp_path / "run" / runner.RESULTS)
  assert sorted(r["metrics"]["value"] for r in records.values()) == sorted(
      [2.0 * x for x in range(1, 6)] * 2)
  report = (tmp_path / "run" / "report.md").read_text()
  assert "10 points finished, 0 failed" in report and "![values](values.png)" in report
  assert (tmp_path / "run" / "values.png").stat().st_size > 1000
  env = json.loads((tmp_path / "run" / "environment.json").read_text())
  assert env["jax"] and env["local_device_count"] >= 1
  assert "sweeps.Sweep.name = 'toy'" in (tmp_path / "run" / "config.gin").read_text()
  again = launch.run(str(config), out=str(tmp_path / "run"), progress=False)
  assert again.resumed and (again.skipped, again.ok) == (10, 0)


def test_killed_sweep_resumes_and_finishes_every_point_exactly_once(config, tmp_path):
  out = tmp_path / "run"
  env = {"SWEEP_KILL_AT": "3", "SWEEP_KILL_MARKER": str(tmp_path / "marker")}
  first = _run(["run", str(config), "--out", str(out), "--no-progress"], env)
  assert first.returncode == 137, first.stderr[-2000:]
  partial = runner.read_results(out / runner.RESULTS)
  assert 0 < len(partial) < 10  # the point in flight was lost, nothing else
  second = _run(["run", str(config), "--out", str(out), "--no-progress", "--json"], env)
  assert second.returncode == 0, second.stderr[-2000:]
  summary = json.loads(second.stdout)
  assert summary["resumed"] and summary["skipped"] == len(partial)
  lines = [json.loads(l) for l in (out / runner.RESULTS).read_text().splitlines() if l.strip()]
  ids = [l["id"] for l in lines]
  assert len(ids) == len(set(ids)) == 10  # every point exactly once


def test_failing_point_is_recorded_and_retried_without_stopping_the_sweep(tmp_path):
  path = tmp_path / "fail.gin"
  path.write_text(CONFIG.replace('"x": [1, 2, 3, 4, 5]', '"x": [12, 13, 14]'))
  s = launch.run(str(path), out=str(tmp_path / "run"), progress=False)
  assert (s.ok, s.failed) == (4, 2)
  records = runner.read_results(tmp_path / "run" / runner.RESULTS)
  errors = [r for r in records.values() if r["status"] == "error"]
  assert len(errors) == 2 and all("x = 13 is unlucky" in r["error"] for r in errors)
  assert "## Failed points" in (tmp_path / "run" / "report.md").read_text()
  again = launch.run(str(path), out=str(tmp_path / "run"), progress=False)
  assert (again.skipped, again.ok, again.failed) == (4, 0, 2)  # failures retried, not skipped


@pytest.mark.parametrize("change, match", [
    (("sweeps.Sweep:", "sweeps.Swep:"), "closest valid names: sweeps.Sweep"),
    (("point_fn = @fx.point", "point_fn = @fx.pont"), "closest valid names: fx.point"),
    (('"y": ["a", "b"]', '"yy": ["a", "b"]'), "unknown parameter 'yy'.*did you mean y"),
    (('fixed = {"scale": 2.0}', 'fixed = {"scale": -1.0}'), "scale must be > 0"),
    (('"x": [1, 2, 3, 4, 5]', '"x": [1, "two"]'), "x must be an int"),
    (("name = \"toy\"", "nme = \"toy\""), "closest valid names: name"),
    (("import specjax.sweeps as sweeps", "import experiments.common as sweeps"),
     "`Sweep` now lives in the library"),  # a config written before the move
])
def test_bad_configs_fail_before_any_work_with_clear_errors(tmp_path, change, match):
  path = tmp_path / "bad.gin"
  path.write_text(CONFIG.replace(*change))
  with pytest.raises(ValueError, match=match):
    launch.run(str(path), out=str(tmp_path / "run"), progress=False)
  assert not (tmp_path / "run").exists()  # nothing was written


def test_cli_errors_unknown_experiment_binding_and_occupied_out(config, tmp_path, capsys):
  assert main(["run", "quikstart-nonexistent"]) == 2
  assert "unknown experiment config" in capsys.readouterr().err
  assert main(["run", str(config), "--gin_param", "sweeps.Sweep.sede = 3",
               "--out", str(tmp_path / "r")]) == 2
  assert "closest valid names: seed" in capsys.readouterr().err
  occupied = tmp_path / "occupied"
  occupied.mkdir()
  (occupied / "precious.txt").write_text("keep me")
  assert main(["run", str(config), "--out", str(occupied)]) == 2
  assert "not a specjax run directory" in capsys.readouterr().err
  assert (occupied / "precious.txt").read_text() == "keep me"
  other = tmp_path / "other"
  launch.run(str(config), out=str(other), progress=False)
  before = (other / runner.RESULTS).read_text()
  assert main(["run", str(config), "--gin_param", "sweeps.Sweep.seed = 7",
               "--out", str(other)]) == 2
  assert "holds a different run" in capsys.readouterr().err
  assert (other / runner.RESULTS).read_text() == before
  locked = tmp_path / "locked"
  locked.mkdir()
  locked.chmod(0o500)
  if not os.access(locked, os.W_OK):  # root ignores permission bits
    assert main(["run", str(config), "--out", str(locked / "x")]) == 2
    assert "not writable" in capsys.readouterr().err


def test_shards_cover_the_sweep_and_merge_into_one_run(config, tmp_path):
  dirs = []
  for i in range(3):
    s = launch.run(str(config), out=str(tmp_path / f"shard{i}"), shard_index=i, num_shards=3,
                   progress=False)
    dirs.append(s.run_dir)
  assert sum(len(runner.read_results(d / runner.RESULTS)) for d in dirs) == 10
  assert main(["merge", *map(str, dirs), "--out", str(tmp_path / "merged")]) == 0
  merged = runner.read_results(tmp_path / "merged" / runner.RESULTS)
  full = launch.run(str(config), out=str(tmp_path / "full"), progress=False)
  assert merged.keys() == runner.read_results(full.run_dir / runner.RESULTS).keys()
  assert "10 points finished" in (tmp_path / "merged" / "report.md").read_text()
  with pytest.raises(ValueError, match="shard_index must be in"):
    runner.shard(runner.expand({"x": [1]}), 3, 3)


def test_two_process_jax_distributed_sweep_splits_and_merges(config, tmp_path):
  """`--coordinator/--num-processes/--process-id`: jax.distributed across two processes,
  each running its shard of the sweep; merged, they are the whole sweep."""
  import socket
  with socket.socket() as sock:
    sock.bind(("localhost", 0))
    port = sock.getsockname()[1]
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
  procs = [subprocess.Popen(
      [sys.executable, "-m", "specjax.cli", "run", str(config), "--no-progress", "--json",
       "--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i),
       "--out", str(tmp_path / f"p{i}")], env=env, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True) for i in range(2)]
  outs = [p.communicate(timeout=300) for p in procs]
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  counts = [len(runner.read_results(tmp_path / f"p{i}" / runner.RESULTS)) for i in range(2)]
  assert sorted(counts) == [5, 5]
  for i in range(2):
    env_rec = json.loads((tmp_path / f"p{i}" / "environment.json").read_text())
    assert (env_rec["process_index"], env_rec["process_count"]) == (i, 2)
  assert main(["merge", str(tmp_path / "p0"), str(tmp_path / "p1"),
               "--out", str(tmp_path / "m")]) == 0
  assert len(runner.read_results(tmp_path / "m" / runner.RESULTS)) == 10
  assert main(["run", str(config), "--coordinator", "localhost:1", "--process-id", "0"]) == 2


def test_torn_last_line_is_ignored_and_fenced(tmp_path):
  path = tmp_path / runner.RESULTS
  runner.append_result(path, {"id": "a", "status": "ok"})
  with open(path, "a") as f:
    f.write('{"id": "b", "sta')  # a writer killed mid-line
  assert set(runner.read_results(path)) == {"a"}
  runner.append_result(path, {"id": "c", "status": "ok"})
  assert set(runner.read_results(path)) == {"a", "c"}


EXACTNESS_ARGS = ["run", "exactness", "--no-progress", "--json", "--gin_param",
                  'sweeps.Sweep.axes = {"vocab": [8], "kind": ["stochastic"], '
                  '"temperature": [0.7, 1.0, 1.3], "top_p": [1.0]}',
                  "--gin_param", 'sweeps.Sweep.fixed = {"samples": 4000}']


def test_sweep_over_four_fake_devices_matches_serial_run(tmp_path):
  serial = _run([*EXACTNESS_ARGS, "--out", str(tmp_path / "serial")],
                {"XLA_FLAGS": "--xla_backend_optimization_level=0"})
  assert serial.returncode == 0, serial.stderr[-3000:]
  multi = _run([*EXACTNESS_ARGS, "--out", str(tmp_path / "multi")],
               {"XLA_FLAGS": "--xla_force_host_platform_device_count=4 "
                             "--xla_backend_optimization_level=0"})
  assert multi.returncode == 0, multi.stderr[-3000:]
  env = json.loads((tmp_path / "multi" / "environment.json").read_text())
  assert env["local_device_count"] == 4
  a = runner.read_results(tmp_path / "serial" / runner.RESULTS)
  b = runner.read_results(tmp_path / "multi" / runner.RESULTS)
  assert a.keys() == b.keys() and len(a) == 3
  for pid in a:
    ma, mb = a[pid]["metrics"], b[pid]["metrics"]
    assert ma["counts"] == mb["counts"]  # the same samples, token for token
    assert ma["p_value"] == pytest.approx(mb["p_value"], rel=1e-5)  # p in float32 on each side
    assert ma["passed"] and mb["passed"]
