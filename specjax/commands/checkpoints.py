"""`specjax import-hf`, `specjax export-hf`, `specjax inspect`: checkpoints in and out.

    specjax import-hf HF_DIR --out CKPT [--dtype float32|bfloat16]
    specjax export-hf CKPT --out HF_DIR [--dtype ...] [--max-shard-size 5GB]
    specjax inspect CKPT [--json]

CKPT is a specjax orbax checkpoint (from import-hf or the trainer); export-hf and inspect
also accept a Hugging Face directory. Outputs are written atomically: on any error nothing
appears at --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re


def add_parsers(subparsers) -> None:
  """Adds the three subcommands; each sets `func` (args -> exit code)."""
  p = subparsers.add_parser(
      "import-hf", help="import a Hugging Face model directory into a specjax checkpoint",
      description="Reads config.json + model.safetensors (or a sharded index, or GPT-2's "
      "flax_model.msgpack) of a GPT-2, Llama, Mistral or Qwen2 model, checks every tensor "
      "name and shape, and saves the parameters with their ModelConfig (orbax) and the "
      "tokenizer files.")
  p.add_argument("src", help="Hugging Face model directory")
  p.add_argument("--out", required=True, help="checkpoint directory to create")
  _dtype_flag(p)
  p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
  p.add_argument("--tokenizer", metavar="byte|DIR", default=None,
                 help="the tokenizer to attach: a directory holding tokenizer.json (and its "
                 "companions), or 'byte' for specjax's 259-id byte tokenizer. Default: the "
                 "tokenizer files in the model directory; without any, the byte tokenizer "
                 "only if every one of its ids is in the model's vocabulary (else refused)")
  p.add_argument("--json", action="store_true", help="print one JSON document")
  p.set_defaults(func=run_import)

  p = subparsers.add_parser(
      "export-hf", help="export a specjax checkpoint as a Hugging Face model directory",
      description="Writes config.json + safetensors that transformers loads "
      "(GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM or "
      "Qwen3ForCausalLM, chosen from the config), or flax_model.msgpack with --layout flax, "
      "plus the tokenizer files when the checkpoint has them.")
  p.add_argument("ckpt", help="specjax checkpoint (or Hugging Face directory)")
  p.add_argument("--out", required=True, help="directory to create")
  _dtype_flag(p)
  p.add_argument("--max-shard-size", default="5GB",
                 help="largest safetensors shard, e.g. 5GB, 500MB or bytes (default %(default)s)")
  p.add_argument("--layout", choices=("safetensors", "flax"), default="safetensors",
                 help="weight file layout (default %(default)s; flax: one flax_model.msgpack)")
  p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
  p.set_defaults(func=run_export)

  p = subparsers.add_parser(
      "inspect", help="show a checkpoint's config, parameter count, bytes and dtype",
      description="Reads only headers and metadata (no weights).")
  p.add_argument("ckpt", help="specjax checkpoint or Hugging Face directory")
  p.add_argument("--json", action="store_true", help="print one JSON document")
  p.set_defaults(func=run_inspect)


def _dtype_flag(p: argparse.ArgumentParser) -> None:
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                 help="convert the weights (default: keep the stored precision)")


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30}


def parse_size(text: str) -> int:
  m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
  if not m or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
    raise ValueError(f"--max-shard-size must be a positive size like 5GB, 500MB or a byte "
                     f"count, got {text!r}")
  return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _human(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if n < 1024 or unit == "TiB":
      return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
    n /= 1024
  return str(n)


def _output_dir(args: argparse.Namespace, source) -> pathlib.Path:
  """hf.prepare_output_dir, its errors naming --out (which may not hold `source`)."""
  from specjax.checkpoints import hf
  try:
    return hf.prepare_output_dir(args.out, args.overwrite, inputs=(source,))
  except ValueError as e:
    raise ValueError(f"--out: {e}" + (" (--overwrite)" if "overwrite" in str(e) else "")) \
        from None
  except OSError as e:
    raise OSError(e.errno, e.strerror or str(e), f"--out {args.out}") from None


def _import_tokenizer(args: argparse.Namespace, src: pathlib.Path, hf_config: dict,
                      vocab_size: int):
  """(tokenizer, directory whose tokenizer files to copy or None) for import-hf.

  A model directory without tokenizer files gets the byte tokenizer only when its ids all
  lie in the model's vocabulary; otherwise the vocabulary belongs to a tokenizer we do not
  have, and attaching the byte one would produce wrong ids later: refused, naming
  --tokenizer."""
  from specjax.checkpoints import hf
  from specjax.data.tokenizer import ByteTokenizer
  if args.tokenizer == "byte":
    tokenizer, tok_dir = ByteTokenizer(), None
  elif args.tokenizer is not None:
    tok_dir = pathlib.Path(args.tokenizer)
    if not (tok_dir / "tokenizer.json").is_file():
      raise ValueError(f"--tokenizer {args.tokenizer}: no tokenizer.json there: give a "
                       f"directory holding the model's tokenizer files, or 'byte'")
    tokenizer = hf.load_tokenizer_for(tok_dir, hf_config)
  else:
    tok_dir = src
    tokenizer = hf.load_tokenizer_for(src, hf_config)
  if isinstance(tokenizer, ByteTokenizer) and tokenizer.vocab_size > vocab_size:
    where = ("--tokenizer byte" if args.tokenizer == "byte" else
             f"{src} has no tokenizer files (no Hugging Face tokenizer.json), so the byte "
             f"tokenizer would be attached")
    raise ValueError(
        f"{where}: its {tokenizer.vocab_size} ids do not fit the model's vocabulary of "
        f"{vocab_size}: pass --tokenizer DIR, a directory with the model's own tokenizer.json")
  return tokenizer, tok_dir


def save_and_report(args: argparse.Namespace, save, summary) -> int:
  """Runs `save()` (writes --out all or nothing, returns the directory), then prints the
  checkpoint's `describe` as JSON (--json) or the line `summary(info)`; returns 0. An
  OSError names --out and says nothing was written."""
  from specjax.checkpoints import describe
  try:
    out = save()
  except OSError as e:  # disk full, read-only, permissions: nothing was written at --out
    raise OSError(e.errno, f"{e.strerror or e} (nothing was written)", f"--out {args.out}") \
        from None
  info = describe(out)
  print(json.dumps(info, indent=2) if args.json else summary(info))
  return 0


def run_import(args: argparse.Namespace) -> int:
  from specjax.checkpoints import hf, save_model
  src = pathlib.Path(args.src)
  _output_dir(args, src)  # fail before reading gigabytes
  imported = hf.import_hf(src, dtype=args.dtype)
  tokenizer, tok_dir = _import_tokenizer(args, src, imported.hf_config,
                                         imported.config.vocab_size)
  metadata = {"family": imported.family, "source_layout": imported.layout,
              "source": src.name, "hf_config": imported.hf_config,
              "tokenizer": tokenizer.to_spec()}
  return save_and_report(args, lambda: save_model(
      args.out, imported.model(), metadata=metadata, tokenizer_dir=tok_dir,
      overwrite=args.overwrite), lambda info: (
      f"imported {imported.family} ({imported.layout}) from {src} -> {args.out}: "
      f"{info['parameters']:,} parameters, {_human(info['bytes'])}, {imported.config.dtype}; "
      f"tokenizer: {tokenizer!r}"))


def run_export(args: argparse.Namespace) -> int:
  from specjax.checkpoints import hf, is_hf_dir, load_checkpoint, load_model
  from specjax.checkpoints.trained import TRAINED_KIND
  max_bytes = parse_size(args.max_shard_size)
  src = pathlib.Path(args.ckpt)
  _output_dir(args, src)
  if is_hf_dir(src):
    model, tokenizer = load_model(src)
    base = hf.read_hf_config(src)
  else:
    model, meta = load_checkpoint(src)
    base = dict(meta.get("hf_config") or {})
    if meta.get("kind") == TRAINED_KIND:
      tokenizer = hf.recorded_tokenizer(meta["tokenizer"], src)
    else:
      tokenizer = hf.load_tokenizer_for(src, base or None)
  for field in ("bos", "eos", "pad"):  # token ids for transformers' generate, unless recorded
    value = getattr(tokenizer, f"{field}_id", None)
    if f"{field}_token_id" not in base and value is not None and value < model.config.vocab_size:
      base[f"{field}_token_id"] = int(value)
  out = hf.export_hf(model, args.out, dtype=args.dtype, tokenizer_dir=src, base_config=base,
                     max_shard_bytes=max_bytes, overwrite=args.overwrite,
                     layout=getattr(args, "layout", "safetensors"))
  files = sorted(p.name for p in out.iterdir() if p.name != hf.OUTPUT_MARKER)
  print(f"exported {hf.family_for(model.config)} -> {out}: {', '.join(files)}")
  return 0


def run_inspect(args: argparse.Namespace) -> int:
  from specjax.checkpoints import describe
  info = describe(args.ckpt)
  if args.json:
    print(json.dumps(info, indent=2))
    return 0
  c = info["config"]
  print(f"{args.ckpt}: {info['format']} checkpoint"
        + (f" ({info['layout']})" if "layout" in info else "")
        + (f", kind {info['kind']}" if info.get("kind") else "")
        + (f", steps {info['steps']}" if "steps" in info else ""))
  if info.get("family") or info.get("architecture"):
    print(f"  family:      {info.get('family')}  {info.get('architecture') or ''}".rstrip())
  print(f"  parameters:  {info['parameters']:,}")
  print(f"  bytes:       {info['bytes']:,} ({_human(info['bytes'])}); on disk "
        f"{_human(info['disk_bytes'])}")
  print(f"  dtype:       {', '.join(info['dtypes'])}")
  if info.get("tokenizer"):
    print(f"  tokenizer:   {info['tokenizer']}")
  print("  config:")
  width = max(map(len, c), default=0)
  for key, value in c.items():
    print(f"    {key:{width}s} {value}")
  return 0
