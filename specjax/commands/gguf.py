"""`specjax import-gguf`: a GGUF model file (llama.cpp's format) into a specjax checkpoint.

    specjax import-gguf model.gguf --out CKPT [--dtype float32|bfloat16] [--overwrite]

A .gguf file is also accepted wherever a target or draft reference is (`--target
model.gguf`): it is imported once into the cache (`resolve.imported_gguf`).
"""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
  p = subparsers.add_parser(
      "import-gguf", help="import a GGUF model file into a specjax checkpoint",
      description="Reads a GGUF file (llama, incl. Mistral, qwen2 or qwen3 architecture; "
      "tensors F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) with the `gguf` package, "
      "dequantizes it and saves the parameters with their ModelConfig (orbax) and the "
      "tokenizer (tokenizer.json, the chat template) as Hugging Face tokenizer files.")
  p.add_argument("src", help="the .gguf file")
  p.add_argument("--out", required=True, help="checkpoint directory to create")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                 help="the weights' precision (default: float32)")
  p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
  p.add_argument("--json", action="store_true", help="print one JSON document")
  p.set_defaults(func=run_import_gguf)


def run_import_gguf(args: argparse.Namespace) -> int:
  from specjax.checkpoints.gguf import save_gguf
  from specjax.commands.checkpoints import _human, _output_dir, save_and_report
  _output_dir(args, args.src)  # fail before reading the file
  return save_and_report(
      args, lambda: save_gguf(args.src, args.out, dtype=args.dtype, overwrite=args.overwrite),
      lambda info: (f"imported {info['family']} (gguf) from {args.src} -> {args.out}: "
                    f"{info['parameters']:,} parameters, {_human(info['bytes'])}, "
                    f"{info['config']['dtype']}"))
