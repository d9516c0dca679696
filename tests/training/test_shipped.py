"""The shipped embedded pair: files match their manifest, the recipes are the code's, loading
needs no training, damage is named, and the flat weight format round-trips."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.checkpoints.flat import load_flat, save_flat
from specjax.training import defaults, shipped
from specjax.training.presets import DEFAULT_PRESET, get_preset

PRESET, CORPUS = "shipped", "code+tests"


@pytest.fixture(scope="module")
def manifest():
  return shipped.read_manifest(shipped.shipped_dir(PRESET, CORPUS))


def test_default_preset_is_the_shipped_one():
  assert DEFAULT_PRESET == PRESET and get_preset(PRESET).corpus == CORPUS


def test_files_match_the_manifest_and_fit_the_size_budget(manifest):
  d = shipped.shipped_dir(PRESET, CORPUS)
  on_disk = {p.name for p in d.iterdir() if p.name != shipped.MANIFEST}
  assert on_disk == set(manifest["files"])
  for name in manifest["files"]:
    shipped.check_file(d, manifest, name)  # raises on a digest mismatch
  assert sum((d / n).stat().st_size for n in manifest["files"]) <= 40 * 2**20


def test_recipes_are_the_ones_this_code_computes(manifest):
  """A change to the preset (or to a head's schedule) must come with a rebuilt shipped pair."""
  assert manifest["target"]["recipe"] == defaults._recipe(PRESET, CORPUS)
  fp = shipped.target_fingerprint_float32(manifest)
  assert manifest["draft"]["recipe"] == defaults._draft_recipe(PRESET, CORPUS, fp)
  for kind in shipped.HEAD_KINDS:
    assert manifest["heads"][kind]["recipe"] == defaults._heads_recipe(kind, PRESET, CORPUS, fp)


def test_recorded_quality_meets_the_goals(manifest):
  target = manifest["target"]["trained"]["target"]["val"]["bpb"]
  draft = manifest["draft"]["trained"]["draft"]["val"]["bpb"]
  assert target <= 1.9 and draft - target >= 0.3


def test_loading_trains_nothing(tmp_path, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setattr(defaults, "train", lambda *a, **k: pytest.fail("trained"))
  pair = defaults.load_default_pair()
  head = defaults.load_default_heads("eagle")
  assert pair.target_config.d_model == 384 and pair.tokenizer.vocab_size == 4096
  assert head.acceptance is not None
  assert not (tmp_path / "cache").exists()
  leaves = jax.tree.leaves(pair.target_params)
  assert all(x.dtype == jnp.float32 for x in leaves)
  # bf16 values held in float32: rounding again changes nothing
  x = leaves[0]
  assert bool(jnp.all(x.astype(jnp.bfloat16).astype(jnp.float32) == x))


def _copy(tmp_path, monkeypatch):
  root = tmp_path / "embedded"
  shutil.copytree(shipped.shipped_dir(PRESET, CORPUS), root / f"{PRESET}-{CORPUS}")
  monkeypatch.setattr(shipped, "embedded_root", lambda: root)
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
  return root / f"{PRESET}-{CORPUS}"


def test_a_damaged_shipped_file_is_named(tmp_path, monkeypatch):
  d = _copy(tmp_path, monkeypatch)
  data = bytearray((d / "target.safetensors").read_bytes())
  data[-10] ^= 0xFF
  (d / "target.safetensors").write_bytes(bytes(data))
  with pytest.raises(defaults.CacheEntryError, match="target.safetensors does not match"):
    defaults.load_default_target()


def test_another_recipe_falls_back_to_the_cache(tmp_path, monkeypatch, capsys):
  d = _copy(tmp_path, monkeypatch)
  m = json.loads((d / shipped.MANIFEST).read_text())
  m["target"]["recipe"]["target_train"]["steps"] += 1
  (d / shipped.MANIFEST).write_text(json.dumps(m))

  class Built(Exception):
    pass

  def build(*a, **k):
    raise Built
  monkeypatch.setattr(defaults, "build_target", build)
  with pytest.raises(Built):
    defaults.load_default_target()
  assert "built by another recipe" in capsys.readouterr().err


def test_flat_round_trip_and_named_mismatches(tmp_path):
  params = {"a": {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3) / 7},
            "b": [jnp.ones((4,), jnp.float32), jnp.zeros((), jnp.int32)]}
  save_flat(tmp_path / "p.safetensors", params, dtype="float32")
  back = load_flat(tmp_path / "p.safetensors", like=params)
  assert jax.tree.all(jax.tree.map(lambda x, y: bool(jnp.all(x == y)), params, back))
  save_flat(tmp_path / "h.safetensors", params)  # bf16
  half = load_flat(tmp_path / "h.safetensors", like=params)
  np.testing.assert_allclose(half["a"]["w"], params["a"]["w"], rtol=1e-2)
  assert half["a"]["w"].dtype == jnp.float32
  other = {"a": {"w": jnp.zeros((3, 2))}, "c": jnp.zeros(())}
  with pytest.raises(ValueError, match=r"a/w has shape \(2, 3\).*\(3, 2\)|missing c"):
    load_flat(tmp_path / "p.safetensors", like=other)
  (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 10)
  with pytest.raises(ValueError, match="cannot read weights file"):
    load_flat(tmp_path / "bad.safetensors", like=params)
