"""Outputs written all or nothing: files and directories built aside and renamed in.

    out = prepare_output_dir(path, overwrite)     # refuse a non-empty directory up front
    with assembling(out) as tmp:                  # a temporary sibling of `out`
      ... write files into tmp ...
    # success: tmp was renamed to `out` (replacing it); any error: tmp is removed and
    # nothing was written at `out`.

    atomic_write(path, text_or_bytes)             # one file: old or new, never half

Both are the project's one way of writing a file or directory that a reader may see while it
is written or after a kill (run directories, the model cache, tokenizers). What they create
gets the modes the process's umask gives (0644 files, 0755 directories under umask 022),
like any file the process writes directly: temporary names are created with `os.open(...,
O_EXCL, 0o666)` / `os.mkdir(..., 0o777)`, not with `tempfile.mkstemp` / `mkdtemp`, whose
0600 / 0700 would survive the rename. A file a library writes with its own mode
(safetensors writes 0600) is given the umask's (`file_mode`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import pathlib
import secrets
import shutil
from typing import Iterator


def file_sha256(path: str | os.PathLike, h=None) -> str:
  """The sha256 of a file's bytes, read in blocks (or fed into the running hash `h`, whose
  hexdigest is returned): the one file digest of manifests and cache keys."""
  h = hashlib.sha256() if h is None else h
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 22), b""):
      h.update(block)
  return h.hexdigest()


def dir_sha256(directory: str | os.PathLike) -> str:
  """sha256 over a directory's regular files (relative names, sizes, contents), hidden ones
  (any path part starting with ".") aside: a model directory's identity, whatever its path."""
  h = hashlib.sha256()
  root = pathlib.Path(directory)
  for path in sorted(p for p in root.rglob("*") if p.is_file()
                     and not any(part.startswith(".") for part in p.relative_to(root).parts)):
    h.update(f"{path.relative_to(root).as_posix()}\0{path.stat().st_size}\0".encode())
    file_sha256(path, h)
  return h.hexdigest()


def _temp_name(parent: pathlib.Path, name: str, kind: str) -> pathlib.Path:
  """A fresh hidden sibling name `.NAME.KIND-PID-RANDOM` in `parent`."""
  return parent / f".{name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def cache_dir() -> pathlib.Path:
  """specjax's cache root: $SPECJAX_CACHE_DIR, or ~/.cache/specjax (models, imported
  checkpoints, compiled programs, calibrations, built kernels)."""
  env = os.environ.get("SPECJAX_CACHE_DIR")
  return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "specjax"


def make_temp_dir(parent: str | os.PathLike, name: str, kind: str = "tmp") -> pathlib.Path:
  """Creates and returns a new empty directory `.NAME.KIND-...` in `parent` (which must
  exist), with the umask's mode (0755 under umask 022; `tempfile.mkdtemp` gives 0700)."""
  parent = pathlib.Path(parent)
  while True:
    path = _temp_name(parent, name, kind)
    try:
      os.mkdir(path, 0o777)
      return path
    except FileExistsError:
      continue


def file_mode() -> int:
  """The mode a file the process creates gets: 0o666 less the umask (0644 under umask 022).
  Read from /proc/self/status where it says (the umask is left alone), else by setting and
  restoring it."""
  try:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
      if line.startswith("Umask:"):
        return 0o666 & ~int(line.split()[1], 8)
  except (OSError, ValueError, IndexError):
    pass
  mask = os.umask(0o022)
  os.umask(mask)
  return 0o666 & ~mask


