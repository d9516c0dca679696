"""The CLI-wide error policy: an expected failure (a bad value, a path that cannot be read or
written, a full disk, an interrupt) ends with one line `specjax: error: ...` on stderr that
names the argument or path, exit status 2, no traceback; only bugs show a traceback.

Every case runs the CLI in-process (`specjax.cli.main`): a subprocess would pay seconds of
imports per case.
"""

from __future__ import annotations

import errno
import tempfile

import numpy as np
import pytest

from specjax import cli

NOT_UTF8 = b"def f(\xff):".decode("utf-8", "surrogateescape")  # how argv carries such bytes


def _hf_dir(path, vocab_size: int):
  """A Hugging Face directory (config + safetensors, no tokenizer files) of a random model."""
  from specjax.checkpoints import hf
  from specjax.models.transformer import ModelConfig
  config = ModelConfig.gpt2(vocab_size=vocab_size, d_model=16, n_layers=1, n_heads=2,
                            n_kv_heads=2, d_ff=32, max_len=32)
  rng = np.random.default_rng(0)
  params = {name: (0.2 * rng.standard_normal(shape)).astype(np.float32)
            for name, shape in hf.param_shapes(config).items()}
  hf.export_hf((config, params), path)
  return str(path)


def _read_only(monkeypatch):
  """Make every temporary directory fail as it would on a read-only file system."""
  def refuse(*args, dir=None, **kwargs):
    raise OSError(errno.EROFS, "Read-only file system", str(dir))
  monkeypatch.setattr(tempfile, "mkdtemp", refuse)


