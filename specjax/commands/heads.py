"""`specjax import-head`, `specjax export-head`: draft heads in the formats other projects
publish (EAGLE-1/2, EAGLE-3, Medusa-1), in and out.

    specjax import-head SRC [--kind eagle|eagle3|medusa] --target TARGET --out DIR
    specjax export-head DIR --format eagle|eagle3|medusa --target TARGET --out HF_DIR

TARGET is any target reference (`specjax.resolve`: default, random:SPEC, a Hugging Face or
specjax model directory): an imported head is checked against it (every tensor's shape) and
bound to it, so `--draft eagle:DIR` / `medusa:DIR` run it with that target; export reads it
for the target's own tensors a format repeats (Medusa's LM projections, EAGLE's embedding).
Outputs are written all or nothing; a refusal is one line (`specjax: error: ...`).
"""

from __future__ import annotations

import argparse
import json

from specjax import resolve


def _formats() -> list[str]:
  from specjax.training.published import FORMATS
  return sorted(FORMATS)


def add_parsers(subparsers) -> None:
  """Adds both subcommands; each sets `func` (args -> exit code)."""
  names = _formats()
  p = subparsers.add_parser(
      "import-head", help="import a published draft head (EAGLE, EAGLE-3, Medusa)",
      description="Reads a published head directory (config.json and safetensors or "
      "PyTorch .bin/.pt weights), checks it against --target and writes a specjax head "
      "directory that --draft KIND:DIR runs.")
  p.add_argument("src", help="the published head's directory")
  p.add_argument("--kind", choices=names, default=None,
                 help="the head's format (default: read from its config.json and tensors)")
  p.add_argument("--target", required=True,
                 help="the target it drafts for: default | random:SPEC | a model directory")
  p.add_argument("--out", required=True, help="head directory to create")
  p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
  p.add_argument("--json", action="store_true", help="print one JSON document")
  p.set_defaults(func=run_import)

  p = subparsers.add_parser(
      "export-head", help="export a specjax draft head in a published format",
      description="Writes a specjax head directory (trained or imported) as config.json + "
      "safetensors in the layout the format's project loads; a head whose structure the "
      "format cannot express is refused.")
  p.add_argument("head", help="specjax head directory")
  p.add_argument("--format", required=True, choices=names, help="the published format")
  p.add_argument("--target", required=True,
                 help="the target the head was made for: default | random:SPEC | a model "
                 "directory")
  p.add_argument("--out", required=True, help="directory to create")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                 help="weights' dtype (default %(default)s: the round trip is bit-identical)")
  p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
  p.set_defaults(func=run_export)


def run_import(args: argparse.Namespace) -> int:
  from specjax.training import published
  from specjax.training.heads import read_head_meta, spec_text
  kind = args.kind or published.detect_kind(args.src)
  target, tokenizer = resolve.load_target(args.target)
  out = published.import_head(args.src, target, args.out, kind=kind, tokenizer=tokenizer,
                              overwrite=args.overwrite)
  head = read_head_meta(out)["head"]
  doc = {"out": str(out), "format": kind, "kind": head["kind"], "spec": head["spec"],
         "draft": f"{head['kind']}:{out}"}
  if args.json:
    print(json.dumps(doc, indent=2))
  else:
    print(f"imported the {kind} head {args.src} for target {args.target} into {out} "
          f"({head['kind']} head {spec_text(head['spec'])}); run it with --draft {doc['draft']}")
  return 0


def run_export(args: argparse.Namespace) -> int:
  from specjax.training import published
  out = published.export_head(args.head, resolve.load_target(args.target)[0], args.out,
                              format=args.format, dtype=args.dtype, overwrite=args.overwrite)
  print(f"exported {args.head} as a {args.format} head into {out}")
  return 0
