"""The model cache and the files it writes (issue 29): atomic writes with the umask's modes,
a damaged `.partial` build discarded and rebuilt, a damaged finished entry rebuilt or
reported in one line, and a process waiting for another's build saying so.

No real default model is trained here: `defaults._cached_build` (the scheme every default
build uses) runs with a small fake build that does what a real one does to its `.partial`
(the real `_build_tokenizer` saves a BPE first and reuses it on resume; an orbax step is
saved, and restored on resume), and the CLI case patches the trainer's two ends.
"""

import errno
import fcntl
import json
import os
import pathlib
import threading
import time
import types

import numpy as np
import pytest

from specjax import files as dirs
from specjax.checkpoints import orbax_io
from specjax.data.tokenizer import ByteTokenizer, load_tokenizer
from specjax.training import defaults

RECIPE = {"format": "test", "what": "fake entry"}
TEXTS = ["\n".join(f"name_{i} = value_{i * 7} + other_{i % 13}" for i in range(400))]


# ----------------------------------------------------------------------------- atomic writes


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_atomic_writes_and_assembled_dirs_get_the_umask_modes(tmp_path, umask, mask):
  umask(mask)
  path = tmp_path / "f.json"
  dirs.atomic_write(path, "old")
  dirs.atomic_write(path, b"new")
  assert path.read_bytes() == b"new" and path.stat().st_mode & 0o777 == 0o666 & ~mask
  ByteTokenizer().save(tmp_path)
  assert (tmp_path / "tokenizer.json").stat().st_mode & 0o777 == 0o666 & ~mask
  out = tmp_path / "model"
  with dirs.assembling(out) as tmp:  # save_model / import-hf build their directory so
    (tmp / "sub").mkdir()
    (tmp / "sub" / "w.bin").write_bytes(b"x")
  assert out.stat().st_mode & 0o777 == 0o777 & ~mask  # mkdtemp gave 0700 under any umask
  assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json", "model", "tokenizer.json"]


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_exported_safetensors_get_the_umask_modes(tmp_path, umask, mask):
  """The safetensors package writes 0600 whatever the umask (issue 29 item 8: outputs
  written 0600 under umask 022); export-hf's weight files get the umask's mode."""
  import numpy as np
  from specjax.checkpoints import hf
  from specjax.checkpoints.hf.tensor_files import write_safetensors
  from specjax.models.transformer import ModelConfig
  umask(mask)
  assert dirs.file_mode() == 0o666 & ~mask
  write_safetensors(tmp_path / "w.safetensors", {"a": np.zeros(3, np.float32)})
  assert (tmp_path / "w.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask
  config = ModelConfig.gpt2(vocab_size=64, d_model=8, n_layers=1, n_heads=2, n_kv_heads=2,
                            d_ff=16, max_len=32)
  params = {k: np.zeros(shape, np.float32) for k, shape in hf.param_shapes(config).items()}
  out = hf.export_hf((config, params), tmp_path / "hf")
  modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
  assert modes == {"config.json": 0o666 & ~mask, "model.safetensors": 0o666 & ~mask,
                   dirs.MARKER: 0o666 & ~mask}, modes
  assert out.stat().st_mode & 0o777 == 0o777 & ~mask


def test_a_failed_atomic_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path,
                                                                          monkeypatch):
  ByteTokenizer().save(tmp_path)
  before = (tmp_path / "tokenizer.json").read_bytes()

  def full(fd):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(os, "fsync", full)  # the data never reached the disk
  with pytest.raises(OSError, match="No space left"):
    ByteTokenizer().save(tmp_path)
  with pytest.raises(OSError, match="No space left"):
    dirs.atomic_write(tmp_path / "tokenizer.json", "{trunc")
  monkeypatch.undo()
  assert (tmp_path / "tokenizer.json").read_bytes() == before
  assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]
  assert load_tokenizer(tmp_path) == ByteTokenizer()


# ----------------------------------------------------------------------------- the cache scheme

BPE = types.SimpleNamespace(name="fake", tokenizer="bpe:300",
                            target=types.SimpleNamespace(vocab_size=300))
CORPUS = types.SimpleNamespace(name="fake", train=[types.SimpleNamespace(text=t) for t in TEXTS])


