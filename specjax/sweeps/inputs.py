"""What a sweep's paths point at: the contents part of a run's identity.

A config names its inputs by path (`prompts=q.jsonl`, `target=DIR`, `draft=eagle:DIR`, a
GGUF file ...); the same text can name other contents tomorrow. `digests(axes, fixed)`
finds every string value (nested ones too) that names an existing file or directory, alone
or after a `KIND:` prefix, and takes the sha256 of what it names: a file's bytes, a
directory's regular files (names, sizes, contents; hidden ones aside: `files.dir_sha256`,
the key of the Hugging Face import cache). Embedded references (`default`, `code`,
`random:SPEC`, `eagle:default` ...) name no path and add nothing, so a run without paths
keeps the fingerprint it had. `run_directory.fingerprint` hashes the digests with the
config; `changed` names the inputs whose contents differ between two runs.
"""

from __future__ import annotations

import functools
import os
import pathlib
import stat
from typing import Any, Mapping, Sequence
from specjax.files import file_sha256
from specjax.files import dir_sha256

# Words that are references, never paths, wherever they appear (a file named `code` in the
# working directory is not the embedded `code` set: `specjax.data.prompts`).
RESERVED = frozenset({"default", "code", "prose", "random", "self", "lookup"})


def digests(axes: Mapping[str, Sequence], fixed: Mapping[str, Any]) -> list[dict]:
  """[{"param", "path", "sha256"}] for every path the sweep's values name, sorted (module
  doc). A path that cannot be read is left out: the point that reads it fails and says why."""
  found: dict[tuple[str, str], str] = {}
  for name, values in axes.items():
    for value in values:
      _walk(name, value, found)
  for name, value in fixed.items():
    _walk(name, value, found)
  return [{"param": p, "path": path, "sha256": d} for (p, path), d in sorted(found.items())]


def _walk(name: str, value: Any, found: dict) -> None:
  if isinstance(value, str):
    for path in _paths(value):
      digest = path_digest(path)
      if digest is not None:
        found[(name, path)] = digest
  elif isinstance(value, Mapping):
    for v in value.values():
      _walk(name, v, found)
  elif isinstance(value, (list, tuple)):
    for v in value:
      _walk(name, v, found)


def _paths(text: str) -> list[str]:
  """The existing paths `text` names: itself, or what follows a `KIND:` prefix."""
  out = []
  for candidate in (text, text.partition(":")[2]):
    if candidate and candidate not in RESERVED and candidate not in out and _exists(candidate):
      out.append(candidate)
  return out


def _exists(text: str) -> bool:
  try:
    return os.path.exists(text)
  except (ValueError, OSError):  # a NUL byte, a name too long
    return False


def path_digest(path: str) -> str | None:
  """The sha256 of a regular file's bytes or of a directory's files (`files.dir_sha256`);
  None for anything else (a pipe is read by its consumer, once) or what cannot be read.
  Each version of a path (inode, size, modification time of it and its files) is hashed
  once per process."""
  try:
    return _digest(path, _version(path))
  except OSError:
    return None


def _version(path: str) -> tuple:
  st = os.stat(path)
  if stat.S_ISREG(st.st_mode):
    return ("file", st.st_ino, st.st_size, st.st_mtime_ns)
  if not stat.S_ISDIR(st.st_mode):
    return ("other",)
  files = []
  for root, dirs, names in os.walk(path):
    dirs[:] = sorted(d for d in dirs if not d.startswith("."))
    for n in sorted(names):
      if not n.startswith("."):
        s = os.stat(os.path.join(root, n))
        files.append((os.path.relpath(os.path.join(root, n), path), s.st_ino, s.st_size,
                      s.st_mtime_ns))
  return ("dir", tuple(files))


@functools.lru_cache(maxsize=64)
def _digest(path: str, version: tuple) -> str | None:
  if version[0] == "file":
    return file_sha256(path)
  if version[0] == "dir":
    return dir_sha256(path)
  return None


def changed(old: Sequence[Mapping] | None, new: Sequence[Mapping]) -> str:
  """One phrase naming the inputs whose contents differ between a run's recorded `old`
  digests and `new` ones ("" when none differs): "prompts 'q.jsonl' (sha256 1a2b3c4d5e6f
  then, 9f8e7d6c5b4a now)"; inputs recorded on one side only are named too."""
  def table(entries):
    return {(e.get("param"), e.get("path")): e.get("sha256") for e in entries or ()
            if isinstance(e, Mapping)}
  before, after = table(old), table(new)
  parts = []
  for key in sorted(set(before) | set(after), key=str):
    was, now = before.get(key), after.get(key)
    if was != now:
      parts.append(f"{key[0]} {key[1]!r} (sha256 {_short(was)} then, {_short(now)} now)")
  return "; ".join(parts)


def _short(digest: str | None) -> str:
  return "unrecorded" if digest is None else digest[:12]
