"""Hugging Face checkpoints: import into specjax, export back (GPT-2, Llama, Mistral, Qwen2,
Qwen3).

    from specjax.checkpoints import hf
    imported = hf.import_hf("path/to/hf_dir")       # HFImport(config, params, family, ...)
    model = imported.model()                         # specjax Transformer
    hf.export_hf(model, "path/to/out_dir")           # config.json + model.safetensors

One file per concern:
  tensor_files  weight files: safetensors (through the `safetensors` package), sharded
                index + shards, Flax msgpack; lazy reading; refusals that name the tensor
  config        config.json <-> ModelConfig (supported options, transformers' defaults)
  keys          the declarative tensor-name key maps (`Rule`s per family and layout)
  convert       import_hf / export_hf (all-or-nothing checks, atomic output directory)
  tokenizer     HFTokenizer, which tokenizer a directory holds, copying tokenizer files
"""

from __future__ import annotations

from specjax.files import MARKER as OUTPUT_MARKER
from specjax.files import prepare_output_dir, publish_dir
from specjax.checkpoints.hf.config import (ARCHITECTURES, FAMILIES, config_from_hf, detect_family,
                                           family_for, hf_config_for, read_hf_config,
                                           rope_fields_of, rope_theta_of)
from specjax.checkpoints.hf.convert import (DEFAULT_SHARD_BYTES, HFImport, build_model,
                                            convert_in, convert_out, export_hf, import_hf,
                                            model_params, nest, param_shapes)
from specjax.checkpoints.hf.keys import IGNORED_BUFFERS, Rule, rules_for
from specjax.checkpoints.hf.tensor_files import (FLAX_MSGPACK, SAFETENSORS, SAFETENSORS_INDEX,
                                                 Tensors, checkpoint_layout, itemsize,
                                                 read_flax_msgpack, read_safetensors,
                                                 read_tensors, safetensors_specs, tensor_headers,
                                                 write_flax_msgpack, write_safetensors)
from specjax.checkpoints.hf.tokenizer import (TOKENIZER_FILES, HFTokenizer, copy_tokenizer_files,
                                              load_tokenizer_for, recorded_tokenizer)

__all__ = [
    "ARCHITECTURES", "DEFAULT_SHARD_BYTES", "FAMILIES", "FLAX_MSGPACK", "HFImport", "HFTokenizer",
    "IGNORED_BUFFERS", "Rule", "SAFETENSORS", "SAFETENSORS_INDEX", "TOKENIZER_FILES", "Tensors",
    "build_model", "checkpoint_layout", "config_from_hf", "convert_in", "convert_out",
    "copy_tokenizer_files", "detect_family", "export_hf", "family_for", "hf_config_for",
    "import_hf", "itemsize", "load_tokenizer_for", "model_params", "nest", "param_shapes",
    "OUTPUT_MARKER", "prepare_output_dir", "publish_dir", "read_flax_msgpack", "read_hf_config",
    "recorded_tokenizer",
    "read_safetensors", "read_tensors", "rope_fields_of", "rope_theta_of", "rules_for",
    "safetensors_specs",
    "tensor_headers", "write_flax_msgpack", "write_safetensors",
]
