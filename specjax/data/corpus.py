"""Embedded corpora: text that every Python installation carries, so training needs no download.

- code:  the `.py` sources of the running interpreter's standard library, minus tests,
         site-packages, codec tables (`encodings/`) and `pydoc_data` (which is prose).
- code+tests: the same with the library's own test suites (`test/`, `tests/`, `test_*.py`):
         three times the text (~29 MB on 3.11), what the shipped embedded pair trains on.
         A document's split depends on its name only, so `code`'s validation documents are
         validation documents here too: held out from both.
- prose: `pydoc_data.topics` (the language reference topics behind `help()`), one document per
         topic, plus the docstrings of the standard library modules, one document per module
         (parsed with `ast`; nothing is imported or executed).
- DIR:   every non-hidden regular file under a user directory (optionally filtered by a glob).

Determinism: documents are named by their path relative to the library (or directory), so the
selection depends only on the file contents and the Python version. Each document's bucket is
sha256(name); a document goes to validation when its bucket falls under `val_fraction`, so the
split is by file and stable when files are added or removed elsewhere. Documents are listed in
bucket order (a fixed shuffle), so a `max_bytes` cap takes a varied sample, not one package.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import os
import pathlib
import sysconfig
from typing import Iterator

EMBEDDED = ("code", "code+tests", "prose")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "encodings", "pydoc_data"}
_TEST_DIRS = {"test", "tests", "idle_test"}
_MAX_FILE_BYTES = 512 * 1024


@dataclasses.dataclass(frozen=True)
class Document:
  name: str
  text: str


@dataclasses.dataclass(frozen=True)
class Corpus:
  """A named train/validation split of documents; `fingerprint` hashes names and texts."""
  name: str
  train: tuple[Document, ...]
  validation: tuple[Document, ...]

  @functools.cached_property
  def fingerprint(self) -> str:
    h = hashlib.sha256()
    for split, docs in (("train", self.train), ("validation", self.validation)):
      for d in docs:
        h.update(f"{split}\0{d.name}\0{len(d.text)}\0".encode())
        h.update(d.text.encode("utf-8", errors="surrogatepass"))
    return h.hexdigest()[:16]

  def num_bytes(self, split: str = "train") -> int:
    return sum(len(d.text.encode("utf-8", errors="surrogatepass"))
               for d in getattr(self, split))

  def summary(self) -> str:
    return (f"corpus {self.name}: {len(self.train)} train docs ({self.num_bytes('train'):,} B), "
            f"{len(self.validation)} validation docs ({self.num_bytes('validation'):,} B), "
            f"fingerprint {self.fingerprint}")


def _bucket(name: str) -> float:
  """A fixed pseudo-random number in [0, 1) for a document name."""
  return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2.0**64


def _check_fraction(val_fraction: float) -> None:
  if not 0.0 < val_fraction < 1.0:
    raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")


def _check_max_bytes(max_bytes: int | None) -> None:
  if max_bytes is not None and max_bytes <= 0:
    raise ValueError(f"max_bytes must be a positive number of bytes or None, got {max_bytes}")


def split_documents(name: str, docs: Iterator[Document], *, val_fraction: float = 0.05,
                    max_bytes: int | None = None) -> Corpus:
  """Split `docs` (already in bucket order) into train/validation by name bucket.

  max_bytes caps the train text; validation is capped at max_bytes * val_fraction / (1 -
  val_fraction), so both keep their proportions. Reading stops once both caps are reached.
  Validation always gets at least one document when there are two or more.
  """
  _check_fraction(val_fraction)
  _check_max_bytes(max_bytes)
  val_cap = (None if max_bytes is None
             else max(1, int(max_bytes * val_fraction / (1 - val_fraction))))
  train: list[Document] = []
  val: list[Document] = []
  n_train = n_val = 0
  for doc in docs:
    if not doc.text:
      continue
    size = len(doc.text.encode("utf-8", errors="surrogatepass"))
    if _bucket(doc.name) < val_fraction:
      if val_cap is None or n_val < val_cap:
        val.append(doc)
        n_val += size
    elif max_bytes is None or n_train < max_bytes:
      train.append(doc)
      n_train += size
    if max_bytes is not None and n_train >= max_bytes and n_val >= val_cap:
      break
  if not val and len(train) >= 2:  # tiny corpora: move the last train document over
    val.append(train.pop())
  return Corpus(name, tuple(train), tuple(val))


def stdlib_dir() -> pathlib.Path:
  """The standard library the embedded corpora read: the running interpreter's, or the tree
  named by $SPECJAX_STDLIB_DIR (a copy of another interpreter's library, so a pair can be
  trained on another machine from exactly the text a given Python version carries)."""
  override = os.environ.get("SPECJAX_STDLIB_DIR")
  if override:
    root = pathlib.Path(override)
    if not root.is_dir():
      raise ValueError(f"$SPECJAX_STDLIB_DIR must name a directory, got {override!r}")
    return root
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=None)
def _stdlib_sources(tests: bool = False) -> tuple[tuple[str, pathlib.Path], ...]:
  """(relative name, path) of the library's .py files we use (with its test suites when
  `tests`), in bucket order."""
  root = stdlib_dir()
  skip = _SKIP_DIRS if tests else _SKIP_DIRS | _TEST_DIRS
  found = []
  for folder, dirs, files in os.walk(root):
    dirs[:] = [d for d in dirs if d not in skip and not d.startswith(".")]
    for name in files:
      if not name.endswith(".py") or (name.startswith("test_") and not tests):
        continue
      path = pathlib.Path(folder, name)
      try:
        if not path.is_file() or path.stat().st_size > _MAX_FILE_BYTES:
          continue
      except OSError:
        continue
      found.append((path.relative_to(root).as_posix(), path))
  found.sort(key=lambda item: (_bucket(item[0]), item[0]))
  return tuple(found)


def _read_utf8(path: pathlib.Path) -> str | None:
  """Library files that cannot be read as UTF-8 are skipped (the same on every run)."""
  try:
    return path.read_bytes().decode("utf-8")
  except (OSError, UnicodeDecodeError):
    return None


def _code_documents(tests: bool = False) -> Iterator[Document]:
  for name, path in _stdlib_sources(tests):
    text = _read_utf8(path)
    if text is not None:
      yield Document(name, text)


def _docstrings(source: str) -> str:
  """Module, class and function docstrings of one source file, in source order."""
  try:
    tree = ast.parse(source)
  except (SyntaxError, ValueError):
    return ""
  parts = []
  for node in _scopes(tree):
    doc = ast.get_docstring(node, clean=True)
    if doc and len(doc) >= 40:  # skip one-liners like "Return x."; they are mostly noise
      parts.append(doc.strip())
  return "\n\n".join(parts)


_SCOPES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _scopes(node: ast.AST) -> Iterator[ast.AST]:
  """Module, class and function nodes in source order, visiting statement bodies only
  (docstrings cannot hide in expressions; skipping them makes this ~5x faster than ast.walk)."""
  if isinstance(node, _SCOPES):
    yield node
  for field in ("body", "orelse", "finalbody", "handlers", "cases"):
    for child in getattr(node, field, None) or ():
      if isinstance(child, ast.AST):
        yield from _scopes(child)


def _topics() -> list[tuple[str, str]]:
  try:
    from pydoc_data import topics  # stdlib data module: a dict of help() topics
  except ImportError:
    return []
  return sorted(topics.topics.items())


def _prose_documents() -> Iterator[Document]:
  docs = [(f"pydoc_data/topics/{key}", None, text) for key, text in _topics()]
  docs += [(f"docstrings/{name}", path, None) for name, path in _stdlib_sources()]
  docs.sort(key=lambda item: (_bucket(item[0]), item[0]))
  for name, path, text in docs:
    if text is None:
      source = _read_utf8(path)
      text = _docstrings(source) if source is not None else ""
    if text:
      yield Document(name, text)


def directory_documents(directory: str | pathlib.Path, glob: str = "**/*") -> list[Document]:
  """Text files under `directory` (hidden files and folders skipped), in bucket order.

  Raises ValueError for a missing directory, an unreadable file, a file that is not UTF-8
  text, or a directory without any non-empty text file.
  """
  root = pathlib.Path(directory)
  if not root.is_dir():
    raise ValueError(f"corpus directory {str(directory)!r} does not exist or is not a "
                     "directory (embedded corpora are 'code' and 'prose')")
  docs = []
  for path in sorted(root.glob(glob)):
    rel = path.relative_to(root)
    if any(part.startswith(".") for part in rel.parts) or not path.is_file():
      continue
    try:
      data = path.read_bytes()
    except OSError as e:
      raise ValueError(f"cannot read corpus file {str(path)!r}: {e.strerror or e}") from e
    try:
      text = data.decode("utf-8")
    except UnicodeDecodeError as e:
      raise ValueError(f"corpus file {str(path)!r} is not UTF-8 text ({e.reason} at byte "
                       f"{e.start}); remove it or select text files with a glob") from e
    if "\0" in text:
      raise ValueError(f"corpus file {str(path)!r} looks binary (contains NUL bytes); remove "
                       "it or select text files with a glob")
    if text:
      docs.append(Document(rel.as_posix(), text))
  if not docs:
    raise ValueError(f"corpus directory {str(directory)!r} contains no non-empty text files "
                     f"(glob {glob!r})")
  docs.sort(key=lambda d: (_bucket(d.name), d.name))
  return docs


def _split_single(doc: Document, val_fraction: float) -> tuple[Document, Document]:
  """One file only: its last `val_fraction` of lines become the validation document."""
  lines = doc.text.splitlines(keepends=True)
  cut = max(1, min(len(lines) - 1, round(len(lines) * (1 - val_fraction))))
  if len(lines) < 2:  # a single line: cut by characters
    cut_c = max(1, int(len(doc.text) * (1 - val_fraction)))
    return Document(doc.name, doc.text[:cut_c]), Document(doc.name + "#val", doc.text[cut_c:])
  return (Document(doc.name, "".join(lines[:cut])),
          Document(doc.name + "#val", "".join(lines[cut:])))


@functools.lru_cache(maxsize=8)
def _embedded(spec: str, val_fraction: float, max_bytes: int | None) -> Corpus:
  documents = (_prose_documents() if spec == "prose" else
               _code_documents(tests=spec == "code+tests"))
  return split_documents(spec, documents, val_fraction=val_fraction, max_bytes=max_bytes)


def load_corpus(spec: str | pathlib.Path, *, val_fraction: float = 0.05,
                max_bytes: int | None = None, glob: str = "**/*") -> Corpus:
  """'code', 'code+tests', 'prose', or a directory path -> Corpus.

  Embedded corpora are cached per process (a Corpus is frozen). A directory is read afresh on
  every call; one with a single file is split inside the file (its last lines go to validation).
  """
  _check_fraction(val_fraction)
  _check_max_bytes(max_bytes)
  spec = str(spec)
  if spec in EMBEDDED:
    corpus = _embedded(spec, float(val_fraction), max_bytes)
  else:
    docs = directory_documents(spec, glob)
    if len(docs) == 1:
      if len(docs[0].text) < 2:
        raise ValueError(f"corpus directory {spec!r} holds too little text to split into "
                         "train and validation")
      train_doc, val_doc = _split_single(docs[0], val_fraction)
      return Corpus(f"dir:{pathlib.Path(spec).name}", (train_doc,), (val_doc,))
    corpus = split_documents(f"dir:{pathlib.Path(spec).name}", iter(docs),
                             val_fraction=val_fraction, max_bytes=max_bytes)
  if not corpus.train or not corpus.validation:
    raise ValueError(f"corpus {spec!r} yielded {len(corpus.train)} train and "
                     f"{len(corpus.validation)} validation documents; both must be non-empty")
  return corpus
