"""`specjax bench`: Spec-Bench on any target, drafter and question file, one command.

    specjax bench --target default --draft eagle:default --prompts questions.jsonl --out DIR

A thin front over the `specbench` study (configs/specbench.gin, experiments/specbench.py):
the flags become the sweep's fixed values and the file's question ids its axis; the run
directory has the guarantees of every `specjax run` (re-running the command resumes: finished
questions are skipped), results.jsonl holds one row per question and report.md Spec-Bench's
table per category.
"""

from __future__ import annotations

import argparse
import json

from specjax.commands.models import add_mesh_flag, ints_arg


def _k(text: str):
  if text == "auto":
    return text
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be an int >= 1 or 'auto', got {text!r}")
  return value


def add_parser(subparsers) -> None:
  p = subparsers.add_parser(
      "bench", help="Spec-Bench: every question decoded plainly and speculatively",
      description=__doc__.split("\n\n")[0] + " Each question's first turn is rendered with "
      "the target tokenizer's chat template (when it has one), decoded plainly and "
      "speculatively (alternated, --repeats times), and reported end to end (prefill "
      "included) and decode phase.", formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--target", default="default",
                 help="default | random:SPEC | a Hugging Face or specjax model directory")
  p.add_argument("--draft", default="eagle:default",
                 help="default | self | lookup | layer-skip:M | eagle:DIR | medusa:DIR | "
                 "random:SPEC | a draft model directory (default %(default)s)")
  p.add_argument("--prompts", default="code",
                 help="a Spec-Bench/MT-Bench question file or plain JSONL file, or the "
                 "embedded 'code' / 'prose' sets (default %(default)s)")
  shape = p.add_mutually_exclusive_group()
  shape.add_argument("--k", type=_k, default=4, help="chain length, or 'auto' (default 4)")
  shape.add_argument("--tree", type=ints_arg(1), default=None, metavar="W1,W2,...",
                     help="a static tree: candidates per depth")
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--top-k", type=int, default=0)
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--max-new-tokens", type=int, default=128)
  p.add_argument("--batch", type=int, default=1, help="copies of each question per call")
  p.add_argument("--repeats", type=int, default=3, help="alternated timed calls")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--limit", type=int, default=None, help="the first N questions only")
  p.add_argument("--target-dtype", choices=("float32", "bfloat16"), default=None,
                 help="serve the target's weights in this dtype (default: as stored; the "
                 "shipped target: bfloat16)")
  p.add_argument("--no-chat-template", action="store_true",
                 help="encode the prompts as plain text even if the tokenizer has a template")
  p.add_argument("--multi-turn", action="store_true",
                 help="decode every turn of a question in order, each model answer fed back "
                 "as the assistant turn (default: the first turn only)")
  p.add_argument("--allow-beyond-max-len", action="store_true",
                 help="let a RoPE target generate past max_len, the length it was trained "
                 "for (refused by default: quality past it is not guaranteed)")
  p.add_argument("--out", default=None, help="run directory (default runs/specbench/TIME)")
  p.add_argument("--no-progress", action="store_true")
  p.add_argument("--json", action="store_true", help="print the run summary as JSON")
  add_mesh_flag(p)
  p.set_defaults(func=run)


def bindings(args) -> list[str]:
  """The gin bindings of the flags: the question axis and every fixed value, checked as
  `specjax generate` checks its flags (`specbench.validate` and `preflight`: a bad target,
  draft, tokenizer pair, mesh or context is one line, exit 2, before any question)."""
  from specjax.experiments import specbench
  if args.limit is not None and args.limit < 1:
    raise ValueError(f"--limit must be an int >= 1, got {args.limit}")
  ids = specbench.question_ids(args.prompts)  # reads and validates the file (line numbers)
  ids = ids[:args.limit] if args.limit is not None else ids
  dtype = args.target_dtype or ("bfloat16" if args.target == "default" else None)
  fixed = {"target": args.target, "draft": args.draft, "prompts": args.prompts,
           "k": args.k, "tree_widths": args.tree, "temperature": args.temperature,
           "top_k": args.top_k, "top_p": args.top_p, "max_new_tokens": args.max_new_tokens,
           "batch": args.batch, "repeats": args.repeats, "seed": args.seed,
           "chat_template": not args.no_chat_template, "target_dtype": dtype,
           "multi_turn": args.multi_turn}
  if args.allow_beyond_max_len:  # only when given: earlier runs keep their fingerprints
    fixed["allow_beyond_max_len"] = True
  specbench.validate(fixed)
  specbench.preflight(fixed)  # the models, mesh and context, once before any question
  return [f"sweeps.Sweep.axes = {{'question': {ids!r}}}",
          f"sweeps.Sweep.fixed = {fixed!r}"]


def run(args) -> int:
  from specjax.sweeps import launch
  summary = launch.run("specbench", bindings(args), out=args.out,
                       progress=not args.no_progress)
  if args.json:
    print(json.dumps(summary.to_dict(), indent=2))
  else:
    print(launch_report(summary))
  return 1 if summary.failed else 0


def launch_report(summary) -> str:
  report = (summary.run_dir / "report.md")
  text = report.read_text() if report.is_file() else ""
  return (text + "\n\n" if text else "") + (
      f"{summary.ok} questions finished, {summary.failed} failed, {summary.skipped} already "
      f"done; report: {report}")
