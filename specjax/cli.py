"""The `specjax` command line: one dispatcher, subcommands in `specjax/commands/`.

Subcommand modules are imported lazily so that `specjax theory ...` does not pay for
importing JAX model code it does not use.

Every parser is a `Parser` (argparse makes subcommand parsers of the parent's class), which
applies three rules to all commands at once:
  - a usage error (an unknown flag, a missing or bad value) is one line
    `specjax: error: argument --flag: ...` and exit status 2, like every expected failure;
  - `type=int` flags take Python ints (`parse_int`: '12', '-3', '1_000', or a whole number
    in e-notation such as '1e6'), refused outside the 64-bit range that JAX and NumPy convert
    without overflow, naming the flag and the text given;
  - a value that starts with '-' and a digit or '.' ('-1,-1,0,0,1', '-0.5,0.2') is a value,
    never an option: `--parents -1,-1,0,0,1` works as `--parents=-1,-1,0,0,1` does.
"""

from __future__ import annotations

import argparse
import decimal
import errno
import importlib
import os
import re
import sys

# subcommand name(s) -> module exposing `add_parser(subparsers)` or `add_parsers(subparsers)`;
# each parser sets `func` (args -> int exit code) via set_defaults.
COMMANDS = {
    "generate": "specjax.commands.generate",
    "check-exact": "specjax.commands.check_exact",
    "theory": "specjax.commands.theory",
    "train": "specjax.commands.train",
    "import-hf, export-hf, inspect": "specjax.commands.checkpoints",
    "import-gguf": "specjax.commands.gguf",
    "run, merge": "specjax.commands.run",
    "bench": "specjax.commands.bench",
    "import-head, export-head": "specjax.commands.heads",
}


INT_BITS = 64  # integer flags: |value| < 2**63 (what int64 / a C long holds)


def parse_int(text: str) -> int:
  """The value of a `type=int` flag as a Python int: an integer ('12', '-3', '1_000') or a
  whole number in decimal or e-notation ('1e6', '2.5e3'), with |value| < 2**63. Anything
  else raises ArgumentTypeError with the text given (argparse prefixes the flag)."""
  try:
    number = decimal.Decimal(text.strip())
  except (decimal.InvalidOperation, ValueError):
    number = None
  if number is None or not number.is_finite():
    raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}")
  limit = 2 ** (INT_BITS - 1)
  if number.adjusted() >= len(str(limit)):  # far too large to convert digit by digit
    raise argparse.ArgumentTypeError(f"must be an integer with |value| < 2**{INT_BITS - 1}, "
                                     f"got {text!r}")
  if number != number.to_integral_value():
    raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}")
  value = int(number)
  if not -limit <= value < limit:
    raise argparse.ArgumentTypeError(f"must be an integer with |value| < 2**{INT_BITS - 1}, "
                                     f"got {text!r}")
  return value


# A value, not an option, when it starts like a negative number: '-1', '-.5', '-1,-1,0'
# (argparse itself accepts only '-1' and '-1.5', and takes '-1,-1,0' for an unknown option).
_NEGATIVE_NUMBER_LIKE = re.compile(r"^-\.?\d")


class Parser(argparse.ArgumentParser):
  """argparse with the CLI's rules (module doc): one-line usage errors, checked ints,
  values that start like negative numbers."""

  def __init__(self, *args, **kwargs) -> None:
    super().__init__(*args, **kwargs)
    self.register("type", int, parse_int)  # type=int resolves to parse_int
    self._negative_number_matcher = _NEGATIVE_NUMBER_LIKE  # argparse's own test, widened

  def error(self, message: str):
    """A usage error: one line on stderr, exit status 2 (SystemExit, as argparse's)."""
    self.exit(2, f"specjax: error: {' '.join(message.split())} "
                 f"(see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
  parser = Parser(prog="specjax", description="Exact speculative decoding in JAX.")
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


# What to do about an OSError, by errno (the message names the path; this says the fix).
_OS_HINTS = {
    errno.ENOENT: "check the path",
    errno.EACCES: "choose a path you may read or write, or fix its permissions",
    errno.EPERM: "choose a path you may read or write, or fix its permissions",
    errno.EROFS: "the file system is read-only: choose a writable location",
    errno.ENOSPC: "the disk is full: free space or choose another location",
    errno.EDQUOT: "the disk quota is exhausted: free space or choose another location",
    errno.EISDIR: "it is a directory: give a file path",
    errno.ENOTDIR: "a parent of it is a file, not a directory: fix the path",
    errno.EEXIST: "it already exists: remove it or choose another path",
}


def error_message(e: BaseException) -> str:
  """One line for an expected failure: the message, or for an OSError the path, the reason
  and what to do."""
  if isinstance(e, KeyboardInterrupt):
    return "interrupted before the command finished: run it again to complete it"
  if isinstance(e, OSError):
    reason = e.strerror or str(e) or type(e).__name__
    if reason[:1].isupper() and reason[1:2].islower():  # "No such file" -> "no such file"
      reason = reason[0].lower() + reason[1:]
    where = ": ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    text = f"{where}: {reason}" if where else reason
    hint = _OS_HINTS.get(e.errno)
    if hint and hint not in text:
      text += f" ({hint})"
  else:
    text = str(e) or type(e).__name__
  return " ".join(text.split())  # one line


# Expected failures: bad values (ValueError, UnicodeError included) and paths that cannot be
# read or written (OSError: missing, permission, read-only, disk full, a directory where a
# file belongs ...). Anything else is a bug and keeps its traceback.
EXPECTED = (ValueError, OSError, KeyboardInterrupt)


def main(argv: list[str] | None = None) -> int:
  """Runs one subcommand. Expected failures print one line, `specjax: error: ...`, on
  stderr and return 2; a bug raises (traceback).

  As the program (`argv` None), an interrupt (Ctrl-C) leaves through `os._exit(2)` once the
  streams are flushed: the interpreter's own shutdown, with JAX's runtime threads stopped
  mid-work, can crash (SIGSEGV) after the command has already reported and saved its data."""
  try:
    parser = build_parser()
    args = parser.parse_args(argv)
    from specjax.commands.models import mesh_context  # --mesh, for the commands that have it
    with mesh_context(args):
      return int(args.func(args) or 0)
  except EXPECTED as e:
    print(f"specjax: error: {error_message(e)}", file=sys.stderr)
    if isinstance(e, KeyboardInterrupt) and argv is None:
      _leave(2)
    return 2


def _leave(code: int) -> None:
  """Exit now with `code`, after flushing stdout and stderr, skipping the interpreter's
  finalisation."""
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except Exception:  # a closed pipe: nothing more can be said
      pass
  os._exit(code)


if __name__ == "__main__":
  sys.exit(main())
