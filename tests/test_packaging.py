"""A plain (non-editable) install: the wheel carries the studies and the shipped configs inside
the package (`specjax.experiments`, `specjax/configs/*.gin`) and nothing under a generic
top-level name, and `specjax run --list` / `specjax run quickstart` work from a directory
outside the checkout. The wheel is built from a copy of the working tree (no build files in
the checkout) and installed without dependencies into a temporary venv that borrows this
environment's packages (no download)."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
IGNORED = (".venv", "venv", ".git", "runs", "build", "*.egg-info", "__pycache__",
           ".pytest_cache", ".hypothesis", ".notes", "*.png")


def _run(argv, **kw) -> subprocess.CompletedProcess:
  out = subprocess.run([str(a) for a in argv], capture_output=True, text=True, **kw)
  assert out.returncode == 0, f"{argv}: {out.stdout[-2000:]}\n{out.stderr[-4000:]}"
  return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
  """(venv python, its site-packages, the wheel's file names)."""
  tmp = tmp_path_factory.mktemp("packaging")
  src = tmp / "src"
  shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*IGNORED))
  _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
        "-w", tmp / "wheels", src])
  (wheel,) = (tmp / "wheels").glob("specjax-*.whl")
  venv = tmp / "venv"
  _run([sys.executable, "-m", "venv", "--without-pip", venv])
  python = venv / "bin" / "python"
  _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
        "-q", wheel])
  site = pathlib.Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                                           "['purelib'])"]).stdout.strip())
  # this environment's packages (jax, gin, ...) after the venv's own: not its specjax, whose
  # editable finder lives in a .pth file that a path added this way does not run
  (site / "borrowed_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
  return python, site, zipfile.ZipFile(wheel).namelist()


def _env(tmp_path) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
  env["SPECJAX_CACHE_DIR"] = str(tmp_path / "cache")
  return env


@pytest.mark.slow
def test_the_wheel_puts_no_generic_top_level_package(installed):
  python, site, names = installed
  tops = {n.split("/")[0] for n in names}
  assert not any(t == "experiments" or t == "configs" for t in tops), sorted(tops)
  assert "specjax/experiments/quickstart.py" in names
  assert "specjax/experiments/references.py" in names
  assert "specjax/configs/quickstart.gin" in names and "specjax/configs/specbench.gin" in names
  assert any(n.startswith("specjax/embedded/") for n in names)  # the shipped weights
  for f in ("manifest.json", "config.json", "model.safetensors"):  # eagle3:smollm2
    assert f"specjax/embedded/heads/smollm2/{f}" in names
  assert not (site / "experiments").exists() and (site / "specjax" / "experiments").is_dir()


@pytest.mark.slow
def test_specjax_run_list_and_quickstart_outside_the_checkout(installed, tmp_path):
  python, site, _ = installed
  specjax = python.parent / "specjax"
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  env = _env(tmp_path)
  listed = _run([specjax, "run", "--list"], cwd=elsewhere, env=env).stdout
  assert {line.split()[0] for line in listed.splitlines()} >= {"quickstart", "specbench",
                                                               "exactness"}
  where = _run([python, "-c", "import specjax.experiments.quickstart as q, specjax.sweeps."
                "launch as l; print(q.__file__); print(l.CONFIG_DIR)"], cwd=elsewhere,
               env=env).stdout.split()
  assert all(pathlib.Path(p).is_relative_to(site) for p in where), where  # not the checkout
  # the main job, reduced: one point of the shipped pair, from the installed config
  _run([specjax, "run", "quickstart", "--out", tmp_path / "qs", "--no-progress",
        "--axis", "mode=chain", "--axis", "batch=1", "--axis", "temperature=0.0",
        "--set", "max_new_tokens=8", "--set", "repeats=1", "--set", "calibration_repeats=1",
        "--set", "prompt_count=1", "--set", "prompts=code", "--set", "prompt_len=16"],
       cwd=elsewhere, env=env)
  assert (tmp_path / "qs" / "report.md").is_file()
