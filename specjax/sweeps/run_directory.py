"""Run directories: where a run's files go, and one writer at a time.

`open_run_dir` finds or creates `runs/NAME/TIMESTAMP/` (or the `--out` given) under its
lock: the directory whose fingerprint (`fingerprint`: operative config + shard) matches is
resumed; a different config never writes into an existing directory, and a damaged
config.json is reported as damaged (`DamagedConfig`, naming it), never taken for another
run. `.lock` holds one writer per directory (`RunLock`, an `fcntl.flock` the kernel drops
when the process ends). `environment` is what `environment.json` records. Expected
failures (full disk, unwritable path, another writer) are one-line `RunDirError`s. What the
directory holds and how results are appended: `runner.py` (docs/run_directories.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import errno
import fcntl
import hashlib
import json
import os
import pathlib
import platform
import sys
from typing import Callable, Mapping, Sequence
from specjax.sweeps.inputs import changed


class RunDirError(OSError, ValueError):
  """An expected failure of a run directory (full disk, unwritable path, another writer):
  its message is one complete line naming the path and what to do. Both an OSError and a
  ValueError, so the CLI reports it as a one-line error (exit 2), never a traceback."""

  def __init__(self, message: str, errno_: int | None = None):
    super().__init__(message)
    self.errno = errno_


def write_failed(path, e: OSError, what: str) -> RunDirError:
  if e.errno == errno.ENOSPC:
    return RunDirError(f"no space left on device writing {str(path)!r} ({what}); the results "
                       f"recorded so far are intact: free space and re-run the same command "
                       f"to resume", errno.ENOSPC)
  return RunDirError(f"cannot write {str(path)!r} ({what}): {e.strerror or e}", e.errno)


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
    from specjax.models.one_row_bf16 import fusion_policy, padding_policy, row_split_limit
    from specjax.sharding import default_mesh_shape
    mesh = default_mesh_shape()
    env["mesh"] = None if mesh is None else {"data": mesh[0], "model": mesh[1]}
    env.update(backend=jax.default_backend(), device_kind=devices[0].device_kind,
               local_device_count=len(devices), device_count=jax.device_count(),
               process_index=jax.process_index(), process_count=jax.process_count(),
               pad_one_row_bf16=padding_policy(), fuse_products=fusion_policy(),
               row_products=row_split_limit())
  except Exception as e:  # noqa: BLE001 - the record is best effort, never fatal
    env["environment_error"] = repr(e)
  return env


def fingerprint(config_text: str, shard_index: int, num_shards: int,
                mesh: tuple[int, int] | None = None, inputs: Sequence[Mapping] = ()) -> str:
  """The run's identity: the operative config, the shard, the decoding mesh (--mesh;
  None, one device, adds nothing, so runs without one keep their fingerprints) and the
  contents its paths name (`inputs.digests`; none for embedded references, which keep
  their fingerprints)."""
  blob = f"{config_text}\n--shard {shard_index}/{num_shards}"
  if mesh is not None:
    blob += f"\n--mesh data={mesh[0]},model={mesh[1]}"
  for e in inputs:
    blob += f"\n--input {e['param']} {e['path']} sha256:{e['sha256']}"
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Identity:
  """What a run directory is claimed by: `fingerprint` (all of it), and to name what
  changed when it differs, the fingerprint of the config alone and the input digests."""
  fingerprint: str
  config_fingerprint: str | None = None
  inputs: tuple = ()

  def record(self) -> dict:
    """The fields config.json keeps of it."""
    return {"fingerprint": self.fingerprint, "config_fingerprint": self.config_fingerprint,
            "inputs": list(self.inputs)}

  def other_inputs(self, old: dict) -> str:
    """What changed when the run recorded in `old` (a config.json) has this config on other
    inputs ("" when it is another config, or nothing tells)."""
    if self.config_fingerprint is None or old.get("config_fingerprint") != \
        self.config_fingerprint:
      return ""
    return changed(old.get("inputs"), self.inputs)


def _identity(fp: "str | Identity") -> Identity:
  return fp if isinstance(fp, Identity) else Identity(fp)


LOCK = ".lock"


def check_writable(path: pathlib.Path, what: str = "output directory") -> None:
  """`path` (a directory to be) is not a file and lies under a writable directory."""
  if path.exists() and not path.is_dir():
    raise RunDirError(f"{what} {str(path)!r} is a file, not a directory; choose a directory "
                      f"path: nothing was written", errno.ENOTDIR)
  probe = path
  while not probe.exists():
    probe = probe.parent
  if not probe.is_dir():
    raise RunDirError(f"{what} {str(path)!r}: {str(probe)!r} is a file, not a directory; "
                      f"choose a directory path: nothing was written", errno.ENOTDIR)
  if not os.access(probe, os.W_OK):
    raise RunDirError(f"{what} {str(path)!r} is not writable", errno.EACCES)


class DamagedConfig(ValueError):
  """A run directory's config.json that cannot be read as one (not UTF-8, not JSON, not
  an object with a string "fingerprint"); the message names the file."""


def read_run_config(run_dir: str | os.PathLike) -> dict:
  """RUN_DIR/config.json as a dict holding a string "fingerprint". A damaged file (a write
  cut short by an old version or a full disk, an edit) raises `DamagedConfig` naming it;
  one that cannot be opened raises `RunDirError`."""
  cfg = pathlib.Path(run_dir) / "config.json"
  try:
    data = cfg.read_bytes()
  except OSError as e:
    raise RunDirError(f"cannot read {str(cfg)!r}: {e.strerror or e}", e.errno) from None
  try:
    config = json.loads(data.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
    raise DamagedConfig(f"{str(cfg)!r} is damaged (not valid JSON: {e})") from None
  if not isinstance(config, dict) or not isinstance(config.get("fingerprint"), str):
    raise DamagedConfig(f"{str(cfg)!r} is damaged (not a run config: no string "
                        f"'fingerprint')")
  return config


def _claim(out: pathlib.Path, fp: "str | Identity") -> bool:
  """Whether `out` holds this run (resume) or nothing yet; refuses anything else (naming
  the inputs whose contents changed, for this config on other inputs), and a damaged
  config.json as damaged (naming it), not as another run."""
  ident = _identity(fp)
  fp = ident.fingerprint
  cfg = out / "config.json"
  if cfg.exists():
    try:
      recorded = read_run_config(out)
      old = recorded["fingerprint"]
    except DamagedConfig as e:
      raise DamagedConfig(f"--out {str(out)!r}: {e}, so this run cannot tell whether to "
                          f"resume there; remove that directory (or repair the file) or "
                          f"choose another --out: nothing was written") from None
    changed = ident.other_inputs(recorded) if old != fp else ""
    if changed:
      raise ValueError(f"--out {str(out)!r} holds this config's run on other inputs, whose "
                       f"contents changed since: {changed}; resuming would mix results of "
                       f"both: choose another --out (or remove that directory to start "
                       f"over): nothing was written")
    if old != fp:
      raise ValueError(f"--out {str(out)!r} holds a different run (fingerprint {old}, this "
                       f"config {fp}); choose another directory: nothing was written")
    return True
  if out.exists() and any(p.name != LOCK for p in out.iterdir()):
    raise ValueError(f"--out {str(out)!r} exists and is not a specjax run directory; "
                     f"choose another directory: nothing was written")
  return False


def resolve_run_dir(root: str | os.PathLike, name: str, fp: "str | Identity",
                    out: str | os.PathLike | None = None) -> tuple[pathlib.Path, bool]:
  """(directory, resuming). `out` pins the directory; otherwise root/name/TIMESTAMP, reusing
  the newest directory there with the same fingerprint (a run of this config on inputs
  changed since is named on stderr and left alone: the new one starts fresh)."""
  if out is not None:
    out = pathlib.Path(out)
    check_writable(out, "--out")
    return out, _claim(out, fp)
  ident = _identity(fp)
  base = pathlib.Path(root) / name
  check_writable(base)
  stale = None
  if base.exists():
    for d in sorted(base.iterdir(), reverse=True):
      if (d / "config.json").exists():
        try:
          recorded = read_run_config(d)
          if recorded["fingerprint"] == ident.fingerprint:
            return d, True
          if stale is None and ident.other_inputs(recorded):
            stale = (d, ident.other_inputs(recorded))
        except DamagedConfig as e:
          print(f"specjax: warning: ignoring run directory {str(d)!r}: {e} (if it is this "
                f"run, repair that file or remove the directory)", file=sys.stderr,
                flush=True)
          continue
  if stale is not None:
    print(f"specjax: note: {str(stale[0])!r} ran this config on other inputs ({stale[1]}); "
          f"starting a fresh run directory", file=sys.stderr, flush=True)
  stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
  d = base / stamp
  n = 1
  while d.exists():
    d = base / f"{stamp}-{n}"
    n += 1
  return d, False


class RunLock:
  """One writer per run directory: an exclusive `fcntl.flock` on DIR/.lock, held for the
  whole run and released by the kernel when the process ends (even by kill -9), so a stale
  lock file never blocks. A second run into a locked directory is refused at once
  (`RunDirError` naming the directory and the holder's pid); nothing is computed twice."""

  def __init__(self, run_dir: str | os.PathLike, wait: bool = False):
    self.path = pathlib.Path(run_dir) / LOCK
    self.wait = wait
    self.fd: int | None = None

  def acquire(self) -> "RunLock":
    try:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)  # umask applies
    except OSError as e:
      raise write_failed(self.path, e, "lock") from None
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | (0 if self.wait else fcntl.LOCK_NB))
    except BlockingIOError:
      holder = os.pread(fd, 64, 0).decode("utf-8", "replace").strip() or "unknown"
      os.close(fd)
      raise RunDirError(f"run directory {str(self.path.parent)!r} is in use by another specjax "
                        f"run (pid {holder}); wait for it to finish (then re-run to resume) or "
                        f"choose another --out", errno.EBUSY) from None
    try:  # best effort: the pid is only for the message above
      os.ftruncate(fd, 0)
      os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
      pass
    self.fd = fd
    return self

  def release(self) -> None:
    if self.fd is not None:
      os.close(self.fd)  # closing the descriptor drops the flock
      self.fd = None

  def __enter__(self) -> "RunLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


