"""Ctrl-C ends a JAX command with exit status 2 and its one line, never a crash at
interpreter exit (issue 40, item 6: SIGSEGV, status 139, after the "interrupted" line)."""

import os
import signal
import subprocess
import sys
import time

import pytest

ARGS = ["generate", "--target-config", "tiny-gpt2", "--draft-config", "tiny-gpt2",
        "--max-new-tokens", "64", "--repeats", "100000"]


def _interrupt(after_s: float) -> tuple[int, str]:
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.Popen(
      [sys.executable, "-c", "import sys; from specjax.cli import main; sys.exit(main())", *ARGS],
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
      preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
  time.sleep(after_s)
  proc.send_signal(signal.SIGINT)
  try:
    _, err = proc.communicate(timeout=120)
  except subprocess.TimeoutExpired:
    proc.kill()
    raise
  return proc.returncode, err


@pytest.mark.slow
@pytest.mark.parametrize("after_s", [6.0, 9.0, 12.0])
def test_ctrl_c_exits_2_with_one_line(after_s):
  code, err = _interrupt(after_s)
  assert code == 2, (code, err[-2000:])
  assert err.strip().splitlines()[-1].startswith("specjax: error: interrupted"), err[-2000:]
