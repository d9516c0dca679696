"""`specjax check-exact`: is speculative decoding with this draft exactly the target's law?

Runs `specjax.exactness.checker.check`: the real compiled loop on many independent rows, the χ²
test of the first m tokens against the target's enumerated law (greedy identity at T = 0),
its power, and planted-bug controls. Exit code 0 on PASS, 1 on FAIL; bad input is one line
on stderr (exit 2, the CLI's policy).
"""

from __future__ import annotations

import argparse
import json
import os

from specjax.commands.models import (add_config_flags, default_models, draft_from_flags,
                                     target_from_flags)

DRAFT_WORDS = ("default", "self", "oracle")


def add_parser(subparsers) -> None:
  p = subparsers.add_parser(
      "check-exact", help="check that a draft leaves the target's output law unchanged",
      description="Runs the compiled speculative loop on many independent rows of one prompt "
      "and tests the joint law of the first --tokens emitted tokens against the target's own "
      "law, enumerated exactly (a χ² test at --false-alarm, with its power against any "
      "deviation of total variation >= --deviation), alongside planted acceptance bugs that "
      "the same test must reject. At --temperature 0 it checks token-for-token identity with "
      "plain greedy decoding instead. Exit code 0: PASS, 1: FAIL.")
  p.add_argument("--target", default=None, metavar="default|DIR",
                 help="'default' (the embedded trained target; trained on first use), a "
                 "Hugging Face model directory, a GGUF file or a specjax checkpoint directory "
                 "(default: a random model from --target-config)")
  p.add_argument("--draft", default=None, metavar="default|self|oracle|lookup|KIND:ARG|DIR",
                 help="'default' (the embedded distilled draft), 'self' (the target drafts "
                 "for itself), 'oracle' (the controlled-α drafter, --alpha), 'lookup' (prompt "
                 "lookup), 'layer-skip:M', draft heads 'eagle:DIR' / 'eagle3:DIR' / "
                 "'medusa:DIR' (trained or imported for --target; eagle3:NAME a head shipped "
                 "for a real target), or a checkpoint directory (default: a random "
                 "model from --draft-config)")
  add_config_flags(p, "as --target-config (default: %(default)s)")
  p.add_argument("--alpha", type=float, default=0.5,
                 help="acceptance rate of --draft oracle (default %(default)s)")
  p.add_argument("--deterministic-draft", action="store_true",
                 help="propose the draft's top candidates (point masses) instead of sampling")
  shape = p.add_mutually_exclusive_group()
  shape.add_argument("--k", type=int, default=None, help="a chain of K drafts (default 2)")
  shape.add_argument("--tree", default=None, metavar="W1,W2,..|dynamic:N,D,W",
                     help="a static tree (W_d children per node at depth d, e.g. 2,1) or a "
                     "dynamic tree of N nodes, depth D, width W")
  p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy identity check")
  p.add_argument("--top-k", type=int, default=8,
                 help="top-k of the warp (default %(default)s; keeps the law of --tokens "
                 "tokens enumerable: at most top_k^tokens <= --max-cells outcomes; 0 = off)")
  p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
  p.add_argument("--tokens", type=int, default=None,
                 help="emitted tokens compared, m (default 3; at T = 0 up to 32)")
  p.add_argument("--samples", type=int, default=20_000, help="independent rows (T > 0)")
  p.add_argument("--false-alarm", type=float, default=1e-3,
                 help="probability that an exact drafter fails (default %(default)g)")
  p.add_argument("--deviation", type=float, default=0.05,
                 help="total variation at which the power is stated (default %(default)g)")
  p.add_argument("--controls", default=None, metavar="BUG,..",
                 help="planted bugs to run (default: all that are visible; for --draft oracle "
                 "only always_accept, since its residual is the target's law itself)")
  p.add_argument("--max-cells", type=int, default=None,
                 help="largest enumerated law accepted (default 4096 outcomes)")
  p.add_argument("--prompt", default=None, help="prompt text (default: 4 random token ids)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--json", action="store_true", help="print the report as one JSON document")
  p.add_argument("--out", default=None, metavar="FILE", help="also write the JSON report here")
  p.set_defaults(func=run)


