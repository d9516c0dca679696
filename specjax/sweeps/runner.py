"""Sweep runner: points, run directories, append-only results, resume, shards, devices.

No gin here: `launch.py` parses a gin config into a `Sweep` and hands its points here. A
sweep is the cartesian product of its axes; each point has a stable id (a hash of its
parameters), so a rerun knows what is done.

Run directory `runs/NAME/TIMESTAMP/`:
- `config.gin` (operative gin config), `config.json` (sweep, shard, fingerprint),
  `environment.json` (versions, backend, device kind and count, seed);
- `results.jsonl`: one JSON line per finished point, written with a single append + fsync,
  so a killed run loses at most the point in flight. A torn last line is ignored on read and
  fenced off with a newline before the next append. Later lines win: a point recorded as
  failed is retried on the next run and its new line supersedes the old one;
- `report.md` and PNG plots, rebuilt from results.jsonl after every run.
Re-running the same command finds the directory whose fingerprint (operative config + shard)
matches and resumes there; a different config never writes into an existing directory.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import itertools
import json
import os
import pathlib
import platform
import sys
import time
import traceback
from typing import Any, Callable, Iterable, Mapping, Sequence

RESULTS = "results.jsonl"


# ----------------------------------------------------------------------------- points


def point_id(params: Mapping[str, Any]) -> str:
  blob = json.dumps(params, sort_keys=True, default=repr)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Point:
  params: dict
  index: int  # position in the full (unsharded) sweep

  @property
  def id(self) -> str:
    return point_id(self.params)


def expand(axes: Mapping[str, Sequence], fixed: Mapping[str, Any] | None = None) -> list[Point]:
  """The cartesian product of `axes` (in their given order), each merged with `fixed`."""
  fixed = dict(fixed or {})
  for name, values in axes.items():
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
      raise ValueError(f"sweep axis {name!r} must be a list of values, got {values!r}")
    if len(list(values)) == 0:
      raise ValueError(f"sweep axis {name!r} is empty")
    if name in fixed:
      raise ValueError(f"parameter {name!r} is both a sweep axis and fixed")
  names = list(axes)
  points = []
  for i, combo in enumerate(itertools.product(*(list(axes[n]) for n in names))):
    points.append(Point(params={**fixed, **dict(zip(names, combo))}, index=i))
  ids = [p.id for p in points]
  if len(set(ids)) != len(ids):
    raise ValueError("sweep axes contain duplicate values: every point must be distinct")
  return points


def shard(points: list[Point], shard_index: int, num_shards: int) -> list[Point]:
  """Round-robin split: shard i takes points i, i + n, i + 2n, ... (stable across reruns)."""
  if num_shards < 1:
    raise ValueError(f"num_shards must be >= 1, got {num_shards}")
  if not 0 <= shard_index < num_shards:
    raise ValueError(f"shard_index must be in [0, {num_shards}), got {shard_index}")
  return [p for p in points if p.index % num_shards == shard_index]


# ----------------------------------------------------------------------------- results file


def read_results(path: str | os.PathLike) -> dict[str, dict]:
  """Latest record per point id; torn or corrupt lines (a killed writer) are skipped."""
  path = pathlib.Path(path)
  latest: dict[str, dict] = {}
  if not path.exists():
    return latest
  with open(path, encoding="utf-8") as f:
    for line in f:
      line = line.strip()
      if not line:
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        continue
      if isinstance(record, dict) and "id" in record:
        latest[record["id"]] = record
  return latest


def append_result(path: str | os.PathLike, record: dict) -> None:
  """Appends one JSON line with a single write and fsync (atomic for our purposes)."""
  line = json.dumps(record, sort_keys=True, default=_json_default) + "\n"
  fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
  try:
    size = os.fstat(fd).st_size
    if size:
      with open(path, "rb") as f:  # fence off a torn last line left by a killed writer
        f.seek(size - 1)
        if f.read(1) != b"\n":
          line = "\n" + line
    os.write(fd, line.encode("utf-8"))
    os.fsync(fd)
  finally:
    os.close(fd)


def _json_default(x):
  try:
    import numpy as np
    if isinstance(x, np.generic):
      return x.item()
    if isinstance(x, np.ndarray):
      return x.tolist()
  except ImportError:  # pragma: no cover
    pass
  return repr(x)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
  path = pathlib.Path(path)
  tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
  tmp.write_text(text, encoding="utf-8")
  os.replace(tmp, path)


# ----------------------------------------------------------------------------- run directory


def environment(seed: int | None = None) -> dict:
  """Versions, backend, device kind and count: what a reader needs to trust a number."""
  env = {"python": sys.version.split()[0], "platform": platform.platform(), "seed": seed,
         "argv": sys.argv, "time": _dt.datetime.now().isoformat(timespec="seconds")}
  try:
    import importlib.metadata as md
    for pkg in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "gin-config",
                "specjax"):
      try:
        env[pkg] = md.version(pkg)
      except md.PackageNotFoundError:
        env[pkg] = None
    import jax
    devices = jax.local_devices()
    env.update(backend=jax.default_backend(), device_kind=devices[0].device_kind,
               local_device_count=len(devices), device_count=jax.device_count(),
               process_index=jax.process_index(), process_count=jax.process_count())
  except Exception as e:  # noqa: BLE001 - the record is best effort, never fatal
    env["environment_error"] = repr(e)
  return env


def fingerprint(config_text: str, shard_index: int, num_shards: int) -> str:
  blob = f"{config_text}\n--shard {shard_index}/{num_shards}"
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _check_writable(path: pathlib.Path) -> None:
  probe = path
  while not probe.exists():
    probe = probe.parent
  if not os.access(probe, os.W_OK):
    raise ValueError(f"output directory {str(path)!r} is not writable")


def resolve_run_dir(root: str | os.PathLike, name: str, fp: str,
                    out: str | os.PathLike | None = None) -> tuple[pathlib.Path, bool]:
  """(directory, resuming). `out` pins the directory; otherwise root/name/TIMESTAMP, reusing
  the newest directory there with the same fingerprint."""
  if out is not None:
    out = pathlib.Path(out)
    _check_writable(out)
    cfg = out / "config.json"
    if cfg.exists():
      old = json.loads(cfg.read_text()).get("fingerprint")
      if old != fp:
        raise ValueError(f"--out {str(out)!r} holds a different run (fingerprint {old}, this "
                         f"config {fp}); choose another directory: nothing was written")
      return out, True
    if out.exists() and any(out.iterdir()):
      raise ValueError(f"--out {str(out)!r} exists and is not a specjax run directory; "
                       f"choose another directory: nothing was written")
    return out, False
  base = pathlib.Path(root) / name
  _check_writable(base)
  if base.exists():
    for d in sorted(base.iterdir(), reverse=True):
      cfg = d / "config.json"
      if cfg.exists():
        try:
          if json.loads(cfg.read_text()).get("fingerprint") == fp:
            return d, True
        except json.JSONDecodeError:
          continue
  stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
  d = base / stamp
  n = 1
  while d.exists():
    d = base / f"{stamp}-{n}"
    n += 1
  return d, False


# ----------------------------------------------------------------------------- running


@dataclasses.dataclass
class RunSummary:
  run_dir: pathlib.Path
  resumed: bool
  total: int  # points in this shard
  skipped: int  # already finished before this run
  ok: int  # finished in this run
  failed: int  # failed in this run
  table: str = ""  # the experiment's headline columns, markdown (empty if it names none)

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["run_dir"] = str(self.run_dir)
    return d


def run_points(points: list[Point], run_dir: pathlib.Path,
               run_group: Callable[[list[Point]], list[dict]],
               group_key: Callable[[Point], Any] = lambda p: p.index,
               progress: bool = True, on_point_done: Callable[[Point, dict], None] | None = None
               ) -> tuple[int, int, int]:
  """Runs the unfinished points, grouped by `group_key` (points of a group share static
  shapes and run in one vectorised call). Returns (skipped, ok, failed).

  A group that raises is retried point by point, so one bad point does not take its group
  down; a point that raises is recorded with its error and the sweep goes on.
  """
  path = run_dir / RESULTS
  done = {i for i, r in read_results(path).items() if r.get("status") == "ok"}
  todo = [p for p in points if p.id not in done]
  groups: dict[Any, list[Point]] = {}
  for p in todo:
    groups.setdefault(group_key(p), []).append(p)
  ok = failed = 0
  bar = _progress(len(points), len(points) - len(todo), progress)
  for group in groups.values():
    start = time.perf_counter()
    try:
      outcomes = run_group(group)
      if len(outcomes) != len(group):
        raise RuntimeError(f"run_group returned {len(outcomes)} results for {len(group)} points")
      per_point = (time.perf_counter() - start) / len(group)
      results = [(p, {"status": "ok", "metrics": m, "seconds": per_point})
                 for p, m in zip(group, outcomes)]
    except Exception:  # noqa: BLE001 - fall back to one point at a time
      results = []
      for p in group:
        t0 = time.perf_counter()
        try:
          m = run_group([p])[0]
          results.append((p, {"status": "ok", "metrics": m,
                              "seconds": time.perf_counter() - t0}))
        except Exception as e:  # noqa: BLE001 - record and continue
          results.append((p, {"status": "error", "error": f"{type(e).__name__}: {e}",
                              "traceback": traceback.format_exc(limit=8),
                              "seconds": time.perf_counter() - t0}))
    for p, outcome in results:
      record = {"id": p.id, "index": p.index, "params": p.params, **outcome,
                "finished": _dt.datetime.now().isoformat(timespec="seconds")}
      append_result(path, record)
      ok += outcome["status"] == "ok"
      failed += outcome["status"] != "ok"
      if on_point_done is not None:
        on_point_done(p, record)
      bar.update(1)
  bar.close()
  return len(points) - len(todo), ok, failed


def _progress(total: int, initial: int, enabled: bool):
  from tqdm import tqdm
  return tqdm(total=total, initial=initial, desc="points", unit="pt", disable=not enabled,
              file=sys.stderr, dynamic_ncols=True)


def merge(run_dirs: Sequence[str | os.PathLike], out: str | os.PathLike) -> pathlib.Path:
  """Joins the results of several shards (or hosts) into one run directory.

  Shards must come from the same config (equal `config.gin`); the newest record of each
  point wins. The merged directory gets the shared config and a results.jsonl with every
  point once.
  """
  if not run_dirs:
    raise ValueError("merge needs at least one run directory")
  dirs = [pathlib.Path(d) for d in run_dirs]
  configs = []
  for d in dirs:
    if not (d / "config.json").exists():
      raise ValueError(f"{str(d)!r} is not a specjax run directory (no config.json)")
    configs.append(json.loads((d / "config.json").read_text()))
  texts = {(d / "config.gin").read_text() for d in dirs}
  if len(texts) != 1:
    raise ValueError("cannot merge runs of different configs (their config.gin differ)")
  out = pathlib.Path(out)
  if out.exists() and any(out.iterdir()):
    raise ValueError(f"merge output {str(out)!r} exists and is not empty: nothing was written")
  records: dict[str, dict] = {}
  for d in dirs:
    for pid, r in read_results(d / RESULTS).items():
      if pid not in records or r.get("finished", "") >= records[pid].get("finished", ""):
        records[pid] = r
  out.mkdir(parents=True, exist_ok=True)
  (out / "config.gin").write_text(texts.pop())
  merged_cfg = {**configs[0], "merged_from": [str(d) for d in dirs],
                "shard_index": None, "num_shards": None}
  atomic_write_text(out / "config.json", json.dumps(merged_cfg, indent=2))
  for r in sorted(records.values(), key=lambda r: r.get("index", 0)):
    append_result(out / RESULTS, r)
  return out
