"""What a gin config binds: a `Sweep` of one study's point function over axes.

Configs (configs/*.gin) use gin's dynamic registration, so neither this module nor the
experiment modules need gin decorators (gin itself is imported by `launch.py` only):

    from __gin__ import dynamic_registration
    import specjax.sweeps as sweeps
    import experiments.exactness as exactness

    sweeps.Sweep:
      name = "exactness"
      point_fn = @exactness.point
      axes = {"temperature": [0.0, 1.0], "vocab": [8, 16]}
      fixed = {"samples": 100000}

Every key of `axes` and `fixed` must be a parameter of `point_fn`; `validate_fn` checks types
and ranges and `memory_fn` estimates bytes per point, both before any work starts.
`vectorized` names runtime-valued axes: points that differ only there share static shapes
and run as one group through `group_fn` (vectorised, spread over the local devices).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from typing import Any, Callable, Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Sweep:
  name: str
  point_fn: Callable[..., dict]
  axes: Mapping[str, Sequence] = dataclasses.field(default_factory=dict)
  fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  vectorized: Sequence[str] = ()
  group_fn: Callable[[list[dict]], list[dict]] | None = None
  validate_fn: Callable[[dict], None] | None = None
  memory_fn: Callable[[dict], int] | None = None
  report_fn: Callable[..., str] | None = None
  summary_columns: Sequence[str] = ()  # metrics `specjax run` prints when the sweep ends
  seed: int = 0

  def parameters(self) -> list[str]:
    return [n for n, p in inspect.signature(self.point_fn).parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

  def check(self) -> None:
    """Names and shape of the sweep: unknown or missing parameters, bad vectorized axes."""
    if not isinstance(self.name, str) or not self.name.isidentifier():
      raise ValueError(f"Sweep.name must be an identifier-like string, got {self.name!r}")
    allowed = self.parameters()
    for where, names in (("axes", self.axes), ("fixed", self.fixed)):
      for name in names:
        if name not in allowed:
          close = difflib.get_close_matches(name, allowed, n=3)
          hint = f"; did you mean {', '.join(close)}?" if close else ""
          raise ValueError(f"Sweep.{where} has unknown parameter {name!r} for "
                           f"{_qualname(self.point_fn)}{hint} (valid: {', '.join(allowed)})")
    required = [n for n, p in inspect.signature(self.point_fn).parameters.items()
                if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    missing = [n for n in required if n not in self.axes and n not in self.fixed]
    if missing:
      raise ValueError(f"Sweep {self.name!r}: {_qualname(self.point_fn)} needs {missing} in "
                       f"axes or fixed")
    for name in self.vectorized:
      if name not in self.axes:
        raise ValueError(f"Sweep.vectorized names {name!r}, which is not a sweep axis "
                         f"(axes: {list(self.axes)})")
    if self.vectorized and self.group_fn is None:
      raise ValueError("Sweep.vectorized needs a group_fn to run the grouped points")

  def group_key(self, params: dict) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in params.items() if k not in self.vectorized))

  def run_group(self, params_list: list[dict]) -> list[dict]:
    if self.group_fn is not None and len(params_list) > 1:
      return self.group_fn(params_list)
    return [self.point_fn(**p) for p in params_list]


def _qualname(fn) -> str:
  mod = getattr(fn, "__module__", "")
  return f"{mod}.{getattr(fn, '__qualname__', repr(fn))}".lstrip(".")