class FakeBuild:
  """What a default build does to its `.partial`, in a fraction of a second: the real
  `_build_tokenizer` (a BPE trained and saved first; reused when resuming), then a
  "training" that resumes from the newest orbax step in partial/target or saves step 0."""

  def __init__(self):
    self.calls = 0
    self.resumed_steps: list[int] = []

  def __call__(self, partial: pathlib.Path) -> dict:
    self.calls += 1
    pytest.importorskip("tokenizers")
    tokenizer = defaults._build_tokenizer(BPE, CORPUS, partial)
    params = {"w": np.arange(64, dtype=np.float32) * tokenizer.vocab_size}
    with orbax_io.Checkpointer(partial / "target") as ckpt:
      if ckpt.latest_step() is not None:  # a resumed build reads what the partial holds
        restored = ckpt.restore(params_target=params)
        self.resumed_steps.append(restored.step)
        assert np.array_equal(restored.params["w"], params["w"])
      else:
        ckpt.save(0, params=params)
    return {"recipe": RECIPE, "build_seconds": 0.0}

  def interrupted(self, partial: pathlib.Path) -> None:
    """A build killed after its first checkpoint: the partial it leaves behind."""
    self(partial)
    self.calls -= 1


def _verify(entry: pathlib.Path):
  defaults._check_manifest(entry, RECIPE, "test recipe")
  return load_tokenizer(entry)


def _build(entry: pathlib.Path, build: FakeBuild, verify=_verify, rebuild: bool = False):
  return defaults._cached_build(
      entry, rebuild, verify, build, unusable=f"cached fake at {entry} is unusable",
      build_name="fake build", training=f"building the fake entry into {entry}",
      ready=lambda result, body: f"fake entry ready in {entry}")


@pytest.fixture
def entry(tmp_path):
  return tmp_path / "models" / "fake-code-0123456789ab"


