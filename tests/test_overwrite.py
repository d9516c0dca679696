"""`--overwrite` replaces only what specjax wrote (`dirs.MARKER`), never the working
directory, a directory above it, nor one holding the command's input (issue 40, item 2)."""

import os

import pytest

from specjax import cli
from specjax import files as dirs


def _user_dir(path):
  path.mkdir(parents=True, exist_ok=True)
  (path / "keep.txt").write_text("mine")
  return path


def test_a_published_directory_carries_the_marker_and_may_be_replaced(tmp_path):
  out = tmp_path / "out"
  with dirs.assembling(dirs.prepare_output_dir(out, False)) as tmp:
    (tmp / "a").write_text("1")
  assert (out / dirs.MARKER).is_file()
  with dirs.assembling(dirs.prepare_output_dir(out, True)) as tmp:
    (tmp / "b").write_text("2")
  assert not (out / "a").exists() and (out / "b").read_text() == "2"


@pytest.mark.parametrize("case", ["user_dir", "holds_input", "is_input", "cwd", "cwd_parent",
                                  "dot"])
def test_overwrite_refuses_what_specjax_did_not_write(tmp_path, monkeypatch, case):
  out = _user_dir(tmp_path / "ow")
  inputs = ()
  if case in ("holds_input", "is_input"):
    (out / dirs.MARKER).write_text("")  # even a specjax directory, when it holds the input
    src = out / "src" if case == "holds_input" else out
    src.mkdir(exist_ok=True)
    inputs = (src,)
  elif case in ("cwd", "cwd_parent", "dot"):
    (out / dirs.MARKER).write_text("")
    (out / "sub").mkdir()
    monkeypatch.chdir(out if case != "cwd_parent" else out / "sub")
    out = "." if case == "dot" else out
  match = {"user_dir": "not written by specjax", "holds_input": "holds the input",
           "is_input": "holds the input"}.get(case, "working directory")
  with pytest.raises(ValueError, match=match):
    dirs.prepare_output_dir(out, True, inputs=inputs)
  assert (tmp_path / "ow" / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("command", ["import-head", "export-head", "import-hf", "export-hf"])
def test_cli_overwrite_of_the_sources_parent_is_one_line_and_deletes_nothing(
    tmp_path, monkeypatch, capsys, command):
  ow = _user_dir(tmp_path / "ow")
  src = ow / "src"
  src.mkdir()
  (src / "config.json").write_text("{}")
  extra = {"import-head": ["--kind", "eagle", "--target", "random:tiny-llama"],
           "export-head": ["--format", "eagle", "--target", "random:tiny-llama"]}.get(command, [])
  assert cli.main([command, str(src), *extra, "--out", str(ow), "--overwrite"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "--out" in err and "holds the input" in err, err
  assert (ow / "keep.txt").read_text() == "mine" and (src / "config.json").is_file()
  # a user directory beside the source is not replaced either
  other = _user_dir(tmp_path / "other")
  assert cli.main([command, str(src), *extra, "--out", str(other), "--overwrite"]) == 2
  assert "not written by specjax" in capsys.readouterr().err
  assert (other / "keep.txt").read_text() == "mine"
  monkeypatch.chdir(ow)
  assert cli.main([command, str(src), *extra, "--out", ".", "--overwrite"]) == 2
  err = capsys.readouterr().err
  assert "working directory" in err and "PosixPath" not in err
  assert os.path.isfile(ow / "keep.txt")
