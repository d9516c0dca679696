"""benchmarks/bench_api_defaults.py's plumbing: the API at its defaults decodes the held-out
windows between the quickstart's, identical to plain at T = 0, with τ and both timings per
temperature. Figures are never asserted (benchmarks measure, tests check the plumbing)."""

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_api_defaults  # noqa: E402


def test_the_windows_fall_between_the_quickstarts():
  from specjax.data.prompts import cut_prompts, held_out_texts
  from specjax.training.defaults import load_default_target
  tok = load_default_target().tokenizer
  ours = bench_api_defaults._prompts(tok, 8)
  theirs = cut_prompts(tok, held_out_texts("code"), 8, 64)
  assert len(ours) == 8 and all(len(p) == 64 for p in ours)
  assert not {tuple(p) for p in ours} & {tuple(p) for p in theirs}
  assert bench_api_defaults._prompts(tok, 8, "quickstart") == theirs


@pytest.mark.slow
def test_the_api_at_its_defaults_runs_both_temperatures():
  out = bench_api_defaults.run(new_tokens=6, prompts=1, repeats=1, target_dtype=None)
  assert out["shape"] == {"k": 4} and out["target_dtype"] == "float32"
  for t, r in out["temperatures"].items():
    assert r["plain_s"] > 0 and r["spec_s"] > 0 and r["tau"] >= 1
    assert r["identical_to_plain"] is (True if t == "0.0" else None)
