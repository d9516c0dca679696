"""`specjax generate` end to end on tiny random models."""

import json

from specjax.cli import main


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
