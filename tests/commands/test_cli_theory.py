"""`specjax theory ...`: every subcommand, human and --json output, plots, clean errors."""

import json

import pytest

from specjax import cli


def run(capsys, *argv):
  code = cli.main(["theory", *argv])
  out, err = capsys.readouterr()
  return code, out, err


def run_json(capsys, *argv):
  code, out, err = run(capsys, *argv, "--json")
  assert code == 0, err
  return json.loads(out)  # one JSON document, nothing else on stdout


def test_table_json_is_the_lecture_row(capsys):
  doc = run_json(capsys, "table")
  rows = {r["alpha"]: r for r in doc["rows"]}
  assert [round(rows[a]["best_speedup"], 2) for a in (0.6, 0.7, 0.8, 0.9)] == \
      [1.51, 1.75, 2.11, 2.78]
  assert [rows[a]["best_k"] for a in (0.6, 0.7, 0.8, 0.9)] == [2, 3, 5, 8]
  assert doc["k"] == list(range(1, 9)) and len(rows[0.8]["speedup"]) == 8


def test_table_human_output_is_aligned(capsys):
  code, out, _ = run(capsys, "table", "--alphas", "0.5,0.8", "--k-max", "4")
  assert code == 0
  lines = out.splitlines()
  header, rule, *rows = lines[1:]
  assert len(rows) == 2 and len({len(header), len(rule), *map(len, rows)}) == 1
  assert "best k" in header


def test_optimal_k(capsys):
  doc = run_json(capsys, "optimal-k", "--alpha", "0.8", "--c", "0.15")
  assert doc["rows"][0]["k"] == 5 and round(doc["rows"][0]["speedup"], 2) == 2.11


def test_roofline_json(capsys):
  doc = run_json(capsys, "roofline", "--batches", "1,164")
  rows = {r["batch"]: r for r in doc["rows"]}
  assert round(rows[1]["gain"]["full"], 2) == 2.10
  assert rows[164]["gain"]["verify_only"] == pytest.approx(1.2236, abs=5e-4)
  assert doc["break_even_batch"]["verify_only"] == pytest.approx(259.9, abs=0.1)
  assert doc["break_even_batch"]["full"] == pytest.approx(165.7, abs=0.1)
  assert doc["policy"]["breakpoints"][0] == [1, 5]


def test_roofline_with_the_lectures_rounded_cache_size(capsys):
  doc = run_json(capsys, "roofline", "--batches", "164", "--kv-bytes-per-token", "128125")
  assert round(doc["rows"][0]["gain"]["verify_only"], 2) == 1.21


def test_roofline_human_and_plot(capsys, tmp_path):
  png = tmp_path / "gain.png"
  code, out, _ = run(capsys, "roofline", "--plot", str(png))
  assert code == 0 and "break-even batch" in out
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_plot(capsys, tmp_path):
  png = tmp_path / "speedup.png"
  code, _, _ = run(capsys, "table", "--plot", str(png))
  assert code == 0 and png.stat().st_size > 1000


def test_long_context(capsys):
  doc = run_json(capsys, "long-context")
  assert doc["batch"] == 29 and doc["memory_bound_verify"] == pytest.approx(5.72, abs=0.005)


def test_sample_size(capsys):
  doc = run_json(capsys, "sample-size", "--alpha", "0.8", "--half-width", "0.01", "--rho", "0.5")
  assert doc["drafted_tokens_if_independent"] == 6147 and doc["drafted_tokens"] == 18440


def test_draft_kv(capsys):
  doc = run_json(capsys, "draft-kv", "--draft-fraction", "0.1")
  assert doc["batch_plain"] == 745 and doc["batch_spec"] < 745


def test_burstiness_and_tree(capsys):
  doc = run_json(capsys, "burstiness", "--rhos", "0,0.6", "--cycles", "20000")
  assert doc["rows"][0]["tau_exact"] == pytest.approx(3.3616)
  assert doc["rows"][1]["tau_exact"] < doc["rows"][0]["tau_exact"]
  doc = run_json(capsys, "tree", "--parents=-1,0,1,2", "--rank-probs", "0.8")
  assert doc["expected_tokens"] == pytest.approx(3.3616)


def test_model_config_workload(capsys, tmp_path):
  transformer = pytest.importorskip("specjax.models.transformer")
  path = tmp_path / "gpt2.json"
  path.write_text(json.dumps(transformer.ModelConfig.gpt2().to_dict()))
  doc = run_json(capsys, "roofline", "--model-config", str(path), "--batches", "1",
                 "--hardware", "a100")
  assert doc["workload"]["weight_bytes"] == 124_439_808 * 4
  assert doc["hardware"]["name"] == "a100"


@pytest.mark.parametrize("argv,name", [
    (["optimal-k", "--alpha", "1.5"], "alpha"),
    (["table", "--c", "-1"], "c"),
    (["roofline", "--batches", "0,4"], "batch"),
    (["roofline", "--k", "-2"], "k"),
    (["long-context", "--alpha", "nan"], "alpha"),
    (["sample-size", "--half-width", "0"], "--half-width"),
    (["tree", "--parents=0", "--rank-probs", "0.5"], "parents"),
])
def test_bad_input_is_a_clean_error(capsys, argv, name):
  code, out, err = run(capsys, *argv)
  assert code == 2 and out == ""
  assert name in err and "Traceback" not in err