def atomic_write(path: str | os.PathLike, data: str | bytes) -> None:
  """Writes `data` (str: as UTF-8) to `path` all or nothing: into a temporary sibling,
  fsync'd, then renamed over `path` (and the directory fsync'd, best effort). A reader, or
  the next process after a kill or a full disk, sees the old file or the new one, never
  half of one. The file gets the umask's mode (0644 under umask 022). An OSError (ENOSPC,
  EACCES, ...) leaves `path` as it was, removes the temporary file and propagates."""
  path = pathlib.Path(path)
  blob = data.encode("utf-8") if isinstance(data, str) else bytes(data)
  while True:
    tmp = _temp_name(path.parent, path.name, "tmp")
    try:
      fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
      break
    except FileExistsError:
      continue
  try:
    try:
      view = memoryview(blob)
      while view:
        view = view[os.write(fd, view):]
      os.fsync(fd)
    finally:
      os.close(fd)
    os.replace(tmp, path)
  except BaseException:
    try:
      os.unlink(tmp)
    except OSError:
      pass
    raise
  try:  # the rename itself survives a power cut once the directory is on disk
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
      os.fsync(dfd)
    finally:
      os.close(dfd)
  except OSError:
    pass


MARKER = ".specjax-output"
"""The file every directory `assembling` publishes holds: `--overwrite` replaces only a
directory that has it (one specjax wrote), never one a user made."""


def _inside(path: pathlib.Path, root: pathlib.Path) -> bool:
  return path == root or root in path.parents


def prepare_output_dir(out: str | os.PathLike, overwrite: bool,
                       inputs: tuple = ()) -> pathlib.Path:
  """Refuse a non-empty output directory unless `overwrite`, and a location that cannot be
  written (read-only file system, no permission, a file where a directory belongs): checked
  before any work, by creating and removing a probe directory where `out` will be
  assembled. `overwrite` replaces only a directory specjax wrote (it holds `MARKER`), never
  the working directory or one above it, nor one holding any of `inputs` (the paths the
  output is made from). Raises ValueError or OSError naming `out`."""
  out = pathlib.Path(out)
  real = pathlib.Path(os.path.realpath(out))
  if _inside(pathlib.Path(os.path.realpath(os.getcwd())), real):
    raise ValueError(f"output directory {str(out)!r} is the working directory or holds it: "
                     f"name a new directory to write")
  for source in inputs:
    if source is not None and _inside(pathlib.Path(os.path.realpath(source)), real):
      raise ValueError(f"output directory {str(out)!r} holds the input {str(source)!r}: "
                       f"name a directory outside it")
  if out.exists() and not out.is_dir():
    raise ValueError(f"output path {str(out)!r} exists and is not a directory")
  if out.is_dir() and any(out.iterdir()):
    if not overwrite:
      raise ValueError(f"output directory {str(out)!r} is not empty (pass overwrite to "
                       f"replace it)")
    if not (out / MARKER).is_file():
      raise ValueError(f"output directory {str(out)!r} was not written by specjax (it has no "
                       f"{MARKER} file), so overwrite will not delete it: remove it yourself "
                       f"or name another directory")
  parent = real.parent
  while not parent.exists():  # the directories assembling() will create start here
    parent = parent.parent
  if not parent.is_dir():
    raise NotADirectoryError(errno.ENOTDIR, f"cannot create it: {str(parent)!r} is a file",
                             str(out))
  try:
    os.rmdir(make_temp_dir(parent, real.name, "probe"))
  except OSError as e:
    raise OSError(e.errno, f"cannot write under {str(parent)!r}: {e.strerror or e}",
                  str(out)) from None
  return out


def publish_dir(tmp: pathlib.Path, out: pathlib.Path) -> None:
  """Move a completed temporary directory to `out` (replacing it) in one rename."""
  old = None
  if out.exists():
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.rename(out, old)
  os.rename(tmp, out)
  if old is not None:
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def assembling(out: pathlib.Path) -> Iterator[pathlib.Path]:
  """A temporary sibling directory of `out`, published at `out` when the block succeeds and
  removed when it raises (KeyboardInterrupt included). The published directory has the
  umask's mode (0755 under umask 022), like one made with mkdir."""
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = make_temp_dir(out.parent, out.name)
  try:
    (tmp / MARKER).write_text("written by specjax; --overwrite may replace this directory\n")
    yield tmp
    publish_dir(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
