"""Heads shipped for a real target (`training.shipped_heads`, `--draft eagle3:NAME`, issue
44): written from a trained head in the published EAGLE-3 layout (bf16) with a manifest,
run by name for the target they were trained for and for no other, damaged files refused,
greedy decoding exact with them."""

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from specjax.training import shipped_heads  # noqa: E402
from specjax.training.published import eagle3 as pub  # noqa: E402
from specjax.training.published import files as pub_files  # noqa: E402
from test_eagle3_import import DRAFT_IDS, D, V, _published, hf_target  # noqa: E402

_ = hf_target  # the module fixture: a random 8-layer Llama written by transformers


@pytest.fixture
def shipped(hf_target, tmp_path, monkeypatch):
  """(root, name): a head shipped as `tiny` under a temporary embedded root."""
  _, _, target = hf_target
  _published(tmp_path / "pub", vocab=V, d_model=D, draft_ids=DRAFT_IDS, seed=1)
  pub.import_head(tmp_path / "pub", target, tmp_path / "head")
  root = tmp_path / "embedded"
  monkeypatch.setattr(shipped_heads, "heads_root", lambda: root)
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.chdir(tmp_path)
  manifest = shipped_heads.ship(tmp_path / "head", target, root / "tiny", name="tiny",
                                recipe="smollm2-eagle3", target_name="a random Llama",
                                training_seconds=1.0)
  assert sorted(manifest["files"]) == ["config.json", "model.safetensors"]
  assert manifest["target"]["fingerprint_float32"] == shipped_heads.target_fingerprint(target)
  return root, "tiny"


@pytest.mark.slow  # compiles speculative decoding
def test_a_shipped_head_runs_by_name_and_decodes_greedily_exact(hf_target, shipped):
  import specjax
  from specjax.engine import decoding
  d, _, target = hf_target
  assert shipped_heads.names() == ["tiny"] and shipped_heads.is_shipped("tiny")
  run = specjax.load(target=str(d), draft="eagle3:tiny", k=3)
  prompt = [3, 17, 9, 40, 2]
  plain = decoding.generate(run.target, [prompt], max_new_tokens=24)
  spec = decoding.speculative_generate(run.target, run.drafter, [prompt], k=3,
                                       max_new_tokens=24)
  assert spec.tokens == plain.tokens
  # what runs is the shipped bf16 head: exporting the imported one gives the same tensors
  root, name = shipped
  bound = shipped_heads.bound_dir(name, target)
  again = pub.export_head(bound, target, bound.parent / "again", dtype="bfloat16")
  ours, theirs = pub_files.read_weights(again), pub_files.read_weights(root / name)
  assert sorted(ours) == sorted(theirs)
  for k in ours:
    np.testing.assert_array_equal(np.asarray(ours[k], np.float32),
                                  np.asarray(theirs[k], np.float32), err_msg=k)


def test_a_shipped_head_is_refused_for_another_target(hf_target, shipped):
  from flax import nnx

  from specjax.models.transformer import Transformer
  _, _, target = hf_target
  other = Transformer(target.config, rngs=nnx.Rngs(5))
  with pytest.raises(ValueError, match=r"eagle3:tiny drafts for a random Llama \(float32 "
                                       r"parameter fingerprint [0-9a-f]+\); this target's is"):
    shipped_heads.bound_dir("tiny", other)


def test_a_damaged_shipped_file_is_refused_naming_it(hf_target, shipped):
  root, name = shipped
  path = root / name / "model.safetensors"
  path.write_bytes(path.read_bytes()[:-8] + b"\0" * 8)
  with pytest.raises(ValueError, match="model.safetensors is missing or does not match its "
                                       "digest"):
    shipped_heads.bound_dir(name, hf_target[2])


def test_a_directory_of_the_same_name_wins_over_the_shipped_head(shipped, tmp_path):
  assert shipped_heads.is_shipped("tiny")
  (tmp_path / "tiny").mkdir()  # the test runs in tmp_path
  assert not shipped_heads.is_shipped("tiny")
  assert not shipped_heads.is_shipped("nope")