@contextlib.contextmanager
def open_run_dir(root: str | os.PathLike, name: str, fp: "str | Identity",
                 out: str | os.PathLike | None = None,
                 init: Callable[[pathlib.Path], None] | None = None):
  """Finds or creates the run directory and holds its lock: yields (directory, resuming).

  `init(dir)` writes a new directory's config (under the lock, before any point runs). Without
  `out`, finding or creating the directory happens under a lock on root/NAME/.lock, so two
  runs of one config started together share one directory (and the second is refused)
  instead of each doing all the work in its own.
  """
  def lock_and_claim(run_dir: pathlib.Path) -> tuple[RunLock, bool]:
    """Takes the run's lock, then claims the directory (and writes its config if new)."""
    lock = RunLock(run_dir).acquire()
    try:
      resumed = _claim(run_dir, fp)  # under the lock: the truth, whoever wrote before
      if not resumed and init is not None:
        init(run_dir)
    except BaseException:
      lock.release()
      raise
    return lock, resumed

  if out is not None:
    run_dir, _ = resolve_run_dir(root, name, fp, out)  # refuses before anything is written
    try:
      run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
      raise write_failed(run_dir, e, "--out") from None
    lock, resumed = lock_and_claim(run_dir)
  else:
    base = pathlib.Path(root) / name
    check_writable(base)
    try:
      base.mkdir(parents=True, exist_ok=True)
    except OSError as e:
      raise write_failed(base, e, "run root") from None
    with RunLock(base, wait=True):  # held for milliseconds: find or create, then write config
      run_dir, _ = resolve_run_dir(root, name, fp)
      run_dir.mkdir(parents=True, exist_ok=True)
      lock, resumed = lock_and_claim(run_dir)
  try:
    yield run_dir, resumed
  finally:
    lock.release()