def parse_tree(text: str):
  """--tree: 'W1,W2,..' (trees.branching) or 'dynamic:N,D,W' (trees.DynamicTree)."""
  from specjax.verify import trees
  body = text.split(":", 1)[1] if text.startswith("dynamic:") else text
  try:
    numbers = [int(x) for x in body.split(",")]
  except ValueError:
    numbers = None
  try:
    if numbers is not None and text.startswith("dynamic:") and len(numbers) == 3:
      return trees.DynamicTree(*numbers)
    if numbers is not None and not text.startswith("dynamic:"):
      return trees.branching(numbers)
  except ValueError as e:
    raise ValueError(f"--tree {text!r}: {e}") from None
  raise ValueError(f"--tree must be children per depth 'W1,W2,..' (e.g. 2,1) or "
                   f"'dynamic:N,D,W' (nodes, depth, width), got {text!r}")


def _check_args(args) -> None:
  """Flags that need no model, checked before any model is loaded or built."""
  from specjax.exactness import planted_bugs
  from specjax.verify import sampling
  from specjax.drafters.oracle import check_alpha
  sampling.make_sampler(args.temperature, args.top_k, args.top_p)
  for flag, value, lo in (("--k", args.k, 1), ("--tokens", args.tokens, 1),
                          ("--samples", args.samples, 100), ("--max-cells", args.max_cells, 2),
                          ("--seed", args.seed, 0)):
    if value is not None and value < lo:
      raise ValueError(f"{flag} must be an int >= {lo}, got {value}")
  for flag, value in (("--false-alarm", args.false_alarm), ("--deviation", args.deviation)):
    if not 0.0 < value < 1.0:  # NaN included
      raise ValueError(f"{flag} must be in (0, 1), got {value}")
  if args.tree is not None:
    parse_tree(args.tree)
  try:
    check_alpha(args.alpha)
  except ValueError as e:
    raise ValueError(f"--alpha: {e}") from None
  for name in _controls(args) or []:
    if name not in planted_bugs.PLANTED_BUGS:
      raise ValueError(f"--controls: unknown planted bug {name!r}; known: "
                       f"{', '.join(planted_bugs.PLANTED_BUGS)}")
  if args.out is not None:
    parent = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(parent):
      raise ValueError(f"--out {args.out}: the directory {parent} does not exist")
    if os.path.isdir(args.out):
      raise ValueError(f"--out {args.out} is a directory: give a file path")


def _controls(args) -> list[str] | None:
  if args.controls is not None:
    return [c.strip() for c in args.controls.split(",") if c.strip()]
  if args.draft == "oracle" and args.temperature > 0:
    return ["always_accept"]
  return None


def _models(args):
  """(target, drafter, tokenizer or None) as the flags ask."""
  from specjax.drafters.model import ModelDrafter
  from specjax.drafters.oracle import OracleDrafter

  pair = default_models(args.target, args.draft)
  target, tok = target_from_flags(args, pair)
  if args.draft == "oracle":
    return target, OracleDrafter.of(target, args.alpha), tok
  from specjax import resolve
  if args.draft is not None and resolve.draft_kind(args.draft, "--draft")[0] not in (
      "model", "self", "default", "random"):  # lookup, layer-skip:M, draft heads
    drafter, _ = resolve.make_drafter(args.draft, target, k=args.k or 2,
                                      deterministic=args.deterministic_draft, flag="--draft")
    return target, drafter, tok
  draft = draft_from_flags(args.draft, args, target, pair, tokenizer=tok)
  return target, ModelDrafter.of(draft, deterministic=args.deterministic_draft), tok


def run(args: argparse.Namespace) -> int:
  from specjax.exactness import checker as exactness
  from specjax.verify import sampling

  _check_args(args)
  sampler = sampling.make_sampler(args.temperature, args.top_k, args.top_p)
  tree = parse_tree(args.tree) if args.tree is not None else None
  k = None if tree is not None else (args.k if args.k is not None else 2)
  target, drafter, tok = _models(args)
  if args.prompt is not None and tok is None:
    raise ValueError("--prompt needs a tokenizer, and the --target checkpoint has none: "
                     "leave --prompt out (random token ids)")
  prompt = tok.encode(args.prompt, bos=True) if args.prompt is not None else None
  extra = {} if args.max_cells is None else {"max_cells": args.max_cells}
  report = exactness.check(target, drafter, k=k, tree=tree, sampler=sampler,
                           tokens=args.tokens, samples=args.samples,
                           false_alarm=args.false_alarm, deviation=args.deviation,
                           seed=args.seed, prompt=prompt, controls=_controls(args), **extra)
  doc = report.to_dict()
  if args.out is not None:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(doc, f, indent=2, allow_nan=False)
      f.write("\n")
  if args.json:
    print(json.dumps(doc, indent=2, allow_nan=False))
  else:
    print("\n".join(report.lines()))
  return 0 if report.passed else 1
