"""Checkpoint import/export without torch: safetensors and Flax layouts, orbax round trips,
the import-hf / export-hf / inspect commands, and every bad-input path.

Hugging Face directories here are written by specjax's own exporter from random parameters
(tests/checkpoints/test_hf.py checks the layouts against `transformers` itself when torch is
installed).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors

from specjax.checkpoints import describe, hf, load_checkpoint, load_model, save_model
from specjax.commands import checkpoints as commands
from specjax.models.transformer import ModelConfig, param_count

CONFIGS = {
    "gpt2": ModelConfig.gpt2(vocab_size=300, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4,
                             d_ff=64, max_len=64),
    "gpt2-untied": ModelConfig.gpt2(vocab_size=300, d_model=32, n_layers=2, n_heads=4,
                                    n_kv_heads=4, d_ff=64, max_len=64, tie_embeddings=False),
    "llama": ModelConfig.llama(vocab_size=300, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                               d_ff=48, max_len=64, rope_theta=500000.0),
    "qwen2": ModelConfig.llama(vocab_size=300, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                               d_ff=48, max_len=64, qkv_bias=True, tie_embeddings=True),
    "llama3": ModelConfig.llama(vocab_size=300, d_model=32, n_layers=2, n_heads=4, n_kv_heads=1,
                                d_ff=48, max_len=64, rope_scaling="llama3", rope_factor=4.0,
                                rope_original_max_len=32),
    "mistral": ModelConfig.llama(vocab_size=300, d_model=32, n_layers=2, n_heads=4,
                                 n_kv_heads=2, d_ff=48, max_len=64, sliding_window=8),
    "qwen3": ModelConfig.llama(vocab_size=300, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                               d_ff=48, max_len=64, qk_norm=True, head_dim_override=12,
                               sliding_window=8, window_first_layer=1),
}
FAMILY = {"gpt2": "gpt2", "gpt2-untied": "gpt2", "llama": "llama", "qwen2": "qwen2",
          "llama3": "llama", "mistral": "mistral", "qwen3": "qwen3"}


def random_params(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  dtype = ml_dtypes.bfloat16 if config.dtype == "bfloat16" else np.float32
  out = {}
  for name, shape in hf.param_shapes(config).items():
    base = 1.0 if name.endswith("scale") else 0.0
    out[name] = (base + 0.2 * rng.standard_normal(shape)).astype(dtype)
  return out


def write_hf(directory: pathlib.Path, name: str, **kw) -> tuple[ModelConfig, dict]:
  config = CONFIGS[name].replace(**kw)
  params = random_params(config)
  hf.export_hf((config, params), directory)
  return config, params


def assert_params_equal(a: dict, b: dict) -> None:
  assert sorted(a) == sorted(b)
  for k in a:
    assert a[k].dtype == b[k].dtype, k
    np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)


def cli(*argv) -> int:
  parser = argparse.ArgumentParser()
  commands.add_parsers(parser.add_subparsers(dest="command"))
  args = parser.parse_args([str(a) for a in argv])
  return args.func(args)


def nothing_written(out: pathlib.Path) -> bool:
  leftovers = [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
  return not out.exists() and not leftovers


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hf_directory_round_trip_is_bit_exact(tmp_path, name):
  config, params = write_hf(tmp_path / "hf", name)
  written = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert written["architectures"] == [hf.ARCHITECTURES[FAMILY[name]]]
  imported = hf.import_hf(tmp_path / "hf")
  assert imported.family == FAMILY[name]
  assert imported.config == config
  assert_params_equal(imported.params, params)


def test_bf16_stays_bf16_unless_asked(tmp_path):
  config, params = write_hf(tmp_path / "hf", "llama", dtype="bfloat16")
  assert {d for _, d in hf.tensor_headers(tmp_path / "hf").values()} == {"BF16"}
  kept = hf.import_hf(tmp_path / "hf")
  assert kept.config.dtype == "bfloat16"
  assert_params_equal(kept.params, params)
  as_f32 = hf.import_hf(tmp_path / "hf", dtype="float32")
  assert as_f32.config == config.replace(dtype="float32")
  assert_params_equal(as_f32.params, {k: v.astype(np.float32) for k, v in params.items()})


def test_sharded_safetensors_round_trip(tmp_path):
  config, params = CONFIGS["llama"], random_params(CONFIGS["llama"])
  hf.export_hf((config, params), tmp_path / "hf", max_shard_bytes=20_000)
  shards = sorted(p.name for p in (tmp_path / "hf").glob("model-*.safetensors"))
  assert len(shards) > 2 and not (tmp_path / "hf" / hf.SAFETENSORS).exists()
  index = json.loads((tmp_path / "hf" / hf.SAFETENSORS_INDEX).read_text())
  assert set(index["weight_map"].values()) == set(shards)
  assert_params_equal(hf.import_hf(tmp_path / "hf").params, params)


def _flax_gpt2_tree(config: ModelConfig, params: dict) -> dict:
  """GPT-2 params in the layout of Hugging Face's FlaxGPT2LMHeadModel (FlaxConv1D kernels
  are [out, in]; embeddings are 'embedding'; LayerNorm weights are 'scale')."""
  def ln(prefix):
    return {"scale": params[f"{prefix}.scale"], "bias": params[f"{prefix}.bias"]}

  def conv(prefix):
    return {"kernel": params[f"{prefix}.kernel"].T, "bias": params[f"{prefix}.bias"]}

  blocks = {}
  for i in range(config.n_layers):
    b = f"blocks.{i}"
    qkv = [params[f"{b}.attn.{n}.kernel"] for n in "qkv"]
    blocks[str(i)] = {
        "ln_1": ln(f"{b}.attn_norm"), "ln_2": ln(f"{b}.mlp_norm"),
        "attn": {"c_attn": {"kernel": np.concatenate(qkv, axis=1).T,
                            "bias": np.concatenate([params[f"{b}.attn.{n}.bias"]
                                                    for n in "qkv"])},
                 "c_proj": conv(f"{b}.attn.o")},
        "mlp": {"c_fc": conv(f"{b}.mlp.up"), "c_proj": conv(f"{b}.mlp.down")}}
  tree = {"transformer": {"wte": {"embedding": params["embed"]},
                          "wpe": {"embedding": params["pos_embed"]}, "h": blocks,
                          "ln_f": ln("final_norm")}}
  if not config.tie_embeddings:
    tree["lm_head"] = {"kernel": params["lm_head.kernel"]}  # flax Dense: [in, out]
  return tree


@pytest.mark.parametrize("name", ["gpt2", "gpt2-untied"])
def test_flax_msgpack_gpt2_import(tmp_path, name):
  from flax import serialization
  config, params = CONFIGS[name], random_params(CONFIGS[name], seed=3)
  d = tmp_path / "flax"
  d.mkdir()
  (d / "config.json").write_text(json.dumps(hf.hf_config_for(config)))
  tree = {"params": _flax_gpt2_tree(config, params)} if name == "gpt2" else _flax_gpt2_tree(
      config, params)  # with and without the outer "params" collection
  (d / hf.FLAX_MSGPACK).write_bytes(serialization.msgpack_serialize(tree))
  imported = hf.import_hf(d)
  assert imported.layout == "flax" and imported.config == config
  assert_params_equal(imported.params, params)


def test_orbax_round_trip_and_config_mismatch(tmp_path):
  config, params = CONFIGS["llama"], random_params(CONFIGS["llama"])
  save_model(tmp_path / "ckpt", hf.build_model(config, params), metadata={"note": "x"})
  model, meta = load_checkpoint(tmp_path / "ckpt")
  assert model.config == config and meta["note"] == "x" and meta["kind"] == "specjax-model"
  assert_params_equal(hf.model_params(model), params)
  with pytest.raises(ValueError, match=r"n_layers: checkpoint=2, expected=3"):
    load_checkpoint(tmp_path / "ckpt", config=config.replace(n_layers=3))
  with pytest.raises(ValueError, match=r"rope_theta"):
    load_checkpoint(tmp_path / "ckpt", config=config.replace(rope_theta=10000.0))


def test_cli_import_inspect_export(tmp_path, capsys):
  config, params = write_hf(tmp_path / "hf", "gpt2", dtype="bfloat16")
  assert cli("import-hf", tmp_path / "hf", "--out", tmp_path / "ckpt") == 0
  capsys.readouterr()
  assert cli("inspect", tmp_path / "ckpt", "--json") == 0
  info = json.loads(capsys.readouterr().out)
  assert info["parameters"] == param_count(config)
  assert info["bytes"] == 2 * param_count(config) and info["dtypes"] == ["bfloat16"]
  assert info["config"] == config.to_dict() and info["family"] == "gpt2"
  hf_info = describe(tmp_path / "hf")
  assert (hf_info["parameters"], hf_info["bytes"], hf_info["dtypes"]) == (
      info["parameters"], info["bytes"], ["BF16"])
  assert cli("inspect", tmp_path / "hf") == 0
  text = capsys.readouterr().out
  assert f"{param_count(config):,}" in text and "BF16" in text
  assert cli("export-hf", tmp_path / "ckpt", "--out", tmp_path / "out", "--dtype",
             "float32") == 0
  again = hf.import_hf(tmp_path / "out")
  assert again.config == config.replace(dtype="float32")
  assert_params_equal(again.params, {k: v.astype(np.float32) for k, v in params.items()})
  # A non-empty output directory is refused unless --overwrite.
  with pytest.raises(ValueError, match="not empty"):
    cli("export-hf", tmp_path / "ckpt", "--out", tmp_path / "out")
  assert cli("export-hf", tmp_path / "ckpt", "--out", tmp_path / "out", "--overwrite") == 0
  assert hf.import_hf(tmp_path / "out").config.dtype == "bfloat16"
  assert cli("export-hf", tmp_path / "ckpt", "--out", tmp_path / "flax", "--layout", "flax") == 0
  assert sorted(p.name for p in (tmp_path / "flax").iterdir()) == [
      hf.OUTPUT_MARKER, "config.json", hf.FLAX_MSGPACK]
  flax = hf.import_hf(tmp_path / "flax")
  assert flax.layout == "flax" and flax.config == config
  assert_params_equal(flax.params, params)


def test_load_model_hf_dir_and_checkpoint_generate_the_same(tmp_path):
  from specjax.engine import decoding
  from specjax.data.tokenizer import ByteTokenizer
  write_hf(tmp_path / "hf", "llama")
  cli("import-hf", tmp_path / "hf", "--out", tmp_path / "ckpt")
  (m1, t1), (m2, t2) = load_model(tmp_path / "hf"), load_model(tmp_path / "ckpt")
  assert isinstance(t1, ByteTokenizer) and isinstance(t2, ByteTokenizer)
  assert_params_equal(hf.model_params(m1), hf.model_params(m2))
  prompts = [t1.encode("hello", bos=True), t1.encode("a", bos=True)]
  g1 = decoding.generate(m1, prompts, max_new_tokens=6)
  g2 = decoding.generate(m2, prompts, max_new_tokens=6)
  assert g1.tokens == g2.tokens and all(len(t) == 6 for t in g1.tokens)


def test_trainer_checkpoint_loads_and_exports(tmp_path):
  """A checkpoint in the trainer's format (float32 params, kind 'specjax-lm', tokenizer spec
  in the metadata, tokenizer.json beside it) goes through load_model and export-hf."""
  from flax import nnx

  from specjax.checkpoints import orbax_io
  from specjax.data.tokenizer import ByteTokenizer
  config, params = CONFIGS["gpt2"], random_params(CONFIGS["gpt2"], seed=5)
  state = nnx.state(hf.build_model(config, params), nnx.Param)
  orbax_io.save(tmp_path / "run", 7, params=state, config=config,
                metadata={"kind": "specjax-lm", "tokenizer": {"kind": "byte"}})
  ByteTokenizer().save(tmp_path / "run")
  model, tokenizer = load_model(tmp_path / "run")
  assert isinstance(tokenizer, ByteTokenizer) and model.config == config
  assert_params_equal(hf.model_params(model), params)
  assert describe(tmp_path / "run")["steps"] == [7]
  cli("export-hf", tmp_path / "run", "--out", tmp_path / "out")
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert (written["bos_token_id"], written["eos_token_id"]) == (256, 257)
  assert not (tmp_path / "out" / "tokenizer.json").exists()  # the byte marker is not HF's
  assert_params_equal(hf.import_hf(tmp_path / "out").params, params)


def test_hf_tokenizer_is_loaded_and_copied(tmp_path):
  tokenizers = pytest.importorskip("tokenizers")
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=290, special_tokens=["<|endoftext|>"], show_progress=False,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(["the cat sat on the mat"] * 20, trainer=trainer)
  write_hf(tmp_path / "hf", "gpt2")
  tok.save(str(tmp_path / "hf" / "tokenizer.json"))
  (tmp_path / "hf" / "tokenizer_config.json").write_text(
      json.dumps({"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}))
  cli("import-hf", tmp_path / "hf", "--out", tmp_path / "ckpt")
  assert (tmp_path / "ckpt" / "tokenizer.json").is_file()
  for path in (tmp_path / "hf", tmp_path / "ckpt"):
    _, t = load_model(path)
    assert isinstance(t, hf.HFTokenizer)
    assert t.eos_id == t.bos_id == tok.token_to_id("<|endoftext|>")
    ids = t.encode("the cat", bos=True)
    assert ids[0] == t.bos_id and t.decode(ids) == "the cat"
  cli("export-hf", tmp_path / "ckpt", "--out", tmp_path / "out")
  assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (
      tmp_path / "hf" / "tokenizer.json").read_bytes()


# ----------------------------------------------------------------------------- configs


def _llama_hf(**fields) -> dict:
  base = hf.hf_config_for(CONFIGS["llama"])
  for k in ("rope_theta", "rope_parameters"):
    base.pop(k)
  return {**base, **fields}


def test_rope_theta_read_from_old_and_new_fields():
  new = _llama_hf(rope_parameters={"rope_type": "default", "rope_theta": 250000.0})
  old = _llama_hf(rope_theta=250000.0, rope_scaling=None)
  both = _llama_hf(rope_theta=1.0, rope_parameters={"rope_theta": 250000.0})
  for fields in (new, old, both):
    assert hf.config_from_hf(fields)[1].rope_theta == 250000.0
  assert hf.config_from_hf(_llama_hf())[1].rope_theta == 10000.0  # transformers' default
  for bad, match in (({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "llama3"),
                     ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "linear"),
                     ({"partial_rotary_factor": 0.5}, "partial_rotary_factor")):
    with pytest.raises(ValueError, match=match):
      hf.config_from_hf(_llama_hf(**bad))


def test_family_specific_config_fields():
  mistral = {**_llama_hf(), "model_type": "mistral", "sliding_window": 32,
             "num_key_value_heads": 1}
  family, cfg = hf.config_from_hf(mistral)
  assert family == "mistral" and cfg.n_kv_heads == 1
  assert (cfg.sliding_window, cfg.window_first_layer, cfg.max_len) == (32, 0, 64)  # enforced
  family, cfg = hf.config_from_hf({**_llama_hf(), "model_type": "qwen2"})
  assert family == "qwen2" and cfg.qkv_bias and not cfg.use_bias
  gpt2 = hf.hf_config_for(CONFIGS["gpt2"])
  assert hf.config_from_hf({**gpt2, "n_inner": None})[1].d_ff == 4 * 32
  for fields, match in (({"activation_function": "gelu"}, "activation_function"),
                        ({"scale_attn_by_inverse_layer_idx": True},
                         "scale_attn_by_inverse_layer_idx")):
    with pytest.raises(ValueError, match=match):
      hf.config_from_hf({**gpt2, **fields})
  for fields, match in (({"hidden_act": "gelu"}, "hidden_act"),
                        ({"attention_bias": True}, "attention_bias"),
                        ({"hidden_size": None}, "hidden_size")):
    with pytest.raises(ValueError, match=match):
      hf.config_from_hf(_llama_hf(**fields))
  assert hf.config_from_hf(_llama_hf(head_dim=16))[1].head_dim == 16  # != 32 / 4 heads
  assert hf.config_from_hf(_llama_hf(head_dim=8))[1].head_dim_override is None  # derived


LLAMA3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_llama3_rope_scaling_is_read_and_written_back():
  for fields in ({"rope_parameters": LLAMA3},
                 {"rope_theta": 5e5, "rope_scaling": {**LLAMA3, "rope_theta": None}}):
    _, cfg = hf.config_from_hf(_llama_hf(**fields))
    assert (cfg.rope_scaling, cfg.rope_theta, cfg.rope_factor, cfg.rope_low_freq_factor,
            cfg.rope_high_freq_factor, cfg.rope_original_max_len) == (
                "llama3", 5e5, 32.0, 1.0, 4.0, 8192)
    again = hf.config_from_hf(hf.hf_config_for(cfg))[1]
    assert again == cfg
  no_factor = {k: v for k, v in LLAMA3.items() if k != "factor"}
  with pytest.raises(ValueError, match=r"rope_parameters\.factor=None"):
    hf.config_from_hf(_llama_hf(rope_parameters=no_factor))


@pytest.mark.parametrize("field", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("kind", ["linear", "dynamic", "yarn", "longrope", "su"])
def test_other_rope_scalings_are_refused_naming_field_and_value(field, kind):
  with pytest.raises(ValueError, match=rf"{field}\.rope_type='{kind}' is not supported"):
    hf.config_from_hf(_llama_hf(**{field: {"rope_type": kind, "factor": 2.0}}))
  if field == "rope_scaling":  # the old key name
    with pytest.raises(ValueError, match=rf"rope_scaling\.type='{kind}'"):
      hf.config_from_hf(_llama_hf(rope_scaling={"type": kind, "factor": 2.0}))


def test_qwen_sliding_window_layers():
  qwen = {**_llama_hf(), "model_type": "qwen3", "num_hidden_layers": 4}
  qwen.pop("head_dim")
  _, cfg = hf.config_from_hf(qwen)
  assert cfg.qk_norm and not cfg.qkv_bias and cfg.head_dim == 128  # Qwen3's default head_dim
  assert cfg.sliding_window is None  # use_sliding_window defaults to false
  _, cfg = hf.config_from_hf({**qwen, "use_sliding_window": True, "sliding_window": 6,
                              "max_window_layers": 1})
  assert (cfg.sliding_window, cfg.window_first_layer) == (6, 1)
  assert [cfg.window_of(i) for i in range(4)] == [None, 6, 6, 6]
  assert hf.config_from_hf(hf.hf_config_for(cfg))[1] == cfg
  types = ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]
  _, cfg = hf.config_from_hf({**qwen, "use_sliding_window": True, "sliding_window": 6,
                              "layer_types": types})
  assert cfg.window_first_layer == 2
  for bad, match in ((types[::-1], "a final run of layers"), (types[:3], "each of the 4 layers"),
                     (["full_attention"] * 3 + ["chunked_attention"], "chunked_attention")):
    with pytest.raises(ValueError, match=match):
      hf.config_from_hf({**qwen, "use_sliding_window": True, "layer_types": bad})
  with pytest.raises(ValueError, match="attention_bias"):
    hf.config_from_hf({**qwen, "attention_bias": True})


# ----------------------------------------------------------------------------- bad input


def _rewrite(path: pathlib.Path, edit) -> None:
  tensors = {k: np.array(v) for k, v in hf.read_safetensors(path).items()}
  edit(tensors)
  hf.write_safetensors(path, tensors, {"format": "pt"})


def _truncate(path, n):
  data = path.read_bytes()
  path.write_bytes(data[:-n])


def _corrupt(path, offset, payload):
  data = bytearray(path.read_bytes())
  data[offset:offset + len(payload)] = payload
  path.write_bytes(bytes(data))


def _last_tensor(path) -> str:
  """The tensor stored last in the file (the one a truncation cuts)."""
  with safetensors.safe_open(str(path), framework="numpy") as f:
    return f.offset_keys()[-1]


BAD_INPUTS = {
    "missing tensor": (lambda d: _rewrite(d / hf.SAFETENSORS, lambda t: t.pop(
        "transformer.h.1.mlp.c_fc.bias")), r"missing tensor 'transformer\.h\.1\.mlp\.c_fc\.bias'"),
    "unexpected tensor": (lambda d: _rewrite(d / hf.SAFETENSORS, lambda t: t.update(
        {"transformer.h.0.attn.extra.weight": np.zeros((2, 2), np.float32)})),
        r"unexpected tensor 'transformer\.h\.0\.attn\.extra\.weight'"),
    "wrong shape": (lambda d: _rewrite(d / hf.SAFETENSORS, lambda t: t.update(
        {"transformer.h.0.attn.c_proj.weight": np.zeros((32, 31), np.float32)})),
        r"'transformer\.h\.0\.attn\.c_proj\.weight' has shape \(32, 31\), expected \(32, 32\)"),
    "unsupported architecture": (lambda d: (d / "config.json").write_text(json.dumps(
        {"model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": 300})),
        r"unsupported architecture 'BertForMaskedLM' \(model_type 'bert'\)"),
    "truncated safetensors": (lambda d: _truncate(d / hf.SAFETENSORS, 10),
                              r"truncated.*tensor '{last}' needs bytes"),
    "corrupted header": (lambda d: _corrupt(d / hf.SAFETENSORS, 12, b"\xff\x00garbage"),
                         r"corrupted.*header is not valid JSON"),
    "corrupted header length": (lambda d: _corrupt(d / hf.SAFETENSORS, 0,
                                                   struct.pack("<Q", 2**40)),
                                r"header claims 1099511627776 bytes"),
    "empty weights file": (lambda d: (d / hf.SAFETENSORS).write_bytes(b"abc"),
                           r"fewer than the 8-byte header length"),
    "no weights": (lambda d: (d / hf.SAFETENSORS).unlink(), r"holds no model\.safetensors"),
    "unreadable config": (lambda d: (d / "config.json").write_text("{oops"),
                          r"cannot read .*config\.json"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_refused_and_nothing_is_written(tmp_path, case):
  write_hf(tmp_path / "hf", "gpt2")
  last = _last_tensor(tmp_path / "hf" / hf.SAFETENSORS)
  damage, pattern = BAD_INPUTS[case]
  damage(tmp_path / "hf")
  out = tmp_path / "ckpt"
  with pytest.raises(ValueError, match=pattern.replace("{last}", last.replace(".", r"\."))):
    cli("import-hf", tmp_path / "hf", "--out", out)
  assert nothing_written(out)
  with pytest.raises(ValueError, match=pattern.replace("{last}", last.replace(".", r"\."))):
    load_model(tmp_path / "hf")


def _edit_tensors(directory: pathlib.Path, edit) -> None:
  """Apply `edit` to the {name: array} of a safetensors or Flax msgpack directory."""
  if (directory / hf.FLAX_MSGPACK).is_file():
    tensors = hf.read_flax_msgpack(directory / hf.FLAX_MSGPACK)
    edit(tensors)
    hf.write_flax_msgpack(directory / hf.FLAX_MSGPACK, tensors)
  else:
    _rewrite(directory / hf.SAFETENSORS, edit)


# (family, tensor to drop, tensor to mis-shape, config edit that must be refused, its name)
FAMILY_BAD = {
    "llama3": ("model.layers.1.mlp.down_proj.{w}", "model.layers.0.self_attn.k_proj.{w}",
               {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
               r"rope_parameters\.rope_type='yarn'"),
    "mistral": ("lm_head.{w}", "model.layers.1.post_attention_layernorm.weight",
                {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    "qwen3": ("model.layers.1.self_attn.k_norm.weight", "model.layers.0.self_attn.q_norm.weight",
              {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    "qwen2": ("model.layers.0.self_attn.v_proj.bias", "model.embed_tokens.{e}",
              {"num_experts": 4, "model_type": "qwen2_moe"}, "model_type 'qwen2_moe'"),
}


@pytest.mark.parametrize("layout", ["safetensors", "flax"])
@pytest.mark.parametrize("name", sorted(FAMILY_BAD))
def test_bad_checkpoints_of_every_family_name_the_problem(tmp_path, name, layout):
  """Missing, unexpected and mis-shaped tensors and unsupported config fields, in both
  layouts: refused naming the tensor or field, nothing written at --out."""
  config = CONFIGS[name]
  drop, reshape, bad_config, config_match = FAMILY_BAD[name]
  w, e = ("kernel", "embedding") if layout == "flax" else ("weight", "weight")
  drop, reshape = drop.format(w=w), reshape.format(w=w, e=e)
  extra = "model.layers.0.self_attn.extra." + w
  cases = {
      "missing": (lambda t: t.pop(drop), rf"missing tensor '{re.escape(drop)}'"),
      "unexpected": (lambda t: t.update({extra: np.zeros((2, 2), np.float32)}),
                     rf"unexpected tensor '{re.escape(extra)}'"),
      "shape": (lambda t: t.update({reshape: t[reshape][..., :-1]}),
                rf"tensor '{re.escape(reshape)}' has shape"),
  }
  for case, (edit, match) in cases.items():
    d = tmp_path / case
    hf.export_hf((config, random_params(config)), d, layout=layout)
    assert hf.import_hf(d).layout == layout
    _edit_tensors(d, edit)
    out = tmp_path / f"out-{case}"
    with pytest.raises(ValueError, match=match):
      cli("import-hf", d, "--out", out)
    assert nothing_written(out)
  d = tmp_path / "config"
  hf.export_hf((config, random_params(config)), d, layout=layout)
  fields = json.loads((d / "config.json").read_text())
  (d / "config.json").write_text(json.dumps({**fields, **bad_config}))
  with pytest.raises(ValueError, match=config_match):
    cli("import-hf", d, "--out", tmp_path / "out-config")
  assert nothing_written(tmp_path / "out-config")


def test_bad_shard_index_is_refused(tmp_path):
  hf.export_hf((CONFIGS["llama"], random_params(CONFIGS["llama"])), tmp_path / "hf",
               max_shard_bytes=20_000)
  first = sorted((tmp_path / "hf").glob("model-*.safetensors"))[0]
  held = next(iter(hf.read_safetensors(first)))
  first.unlink()
  with pytest.raises(ValueError, match=rf"shard '{first.name}' \(holding tensor '[^']+'\) is "
                     "missing"):
    hf.import_hf(tmp_path / "hf")
  assert held


def test_export_refuses_unexportable_models_without_writing(tmp_path):
  odd = CONFIGS["llama"].replace(norm="layernorm")  # no Hugging Face family computes this
  with pytest.raises(ValueError, match="no Hugging Face family computes this model"):
    hf.export_hf((odd, random_params(odd)), tmp_path / "out")
  gqa_gpt2 = CONFIGS["gpt2"].replace(n_kv_heads=2)
  with pytest.raises(ValueError, match="n_kv_heads=2"):
    hf.export_hf((gqa_gpt2, random_params(gqa_gpt2)), tmp_path / "out")
  params = random_params(CONFIGS["gpt2"])
  params["blocks.0.attn.q.kernel"] = params["blocks.0.attn.q.kernel"][:, :3]
  for layout in ("safetensors", "flax"):
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.q\.kernel: shape \(32, 3\)"):
      hf.export_hf((CONFIGS["gpt2"], params), tmp_path / "out", layout=layout)
  with pytest.raises(ValueError, match="layout must be 'safetensors' or 'flax', got 'bin'"):
    hf.export_hf((CONFIGS["gpt2"], random_params(CONFIGS["gpt2"])), tmp_path / "out",
                 layout="bin")
  for odd, match in ((CONFIGS["qwen3"].replace(qkv_bias=True), "both qk_norm and qkv_bias"),
                     (CONFIGS["mistral"].replace(window_first_layer=1), "window_first_layer=1"),
                     (CONFIGS["gpt2"].replace(sliding_window=4), "GPT-2 has no sliding_window")):
    with pytest.raises(ValueError, match=match):
      hf.export_hf((odd, random_params(odd)), tmp_path / "out")
  assert nothing_written(tmp_path / "out")


def test_cli_parse_size_and_missing_paths(tmp_path):
  assert commands.parse_size("5GB") == 5 * 10**9 and commands.parse_size("512MiB") == 2**29
  assert commands.parse_size("1000") == 1000
  with pytest.raises(ValueError, match="--max-shard-size"):
    commands.parse_size("lots")
  with pytest.raises(ValueError, match="does not exist"):
    cli("import-hf", tmp_path / "nope", "--out", tmp_path / "ckpt")
  with pytest.raises(ValueError, match="neither a Hugging Face model directory"):
    cli("inspect", tmp_path)
  assert nothing_written(tmp_path / "ckpt")