def test_a_truncated_tokenizer_in_the_partial_is_discarded_and_rebuilt(entry, capfd):
  build = FakeBuild()
  partial = entry.with_name(entry.name + ".partial")
  build.interrupted(partial)
  good = (partial / "tokenizer.json").read_text()
  (partial / "tokenizer.json").write_text(good[:len(good) // 3])  # the probe's damage
  capfd.readouterr()
  tokenizer = _build(entry, build)
  err = capfd.readouterr().err
  assert "resuming an interrupted fake build" in err
  assert (f"the interrupted fake build in {partial} cannot be resumed (cannot read tokenizer "
          f"file {str(partial / 'tokenizer.json')!r}") in err
  assert "discarding it and building from scratch" in err and f"ready in {entry}" in err
  assert build.calls == 2 and not partial.exists() and tokenizer.vocab_size == 300
  assert (entry / "tokenizer.json").read_text() == good  # the same BPE, trained again
  assert _build(entry, build).to_spec() == tokenizer.to_spec() and build.calls == 2  # cached
  assert not [p for p in entry.parent.iterdir() if ".bad-" in p.name]


def test_a_damaged_checkpoint_step_in_the_partial_is_discarded_and_rebuilt(entry, capfd):
  build = FakeBuild()
  partial = entry.with_name(entry.name + ".partial")
  build.interrupted(partial)
  for f in (partial / "target").rglob("*"):  # every stored byte of the step cut in half
    if f.is_file() and "params" in f.parts:
      f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
  capfd.readouterr()
  _build(entry, build)
  err = capfd.readouterr().err
  assert f"the interrupted fake build in {partial} cannot be resumed (" in err
  assert "discarding it and building from scratch" in err and "Traceback" not in err
  assert build.calls == 2 and build.resumed_steps == [] and entry.is_dir()
  # an intact partial is resumed, not discarded
  entry.rename(partial)
  (partial / defaults.MANIFEST).unlink()
  capfd.readouterr()
  _build(entry, build)
  err = capfd.readouterr().err
  assert "resuming an interrupted fake build" in err and "cannot be resumed" not in err
  assert build.resumed_steps == [0]


def test_a_damaged_finished_entry_is_rebuilt_or_reported_in_one_line(entry, capfd,
                                                                     monkeypatch):
  build = FakeBuild()
  _build(entry, build)
  text = (entry / "tokenizer.json").read_text()
  (entry / "tokenizer.json").write_text(text[:100])
  capfd.readouterr()
  _build(entry, build)
  err = capfd.readouterr().err
  assert f"cached fake at {entry} is unusable (1 file(s) differ from the manifest" in err
  assert build.calls == 2 and (entry / "tokenizer.json").read_text() == text
  (entry / defaults.MANIFEST).write_text("[]")  # valid JSON, not a manifest: no traceback
  _build(entry, build)
  assert "unreadable manifest: not a JSON object" in capfd.readouterr().err
  # an entry that cannot be moved aside: one line naming it and what to do
  (entry / "tokenizer.json").write_text(text[:100])
  real_rename = pathlib.Path.rename

  def refuse(self, target):
    if self == entry:
      raise PermissionError(errno.EACCES, "Permission denied", str(self))
    return real_rename(self, target)

  monkeypatch.setattr(pathlib.Path, "rename", refuse)
  with pytest.raises(defaults.CacheEntryError) as e:
    _build(entry, build)
  message = str(e.value)
  assert "\n" not in message and isinstance(e.value, ValueError)
  assert f"cannot move {entry} aside to rebuild it" in message
  assert "remove it and re-run (or run `specjax train defaults`)" in message
  monkeypatch.undo()
  # a fresh build that does not verify: one line naming the partial
  def broken(d):
    raise defaults.CacheError("checkpoint does not restore: truncated")

  with pytest.raises(defaults.CacheEntryError, match=r"the fake build just made in .*\.partial "
                     r"does not verify \(checkpoint does not restore: truncated\): remove "):
    _build(entry, build, verify=broken, rebuild=True)


def test_generate_with_a_default_target_that_cannot_be_built_is_a_one_line_error(
    tmp_path, monkeypatch, capfd):
  """`specjax generate --target default` through the real cache code, the trainer's two
  ends patched: a build whose checkpoint does not restore ends in one line, exit 2."""
  from specjax import cli
  from specjax.training import shipped
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
  monkeypatch.setattr(shipped, "embedded_root", lambda: tmp_path / "nothing shipped")

  def fake_target(preset, corpus, out, progress=True):
    out.mkdir(parents=True, exist_ok=True)
    ByteTokenizer().save(out)
    return {"build_seconds": 0.0, "target": {"fingerprint": "0", "val": None}}

  def truncated(*args, **kwargs):
    raise RuntimeError("TensorStore: DATA_LOSS: truncated chunk\n  (a multi-line error)")

  monkeypatch.setattr(defaults, "build_target", fake_target)
  monkeypatch.setattr(defaults, "load_trained", truncated)
  assert cli.main(["generate", "--target", "default", "--prompt", "x",
                   "--max-new-tokens", "4"]) == 2
  err = [l for l in capfd.readouterr().err.splitlines() if l.startswith("specjax: error")]
  entry = defaults.entry_dir()
  assert len(err) == 1, err
  assert (f"the build just made in {entry}.partial does not verify (checkpoint does not "
          "restore: TensorStore: DATA_LOSS: truncated chunk (a multi-line error)): remove "
          f"{entry}.partial and re-run") in err[0]


# ----------------------------------------------------------------------------- the build lock


def test_a_process_waiting_for_another_build_says_for_which_entry_and_whom(entry, capfd):
  """The lock of a first build is held for minutes: the waiter prints one line naming the
  entry and the holder's pid, then goes on when the holder is done."""
  lock = entry.parent / f".{entry.name}.lock"
  lock.parent.mkdir(parents=True)
  holder = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
  fcntl.flock(holder, fcntl.LOCK_EX)  # another open file: conflicts even in this process
  os.write(holder, b"4242\n")
  done = []
  waiter = threading.Thread(target=lambda: done.append(_build(entry, FakeBuild())),
                            daemon=True)
  capfd.readouterr()
  try:
    waiter.start()
    deadline, err = time.time() + 30, ""
    while "waiting for" not in err and time.time() < deadline:
      time.sleep(0.05)
      err += capfd.readouterr().err
    assert not done  # still waiting
    lines = [l for l in err.splitlines() if "waiting for" in l]
    assert lines == [f"specjax: waiting for another process (pid 4242) that is building or "
                     f"loading {entry}; this one goes on when it is done (a first build "
                     "takes minutes)"]
  finally:
    os.close(holder)  # the holder finishes
  waiter.join(60)
  assert done and done[0].vocab_size == 300
  assert lock.read_text().strip() == str(os.getpid())  # the next waiter names this process
  assert json.loads((entry / defaults.MANIFEST).read_text())["recipe"] == RECIPE
