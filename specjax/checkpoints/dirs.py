"""Output directories written all or nothing: checked first, assembled aside, renamed in.

    out = prepare_output_dir(path, overwrite)     # refuse a non-empty directory up front
    with assembling(out) as tmp:                  # a temporary sibling of `out`
      ... write files into tmp ...
    # success: tmp was renamed to `out` (replacing it); any error: tmp is removed and
    # nothing was written at `out`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import shutil
import tempfile
from typing import Iterator


def prepare_output_dir(out: str | os.PathLike, overwrite: bool) -> pathlib.Path:
  """Refuse a non-empty output directory unless `overwrite`, and a location that cannot be
  written (read-only file system, no permission, a file where a directory belongs): checked
  before any work, by creating and removing a probe directory where `out` will be
  assembled. Raises ValueError or OSError naming `out`."""
  out = pathlib.Path(out)
  if out.exists() and not out.is_dir():
    raise ValueError(f"output path {str(out)!r} exists and is not a directory")
  if out.is_dir() and any(out.iterdir()) and not overwrite:
    raise ValueError(f"output directory {str(out)!r} is not empty (pass overwrite to replace it)")
  parent = out.absolute().parent
  while not parent.exists():  # the directories assembling() will create start here
    parent = parent.parent
  if not parent.is_dir():
    raise NotADirectoryError(errno.ENOTDIR, f"cannot create it: {str(parent)!r} is a file",
                             str(out))
  try:
    os.rmdir(tempfile.mkdtemp(prefix=f".{out.name}.probe-", dir=parent))
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
  removed when it raises (KeyboardInterrupt included)."""
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
  try:
    yield tmp
    publish_dir(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
