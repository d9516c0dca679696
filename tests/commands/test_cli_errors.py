"""The CLI-wide error policy: an expected failure (a bad value, a path that cannot be read or
written, a full disk, an interrupt, a damaged input file, a usage error) ends with one line
`specjax: error: ...` on stderr that names the argument or path, exit status 2, no
traceback; only bugs show a traceback.

Every case runs the CLI in-process (`specjax.cli.main`): a subprocess would pay seconds of
imports per case. Usage errors found by argparse itself exit through SystemExit(2), as
argparse's own do; the table reads that status like a returned one.
"""

from __future__ import annotations

import errno
import functools
import os
import pathlib
import shutil
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


def _read_only(monkeypatch, tmp_path):
  """Make every new directory fail as it would on a read-only file system (tempfile's and
  os.mkdir's, whichever the output code uses)."""
  def refuse(*args, dir=None, **kwargs):
    raise OSError(errno.EROFS, "Read-only file system", str(dir))

  def refuse_mkdir(path, *args, **kwargs):
    raise OSError(errno.EROFS, "Read-only file system", str(path))
  monkeypatch.setattr(tempfile, "mkdtemp", refuse)
  monkeypatch.setattr(os, "mkdir", refuse_mkdir)


def _disk_full(monkeypatch, tmp_path):
  from matplotlib.figure import Figure

  def full(self, fname, *args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device", str(fname))
  monkeypatch.setattr(Figure, "savefig", full)


# ----------------------------------------------------------------------------- gin configs

GIN_HEAD = "from __gin__ import dynamic_registration\nimport specjax.sweeps as sweeps\n"


def _gin_files(monkeypatch, tmp_path):
  """ok.gin (parses; nothing runs before a binding fails), unclosed.gin (an unclosed
  bracket), binary.gin (NUL bytes) and latin1.gin (not UTF-8)."""
  (tmp_path / "ok.gin").write_text(GIN_HEAD + 'sweeps.Sweep.name = "toy"\n')
  (tmp_path / "unclosed.gin").write_text(GIN_HEAD + 'sweeps.Sweep.axes = {"x": [1, 2\n')
  (tmp_path / "binary.gin").write_bytes(b"\x00\xff\xfe\x01binary")
  (tmp_path / "latin1.gin").write_bytes(GIN_HEAD.encode() + b'sweeps.Sweep.name = "caf\xe9"\n')


# ----------------------------------------------------------------------------- checkpoints


@functools.lru_cache(maxsize=None)
def _pristine_checkpoint() -> pathlib.Path:
  """A small specjax checkpoint written by the project's own `save_model` (orbax), once per
  session; each case damages a copy of it."""
  from specjax.checkpoints import hf, save_model
  from specjax.models.transformer import ModelConfig
  config = ModelConfig.gpt2(vocab_size=300, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2,
                            d_ff=32, max_len=128)
  rng = np.random.default_rng(0)
  params = {name: (0.2 * rng.standard_normal(shape)).astype(np.float32)
            for name, shape in hf.param_shapes(config).items()}
  root = pathlib.Path(tempfile.mkdtemp(prefix="specjax-test-ckpt-"))
  import atexit
  atexit.register(shutil.rmtree, root, ignore_errors=True)
  return save_model(root / "ck", hf.build_model(config, params))


def _largest_array_file(ck: pathlib.Path) -> pathlib.Path:
  """The largest file in a data folder ('d/') of the params item: array bytes."""
  files = [p for p in (ck / "0" / "params").rglob("*") if p.is_file() and p.parent.name == "d"]
  return max(files, key=lambda p: p.stat().st_size)


def _damaged(damage):
  """A setup: a copy of the pristine checkpoint at {tmp}/ck, then `damage(ck)`."""
  def setup(monkeypatch, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(_pristine_checkpoint(), ck)
    damage(ck)
  return setup


def _truncate(ck):
  path = _largest_array_file(ck)
  with open(path, "r+b") as f:
    f.truncate(path.stat().st_size // 3)


def _flip(ck):
  path = _largest_array_file(ck)
  data = bytearray(path.read_bytes())
  for i in range(0, len(data), 97):
    data[i] ^= 0xFF
  path.write_bytes(bytes(data))


def _empty_step(ck):
  for child in (ck / "0").iterdir():
    shutil.rmtree(child) if child.is_dir() else child.unlink()


DAMAGES = {
    "truncated": _damaged(_truncate),
    "flipped": _damaged(_flip),
    "no-meta": _damaged(lambda ck: shutil.rmtree(ck / "0" / "meta")),
    "empty-step": _damaged(_empty_step),
    "no-manifest": _damaged(lambda ck: (ck / "0" / "params" / "manifest.ocdbt").unlink()),
    "meta-not-json": _damaged(lambda ck: (ck / "0" / "meta" / "metadata").write_text("{not")),
}
GENERATE_TARGET = ["generate", "--target", "{tmp}/ck", "--draft-config", "self",
                   "--max-new-tokens", "4", "--repeats", "1"]
# each line names the directory and says it is damaged (and, where one is missing, the file)
DAMAGE_CASES = [
    (f"generate-{name}", GENERATE_TARGET, ("--target {tmp}/ck", "{tmp}/ck' step 0 is damaged")
     + extra, DAMAGES[name])
    for name, extra in (("truncated", ()), ("flipped", ()), ("no-meta", ("0/meta",)),
                        ("empty-step", ("0/meta",)), ("no-manifest", ("manifest.ocdbt",)),
                        ("meta-not-json", ("0/meta/metadata",)))
] + [
    (f"inspect-{name}", ["inspect", "{tmp}/ck"], ("{tmp}/ck' step 0 is damaged",) + extra,
     DAMAGES[name])
    for name, extra in (("no-meta", ("0/meta",)), ("empty-step", ("0/meta",)),
                        ("no-manifest", ("manifest.ocdbt",)),
                        ("meta-not-json", ("0/meta/metadata",)))
]

# every command taking --seed: a seed beyond int64 is refused naming the flag and the text
HUGE = "99999999999999999999999"
SEED_CASES = [
    (f"seed-overflow-{'-'.join(cmd)}", [*cmd, "--seed", HUGE, *rest],
     ("argument --seed", repr(HUGE)), None)
    for cmd, rest in ((("generate",), ()), (("check-exact",), ()),
                      (("theory", "burstiness"), ()),
                      (("theory", "tree"), ("--parents=-1", "--rank-probs", "0.5")),
                      (("train", "target"), ("--out", "{tmp}/t")),
                      (("train", "draft"), ("--out", "{tmp}/t")),
                      (("train", "medusa"), ("--target", "{tmp}/none", "--out", "{tmp}/t")),
                      (("train", "eagle"), ("--target", "{tmp}/none", "--out", "{tmp}/t")))
]


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
    ("train-seed-negative", ["train", "target", "--seed", "-1", "--out", "{tmp}/t"],
     "--seed must be an int >= 0, got -1", None),  # the flag, not TrainConfig.seed
    ("train-data-parallel-devices", ["train", "medusa", "--target", "default",
                                     "--data-parallel", "64", "--out", "{tmp}/h"],
     "--data-parallel 64: mesh data=64, model=1 needs 64 devices", None),  # before loading
    ("train-data-parallel-zero", ["train", "target", "--data-parallel", "0", "--out",
                                  "{tmp}/t"], "--data-parallel must be an int >= 1", None),
    # gin configs: the file, or the --gin_param binding, that is at fault
    ("gin-file-unclosed", ["run", "{tmp}/unclosed.gin", "--out", "{tmp}/r"],
     ("bad gin config '{tmp}/unclosed.gin'", "unclosed bracket"), _gin_files),
    ("gin-param-unclosed", ["run", "{tmp}/ok.gin", "--out", "{tmp}/r", "--gin_param",
                            'sweeps.Sweep.axes = {{"x": [1'],  # {{ : str.format's brace
     ("bad --gin_param 'sweeps.Sweep.axes = {{\"x\": [1'", "unclosed bracket"), _gin_files),
    ("gin-param-unknown", ["run", "{tmp}/ok.gin", "--out", "{tmp}/r", "--gin_param",
                           "sweeps.Sweep.sede = 3"],
     ("bad --gin_param 'sweeps.Sweep.sede = 3'", "closest valid names: seed"), _gin_files),
    ("gin-binary", ["run", "{tmp}/binary.gin", "--out", "{tmp}/r"],
     "gin config '{tmp}/binary.gin' is a binary file", _gin_files),
    ("gin-not-utf8", ["run", "{tmp}/latin1.gin", "--out", "{tmp}/r"],
     "gin config '{tmp}/latin1.gin' is not UTF-8 text", _gin_files),
    # integer flags: Python ints, range-checked, naming the flag and the text given
    ("context-len-1e20", ["theory", "roofline", "--context-len", "1e20"],
     ("argument --context-len", "'1e20'"), None),
    ("long-context-len-huge", ["theory", "long-context", "--context-len", HUGE],
     ("argument --context-len", repr(HUGE)), None),
    ("int-flag-fraction", ["theory", "roofline", "--k", "2.5"],
     ("argument --k: must be an integer", "'2.5'"), None),
    ("generate-max-new-tokens-huge", ["generate", "--max-new-tokens", "1e30"],
     ("argument --max-new-tokens", "'1e30'"), None),
    ("run-shard-index-huge", ["run", "{tmp}/ok.gin", "--shard-index", "-1e19"],
     ("argument --shard-index", "'-1e19'"), None),
    # values that start like negative numbers are values, also without '='
    ("tree-parents-negative-form", ["theory", "tree", "--parents", "-1,-1,5", "--rank-probs",
                                    "0.5"], "parents must be in topological order", None),
    ("alphas-negative-form", ["theory", "table", "--alphas", "-0.5,0.5"],
     "--alphas must be a number in [0, 1], got -0.5", None),
    # usage errors found by argparse: one line too
    ("usage-missing-flag", ["theory", "tree"], "the following arguments are required: --parents",
     None),
    *SEED_CASES,
    *DAMAGE_CASES,
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
    setup(monkeypatch, tmp_path)
  try:
    code = cli.main([a.format(tmp=tmp) for a in argv])
  except SystemExit as e:  # a usage error found by argparse (cli.Parser.error)
    code = e.code
  out, err = capsys.readouterr()
  assert code == 2, (out, err)
  assert "Traceback" not in err
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("specjax: error: "), err
  for name in (names,) if isinstance(names, str) else names:
    assert name.format(tmp=tmp) in lines[0], err
  assert not (tmp_path / "ckpt").exists()  # a refused import writes nothing
  assert not (tmp_path / "t").exists() and not (tmp_path / "r").exists()  # nor a refused run


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


def test_values_that_start_like_negative_numbers_need_no_equals_sign(capsys):
  """`specjax theory tree --help` documents `--parents -1,-1,0,0,1`: that form parses as
  `--parents=-1,-1,0,0,1` does (argparse alone takes '-1,-1,0,0,1' for an option)."""
  with pytest.raises(SystemExit) as e:
    cli.main(["theory", "tree", "--help"])
  assert e.value.code == 0 and "-1,-1,0,0,1" in capsys.readouterr().out
  docs = []
  for form in (["--parents", "-1,-1,0,0,1"], ["--parents=-1,-1,0,0,1"]):
    assert cli.main(["theory", "tree", *form, "--rank-probs", "0.6,0.3", "--json"]) == 0
    docs.append(capsys.readouterr().out)
  assert docs[0] == docs[1] and '"parents": [' in docs[0]


@pytest.mark.parametrize("text, value", [("12", 12), ("-3", -3), ("1_000", 1000), ("1e6", 10**6),
                                         ("2.5e3", 2500), (" 7 ", 7), (str(2**63 - 1), 2**63 - 1),
                                         (str(-2**63), -2**63)])
def test_integer_flags_are_python_ints(text, value):
  assert cli.parse_int(text) == value and type(cli.parse_int(text)) is int


@pytest.mark.parametrize("text", ["1.5", "abc", "nan", "inf", "0x10", "", str(2**63), "1e19",
                                  "1e999999999999", "9" * 5000])
def test_integer_flags_refuse_other_text_quoting_it(text):
  import argparse
  with pytest.raises(argparse.ArgumentTypeError, match="must be an integer") as e:
    cli.parse_int(text)
  assert repr(text)[:40].rstrip("'") in str(e.value)


def test_summary_of_a_run_that_never_drafted_says_so():
  """--k auto where the adaptive policy picks k = 0 every cycle: α (and, without any
  verification, τ) is undefined; the summary says so instead of failing to format None."""
  from specjax.analysis import metrics
  from specjax.commands.generate import summary_lines
  plain = {"tokens_per_s": 100.0}
  for cycles, emitted in ((0, 0), (3, 3)):  # no verification at all; verifications, no drafts
    stats = metrics.summarize(cycles=[cycles], drafted=[0], accepted=[0], emitted=[emitted],
                              cycle_log=np.full((1, 4), -1), k=6).to_dict()
    report = {"plain": plain, "speculative": {"tokens_per_s": 50.0, **stats}, "k": "auto",
              "speedup": 0.5, "identical_to_plain": True}
    lines = summary_lines(report, temperature=0.0)
    assert "α = n/a (no drafts)" in lines[2], lines
    assert ("τ = n/a" in lines[2]) == (cycles == 0), lines
    assert lines[3] == "greedy outputs identical to plain decoding: True"
  drafted = metrics.summarize(cycles=[2], drafted=[8], accepted=[6], emitted=[8],
                              cycle_log=np.array([[4, 2, -1, -1]]), k=4).to_dict()
  report["speculative"] = {"tokens_per_s": 50.0, **drafted}
  assert summary_lines(report, 1.0)[2].startswith("α = 0.750 [")
