"""Sweep runner: points, run directories, append-only results, resume, shards, devices.

No gin here: `launch.py` parses a gin config into a `Sweep` and hands its points here. A
sweep is the cartesian product of its axes; each point has a stable id (a hash of its
parameters), so a rerun knows what is done.

Run directory `runs/NAME/TIMESTAMP/`:
- `config.gin` (operative gin config), `config.json` (sweep, shard, fingerprint),
  `environment.json` (versions, backend, device kind and count, seed);
- `results.jsonl`: one JSON line per finished point, written with a single append + fsync,
  so a killed run loses at most the point in flight. A torn last line is fenced off with a
  newline before the next append. Every reader (resume, reports, merge) parses the file with
  `read_results`, which skips a corrupt line (torn, not UTF-8, not JSON, not a record) with
  a one-line warning naming the file and line numbers, and uses the others. Later lines
  win: a point recorded as failed is retried on the next run and its new line supersedes
  the old one;
- `report.md` and PNG plots, rebuilt from results.jsonl after every run;
- `.lock`: one writer per directory (`run_directory.RunLock`); a second run into it is
  refused (finding, resuming and locking the directory: `run_directory.py`).
Re-running the same command finds the directory whose fingerprint (operative config + shard)
matches and resumes there; a different config never writes into an existing directory, and a
damaged config.json is reported as damaged (naming it), never taken for another run.
Records are standard JSON (non-finite floats become null, listed under "non_finite"); a full
disk rolls back the partial line and ends the run with a one-line `RunDirError`. A point's
randomness comes from its own parameters (`point_seed`), never from its place in a group.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import itertools
import json
import math
import os
import pathlib
import re
import sys
import time
import traceback
from typing import Any, Callable, Iterable, Mapping, Sequence

from specjax.sweeps.run_directory import (DamagedConfig, RunDirError, check_writable,
                                           read_run_config, write_failed)
from specjax.files import atomic_write
from specjax.sweeps.inputs import changed

RESULTS = "results.jsonl"


# ----------------------------------------------------------------------------- points


def point_id(params: Mapping[str, Any]) -> str:
  blob = json.dumps(params, sort_keys=True, default=repr)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def point_seed(params: Mapping[str, Any], stream: str = "") -> int:
  """A point's own random seed in [0, 2**31): a hash of its parameters (its `seed` included)
  and a stream name, so one point can draw several independent streams ("key", "mc", ...).

  This is what makes a result a function of its point only: the same seed whether the point
  runs alone, in a vectorised group (any size, any order), resumed, sharded, or on 1 or N
  devices. Pass the point's COMPLETE parameters (defaults filled in, `with_defaults`), so a
  point called directly and the same point built by the runner hash alike.
  """
  blob = json.dumps(dict(params), sort_keys=True, default=repr) + "\x00" + stream
  return int.from_bytes(hashlib.sha256(blob.encode()).digest()[:4], "big") & 0x7FFFFFFF


def with_defaults(fn: Callable, params: Mapping[str, Any]) -> dict:
  """`params` completed with the defaults of `fn`'s keyword parameters."""
  import inspect
  full = {n: p.default for n, p in inspect.signature(fn).parameters.items()
          if p.default is not p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
  full.update(params)
  return full


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


def _record_problem(record) -> str | None:
  """Why `record` (a parsed line) is not a result record, or None if it is one: a JSON
  object with a string "id", a "params" object and a string "status", a "metrics" object
  when the status is "ok", an int "index" and a string "finished" where present. These are
  the fields the readers (resume, merge, reports) rely on."""
  if not isinstance(record, dict):
    return "not a JSON object"
  if not isinstance(record.get("id"), str):
    return "no string 'id'"
  if not isinstance(record.get("params"), dict):
    return "no 'params' object"
  if not isinstance(record.get("status"), str):
    return "no string 'status'"
  if record["status"] == "ok" and not isinstance(record.get("metrics"), dict):
    return "status 'ok' without a 'metrics' object"
  index = record.get("index", 0)
  if isinstance(index, bool) or not isinstance(index, int):
    return "'index' is not an int"
  if not isinstance(record.get("finished", ""), str):
    return "'finished' is not a string"
  return None


def scan_results(path: str | os.PathLike) -> tuple[dict[str, dict], list[int]]:
  """(latest record per point id, the 1-based numbers of the lines skipped as corrupt).

  The one parser of results.jsonl. A line is skipped, never fatal, when it is not valid
  UTF-8, not JSON, or not a record (`_record_problem`: e.g. a line torn by a killed writer,
  a flipped byte, a record without "params"); every other line is used, later lines
  winning. Blank lines are not counted as corrupt. A missing file is an empty result; a
  file that cannot be read (permissions, a directory) raises `RunDirError` naming it."""
  path = pathlib.Path(path)
  latest: dict[str, dict] = {}
  skipped: list[int] = []
  if not path.exists():
    return latest, skipped
  try:
    with open(path, "rb") as f:
      for number, raw in enumerate(f, start=1):
        if not raw.strip():
          continue
        try:
          record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
          skipped.append(number)
          continue
        if _record_problem(record) is not None:
          skipped.append(number)
          continue
        latest[record["id"]] = _restore_non_finite(record)
  except OSError as e:
    raise RunDirError(f"cannot read {str(path)!r} (results): {e.strerror or e}",
                      e.errno) from None
  return latest, skipped


_warned: set[tuple[str, tuple[int, ...]]] = set()  # (file, skipped lines) already reported
SHOWN_LINES = 10  # line numbers a warning lists before "..."


def skipped_lines_message(path: str | os.PathLike, skipped: Sequence[int]) -> str:
  """One line: "skipped N corrupt line(s) in FILE: lines 3, 7" (at most SHOWN_LINES
  numbers, then the count of the rest)."""
  shown = ", ".join(str(n) for n in skipped[:SHOWN_LINES])
  if len(skipped) > SHOWN_LINES:
    shown += f", ... ({len(skipped) - SHOWN_LINES} more)"
  s = "" if len(skipped) == 1 else "s"
  return (f"skipped {len(skipped)} corrupt line{s} in {str(path)!r}: line{s} {shown} (not "
          f"valid UTF-8, JSON or a result record; the other lines are used)")


def read_results(path: str | os.PathLike, *, warn: bool = True) -> dict[str, dict]:
  """Latest record per point id (`scan_results`), for every reader of results.jsonl
  (resume, reports, merge). Corrupt lines are skipped; with `warn`, a one-line warning
  naming the file and the lines goes to stderr, once per process for the same file and
  lines (a run reads its file several times)."""
  records, skipped = scan_results(path)
  if skipped and warn:
    key = (str(pathlib.Path(path).absolute()), tuple(skipped))
    if key not in _warned:
      _warned.add(key)
      print(f"specjax: warning: {skipped_lines_message(path, skipped)}", file=sys.stderr,
            flush=True)
  return records


def _restore_non_finite(record: dict) -> dict:
  """Puts the floats listed under "non_finite" (written as null) back in place, so readers of
  a record see the NaN/±inf the point returned."""
  notes = record.get("non_finite")
  if not isinstance(notes, dict):
    return record
  for where, value in notes.items():
    steps = [int(s[:-1]) if s.endswith("]") else s
             for s in re.split(r"\.|\[", str(where)) if s]
    try:
      parent = record
      for step in steps[:-1]:
        parent = parent[step]
      if parent[steps[-1]] is None:
        parent[steps[-1]] = float(value)
    except (KeyError, IndexError, TypeError, ValueError):
      continue  # a note that does not fit the record: leave the null
  return record


def append_result(path: str | os.PathLike, record: dict) -> None:
  """Appends one standard-JSON line with a single write and fsync (atomic for our purposes).

  Non-finite floats (NaN, ±Infinity: not JSON) become null and are listed under
  `"non_finite"` as {"metrics.name": "inf"}. A failed write (ENOSPC, EIO) is rolled back to
  the previous size, so the file never keeps a partial line, and raised as `RunDirError`.
  """
  notes: dict[str, str] = {}
  clean = _finite(record, "", notes)
  if notes:
    clean["non_finite"] = {**clean.get("non_finite", {}), **notes}
  line = json.dumps(clean, sort_keys=True, allow_nan=False) + "\n"
  try:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)  # umask applies
  except OSError as e:
    raise write_failed(path, e, "results") from None
  size = None
  try:
    size = os.fstat(fd).st_size
    if size:
      with open(path, "rb") as f:  # fence off a torn last line left by a killed writer
        f.seek(size - 1)
        if f.read(1) != b"\n":
          line = "\n" + line
    data = line.encode("utf-8")
    written = 0
    while written < len(data):
      written += _os_write(fd, data[written:])
    os.fsync(fd)
  except OSError as e:
    if size is not None:
      try:  # roll back a partial line; if even that fails the reader skips it as torn
        os.ftruncate(fd, size)
      except OSError:
        pass
    raise write_failed(path, e, "results") from None
  finally:
    os.close(fd)


