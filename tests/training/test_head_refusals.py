"""import-head refuses what it cannot run right, in one line: another model's embedding in an
EAGLE-1 head (as EAGLE-3 refuses it), non-finite weights (naming the tensor), the wrong
--kind, a file given as the head directory, an unsafe pickle (issue 40, items 5, 9, 10)."""

import fractions

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from specjax.training import published  # noqa: E402
from test_published_heads import (eagle_config, eagle_tensors, medusa_tensors,  # noqa: E402
                                  target, write_head)

_ = target  # the module fixture: a small random Llama written by transformers


def test_an_eagle_head_with_another_models_embedding_is_refused(target, tmp_path):
  src = write_head(tmp_path / "foreign", eagle_tensors(2, embed=True), eagle_config(),
                   "model.safetensors")
  with pytest.raises(ValueError, match="embed_tokens.weight differs from the target's"):
    published.import_head(src, target[2], tmp_path / "out", kind="eagle")
  own = eagle_tensors(2)
  own["embed_tokens.weight"] = torch.tensor(np.array(target[2].embed[...], np.float32))
  src = write_head(tmp_path / "own", own, eagle_config(), "model.safetensors")
  assert published.import_head(src, target[2], tmp_path / "out", kind="eagle").is_dir()


@pytest.mark.parametrize("kind,value", [("eagle", float("nan")), ("medusa", float("inf")),
                                        ("medusa", float("nan"))])
def test_non_finite_weights_are_refused_naming_the_tensor(target, tmp_path, kind, value):
  if kind == "eagle":
    w, name, cfg, file = eagle_tensors(3), "fc.weight", eagle_config(), "model.safetensors"
  else:
    w, name, file = medusa_tensors(3), "1.0.linear.weight", "medusa_lm_head.safetensors"
    cfg = {"medusa_num_heads": 3, "medusa_num_layers": 2}
  w[name][0, 1] = value
  src = write_head(tmp_path / "src", w, cfg, file)
  with pytest.raises(ValueError, match=f"tensor '{name}' .* non-finite"):
    published.import_head(src, target[2], tmp_path / "out", kind=kind)
  assert not (tmp_path / "out").exists()


def test_the_wrong_kind_names_the_heads_own(target, tmp_path):
  src = tmp_path / "e3"
  src.mkdir()
  (src / "config.json").write_text('{"draft_vocab_size": 32, "architectures": '
                                   '["LlamaForCausalLMEagle3"]}')
  with pytest.raises(ValueError, match="is an EAGLE-3 head .* use --kind eagle3"):
    published.import_head(src, target[2], tmp_path / "out", kind="eagle")


def test_a_file_given_as_the_head_directory(target, tmp_path):
  (tmp_path / "head.safetensors").write_bytes(b"x")
  with pytest.raises(ValueError, match="is a file, not a directory"):
    published.import_head(tmp_path / "head.safetensors", target[2], tmp_path / "out",
                          kind="eagle")


def test_an_unsafe_pickle_is_refused_in_a_whole_sentence(target, tmp_path):
  w = {k: v for k, v in medusa_tensors(4).items()}
  w["extra"] = fractions.Fraction(1, 3)  # an object a weights-only load refuses
  src = write_head(tmp_path / "src", w, {"medusa_num_heads": 3, "medusa_num_layers": 2},
                   "medusa_lm_head.pt")
  with pytest.raises(ValueError) as e:
    published.import_head(src, target[2], tmp_path / "out", kind="medusa")
  text = str(e.value)
  assert "holds more than tensors" in text and text.endswith("as safetensors"), text
  assert "weights_only" not in text and "\n" not in text
