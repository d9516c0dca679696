"""Command-line changes to a sweep's axes and fixed values, merged into the config's.

A config's `Sweep.axes` and `Sweep.fixed` are the defaults; the command line changes them
key by key, in the order given, never wholesale:

  - `--set KEY=VALUE` fixes one parameter: it replaces that key of `fixed` (the others are
    kept) and, when KEY was a sweep axis, that axis;
  - `--axis KEY=V1,V2,...` sweeps one parameter: it adds or replaces that axis and removes
    KEY from `fixed`;
  - a `--gin_param 'sweeps.Sweep.fixed = {...}'` binding is `--set` for each of its keys;
    a `--gin_param 'sweeps.Sweep.axes = {...}'` binding replaces the axes and removes every
    key it names from `fixed`.

Values are Python literals (`0.05`, `None`, `(2, 1)`, `'text'`); anything else is a string
(`--set draft=eagle:default`). This module is plain Python: `launch.py` reads and rebinds the
gin values it merges.
"""

from __future__ import annotations

import ast
import dataclasses
from typing import Any, Mapping

# A value that opens like a literal but does not parse is a typo, not a string.
_LITERAL_OPENERS = tuple("[({'\"")


@dataclasses.dataclass(frozen=True)
class Override:
  """One `--set` (kind "set": value is the fixed value) or `--axis` (kind "axis": value is
  the list of the axis's values)."""
  kind: str
  key: str
  value: Any

  def apply(self, axes: Mapping, fixed: Mapping) -> tuple[dict, dict]:
    """The axes and fixed values with this change made (the inputs are not modified)."""
    axes, fixed = dict(axes), dict(fixed)
    if self.kind == "set":
      axes.pop(self.key, None)
      fixed[self.key] = self.value
    else:
      fixed.pop(self.key, None)
      axes[self.key] = list(self.value)
    return axes, fixed


def parse_value(text: str, given: str) -> Any:
  """A Python literal, or the text itself when it is not one (a bare word such as `eagle`);
  text that opens a literal (a bracket or quote) and does not parse raises ValueError."""
  text = text.strip()
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
    if text.startswith(_LITERAL_OPENERS):
      raise ValueError(f"{text!r} in {given!r} is not a Python literal (an unclosed "
                       f"bracket or quote?)") from None
    return text


def _split(text: str, example: str) -> tuple[str, str]:
  """KEY and VALUE of `KEY=VALUE`; KEY must be a parameter name (`example` shows one)."""
  key, eq, value = text.partition("=")
  key = key.strip()
  if not eq or not key.isidentifier():
    raise ValueError(f"expected KEY=VALUE with KEY a parameter name, got {text!r} (e.g. "
                     f"{example})")
  if not value.strip():
    raise ValueError(f"no value after '=' in {text!r} (e.g. {example})")
  return key, value


def parse_set(text: str) -> Override:
  """`--set KEY=VALUE`: VALUE a Python literal or a bare string."""
  key, value = _split(text, "max_new_tokens=32")
  return Override("set", key, parse_value(value, text))


def parse_axis(text: str) -> Override:
  """`--axis KEY=V1,V2,...`: a literal list or tuple gives the values (`1,8`, `[1, 8]`,
  `(2,1),(1,1)`), one other literal is a one-value axis, and text that is not a literal is
  split at commas, each part a literal or a bare string (`eagle,model`)."""
  key, value = _split(text, "batch=1,8")
  try:
    parsed = ast.literal_eval(value.strip())
  except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
    parts = value.split(",")
    if not all(p.strip() for p in parts):
      raise ValueError(f"an empty value between commas in {text!r}") from None
    return Override("axis", key, [parse_value(p, text) for p in parts])
  values = list(parsed) if isinstance(parsed, (list, tuple)) else [parsed]
  if not values:
    raise ValueError(f"no values in {text!r}: give at least one")
  return Override("axis", key, values)


def merge_binding(before: tuple[Any, Any], after: tuple[Any, Any]) -> tuple[Any, Any]:
  """(axes, fixed) after one command-line gin binding, merged: a new `fixed` dict updates
  the one before (and removes its keys from the axes), new `axes` replace the ones before
  (and remove their keys from `fixed`). Values that are not dicts (a config error that
  `Sweep.check` reports) are left as bound."""
  (axes0, fixed0), (axes1, fixed1) = before, after
  if not all(isinstance(v, Mapping) for v in (axes0, fixed0, axes1, fixed1)):
    return axes1, fixed1
  axes, fixed = dict(axes0), dict(fixed0)
  if axes1 is not axes0:
    axes = dict(axes1)
    fixed = {k: v for k, v in fixed.items() if k not in axes1}
  if fixed1 is not fixed0:
    fixed.update(fixed1)
    if axes1 is axes0:  # both in one binding: a key in both stays a contradiction
      axes = {k: v for k, v in axes.items() if k not in fixed1}
  return axes, fixed