_os_write = os.write  # the one write of a result line (tests replace it to simulate ENOSPC)


def _finite(x, where: str, notes: dict):
  """A copy of `x` that is plain JSON: numpy scalars/arrays as Python values, non-finite
  floats as None (noted in `notes` under their dotted path)."""
  try:
    import numpy as np
    if isinstance(x, np.ndarray):
      x = x.tolist()
    elif isinstance(x, np.generic):
      x = x.item()
  except ImportError:  # pragma: no cover
    pass
  if isinstance(x, float) and not math.isfinite(x):
    notes[where] = repr(x)
    return None
  if isinstance(x, dict):
    return {str(k): _finite(v, f"{where}.{k}" if where else str(k), notes) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_finite(v, f"{where}[{i}]", notes) for i, v in enumerate(x)]
  if x is None or isinstance(x, (bool, int, float, str)):
    return x
  return repr(x)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
  """Writes `text` all or nothing (`checkpoints.dirs.atomic_write`: a temporary file,
  fsync, rename; the umask's mode): readers see the old or the new file, never half of
  one; a failed write (ENOSPC) leaves the old file and raises `RunDirError`."""
  path = pathlib.Path(path)
  try:
    atomic_write(path, text)
  except OSError as e:
    raise write_failed(path, e, path.name) from None


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


