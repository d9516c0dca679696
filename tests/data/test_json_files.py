"""Config JSON is read and checked in one place (`specjax.data.json_files`): deep nesting,
damaged shard indexes and head fields of the wrong type are one-line ValueErrors naming the
file and the field, never a RecursionError, AttributeError or TypeError (issue 40, item 8)."""

import json

import numpy as np
import pytest

from specjax.data import prompts
from specjax.checkpoints.hf import config as hf_config
from specjax.checkpoints.hf import tensor_files
from specjax.checkpoints.hf.tokenizer import HFTokenizer
from specjax.training.published import eagle, eagle3, files, medusa
from specjax.data import json_files

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("reader,name", [
    (files.read_config, "config.json"),
    (hf_config.read_hf_config, "config.json"),
    (lambda d: HFTokenizer.from_dir(d, None), "tokenizer_config.json"),
    (lambda d: prompts.read_jsonl(d / "p.jsonl"), "p.jsonl"),
])
def test_deeply_nested_json_is_one_line(tmp_path, reader, name):
  if name == "tokenizer_config.json":
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "[UNK]": 1}, "[UNK]"))
    tok.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / name).write_text(DEEP if name != "p.jsonl" else DEEP + "\n")
  with pytest.raises(ValueError, match="nested too deeply") as e:
    reader(tmp_path)
  assert name in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("weight_map", [["a"], None, "x", 3])
def test_a_shard_index_whose_weight_map_is_not_an_object(tmp_path, weight_map):
  (tmp_path / tensor_files.SAFETENSORS_INDEX).write_text(json.dumps({"weight_map": weight_map}))
  with pytest.raises(ValueError, match="'weight_map' must be a JSON object"):
    tensor_files._read_index(tmp_path)


_MEDUSA_NAMES = ["0.0.linear.weight", "0.1.weight"]


class _Cfg:
  n_heads, n_kv_heads, norm_eps, rope_theta = 4, 2, 1e-5, 1000.0


@pytest.mark.parametrize("check,doc,name", [
    (lambda c: medusa._sizes(c, _MEDUSA_NAMES), {"medusa_num_heads": True}, "medusa_num_heads"),
    (lambda c: medusa._sizes(c, _MEDUSA_NAMES), {"medusa_num_layers": "1"}, "medusa_num_layers"),
    (lambda c: eagle3._head_fields(c, 32), {"num_attention_heads": None,
                                            "intermediate_size": 64}, "num_attention_heads"),
    (lambda c: eagle3._head_fields(c, 32), {"num_attention_heads": 4, "intermediate_size": 64,
                                            "rms_norm_eps": [1e-6]}, "rms_norm_eps"),
    (lambda c: eagle3._head_fields(c, 32), {"num_attention_heads": "4",
                                            "intermediate_size": 64}, "num_attention_heads"),
    (lambda c: eagle._check_config(c, _Cfg), {"num_attention_heads": "4"},
     "num_attention_heads"),
    (lambda c: eagle._check_config(c, _Cfg), {"rms_norm_eps": [1e-5]}, "rms_norm_eps"),
])
def test_head_fields_of_the_wrong_type_name_the_field(check, doc, name):
  with pytest.raises(ValueError, match=f"field '{name}' must be") as e:
    check(doc)
  assert "\n" not in str(e.value)


def test_field_accepts_the_right_types_and_defaults():
  doc = {"a": 3, "b": 1.5, "c": None}
  assert json_files.field(doc, "a", "positive int", where="x") == 3
  assert json_files.field(doc, "b", "number", where="x") == 1.5
  assert json_files.field(doc, "c", "int", where="x", default=7, null_ok=True) == 7
  assert json_files.field(doc, "d", "int", where="x", default=None) is None
  with pytest.raises(ValueError, match="'d' is missing"):
    json_files.field(doc, "d", "int", where="x")
  assert np.isfinite(json_files.field({"e": 1}, "e", "positive number", where="x"))
