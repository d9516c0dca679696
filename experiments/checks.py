"""The parameter checks of every study's `validate`: one-line errors naming the parameter,
the value and what is allowed."""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np


def _range(lo, hi, lo_open: bool = False, hi_open: bool = False) -> str:
  if hi is None:
    return f"{'>' if lo_open else '>='} {lo}"
  return f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


def check_int(params: Mapping, name: str, default, lo: int, hi: int | None = None) -> int:
  """params[name] (or `default`) as an int in [lo, hi] (hi None: no upper bound)."""
  v = params.get(name, default)
  if (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo
      or (hi is not None and v > hi)):
    raise ValueError(f"{name} must be an int {_range(lo, hi)}, got {v!r}")
  return int(v)


def check_number(params: Mapping, name: str, default, lo: float | None = None,
                 hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False,
                 allow_none: bool = False, note: str = "") -> float | None:
  """params[name] (or `default`) as a finite number in the stated interval (None allowed
  only with allow_none; `note` says what the value means, in the message)."""
  v = params.get(name, default)
  if v is None and allow_none:
    return None
  ok = not isinstance(v, bool) and isinstance(v, (int, float, np.floating, np.integer))
  ok = ok and math.isfinite(v)
  if ok and lo is not None:
    ok = v > lo if lo_open else v >= lo
  if ok and hi is not None:
    ok = v < hi if hi_open else v <= hi
  if not ok:
    bound = "" if lo is None else " " + _range(lo, hi, lo_open, hi_open)
    raise ValueError(f"{name} must be {'None or ' if allow_none else ''}a finite number"
                     f"{bound}{note}, got {v!r}")
  return float(v)


def check_choice(params: Mapping, name: str, default, choices: Sequence):
  v = params.get(name, default)
  if v not in choices:
    raise ValueError(f"{name} must be one of {tuple(choices)}, got {v!r}")
  return v
