"""GGUF files (llama.cpp's format): import into specjax.

    from specjax.checkpoints import gguf
    imported = gguf.import_gguf("model.gguf")      # HFImport(config, params, family, ...)
    gguf.save_gguf("model.gguf", "ckpt_dir")        # a specjax checkpoint + tokenizer files

Read with ggml-org's `gguf` package (the optional extra `specjax[gguf]`); the tensors are
dequantized to float32 (bfloat16 on request). One file per concern:
  read       opening a file, metadata, dequantized tensors, the refusals (not GGUF, cut
             short, a tensor type not covered)
  config     metadata -> the model's Hugging Face config.json, tensor names, q/k permutation,
             Llama 3.1's rope scaling
  tokenizer  `tokenizer.ggml.*` -> tokenizer.json, tokenizer_config.json (chat template),
             generation_config.json
The model is then built by the Hugging Face import (`hf.config_from_hf`, `hf.convert_in`):
one ModelConfig, one set of checks, for both roads in.
"""

from __future__ import annotations

import os
import pathlib
import tempfile

from specjax.checkpoints.gguf.config import ARCHITECTURES, hf_config, hf_tensors, unpermute
from specjax.checkpoints.gguf.read import TENSOR_TYPES, GGUFFile, is_gguf_file, open_gguf
from specjax.checkpoints.gguf.tokenizer import build_tokenizer, tokenizer_files
from specjax.checkpoints import hf
from specjax.models.transformer import check_params_fit
from specjax.checkpoints import save_model
from specjax.checkpoints.hf import load_tokenizer_for


def import_gguf(path: str | os.PathLike, *, dtype: str | None = None):
  """Read and convert a GGUF file: an `hf.HFImport` (layout 'gguf'). dtype: None or
  'float32' (the default), or 'bfloat16'. ValueError naming the file and what is wrong."""
  if dtype not in (None, "float32", "bfloat16"):
    raise ValueError(f"dtype must be None, 'float32' or 'bfloat16', got {dtype!r}")
  f = open_gguf(path)
  config_json = hf_config(f)
  try:
    family, config = hf.config_from_hf(config_json, dtype=dtype or "float32")
  except ValueError as e:
    raise ValueError(f"GGUF file {str(f.path)!r}: {e}") from None
  check_params_fit(config, what=f"GGUF file {str(f.path)!r}")
  tensors = hf_tensors(f, config_json)
  try:
    params = hf.convert_in(hf.rules_for(family, config), tensors, config, family)
  except ValueError as e:
    raise ValueError(f"GGUF file {str(f.path)!r}: {e}") from None
  return hf.HFImport(config=config, params=params, family=family, layout="gguf",
                     hf_config=config_json)


def write_tokenizer_files(path: str | os.PathLike | GGUFFile, directory) -> list[str]:
  """Write the GGUF file's tokenizer as Hugging Face tokenizer files into `directory`."""
  f = path if isinstance(path, GGUFFile) else open_gguf(path)
  files = tokenizer_files(f)
  for name, text in files.items():
    (pathlib.Path(directory) / name).write_text(text, encoding="utf-8")
  return sorted(files)


def save_gguf(path: str | os.PathLike, out: str | os.PathLike, *, dtype: str | None = None,
              overwrite: bool = False, metadata: dict | None = None) -> pathlib.Path:
  """Import a GGUF file and save it as a specjax checkpoint (`checkpoints.save_model`: all or
  nothing) with the tokenizer files; returns the checkpoint directory."""
  src = pathlib.Path(path)
  imported = import_gguf(src, dtype=dtype)
  with tempfile.TemporaryDirectory(prefix="specjax-gguf-tok-") as tok_dir:
    write_tokenizer_files(src, tok_dir)
    tokenizer = load_tokenizer_for(tok_dir, imported.hf_config)
    meta = {"family": imported.family, "source_layout": "gguf", "source": src.name,
            "hf_config": imported.hf_config, "tokenizer": tokenizer.to_spec(),
            **(metadata or {})}
    return save_model(out, imported.model(), metadata=meta, tokenizer_dir=tok_dir,
                      overwrite=overwrite)


__all__ = ["ARCHITECTURES", "GGUFFile", "TENSOR_TYPES", "build_tokenizer", "hf_config",
           "hf_tensors", "import_gguf", "is_gguf_file", "open_gguf", "save_gguf",
           "tokenizer_files", "unpermute", "write_tokenizer_files"]
