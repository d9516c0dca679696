"""Size limits (issue 29, item 6): a request whose work cannot fit this machine is refused
before any work, naming the value and the limit, in about a second: sweep points
(`sweeps.sweep.MAX_POINTS`), model parameters against memory (`transformer.check_params_fit`,
used wherever a model is built from a config), search and simulation sizes
(`theory.MAX_K`, `MAX_TABLE_CELLS`, `MAX_DRAWS`, `MIN_HALF_WIDTH`). Before: a 10^7-point sweep
grew to 5 GB with no output, 10^9-layer configs built until killed, `theory table --k-max
10^8` and `theory tree --samples 10^13` hung or raised MemoryError.

CLI cases run in-process (`specjax.cli.main`), as tests/commands/test_cli_errors.py does.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from specjax.engine.adaptive import roofline_k as adaptive_k
from specjax import cli
from specjax.analysis import roofline, theory
from specjax.sweeps import sweep as sweep_module

BILLION = 10**9


def _tiny_gpt2():
  from specjax.models.transformer import ModelConfig
  return ModelConfig.gpt2(vocab_size=300, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2,
                          d_ff=32, max_len=32)


def _hf_billion_layers(tmp):
  """A Hugging Face directory of a tiny GPT-2 whose config.json claims 10^9 layers."""
  from specjax.checkpoints import hf
  config = _tiny_gpt2()
  params = {k: np.zeros(s, np.float32) for k, s in hf.param_shapes(config).items()}
  d = hf.export_hf((config, params), tmp / "hf")
  doc = json.loads((d / "config.json").read_text())
  (d / "config.json").write_text(json.dumps({**doc, "n_layer": BILLION}))


def _orbax_billion_layers(tmp):
  """A specjax checkpoint of a tiny model whose stored config claims 10^9 layers."""
  from flax import nnx

  from specjax.checkpoints import save_model
  from specjax.models.transformer import Transformer
  ck = save_model(tmp / "ck", Transformer(_tiny_gpt2(), rngs=nnx.Rngs(0)))
  meta = ck / "0" / "meta" / "metadata"
  doc = json.loads(meta.read_text())
  doc["config"]["fields"]["n_layers"] = BILLION
  meta.write_text(json.dumps(doc))


def _sweep_million_points(tmp):
  """A gin sweep of 100 × 100 × 101 = 1,010,000 points (the point function of the runner
  tests; tests/ is on sys.path)."""
  ints = lambda n: "[" + ", ".join(map(str, range(1, n + 1))) + "]"
  (tmp / "big.gin").write_text(
      "from __gin__ import dynamic_registration\nimport specjax.sweeps as sweeps\n"
      "import sweep_fixtures as fx\n\nsweeps.Sweep:\n  name = \"big\"\n  point_fn = @fx.point\n"
      f"  axes = {{\"x\": {ints(100)}, \"y\": {[str(i) for i in range(100)]}, "
      f"\"scale\": {ints(101)}}}\n")


# (id, argv with {tmp} for the test's directory, what the one line must name, setup)
CASES = [
    ("sweep-points", ["run", "{tmp}/big.gin", "--out", "{tmp}/run", "--no-progress"],
     ("1,010,000 points", "x 100 × y 100 × scale 101", "1,000,000"), _sweep_million_points),
    ("import-hf-layers", ["import-hf", "{tmp}/hf", "--out", "{tmp}/out"],
     ("n_layers=1000000000", "more than this machine's", "lower n_layers"), _hf_billion_layers),
    ("target-config-layers", ["generate", "--target-config", "tiny-gpt2:n_layers=1000000000"],
     ("n_layers=1000000000", "more than this machine's"), None),
    ("target-ckpt-layers", ["generate", "--target", "ck", "--draft-config", "self"],
     ("--target ck", "n_layers=1000000000", "more than this machine's"), _orbax_billion_layers),
    ("table-k-max", ["theory", "table", "--k-max", "100000000"],
     ("--k-max = 100,000,000", "limit of 1,000,000"), None),
    ("table-k-search", ["theory", "table", "--k-search", "1000000000"],
     ("--k-search = 1,000,000,000", "limit of 1,000,000"), None),
    ("table-cells", ["theory", "table", "--alphas", ",".join(["0.5"] * 20), "--k-max",
                     "1000000"], ("--alphas × --k-max = 20,000,000", "10,000,000"), None),
    ("optimal-k-k-max", ["theory", "optimal-k", "--k-max", "100000000"],
     ("--k-max = 100,000,000",), None),
    ("tree-samples", ["theory", "tree", "--parents", "-1,0", "--rank-probs", "0.5",
                      "--samples", "10000000000000"],
     ("--samples × tree depth = 20,000,000,000,000", "limit of 10,000,000"), None),
    ("burstiness-cycles", ["theory", "burstiness", "--cycles", "10000000000000"],
     ("--cycles × --k", "limit of 10,000,000"), None),
    ("burstiness-k", ["theory", "burstiness", "--k", "1000000000"], ("--k = 1,000,000,000",),
     None),
    ("roofline-batches", ["theory", "roofline", "--batches", "100000000"],
     ("largest --batches = 100,000,000", "1,111,111"), None),
    ("roofline-k-max", ["theory", "roofline", "--k-max", "1000"],
     ("--k-max = 1,000", "limit of 215"), None),
    ("adaptive-menu", ["theory", "adaptive", "--menu", "0,100000"],
     ("--menu entries × (largest k)²",), None),
    ("sample-size-half-width", ["theory", "sample-size", "--half-width", "1e-300", "--method",
                                "wilson"], ("--half-width must be in [1e-09, 0.5]",), None),
]


@pytest.mark.parametrize("argv, names, setup", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_oversized_requests_fail_fast_in_one_line(argv, names, setup, tmp_path, monkeypatch,
                                                  capsys):
  monkeypatch.chdir(tmp_path)  # relative paths: the checkpoint case uses one
  if setup is not None:
    setup(tmp_path)
  capsys.readouterr()
  start = time.perf_counter()
  code = cli.main([a.replace("{tmp}", str(tmp_path)) for a in argv])
  seconds = time.perf_counter() - start
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1, err
  assert err[0].startswith("specjax: error: "), err
  for name in names:
    assert name.replace("{tmp}", str(tmp_path)) in err[0], (name, err[0])
  assert seconds < 30, seconds  # a refusal, not a build (which ran until killed)
  assert not (tmp_path / "run").exists() and not (tmp_path / "out").exists()


def test_inspect_of_a_config_claiming_a_billion_layers_answers_at_once(tmp_path, monkeypatch,
                                                                         capsys):
  """By a relative path (orbax's array metadata needs an absolute one: without it `inspect`
  counts from the config, now in closed form, instead of tracing 10^9 layers)."""
  monkeypatch.chdir(tmp_path)
  _orbax_billion_layers(tmp_path)
  start = time.perf_counter()
  assert cli.main(["inspect", "ck", "--json"]) == 0
  info = json.loads(capsys.readouterr().out)
  assert info["config"]["n_layers"] == BILLION and info["parameters"] > 0
  assert time.perf_counter() - start < 30


def test_sweep_points_are_counted_before_any_point_is_built():
  def point(a: int, b: int) -> dict:
    return {}
  too_many = sweep_module.Sweep(name="s", point_fn=point,
                                axes={"a": range(10**4), "b": range(10**3)})
  with pytest.raises(ValueError, match=r"10,000,000 points \(a 10,000 × b 1,000\), more than "
                     r"the 1,000,000"):
    too_many.check()
  sweep_module.Sweep(name="s", point_fn=point,
                     axes={"a": range(10**3), "b": range(10**3)}).check()  # at the limit


def test_roofline_search_sizes_are_bounded():
  hw, wl = roofline.HARDWARE["h100"], roofline.Workload.lecture_7b()
  with pytest.raises(ValueError, match="k_max = 100,000,000 exceeds the limit"):
    roofline.best_k(hw, wl, 8, 0.8, 0.1, k_max=10**8)
  with pytest.raises(ValueError, match=r"max_batch × \(k_max \+ 1\) = 900,000,000"):
    adaptive_k.AdaptiveKPolicy(hw, wl, 0.8, 0.1, k_max=8, max_batch=10**8)
  with pytest.raises(ValueError, match=r"\(k_max \+ 1\) × k_max²"):
    adaptive_k.AdaptiveKPolicy(hw, wl, 0.8, 0.1, k_max=1000, max_batch=8)
  assert roofline.best_k(hw, wl, 8, 0.8, 0.1, k_max=theory.MAX_K)[0] >= 1