def _disk_full(monkeypatch):
  from matplotlib.figure import Figure

  def full(self, fname, *args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device", str(fname))
  monkeypatch.setattr(Figure, "savefig", full)


# (id, argv with {tmp} for the test's directory, what the message must name, setup)
CASES = [
    # theory: values named by their flags, not by the library arguments behind them
    ("burstiness-k0", ["theory", "burstiness", "--k", "0"], "--k must be an integer >= 1", None),
    ("roofline-k-1", ["theory", "roofline", "--k", "-1"], "--k must be an integer >= 1", None),
    ("sample-size-alpha0", ["theory", "sample-size", "--alpha", "0"], "--alpha 0", None),
    ("sample-size-alpha1", ["theory", "sample-size", "--alpha", "1"], "--method wilson", None),
    ("optimal-k-alpha", ["theory", "optimal-k", "--alpha", "1.5"], "--alpha", None),
    ("sample-size-half-width", ["theory", "sample-size", "--half-width", "0"], "--half-width",
     None),
    ("tree-parents", ["theory", "tree", "--parents=0", "--rank-probs", "0.5"], "parents", None),
    # theory: paths
    ("model-config-missing", ["theory", "roofline", "--model-config", "{tmp}/none.json"],
     "--model-config {tmp}/none.json", None),
    ("model-config-not-json", ["theory", "roofline", "--model-config", "{tmp}/bad.json"],
     "--model-config {tmp}/bad.json: not valid JSON", "bad_json"),
    ("model-config-directory", ["theory", "roofline", "--model-config", "{tmp}"],
     "--model-config {tmp}", None),
    ("plot-unwritable", ["theory", "table", "--plot", "{tmp}/no/such/dir/x.png"],
     "--plot {tmp}/no/such/dir/x.png", None),
    ("plot-directory", ["theory", "roofline", "--batches", "1", "--plot", "{tmp}"],
     "--plot {tmp}", None),
    ("plot-disk-full", ["theory", "table", "--plot", "{tmp}/x.png"], "disk is full",
     _disk_full),
    # generate: checked before models are built or anything compiles
    ("prompt-not-utf8", ["generate", "--prompt", NOT_UTF8], "--prompt #1 is not valid UTF-8",
     None),
    ("generate-k0", ["generate", "--k", "0"], "--k must be an int >= 1", None),
    ("draft-stop-fixed-k", ["generate", "--draft-stop", "0.3"], "--draft-stop 0.3 needs --k auto",
     None),
    ("draft-stop-range", ["generate", "--k", "auto", "--draft-stop", "1.5"],
     "--draft-stop: threshold must be a finite number in [0, 1]", None),
    ("draft-stop-lookup", ["generate", "--k", "auto", "--draft", "lookup", "--draft-stop",
                           "0.5"], "the lookup drafter has no draft confidence", None),
    ("generate-top-p", ["generate", "--top-p", "1.5", "--repeats", "1"], "top_p", None),
    ("target-config-json", ["generate", "--target-config", "{{bad"], "--target-config", None),
    ("target-config-preset", ["generate", "--target-config", "tiny-gtp2"],
     "did you mean tiny-gpt2", None),
    ("target-missing", ["generate", "--target", "{tmp}/none"], "--target {tmp}/none", None),
    ("k-beyond-context", ["generate", "--target-config", "tiny-gpt2", "--draft-config", "self",
                          "--k", "10000", "--repeats", "1"], "--k 10000", None),
    ("default-pair-k-beyond-context", ["generate", "--target", "default", "--draft", "default",
                                       "--k", "10000"], "--k 10000", None),  # before training
    ("rope-beyond-max-len", ["generate", "--target-config", "tiny-llama:max_len=32",
                             "--draft-config", "self", "--max-new-tokens", "40"],
     "--allow-beyond-max-len", None),
    # checkpoints
    ("import-read-only", ["import-hf", "{tmp}/src", "--out", "{tmp}/ro/ckpt"],
     "--out {tmp}/ro/ckpt", _read_only),
    ("import-out-is-file", ["import-hf", "{tmp}/src", "--out", "{tmp}/bad.json"], "--out",
     "bad_json"),
    ("import-src-missing", ["import-hf", "{tmp}/none", "--out", "{tmp}/ckpt"], "{tmp}/none",
     None),
    ("import-no-tokenizer", ["import-hf", "{tmp}/hf100", "--out", "{tmp}/ckpt"], "--tokenizer",
     "hf100"),
    ("import-byte-tokenizer", ["import-hf", "{tmp}/hf100", "--out", "{tmp}/ckpt",
                               "--tokenizer", "byte"], "--tokenizer byte", "hf100"),
    ("import-tokenizer-dir", ["import-hf", "{tmp}/hf100", "--out", "{tmp}/ckpt",
                              "--tokenizer", "{tmp}"], "--tokenizer {tmp}", "hf100"),
    ("inspect-missing", ["inspect", "{tmp}/none"], "{tmp}/none", None),
    ("train-out-is-file", ["train", "target", "--out", "{tmp}/bad.json"],
     "--out {tmp}/bad.json exists and is not a directory", "bad_json"),
    ("train-eagle-width", ["train", "eagle", "--target", "{tmp}/none", "--width", "0",
                           "--out", "{tmp}/head"], "width must be None", None),  # before loading
]


@pytest.mark.parametrize("argv, names, setup", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_expected_failure_is_one_line_naming_the_argument(capsys, monkeypatch, tmp_path, argv,
                                                          names, setup):
  tmp = str(tmp_path)
  if setup == "bad_json":
    (tmp_path / "bad.json").write_text("{not json")
  elif setup == "hf100":
    _hf_dir(tmp_path / "hf100", vocab_size=100)
  elif setup is not None:
    setup(monkeypatch)
  code = cli.main([a.format(tmp=tmp) for a in argv])
  out, err = capsys.readouterr()
  assert code == 2, (out, err)
  assert "Traceback" not in err
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("specjax: error: "), err
  assert names.format(tmp=tmp) in lines[0], err
  assert not (tmp_path / "ckpt").exists()  # a refused import writes nothing


def test_interrupted_work_is_one_line(capsys, monkeypatch):
  from specjax.commands import theory

  def interrupted(args):
    raise KeyboardInterrupt
  monkeypatch.setattr(theory, "_optimal_k", interrupted)  # build_parser reads it at each call
  assert cli.main(["theory", "optimal-k"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("specjax: error: interrupted") and err.count("\n") == 1


def test_a_bug_keeps_its_traceback(monkeypatch):
  from specjax.commands import theory

  def bug(args):
    raise RuntimeError("a bug")
  monkeypatch.setattr(theory, "_optimal_k", bug)
  with pytest.raises(RuntimeError, match="a bug"):
    cli.main(["theory", "optimal-k"])


def test_import_without_tokenizer_files_is_accepted_when_byte_ids_fit(capsys, tmp_path):
  """The byte tokenizer is attached without a word only when every id of it is in the
  model's vocabulary (here 300 >= 259)."""
  src = _hf_dir(tmp_path / "hf300", vocab_size=300)
  assert cli.main(["import-hf", src, "--out", str(tmp_path / "ckpt")]) == 0
  assert "tokenizer: ByteTokenizer(vocab_size=259)" in capsys.readouterr().out


def test_import_with_tokenizer_byte_is_accepted_when_byte_ids_fit(capsys, tmp_path):
  src = _hf_dir(tmp_path / "hf300", vocab_size=300)
  assert cli.main(["import-hf", src, "--out", str(tmp_path / "ckpt"), "--tokenizer",
                   "byte"]) == 0
  assert "tokenizer: ByteTokenizer" in capsys.readouterr().out
