"""Embedded and directory corpora: determinism, split by file, clear errors."""

import pathlib

import numpy as np
import pytest

from specjax.data import corpus as cp
from specjax.data.batches import TokenData
from specjax.data.corpus import load_corpus
from specjax.data.tokenizer import ByteTokenizer


def _fresh(spec, **kw):
  """Load without the per-process corpus cache (the file listing cache stays)."""
  cp._embedded.cache_clear()
  return load_corpus(spec, **kw)


def test_code_corpus_is_deterministic_and_split_by_file():
  cp._stdlib_sources.cache_clear()
  a = _fresh("code", max_bytes=300_000)
  cp._stdlib_sources.cache_clear()
  b = _fresh("code", max_bytes=300_000)
  assert a.fingerprint == b.fingerprint
  assert [d.name for d in a.train] == [d.name for d in b.train]
  names_train = {d.name for d in a.train}
  names_val = {d.name for d in a.validation}
  assert names_train and names_val and not names_train & names_val
  for name in names_train | names_val:
    parts = pathlib.PurePosixPath(name).parts
    assert name.endswith(".py")
    assert not {"test", "tests", "site-packages", "encodings"} & set(parts[:-1])
  assert 300_000 <= a.num_bytes("train") < 300_000 + 512 * 1024
  # a larger cap extends the same selection: the first documents are the same ones
  c = _fresh("code", max_bytes=600_000)
  assert [d.name for d in c.train[:len(a.train)]] == [d.name for d in a.train]


def test_prose_corpus_has_text_not_code():
  corpus = _fresh("prose", max_bytes=40_000)
  assert corpus.train and corpus.validation
  names = [d.name for d in corpus.train + corpus.validation]
  assert all(n.startswith(("pydoc_data/topics/", "docstrings/")) for n in names)
  text = " ".join(d.text for d in corpus.train)
  assert text.count(" the ") > 20
  assert _fresh("prose", max_bytes=40_000).fingerprint == corpus.fingerprint


def _write(root: pathlib.Path, files: dict):
  for name, text in files.items():
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
      path.write_bytes(text)
    else:
      path.write_text(text)


def test_directory_corpus_split_is_stable(tmp_path):
  files = {f"dir{i % 3}/file{i}.txt": f"document {i}\n" * (i + 1) for i in range(40)}
  files[".hidden/secret.txt"] = "never read"
  files[".dotfile"] = "never read"
  _write(tmp_path, files)
  a = load_corpus(tmp_path, val_fraction=0.2)
  assert a.name == f"dir:{tmp_path.name}"
  names = [d.name for d in a.train + a.validation]
  assert len(names) == 40 and not any(".hidden" in n or ".dotfile" in n for n in names)
  assert load_corpus(str(tmp_path), val_fraction=0.2).fingerprint == a.fingerprint
  # adding a file leaves every other file on its side of the split
  _write(tmp_path, {"new.txt": "new document\n"})
  b = load_corpus(tmp_path, val_fraction=0.2)
  assert {d.name for d in a.validation} <= {d.name for d in b.validation}
  assert {d.name for d in a.train} <= {d.name for d in b.train}
  assert b.fingerprint != a.fingerprint


def test_single_file_directory_is_split_inside(tmp_path):
  _write(tmp_path, {"only.txt": "".join(f"line {i}\n" for i in range(100))})
  corpus = load_corpus(tmp_path, val_fraction=0.1)
  assert len(corpus.train) == 1 and len(corpus.validation) == 1
  assert corpus.train[0].text + corpus.validation[0].text == (tmp_path / "only.txt").read_text()
  assert corpus.validation[0].text.startswith("line 90\n")


def test_directory_errors(tmp_path, monkeypatch):
  with pytest.raises(ValueError, match="does not exist or is not a directory"):
    load_corpus(tmp_path / "missing")
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(ValueError, match="contains no non-empty text files"):
    load_corpus(empty)
  _write(empty, {"blank.txt": ""})
  with pytest.raises(ValueError, match="contains no non-empty text files"):
    load_corpus(empty)

  binary = tmp_path / "binary"
  _write(binary, {"a.txt": "fine\n", "b.bin": b"\xff\xfe\x00\x81"})
  with pytest.raises(ValueError, match=r"b\.bin.*is not UTF-8"):
    load_corpus(binary)
  assert len(load_corpus(binary, glob="*.txt").train) == 1

  unreadable = tmp_path / "unreadable"
  _write(unreadable, {"a.txt": "fine\n", "locked.txt": "secret\n"})
  real = pathlib.Path.read_bytes

  def read_bytes(self):
    if self.name == "locked.txt":
      raise PermissionError(13, "Permission denied")
    return real(self)

  monkeypatch.setattr(pathlib.Path, "read_bytes", read_bytes)
  with pytest.raises(ValueError, match=r"cannot read corpus file .*locked\.txt.*Permission"):
    load_corpus(unreadable)


@pytest.mark.parametrize("kw, match", [({"val_fraction": 0.0}, "val_fraction"),
                                       ({"val_fraction": 1.5}, "val_fraction"),
                                       ({"max_bytes": 0}, "max_bytes")])
def test_bad_arguments(kw, match):
  with pytest.raises(ValueError, match=match):
    load_corpus("code", **kw)


def test_batches_are_a_function_of_seed_and_step(tmp_path):
  _write(tmp_path, {f"f{i}.txt": f"text number {i} " * 50 for i in range(10)})
  data = TokenData.from_corpus(load_corpus(tmp_path), ByteTokenizer())
  tok = ByteTokenizer()
  assert data.train[0] == tok.bos_id and data.train[-1] == tok.eos_id
  a = data.train_batch(seed=3, step=7, batch_size=4, seq_len=16, grad_accum=2)
  assert a.shape == (2, 2, 17) and a.dtype == np.int32
  np.testing.assert_array_equal(a, data.train_batch(3, 7, 4, 16, 2))
  assert not np.array_equal(a, data.train_batch(3, 8, 4, 16, 2))
  val = data.validation_windows(16, 1000)
  assert val.shape[1] == 17 and len(val) <= len(data.validation) // 16
  with pytest.raises(ValueError, match="seq_len 100000 does not fit"):
    data.check_fits(100_000)
