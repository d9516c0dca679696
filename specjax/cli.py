"""The `specjax` command line: one dispatcher, subcommands in `specjax/commands/`.

Subcommand modules are imported lazily so that `specjax theory ...` does not pay for
importing JAX model code it does not use.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand name(s) -> module exposing `add_parser(subparsers)` or `add_parsers(subparsers)`;
# each parser sets `func` (args -> int exit code) via set_defaults.
COMMANDS = {
    "generate": "specjax.commands.generate",
    "theory": "specjax.commands.theory",
    "train": "specjax.commands.train",
    "import-hf, export-hf, inspect": "specjax.commands.checkpoints",
    "run, merge": "specjax.commands.run",
}


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="specjax", description="Exact speculative decoding in JAX.")
  subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
  subparsers.required = True
  for name, module_name in COMMANDS.items():
    try:
      module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:  # a command whose module is not built yet
      if e.name == module_name:
        continue
      raise
    # a module adds one subcommand (add_parser) or a family of them (add_parsers)
    (getattr(module, "add_parsers", None) or module.add_parser)(subparsers)
  return parser


def main(argv: list[str] | None = None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  try:
    return int(args.func(args) or 0)
  except ValueError as e:  # bad input found at the boundary: a clear message, no traceback
    print(f"specjax {args.command}: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
