"""Experiment runner: gin parsing and errors, resume after a kill, failing points, shards,
merge, reports, and a multi-device sweep equal to a serial one."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from specjax.cli import main
from specjax.sweeps import launch, run_directory, runner

TESTS = pathlib.Path(__file__).parents[1]  # tests/: sweep_fixtures.py

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


def test_a_run_on_another_mesh_is_another_run(config, tmp_path):
  """The CLI's --mesh is part of a run's identity: the same config on a mesh does not resume
  the one-device run's directory (its timings are another machine's), and the mesh is
  recorded; one device keeps the fingerprint runs had before meshes existed."""
  from specjax import sharding
  root = tmp_path / "runs"
  first = launch.run(str(config), root=str(root), progress=False)
  with sharding.default_mesh((1, 1)):
    meshed = launch.run(str(config), root=str(root), progress=False)
    again = launch.run(str(config), root=str(root), progress=False)
  assert not meshed.resumed and meshed.run_dir != first.run_dir
  assert again.resumed and again.run_dir == meshed.run_dir
  assert json.loads((meshed.run_dir / "environment.json").read_text())["mesh"] == {
      "data": 1, "model": 1}
  assert json.loads((first.run_dir / "environment.json").read_text())["mesh"] is None
  assert json.loads((meshed.run_dir / "config.json").read_text())["mesh"] == [1, 1]
  assert run_directory.fingerprint("c", 0, 1) == run_directory.fingerprint("c", 0, 1, None)


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


@pytest.mark.slow  # compile-bound (5-18 s): the fast tier's 3 minutes
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


@pytest.mark.slow
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


def _record(pid: str, **extra) -> dict:
  """A minimal well-formed result record (one the toy config's report can plot)."""
  return {"id": pid, "params": {"x": 0, "name": pid}, "status": "ok",
          "metrics": {"value": 0.0}, **extra}


def test_torn_last_line_is_ignored_and_fenced(tmp_path):
  path = tmp_path / runner.RESULTS
  runner.append_result(path, _record("a"))
  with open(path, "a") as f:
    f.write('{"id": "b", "sta')  # a writer killed mid-line
  assert set(runner.read_results(path)) == {"a"}
  runner.append_result(path, _record("c"))
  assert set(runner.read_results(path)) == {"a", "c"}


EXACTNESS_ARGS = ["run", "exactness", "--no-progress", "--json", "--gin_param",
                  'sweeps.Sweep.axes = {"vocab": [8], "kind": ["stochastic"], '
                  '"temperature": [0.7, 1.0, 1.3], "top_p": [1.0]}',
                  "--gin_param", 'sweeps.Sweep.fixed = {"samples": 4000}']


@pytest.mark.slow
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


# ----------------------------------------------------------------------------- issue 16


def _strict(line: str) -> dict:
  def refuse(name):
    raise ValueError(f"not standard JSON: {name}")
  return json.loads(line, parse_constant=refuse)


SMALL_EXACTNESS = ['sweeps.Sweep.axes = {"vocab": [8], "kind": ["stochastic"], '
                   '"temperature": [0.7, 1.0, 1.3], "top_p": [1.0]}',
                   'sweeps.Sweep.fixed = {"samples": 400}']


def test_a_point_gives_the_same_numbers_alone_in_a_group_resumed_and_sharded(tmp_path):
  from specjax.experiments import exactness
  full = launch.run("exactness", SMALL_EXACTNESS, out=str(tmp_path / "full"), progress=False)
  assert full.ok == 3
  grouped = {pid: r for pid, r in runner.read_results(full.run_dir / runner.RESULTS).items()}
  middle = next(r for r in grouped.values() if r["params"]["temperature"] == 1.0)
  # alone, called directly (defaults filled in by the point function itself)
  alone = json.loads(json.dumps(exactness.point(**middle["params"])))
  assert alone == middle["metrics"]
  # resumed: the middle point's line lost, the re-run computes it alone
  res = tmp_path / "resumed"
  launch.run("exactness", SMALL_EXACTNESS, out=str(res), progress=False)
  lines = (res / runner.RESULTS).read_text().splitlines()
  (res / runner.RESULTS).write_text(
      "".join(l + "\n" for l in lines if json.loads(l)["id"] != middle["id"]))
  again = launch.run("exactness", SMALL_EXACTNESS, out=str(res), progress=False)
  assert (again.skipped, again.ok) == (2, 1)
  # two shards: points 0 and 2 as a group of two, point 1 alone
  sharded = {}
  for i in range(2):
    s = launch.run("exactness", SMALL_EXACTNESS, out=str(tmp_path / f"s{i}"), shard_index=i,
                   num_shards=2, progress=False)
    sharded.update(runner.read_results(s.run_dir / runner.RESULTS))
  for other in (runner.read_results(res / runner.RESULTS), sharded):
    assert other.keys() == grouped.keys()
    for pid in grouped:
      assert other[pid]["metrics"] == grouped[pid]["metrics"]  # bit-identical records


def test_point_seed_depends_on_the_point_only():
  from specjax.sweeps import parallel
  a = {"x": 1, "seed": 0}
  assert runner.point_seed(a) == runner.point_seed(dict(reversed(list(a.items()))))
  assert runner.point_seed(a) != runner.point_seed({"x": 1, "seed": 1})
  assert runner.point_seed(a, "mc") != runner.point_seed(a, "loop")
  assert 0 <= runner.point_seed(a) < 2**31
  import jax
  keys = parallel.point_keys([5, 7])
  assert (jax.random.key_data(keys[1]) == jax.random.key_data(jax.random.key(7))).all()


def test_sweep_seed_becomes_the_points_seed(tmp_path):
  s, _ = launch.load_sweep("exactness", [*SMALL_EXACTNESS, "sweeps.Sweep.seed = 5"])
  assert all(p.params["seed"] == 5 for p in launch.plan(s))
  with pytest.raises(ValueError, match="both set the points' seed"):
    launch.load_sweep("exactness", ['sweeps.Sweep.fixed = {"seed": 1}', "sweeps.Sweep.seed = 5"])


@pytest.mark.slow
def test_two_concurrent_runs_into_one_directory_one_writer(config, tmp_path):
  """The second run starts while the first holds the lock: the first run's points wait
  while a hold file exists (removed once the second has answered), so a slow machine cannot
  let the first finish before the second asks."""
  out = tmp_path / "run"
  hold = tmp_path / "hold"
  hold.write_text("the first run waits while this file exists")
  env = {**os.environ, "SWEEP_HOLD": str(hold),
         "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
  first = subprocess.Popen([sys.executable, "-m", "specjax.cli", "run", str(config), "--out",
                            str(out), "--no-progress"], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
  import time
  deadline = time.time() + 240
  lock = out / run_directory.LOCK

  def first_holds_the_lock():  # its pid is written once its flock is taken
    return lock.exists() and lock.read_text().strip() == str(first.pid)
  try:
    while not first_holds_the_lock() and first.poll() is None and time.time() < deadline:
      time.sleep(0.1)  # the first run starts; its points then wait on the hold file
    assert first_holds_the_lock(), "the first run never took the lock"
    second = _run(["run", str(config), "--out", str(out), "--no-progress"])
  finally:  # never leave the first run waiting on the file, whatever failed above
    hold.unlink()
  _, err = first.communicate(timeout=300)
  assert first.returncode == 0, err[-2000:]
  assert second.returncode == 2, second.stderr[-2000:]
  message = second.stderr.strip().splitlines()
  assert len(message) == 1 and "Traceback" not in second.stderr
  assert f"pid {first.pid}" in message[0] and str(out) in message[0]
  ids = [_strict(l)["id"] for l in (out / runner.RESULTS).read_text().splitlines()]
  assert len(ids) == len(set(ids)) == 10  # every point recorded exactly once
  third = _run(["run", str(config), "--out", str(out), "--no-progress", "--json"])
  assert third.returncode == 0 and json.loads(third.stdout)["skipped"] == 10  # lock released


def test_lock_held_in_process_refuses_a_run_and_frees_on_release(config, tmp_path):
  out = tmp_path / "run"
  launch.run(str(config), out=str(out), progress=False)
  lock = run_directory.RunLock(out).acquire()
  try:
    with pytest.raises(run_directory.RunDirError, match=f"in use by another specjax run \\(pid "
                       f"{os.getpid()}\\)"):
      launch.run(str(config), out=str(out), progress=False)
  finally:
    lock.release()
  assert launch.run(str(config), out=str(out), progress=False).skipped == 10


def test_disk_full_keeps_results_well_formed_and_ends_with_one_line(config, tmp_path,
                                                                    monkeypatch, capsys):
  import errno
  out = tmp_path / "run"
  real_write = os.write
  calls = []

  def write(fd, data):
    calls.append(1)
    if len(calls) == 4:  # the fourth line: half of it reaches the disk, then the disk is full
      real_write(fd, data[:len(data) // 2])
      raise OSError(errno.ENOSPC, "No space left on device")
    return real_write(fd, data)

  monkeypatch.setattr(runner, "_os_write", write)
  assert main(["run", str(config), "--out", str(out), "--no-progress"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert "no space left on device" in err[-1] and str(out / runner.RESULTS) in err[-1]
  assert "Traceback" not in "\n".join(err)
  lines = (out / runner.RESULTS).read_text().splitlines()
  assert len(lines) == 3 and all(_strict(l)["status"] == "ok" for l in lines)
  monkeypatch.setattr(runner, "_os_write", real_write)
  s = launch.run(str(config), out=str(out), progress=False)
  assert (s.skipped, s.ok) == (3, 7)
  assert len([_strict(l) for l in (out / runner.RESULTS).read_text().splitlines()]) == 10


def test_records_are_standard_json_failed_and_non_finite_points_included(tmp_path):
  path = tmp_path / "fail.gin"
  path.write_text(CONFIG.replace('"x": [1, 2, 3, 4, 5]', '"x": [2, 13]'))
  s = launch.run(str(path), out=str(tmp_path / "run"), progress=False)
  assert (s.ok, s.failed) == (2, 2)
  records = [_strict(l) for l in (tmp_path / "run" / runner.RESULTS).read_text().splitlines()]
  ok = [r for r in records if r["status"] == "ok"]
  assert all(r["metrics"]["ratio"] is None and r["metrics"]["spread"] is None for r in ok)
  assert all(r["non_finite"] == {"metrics.ratio": "inf", "metrics.spread": "nan"} for r in ok)
  assert all("x = 13 is unlucky" in r["error"] for r in records if r["status"] == "error")
  read = [r for r in runner.read_results(tmp_path / "run" / runner.RESULTS).values()
          if r["status"] == "ok"]  # readers get the point's own values back
  assert all(r["metrics"]["ratio"] == float("inf") and r["metrics"]["spread"] !=
             r["metrics"]["spread"] for r in read)
  path = tmp_path / "nested.jsonl"
  runner.append_result(path, _record("n", m={"h": [1.0, float("-inf")]}))
  assert _strict(path.read_text())["non_finite"] == {"m.h[1]": "-inf"}
  assert runner.read_results(path)["n"]["m"]["h"] == [1.0, float("-inf")]


@pytest.mark.parametrize("binding, match", [
    ("sweeps.Sweep.axes = 5", r"Sweep.axes must be a dict of parameter name -> list"),
    ('sweeps.Sweep.axes = {"x": 5}', r"Sweep.axes\['x'\] must be a non-empty list"),
    ('sweeps.Sweep.axes = {"x": []}', r"Sweep.axes\['x'\] is empty"),
    ("sweeps.Sweep.fixed = [1]", r"Sweep.fixed must be a dict"),
    ("sweeps.Sweep.vectorized = 'x'", r"Sweep.vectorized must be a list of names"),
    ("sweeps.Sweep.seed = -1", r"Sweep.seed must be None or an int"),
])
def test_bad_sweep_field_bindings_are_one_line_errors(config, tmp_path, capsys, binding, match):
  assert main(["run", str(config), "--gin_param", binding, "--out", str(tmp_path / "r")]) == 2
  err = capsys.readouterr().err
  assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
  import re
  assert re.search(match, err), err
  assert not (tmp_path / "r").exists()


def test_out_pointing_at_a_file_is_a_one_line_error_for_run_and_merge(config, tmp_path, capsys):
  afile = tmp_path / "afile"
  afile.write_text("keep")
  for args in (["run", str(config), "--out", str(afile)],
               ["run", str(config), "--out", str(afile / "sub")]):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "is a file, not a directory" in err and str(afile) in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
  run = launch.run(str(config), out=str(tmp_path / "r"), progress=False).run_dir
  assert main(["merge", str(run), "--out", str(afile)]) == 2
  err = capsys.readouterr().err
  assert "is a file, not a directory" in err and str(afile) in err
  assert main(["merge", str(afile), "--out", str(tmp_path / "m")]) == 2
  assert "is not a directory" in capsys.readouterr().err
  assert afile.read_text() == "keep"


@pytest.mark.slow
def test_alpha_k_point_alone_equals_the_point_in_its_vectorised_group(tmp_path):
  """The issue's case: α = 0.8, k = 3 gave another alpha_trial when resumed alone."""
  from specjax.experiments import alpha_k_sweep
  s = launch.run("alpha_k_sweep", out=str(tmp_path / "ak"), progress=False, bindings=[
      'sweeps.Sweep.axes = {"alpha": [0.5, 0.8], "k": [3]}',
      'sweeps.Sweep.fixed = {"models": "random", "max_new_tokens": 32, "batch": 1, '
      '"repeats": 3, "mc_cycles": 200}'])  # calibration times decode minus prefill: with
  # 16 tokens and 1 repeat a loaded worker once measured decode faster than the prefill
  assert s.ok == 2
  grouped = next(r for r in runner.read_results(s.run_dir / runner.RESULTS).values()
                 if r["params"]["alpha"] == 0.8)
  alone = alpha_k_sweep.point(**grouped["params"])
  for name in ("alpha_trial", "trials", "tau_cycle", "histogram", "cycles", "tau_mc"):
    assert alone[name] == grouped["metrics"][name], name  # timings aside, bit-identical


def test_sweep_frees_compiled_programs_near_the_memory_mapping_limit(tmp_path, monkeypatch):
  """A long sweep clears JAX's compiled-program caches after a group once the process holds
  half the kernel's mapping limit (a full sweep in one process once aborted in a compile at
  the limit), and leaves them alone below it."""
  import jax
  real = runner.memory_mappings()
  assert real is None or 0 < real[0] < real[1]  # this process, under the kernel's limit
  cleared = []
  monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(1))
  points = runner.expand({"x": [1, 2, 3]})
  run = lambda group: [{"y": p.params["x"]} for p in group]  # noqa: E731
  monkeypatch.setattr(runner, "memory_mappings", lambda: (1_000, 65_530))
  assert runner.run_points(points, tmp_path, run, progress=False) == (0, 3, 0)
  assert cleared == []
  monkeypatch.setattr(runner, "memory_mappings", lambda: (40_000, 65_530))
  assert runner.run_points(runner.expand({"x": [4, 5]}), tmp_path, run, progress=False) == (
      0, 2, 0)
  assert len(cleared) == 2  # after each of the two groups
  monkeypatch.setattr(runner, "memory_mappings", lambda: None)  # no /proc: nothing to do
  assert runner.free_compiled_programs_if_needed() is False and len(cleared) == 2


# ----------------------------------------------------------------------------- issue 29


def _corrupt(path: pathlib.Path) -> list[int]:
  """Appends five corrupt lines among good ones to results file `path`; returns their line
  numbers (1-based): invalid UTF-8 (the probe's 0xff), a record without params, a JSON
  array, status ok without metrics, and a torn line; a good record and a blank line lie
  between them."""
  lines = path.read_bytes().splitlines(keepends=True) if path.exists() else []
  n = len(lines)
  bad = [b'{"id": "u", "params": {}, "status": "ok", "metrics": {"v": "\xff\xfe"}}\n',
         b'{"id": "np", "status": "ok", "metrics": {}}\n',
         b'[1, 2, 3]\n',
         b'{"id": "nm", "params": {}, "status": "ok"}\n',
         b'{"id": "torn", "par\n']
  good = json.dumps(_record("g")).encode() + b"\n"
  with open(path, "ab") as f:
    f.write(bad[0] + bad[1] + good + b"\n" + bad[2] + bad[3] + bad[4])
  return [n + 1, n + 2, n + 5, n + 6, n + 7]


def test_every_corrupt_line_is_skipped_and_reported_once_with_its_number(tmp_path, capsys):
  path = tmp_path / runner.RESULTS
  runner.append_result(path, _record("a"))
  numbers = _corrupt(path)
  assert numbers == [2, 3, 6, 7, 8]
  runner.append_result(path, _record("z"))  # an append after a torn line still reads back
  records, skipped = runner.scan_results(path)
  assert set(records) == {"a", "g", "z"} and skipped == numbers
  capsys.readouterr()
  assert set(runner.read_results(path)) == {"a", "g", "z"}
  err = capsys.readouterr().err.strip().splitlines()
  assert err == [f"specjax: warning: skipped 5 corrupt lines in {str(path)!r}: lines 2, 3, 6, "
                 "7, 8 (not valid UTF-8, JSON or a result record; the other lines are used)"]
  runner.read_results(path)  # the same file and lines: not reported again
  assert capsys.readouterr().err == ""
  assert runner.read_results(tmp_path / "missing.jsonl") == {}
  (tmp_path / "adir.jsonl").mkdir()
  with pytest.raises(run_directory.RunDirError, match="cannot read .*adir.jsonl"):
    runner.read_results(tmp_path / "adir.jsonl")
  many = runner.skipped_lines_message("f", list(range(1, 14)))
  assert "lines 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, ... (3 more)" in many


def test_run_resumes_and_merge_joins_past_corrupt_lines(config, tmp_path, capsys):
  """The probe's case: one line of invalid UTF-8 (and a record without params) stopped
  `specjax run` and `specjax merge` for good."""
  out = tmp_path / "run"
  assert launch.run(str(config), out=str(out), progress=False).ok == 10
  path = out / runner.RESULTS
  lines = path.read_bytes().splitlines(keepends=True)
  # two finished points' lines damaged: one flipped to invalid UTF-8, one losing its params
  lines[3] = lines[3].replace(b'"status"', b'"st\xffatus"')
  rec = json.loads(lines[5])
  del rec["params"]
  lines[5] = json.dumps(rec).encode() + b"\n"
  path.write_bytes(b"".join(lines))
  capsys.readouterr()
  assert main(["run", str(config), "--out", str(out), "--no-progress", "--json"]) == 0
  cap = capsys.readouterr()
  summary = json.loads(cap.out)
  assert (summary["skipped"], summary["ok"], summary["failed"]) == (8, 2, 0)  # 2 run again
  warnings = [l for l in cap.err.splitlines() if "corrupt" in l]
  assert warnings == [f"specjax: warning: skipped 2 corrupt lines in {str(path)!r}: lines 4, "
                      "6 (not valid UTF-8, JSON or a result record; the other lines are used)"]
  assert "10 points finished" in (out / "report.md").read_text()
  records = runner.read_results(path)
  assert len(records) == 10 and all(r["status"] == "ok" for r in records.values())

  # merge: a shard with corrupt lines joins with the rest, named in one warning
  shards = [launch.run(str(config), out=str(tmp_path / f"s{i}"), shard_index=i, num_shards=2,
                       progress=False).run_dir for i in range(2)]
  numbers = _corrupt(shards[1] / runner.RESULTS)
  capsys.readouterr()
  assert main(["merge", *map(str, shards), "--out", str(tmp_path / "merged")]) == 0
  err = capsys.readouterr().err
  assert f"skipped 5 corrupt lines in {str(shards[1] / runner.RESULTS)!r}: lines " + ", ".join(
      map(str, numbers)) in err and "Traceback" not in err
  merged = runner.read_results(tmp_path / "merged" / runner.RESULTS)
  assert set(merged) == set(records) | {"g"}  # every good line kept, the corrupt ones not


def test_damaged_config_json_is_reported_as_damaged_not_as_another_run(config, tmp_path,
                                                                       capsys):
  out = tmp_path / "run"
  launch.run(str(config), out=str(out), progress=False)
  cfg = out / "config.json"
  text = cfg.read_text()
  before = (out / runner.RESULTS).read_bytes()
  capsys.readouterr()
  for damage in (text[:len(text) // 2], b"\xff" + text.encode(), "[]", '{"name": "toy"}'):
    cfg.write_bytes(damage.encode() if isinstance(damage, str) else damage)
    assert main(["run", str(config), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert f"{str(cfg)!r} is damaged" in err[0] and "holds a different run" not in err[0]
    assert "remove that directory" in err[0]
    assert main(["merge", str(out), "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot merge {str(out)!r}: {str(cfg)!r} is damaged" in err[0]
    assert not (tmp_path / "m").exists()
  assert (out / runner.RESULTS).read_bytes() == before  # nothing was written
  # without --out: a damaged directory under runs/NAME is named and passed over
  root = tmp_path / "root"
  first = launch.run(str(config), root=str(root), progress=False).run_dir
  (first / "config.json").write_text("{")
  capsys.readouterr()
  second = launch.run(str(config), root=str(root), progress=False)
  assert second.run_dir != first and not second.resumed and second.ok == 10
  assert f"ignoring run directory {str(first)!r}: {str(first / 'config.json')!r} is damaged" in (
      capsys.readouterr().err)


@pytest.mark.parametrize("mask", [0o022, 0o002])
def test_run_directory_files_get_the_modes_the_umask_gives(config, tmp_path, umask, mask):
  umask(mask)
  out = tmp_path / "run"
  launch.run(str(config), out=str(out), progress=False)
  file_mode, dir_mode = 0o666 & ~mask, 0o777 & ~mask
  assert out.stat().st_mode & 0o777 == dir_mode
  for name in ("config.gin", "config.json", "environment.json", runner.RESULTS, "report.md",
               run_directory.LOCK):
    assert (out / name).stat().st_mode & 0o777 == file_mode, name
  assert main(["merge", str(out), "--out", str(tmp_path / "merged")]) == 0
  for p in [tmp_path / "merged", *(tmp_path / "merged").iterdir()]:
    assert p.stat().st_mode & 0o777 == (dir_mode if p.is_dir() else file_mode), p
  assert not [p for p in out.iterdir() if ".tmp" in p.name]  # no temporary file left


def test_atomic_write_text_keeps_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
  import errno
  path = tmp_path / "report.md"
  runner.atomic_write_text(path, "old")

  def full(fd):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(os, "fsync", full)
  with pytest.raises(run_directory.RunDirError,
                     match="no space left on device writing .*report.md"):
    runner.atomic_write_text(path, "new " * 1000)
  monkeypatch.undo()
  assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["report.md"]


CACHE_SCRIPT = """
from specjax.commands import run
run._compilation_cache()
import jax, jax.numpy as jnp
for i in range(12):
  jax.jit(lambda x, i=i: jnp.sin(x) * i + jnp.cos(x) ** i)(jnp.ones(100 + i)).block_until_ready()
"""


@pytest.mark.parametrize("mb, bounded", [("0.02", True), ("-1", False)])
def test_compilation_cache_is_bounded(tmp_path, mb, bounded):
  """`specjax run`'s persistent compilation cache keeps at most $SPECJAX_XLA_CACHE_MB (JAX
  evicts the least recently used programs); -1 keeps every one (the negative control)."""
  env = {k: v for k, v in os.environ.items() if k != "SPECJAX_NO_COMPILATION_CACHE"}
  env.update(SPECJAX_CACHE_DIR=str(tmp_path), SPECJAX_XLA_CACHE_MB=mb)
  done = subprocess.run([sys.executable, "-c", CACHE_SCRIPT], env=env, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  entries = [p.stat().st_size for p in (tmp_path / "xla").glob("*-cache")]
  if bounded:
    assert 2 <= len(entries) < 12 and sum(entries) <= 0.02 * 2**20, entries
  else:
    assert len(entries) >= 12, entries


@pytest.mark.parametrize("text", ["0", "-2", "many", "inf", "nan"])
def test_compilation_cache_bound_refused(monkeypatch, text):
  from specjax.commands import run
  monkeypatch.setenv("SPECJAX_XLA_CACHE_MB", text)
  with pytest.raises(ValueError, match=f"SPECJAX_XLA_CACHE_MB must be a number of MiB > 0, "
                                       f"or -1 for no bound, got '{text}'"):
    run.xla_cache_bytes()
  monkeypatch.setenv("SPECJAX_XLA_CACHE_MB", "1.5")
  assert run.xla_cache_bytes() == 3 * 2**19
