"""Spec-Bench on a real model, specjax beside transformers (the front of real_model.sh).

    python benchmarks/real_model.py convert FILE.gguf DIR     # transformers' own import
    python benchmarks/real_model.py run --target DIR [--per-category 5] [--out runs/real_model]

`convert`: a GGUF file dequantized by transformers and written as a float32 Hugging Face
directory (`hf_peer.gguf_to_hf`). `run`: the `real_model` study (configs/real_model.gin,
experiments/real_model.py) over the first --per-category questions of each category of a
Spec-Bench question file (default: the shipped benchmarks/specbench_questions.jsonl, Spec-
Bench's 480 questions in 13 categories, Apache-2.0), at each --temperatures value, every
specjax system of --systems and transformers' plain and prompt-lookup `generate` (and
assisted generation with --hf-draft) on --hf-model (default: the target, when it is a
Hugging Face directory), alternated per question. The run directory resumes like every
`specjax run`: the same command again skips the finished points. report.md holds the
tables, results.jsonl the per-question rows, table.json the aggregated table.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
QUESTIONS = HERE / "specbench_questions.jsonl"


def _floats(text: str) -> list[float]:
  try:
    values = [float(v) for v in text.split(",")]
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be numbers separated by commas, got {text!r}")
  if not values or any(v < 0 for v in values):
    raise argparse.ArgumentTypeError(f"must be temperatures >= 0, got {text!r}")
  return values


def _positive(text: str) -> int:
  if not text.isdigit() or int(text) < 1:
    raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}")
  return int(text)


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = p.add_subparsers(dest="command", required=True)
  c = sub.add_parser("convert", help="GGUF -> float32 Hugging Face directory (transformers)")
  c.add_argument("gguf")
  c.add_argument("out")
  r = sub.add_parser("run", help="the study (module doc)")
  r.add_argument("--target", required=True,
                 help="specjax's target reference: a Hugging Face directory (or a .gguf file "
                 "where specjax reads GGUF)")
  r.add_argument("--hf-model", default=None,
                 help="transformers' model: a Hugging Face directory or a .gguf file "
                 "(default: --target)")
  r.add_argument("--hf-draft", default=None,
                 help="a draft model's Hugging Face directory: adds transformers' assisted "
                 "generation (and its specjax counterpart as DIR@4)")
  r.add_argument("--prompts", default=str(QUESTIONS), help="a Spec-Bench question file")
  r.add_argument("--per-category", type=_positive, default=5)
  r.add_argument("--temperatures", type=_floats, default=[0.0, 1.0])
  r.add_argument("--systems", default=None,
                 help="specjax's speculative systems, DRAFT@K separated by commas (default "
                 "lookup@4,lookup@auto,layer-skip:8@4,layer-skip:15@4)")
  r.add_argument("--no-transformers", action="store_true", help="specjax only")
  r.add_argument("--max-new-tokens", type=_positive, default=128)
  r.add_argument("--repeats", type=_positive, default=2)
  r.add_argument("--torch-threads", type=_positive, default=2)
  r.add_argument("--calibration-repeats", type=_positive, default=2)
  r.add_argument("--out", default=None, help="run directory (default runs/real_model/TIME)")
  r.add_argument("--no-progress", action="store_true")
  return p


def bindings(args) -> list[str]:
  """The gin bindings of the flags: the (question, temperature) axes and every fixed value."""
  from specjax.experiments import real_model
  ids = real_model.select(args.prompts, args.per_category)  # reads and validates the file
  systems = (list(real_model.DEFAULT_SYSTEMS) if args.systems is None
             else [s.strip() for s in args.systems.split(",") if s.strip()])
  hf = [] if args.no_transformers else ["plain", "lookup"]
  if args.hf_draft:
    systems.append(f"{args.hf_draft}@4")
    hf += [] if args.no_transformers else ["assisted"]
  fixed = {"target": args.target, "hf_model": args.hf_model, "prompts": args.prompts,
           "systems": systems, "hf_systems": hf, "hf_draft": args.hf_draft,
           "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
           "torch_threads": args.torch_threads, "calibration_repeats": args.calibration_repeats,
           # one calibration per drafter and temperature: on the first selected question
           "calibration_questions": ids[:1]}
  for t in args.temperatures:
    real_model.validate({**fixed, "temperature": t})
  return [f"sweeps.Sweep.axes = {{'question': {ids!r}, 'temperature': {args.temperatures!r}}}",
          f"sweeps.Sweep.fixed = {fixed!r}"]


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  if args.command == "convert":
    from specjax.experiments import hf_peer
    print(hf_peer.gguf_to_hf(args.gguf, args.out))
    return 0
  try:
    binds = bindings(args)
  except ValueError as e:  # a user error: one line, no traceback
    print(f"real_model.py: error: {e}", file=sys.stderr)
    return 2
  from specjax.commands.bench import launch_report
  from specjax.sweeps import launch
  summary = launch.run("real_model", binds, out=args.out, progress=not args.no_progress)
  print(launch_report(summary).replace("questions finished", "points finished"))
  return 1 if summary.failed else 0


if __name__ == "__main__":
  sys.exit(main())