MAP_FRACTION = 0.5  # free compiled programs once the process holds this share of its limit


def memory_mappings() -> tuple[int, int] | None:
  """(memory mappings this process holds, the kernel's limit `vm.max_map_count`); None where
  /proc does not tell (not Linux)."""
  try:
    with open("/proc/self/maps", "rb") as f:
      used = sum(1 for _ in f)
    return used, int(pathlib.Path("/proc/sys/vm/max_map_count").read_text())
  except (OSError, ValueError):
    return None


def free_compiled_programs_if_needed(fraction: float = MAP_FRACTION) -> bool:
  """Clears JAX's caches of compiled programs (and collects garbage) when this process holds
  `fraction` of the kernel's memory-mapping limit or more; returns whether it did. XLA:CPU
  maps ~15 regions per compiled program and jit caches keep every program, so a long sweep
  compiling thousands of shapes reached the limit and aborted inside a compile ("Cannot
  allocate memory"). Programs a later point needs are compiled again (or read from the
  persistent compilation cache)."""
  m = memory_mappings()
  if m is None or m[0] < fraction * m[1]:
    return False
  import gc

  import jax
  jax.clear_caches()
  gc.collect()
  return True


def run_points(points: list[Point], run_dir: pathlib.Path,
               run_group: Callable[[list[Point]], list[dict]],
               group_key: Callable[[Point], Any] = lambda p: p.index,
               progress: bool = True, on_point_done: Callable[[Point, dict], None] | None = None
               ) -> tuple[int, int, int]:
  """Runs the unfinished points, grouped by `group_key` (points of a group share static
  shapes and run in one vectorised call). Returns (skipped, ok, failed).

  A group that raises is retried point by point, so one bad point does not take its group
  down; a point that raises is recorded with its error and the sweep goes on. After each
  group, compiled programs are freed if the process nears its memory-mapping limit
  (`free_compiled_programs_if_needed`).
  """
  path = run_dir / RESULTS
  done = {i for i, r in read_results(path).items() if r.get("status") == "ok"}
  todo = [p for p in points if p.id not in done]
  groups: dict[Any, list[Point]] = {}
  for p in todo:
    groups.setdefault(group_key(p), []).append(p)
  ok = failed = 0
  bar = _progress(len(points), len(points) - len(todo), progress)
  try:
    for group in groups.values():
      start = time.perf_counter()
      try:
        outcomes = run_group(group)
        if len(outcomes) != len(group):
          raise RuntimeError(f"run_group returned {len(outcomes)} results for "
                             f"{len(group)} points")
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
      free_compiled_programs_if_needed()
  finally:
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
  configs, texts = [], set()
  for d in dirs:
    if not d.is_dir():
      raise ValueError(f"{str(d)!r} is not a directory: merge takes run directories")
    if not (d / "config.json").exists():
      raise ValueError(f"{str(d)!r} is not a specjax run directory (no config.json)")
    try:
      configs.append(read_run_config(d))
    except DamagedConfig as e:
      raise DamagedConfig(f"cannot merge {str(d)!r}: {e}; nothing was written") from None
    gin = d / "config.gin"
    try:
      texts.add(gin.read_bytes().decode("utf-8"))
    except FileNotFoundError:
      raise ValueError(f"{str(d)!r} is not a complete specjax run directory (no "
                       f"config.gin): nothing was written") from None
    except UnicodeDecodeError:
      raise ValueError(f"cannot merge {str(d)!r}: {str(gin)!r} is damaged (not valid "
                       f"UTF-8): nothing was written") from None
    except OSError as e:
      raise RunDirError(f"cannot read {str(gin)!r}: {e.strerror or e}", e.errno) from None
  if len(texts) != 1:
    raise ValueError("cannot merge runs of different configs (their config.gin differ)")
  for d, c in zip(dirs[1:], configs[1:]):
    other = changed(configs[0].get("inputs"), c.get("inputs") or [])
    if other:
      raise ValueError(f"cannot merge {str(dirs[0])!r} and {str(d)!r}: one config on "
                       f"different inputs ({other}): nothing was written")
  out = pathlib.Path(out)
  check_writable(out, "merge --out")
  if out.exists() and any(out.iterdir()):
    raise ValueError(f"merge output {str(out)!r} exists and is not empty: nothing was written")
  records: dict[str, dict] = {}
  for d in dirs:
    for pid, r in read_results(d / RESULTS).items():
      if pid not in records or r.get("finished", "") >= records[pid].get("finished", ""):
        records[pid] = r
  try:
    out.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise write_failed(out, e, "merge --out") from None
  atomic_write_text(out / "config.gin", texts.pop())
  merged_cfg = {**configs[0], "merged_from": [str(d) for d in dirs],
                "shard_index": None, "num_shards": None}
  atomic_write_text(out / "config.json", json.dumps(merged_cfg, indent=2))
  for r in sorted(records.values(), key=lambda r: r.get("index", 0)):
    append_result(out / RESULTS, r)
  return out
