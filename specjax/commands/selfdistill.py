"""`specjax train selfdistill-data`: a target answers the instruction recipe's prompts into
token shards (`specjax.training.selfdistill`), the data of `--corpus selfdistill:DIR`.

  specjax train selfdistill-data --target REF --out DIR --prompts 4096 --max-new-tokens 256 \\
      --batch 16 --seed 0 [--sample-fraction 0.5] [--exclude QUESTIONS.jsonl]

Rerunning the same command continues where it stopped (or extends the data to a larger
--prompts); a directory made with another recipe or target is refused. Hours on a CPU: run
it in the background (never in CI).
"""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
  p = sub.add_parser("selfdistill-data",
                     help="the target's own answers to instruction prompts, as token shards "
                          "(training data: --corpus selfdistill:DIR)",
                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--target", required=True,
                 help="the target: any target reference (a Hugging Face or specjax model "
                      "directory, 'default', random:SPEC)")
  p.add_argument("--out", required=True, help="data directory (continued if it exists)")
  p.add_argument("--prompts", type=int, required=True,
                 help="prompts to answer (a multiple of --batch)")
  p.add_argument("--max-new-tokens", type=int, default=256, help="answer length cap")
  p.add_argument("--batch", type=int, default=16, help="prompts answered per generate call")
  p.add_argument("--seed", type=int, default=0, help="the recipe's seed")
  p.add_argument("--sample-fraction", type=float, default=0.5,
                 help="fraction of batches answered at T = 1 (the rest greedily)")
  p.add_argument("--code-fraction", type=float, default=0.5,
                 help="fraction of prompts about code (the rest about prose)")
  p.add_argument("--max-chars", type=int, default=1500,
                 help="a passage's length cap in characters")
  p.add_argument("--exclude", action="append", default=[], metavar="FILE",
                 help="an evaluation question file: prompts sharing an 8-gram of words with "
                      "it are skipped (repeatable)")
  p.set_defaults(func=run)


def run(args) -> int:
  from specjax.data.instructions import Recipe
  from specjax.resolve import load_target
  from specjax.training.selfdistill import make_data
  flags = {"seed": "--seed", "sample_fraction": "--sample-fraction",
           "code_fraction": "--code-fraction", "max_chars": "--max-chars"}
  try:
    recipe = Recipe(seed=args.seed, sample_fraction=args.sample_fraction,
                    code_fraction=args.code_fraction, max_chars=args.max_chars)
  except ValueError as e:
    message = str(e)
    for field, flag in flags.items():
      message = message.replace(field, flag, 1) if message.startswith(field) else message
    raise ValueError(message) from None
  try:
    manifest = make_data(args.target, args.out, prompts=args.prompts,
                         max_new_tokens=args.max_new_tokens, batch=args.batch, recipe=recipe,
                         exclude=args.exclude,
                         loaded=lambda: load_target(args.target, flag="--target"))
  except ValueError as e:
    message = str(e)
    for name in ("prompts", "max_new_tokens", "batch", "out", "exclude", "target"):
      if message.startswith(name + " "):
        message = "--" + name.replace("_", "-") + message[len(name):]
    raise ValueError(message) from None
  t = manifest["totals"]
  print(f"{args.out}: {t['rows']} rows, {t['answer_tokens']:,} answer tokens "
        f"({t['eos_rows']} ended at EOS), {t['seconds']:.0f} s of generation, "
        f"{t['answer_tokens_per_s']:.1f} tokens/s" + ("" if manifest["complete"] else
                                                       " (incomplete: rerun to continue)"),
        file=sys.stdout)
  return 0
