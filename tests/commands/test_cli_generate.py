"""`specjax generate` end to end on tiny random models."""

import pytest
import json

from specjax.cli import main


@pytest.mark.slow
def test_generate_cli_reports_plain_vs_speculative(capsys):
  code = main(["generate", "--target-config", "tiny-llama", "--draft-config", "self",
               "--max-new-tokens", "12", "--k", "3", "--repeats", "1", "--json",
               "--prompt", "def f(x):", "--prompt", "import os"])
  assert code == 0
  report = json.loads(capsys.readouterr().out)
  assert report["identical_to_plain"] is True  # greedy speculative == greedy plain
  assert report["speculative"]["alpha"] == 1.0  # self-speculation at T=0
  assert report["batch"] == 2 and len(report["texts"]) == 2
  assert report["plain"]["tokens_per_s"] > 0 and report["speculative"]["tau"] > 1


def test_generate_cli_rejects_bad_input_with_a_clear_message(capsys):
  assert main(["generate", "--top-p", "1.5", "--repeats", "1"]) == 2
  assert "top_p must be in (0, 1]" in capsys.readouterr().err
  assert main(["generate", "--target-config", "tiny-gtp2"]) == 2
  assert "did you mean tiny-gpt2" in capsys.readouterr().err
  assert main(["generate", "--k", "0", "--max-new-tokens", "4", "--repeats", "1"]) == 2
  assert "k must be an int >= 1" in capsys.readouterr().err


@pytest.mark.slow  # compile-bound (5-18 s): the fast tier's 3 minutes
def test_generate_cli_rope_past_max_len_only_with_the_opt_in(capsys):
  argv = ["generate", "--target-config", "tiny-llama:max_len=32", "--draft-config", "self",
          "--max-new-tokens", "8", "--k", "2", "--repeats", "1", "--json",
          "--prompt", "def fibonacci(n):\n    return n if n < 2 else"]  # 42 tokens > 32
  assert main(argv) == 2
  err = capsys.readouterr().err
  assert "max_len 32" in err and "--allow-beyond-max-len" in err
  assert main(argv + ["--allow-beyond-max-len"]) == 0
  report = json.loads(capsys.readouterr().out)
  assert report["identical_to_plain"] is True and report["plain"]["tokens"] == 8


@pytest.mark.slow
def test_generate_cli_adaptive_with_draft_stopping(capsys, monkeypatch):
  """--k auto --draft-stop: the adaptive loop with draft stopping. The default policy's menu
  is narrowed to chains of 3 (monkeypatched) so that every cycle drafts; a random draft is
  unsure, so threshold 1 stops every cycle after one node (two of three skipped); T = 0
  output identical to plain decoding; the stopping counters in the report."""
  from specjax.engine import decoding

  real = decoding.default_policy
  monkeypatch.setattr(decoding, "default_policy",
                      lambda target, drafter, **kw: real(target, drafter, entries=(3,), **kw))
  code = main(["generate", "--target-config", "tiny-llama", "--draft-config",
               "tiny-llama:n_layers=1", "--max-new-tokens", "12", "--k", "auto",
               "--draft-stop", "1.0", "--repeats", "1", "--json", "--prompt", "def f(x):"])
  assert code == 0
  report = json.loads(capsys.readouterr().out)
  assert report["identical_to_plain"] is True
  cycles = len(report["choices"])
  assert cycles > 0 and set(report["choices"]) == {"k=3"}
  assert report["draft_stop"] == {"threshold": 1.0, "stopped_cycles": cycles,
                                  "skipped_nodes": 2 * cycles}


@pytest.mark.slow  # compile-heavy (fast-tier durations)
def test_generate_on_the_default_target_serves_bf16_and_reports_both_speeds(capsys):
  """One speed, one meaning: end to end (whole calls) and the decode phase (prefill
  subtracted), labelled; the shipped target served in bf16 as the studies serve it."""
  code = main(["generate", "--target", "default", "--draft", "eagle:default", "--k", "3",
               "--max-new-tokens", "8", "--repeats", "1", "--json"])
  assert code == 0
  report = json.loads(capsys.readouterr().out)
  assert report["target_dtype"] == "bfloat16" and report["identical_to_plain"] is True
  d = report["decode_phase"]  # None when the difference of two calls is lost in noise
  assert d is None or (d["plain_tokens_per_s"] > 0 and d["speculative_tokens_per_s"] > 0
                       and d["speedup"] > 0)
  from specjax.calibration.timing import decode_phase
  assert decode_phase(10, 12, 0.5, 0.25) == {"plain_tokens_per_s": 20.0,
                                              "speculative_tokens_per_s": 48.0, "speedup": 2.0}
  assert decode_phase(10, 12, -0.01, 0.25) is None and decode_phase(0, 1, 1.0, 1.0) is None
  assert main(["generate", "--target", "default", "--draft", "self", "--target-dtype",
               "float32", "--k", "2", "--max-new-tokens", "6", "--repeats", "1", "--json"]) == 0
  report = json.loads(capsys.readouterr().out)
  assert report["target_dtype"] == "float32" and report["speculative"]["alpha"] == 1.0


@pytest.mark.slow  # compile-heavy (fast-tier durations)
@pytest.mark.parametrize("shape", [["--tree", "2,1,1"], ["--dynamic-tree", "6,3,2"]])
def test_generate_speaks_static_and_dynamic_trees(capsys, shape):
  code = main(["generate", "--target-config", "tiny-llama", "--draft-config",
               "tiny-llama:n_layers=1", "--max-new-tokens", "10", "--repeats", "1", "--json",
               "--prompt", "def f(x):"] + shape)
  assert code == 0
  report = json.loads(capsys.readouterr().out)
  assert report["identical_to_plain"] is True and report["shape"].endswith(shape[1])
  depth = 3
  assert len(report["acceptance_by_depth"]) == depth
  assert all(a is None or 0.0 <= a <= 1.0 for a in report["acceptance_by_depth"])


@pytest.mark.parametrize("argv, message", [
    (["--tree", "2,1", "--dynamic-tree", "4,2,2"], "--tree and --dynamic-tree are two shapes"),
    (["--tree", "2,1", "--k", "auto"], "--k auto chooses chains each cycle"),
])
def test_generate_refuses_shapes_that_cannot_combine(capsys, argv, message):
  assert main(["generate", "--max-new-tokens", "4", "--repeats", "1"] + argv) == 2
  assert message in capsys.readouterr().err
