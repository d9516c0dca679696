"""A run's identity includes what its paths point at (`sweeps.inputs`): a resume never
reports a row computed from other contents. A changed prompt file, draft directory or GGUF
file refuses `--out` in one line naming it, and starts a fresh directory without `--out`."""

import json
import pathlib

import pytest

from specjax import cli
from specjax.sweeps import inputs, launch, run_directory, runner

CONFIG = """
from __gin__ import dynamic_registration
import specjax.sweeps as sweeps
import sweep_fixtures as fx

sweeps.Sweep:
  name = "reads"
  point_fn = @fx.read_point
  axes = {"x": [1, 2]}
  fixed = %s
"""


@pytest.fixture(autouse=True)
def _fixtures_importable(monkeypatch):
  monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1]))  # tests/: sweep_fixtures.py


def _inputs(tmp_path):
  (tmp_path / "q.jsonl").write_text('{"prompt": "one"}\n')
  (tmp_path / "head").mkdir()
  (tmp_path / "head" / "weights.bin").write_bytes(b"\x01\x02")
  (tmp_path / "head" / "config.json").write_text("{}")
  (tmp_path / "m.gguf").write_bytes(b"GGUF\x03")
  return {"prompts": str(tmp_path / "q.jsonl"), "draft": f"eagle:{tmp_path / 'head'}"}


def _config(tmp_path, fixed) -> str:
  path = tmp_path / "reads.gin"
  path.write_text(CONFIG % json.dumps(fixed))
  return str(path)


def _rows(run_dir):
  return sorted((r["metrics"]["text"], r["metrics"]["weights"])
                for r in runner.read_results(run_dir / runner.RESULTS).values())


EDITS = {  # what changes between the two runs -> the parameter the refusal names
    "prompt texts": (lambda t: (t / "q.jsonl").write_text('{"prompt": "two"}\n'), "prompts"),
    "draft weights": (lambda t: (t / "head" / "weights.bin").write_bytes(b"\x09\x02"),
                      "draft"),
}


@pytest.mark.parametrize("edit", EDITS, ids=list(EDITS))
def test_changed_contents_refuse_out_and_start_fresh_otherwise(tmp_path, capsys, edit):
  fixed = _inputs(tmp_path)
  config = _config(tmp_path, fixed)
  out, root = tmp_path / "out", tmp_path / "runs"
  first = launch.run(config, out=str(out), progress=False)
  plain = launch.run(config, root=str(root), progress=False)
  before = _rows(out)
  assert launch.run(config, out=str(out), progress=False).resumed  # unchanged: resumes
  change, param = EDITS[edit]
  change(tmp_path)
  with pytest.raises(ValueError, match=f"other inputs.* {param} '") as e:
    launch.run(config, out=str(out), progress=False)
  assert "\n" not in str(e.value) and _rows(out) == before  # nothing written, nothing mixed
  fresh = launch.run(config, root=str(root), progress=False)
  assert not fresh.resumed and fresh.run_dir != plain.run_dir and fresh.ok == 2
  assert "ran this config on other inputs" in capsys.readouterr().err
  assert not set(_rows(fresh.run_dir)) & set(before)  # every row computed from the new contents
  assert first.ok == 2


def test_a_gguf_path_and_a_directory_are_digested_embedded_references_are_not(tmp_path):
  fixed = _inputs(tmp_path)
  found = inputs.digests({"target": [str(tmp_path / "m.gguf"), "default"]},
                         {**fixed, "models": "random:tiny-llama", "prompts2": "code",
                          "nested": [{"a": str(tmp_path / "head")}]})
  assert [(e["param"], pathlib.Path(e["path"]).name) for e in found] == [
      ("draft", "head"), ("nested", "head"), ("prompts", "q.jsonl"), ("target", "m.gguf")]
  before = found[-1]["sha256"]
  (tmp_path / "m.gguf").write_bytes(b"GGUF\x04")
  assert inputs.digests({"target": [str(tmp_path / "m.gguf")]}, {})[0]["sha256"] != before
  (tmp_path / "code").write_text("a file named like the embedded set")
  assert inputs.digests({}, {"prompts": "code", "draft": "eagle:default"}) == []


def test_a_run_without_paths_keeps_its_fingerprint(tmp_path):
  """Embedded references add nothing: the fingerprint is the one runs had before digests."""
  config = _config(tmp_path, {})
  run = launch.run(config, root=str(tmp_path / "runs"), progress=False)
  recorded = run_directory.read_run_config(run.run_dir)
  gin_text = (run.run_dir / "config.gin").read_text()
  assert recorded["inputs"] == [] and recorded["fingerprint"] == recorded[
      "config_fingerprint"] == run_directory.fingerprint(gin_text, 0, 1)


def test_merge_refuses_shards_on_different_inputs(tmp_path, capsys):
  config = _config(tmp_path, _inputs(tmp_path))
  a = launch.run(config, out=str(tmp_path / "s0"), shard_index=0, num_shards=2, progress=False)
  (tmp_path / "q.jsonl").write_text('{"prompt": "two"}\n')
  b = launch.run(config, out=str(tmp_path / "s1"), shard_index=1, num_shards=2, progress=False)
  with pytest.raises(ValueError, match="different inputs.*prompts"):
    runner.merge([a.run_dir, b.run_dir], tmp_path / "merged")
  assert not (tmp_path / "merged").exists()
