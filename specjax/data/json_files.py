"""The one reader of JSON a user hands specjax (config.json of a head or a model,
tokenizer files, a shard index, prompt lines) and the one checker of its fields.

    doc = read_object(path)                    # a dict, or ValueError naming the file
    heads = field(doc, "medusa_num_heads", "positive int", where=path, default=None)

Every failure is a ValueError of one line naming the file (and the field): damaged text,
nesting too deep for Python's parser (RecursionError), an integer past Python's digit limit,
a field of the wrong type (a bool is never an int, a list never a number).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from typing import Any, Mapping

_MISSING = object()


def loads(text: str | bytes, where: str) -> Any:
  """json.loads, its every failure one ValueError naming `where`."""
  try:
    return json.loads(text)
  except RecursionError:
    raise ValueError(f"cannot read {where}: its JSON is nested too deeply") from None
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"cannot read {where}: {' '.join(str(e).split())}") from None
  except ValueError as e:  # an integer literal past Python's digit limit
    raise ValueError(f"cannot read {where}: {' '.join(str(e).split())[:120]}") from None


def read_object(path: str | os.PathLike) -> dict:
  """The JSON object in a file (ValueError naming the file otherwise)."""
  path = pathlib.Path(path)
  try:
    text = path.read_bytes()
  except OSError as e:
    raise ValueError(f"cannot read {str(path)!r}: {e.strerror or e}") from None
  data = loads(text, repr(str(path)))
  if not isinstance(data, dict):
    raise ValueError(f"{str(path)!r} must hold a JSON object, got {type(data).__name__}")
  return data


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


_KINDS = {
    "int": (_is_int, "an integer"),
    "positive int": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "number": (lambda v: (_is_int(v) or isinstance(v, float)) and math.isfinite(v),
               "a finite number"),
    "positive number": (lambda v: (_is_int(v) or isinstance(v, float)) and math.isfinite(v)
                        and v > 0, "a finite number > 0"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "object": (lambda v: isinstance(v, dict), "a JSON object"),
    "list": (lambda v: isinstance(v, list), "a JSON list"),
}


def field(doc: Mapping, name: str, kind: str, *, where: str, default: Any = _MISSING,
          null_ok: bool = False) -> Any:
  """`doc[name]` checked to be of `kind` (a key of `_KINDS`); absent: `default` (ValueError
  when there is none). `null_ok`: a JSON null reads as `default` too."""
  if name not in doc or (null_ok and doc[name] is None):
    if default is _MISSING:
      raise ValueError(f"{where}: field {name!r} is missing")
    return default
  value = doc[name]
  test, what = _KINDS[kind]
  if not test(value):
    raise ValueError(f"{where}: field {name!r} must be {what}, got {value!r}"[:300])
  return value
