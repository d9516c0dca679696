"""What a gin config binds: a `Sweep` of one study's point function over axes.

Configs (configs/*.gin) use gin's dynamic registration, so neither this module nor the
experiment modules need gin decorators (gin itself is imported by `launch.py` only):

    from __gin__ import dynamic_registration
    import specjax.sweeps as sweeps
    import specjax.experiments.exactness as exactness

    sweeps.Sweep:
      name = "exactness"
      point_fn = @exactness.point
      axes = {"temperature": [0.0, 1.0], "vocab": [8, 16]}
      fixed = {"samples": 100000}

Every key of `axes` and `fixed` must be a parameter of `point_fn`; `validate_fn` checks types
and ranges and `memory_fn` estimates bytes per point, both before any work starts.
`axes_fn(fixed)` gives the axes a config may leave out, from the fixed values (specbench:
every question id of its prompt set); an axis the config or the command line gives wins.
`vectorized` names runtime-valued axes: points that differ only there share static shapes
and run as one group through `group_fn` (vectorised, spread over the local devices).

Randomness: a point's result must be a function of its parameters only, never of its place
in a group, shard or run. Point and group functions derive each point's keys from its own
complete parameters (`runner.point_seed(runner.with_defaults(point_fn, params))`), so
a point gives the same numbers alone, in a group, resumed, sharded, on 1 or N devices.
`seed` (the sweep seed), when set, becomes every point's `seed` parameter (for point
functions that take one and whose `seed` is not already an axis or fixed); it is recorded in
environment.json either way.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
from typing import Any, Callable, Mapping, Sequence

# The most points one sweep may have (the cartesian product of its axes, all shards
# together: every shard expands the whole product). The runner keeps each point's parameters,
# id and result record in memory, ~0.5 KB a point (10^7 points took 5 GB before printing
# anything), so 10^6 points hold ~0.5 GB: more than any study runs, and what a small host holds.
MAX_POINTS = 1_000_000


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
  axes_fn: Callable[[dict], Mapping[str, Sequence]] | None = None
  summary_columns: Sequence[str] = ()  # metrics `specjax run` prints when the sweep ends
  seed: int | None = None

  def parameters(self) -> list[str]:
    return [n for n, p in inspect.signature(self.point_fn).parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

  def check(self) -> None:
    """Names and shape of the sweep: field types, the number of points (at most
    `MAX_POINTS`, checked before any point is built), unknown or missing parameters, bad
    vectorized axes."""
    if not isinstance(self.name, str) or not self.name.isidentifier():
      raise ValueError(f"Sweep.name must be an identifier-like string, got {self.name!r}")
    self._check_types()
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
    if self.seed is not None and "seed" in allowed and ("seed" in self.axes
                                                        or "seed" in self.fixed):
      raise ValueError(f"Sweep.seed = {self.seed!r} and a 'seed' in Sweep.axes or Sweep.fixed "
                       f"both set the points' seed: keep one")

  def _check_types(self) -> None:
    """Every field has the type the runner needs (a config binding can put anything there)."""
    def bad(field: str, value, allowed: str):
      return ValueError(f"Sweep.{field} must be {allowed}, got {value!r} "
                        f"({type(value).__name__})")
    if not callable(self.point_fn):
      raise bad("point_fn", self.point_fn, "a function (e.g. @module.point)")
    for field in ("group_fn", "validate_fn", "memory_fn", "report_fn", "axes_fn"):
      value = getattr(self, field)
      if value is not None and not callable(value):
        raise bad(field, value, "a function or None")
    if not isinstance(self.axes, Mapping):
      raise bad("axes", self.axes, 'a dict of parameter name -> list of values, e.g. '
                '{"x": [1, 2, 3]}')
    for name, values in self.axes.items():
      if not isinstance(name, str):
        raise bad("axes", self.axes, "a dict keyed by parameter names (strings)")
      if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Sequence):
        raise ValueError(f"Sweep.axes[{name!r}] must be a non-empty list of values, got "
                         f"{values!r} ({type(values).__name__})")
      if len(values) == 0:
        raise ValueError(f"Sweep.axes[{name!r}] is empty: give at least one value")
    points = math.prod(len(v) for v in self.axes.values())  # exact: Python ints
    if points > MAX_POINTS:
      sizes = " × ".join(f"{name} {len(v):,}" for name, v in self.axes.items())
      raise ValueError(f"Sweep.axes make {points:,} points ({sizes}), more than the "
                       f"{MAX_POINTS:,} a sweep may have (each point's parameters and result "
                       f"are kept in memory): split the sweep or use fewer values per axis")
    if not isinstance(self.fixed, Mapping) or not all(isinstance(k, str) for k in self.fixed):
      raise bad("fixed", self.fixed, 'a dict of parameter name -> value, e.g. {"samples": 1000}')
    for field in ("vectorized", "summary_columns"):
      value = getattr(self, field)
      if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not all(
          isinstance(v, str) for v in value):
        raise bad(field, value, "a list of names (strings)")
    if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                  or not 0 <= self.seed < 2**31):
      raise bad("seed", self.seed, "None or an int in [0, 2**31)")

  def with_default_axes(self) -> "Sweep":
    """The sweep with the axes `axes_fn` fills in, where neither `axes` nor `fixed` name
    them (itself without an `axes_fn`)."""
    if self.axes_fn is None or not callable(self.axes_fn) or not isinstance(
        self.fixed, Mapping) or not isinstance(self.axes, Mapping):
      return self  # `check` names a bad field
    filled = {name: values for name, values in self.axes_fn(self.fixed_params()).items()
              if name not in self.axes and name not in self.fixed}
    return dataclasses.replace(self, axes={**filled, **self.axes}) if filled else self

  def fixed_params(self) -> dict:
    """`fixed`, plus `seed = Sweep.seed` when set and the point function takes a seed."""
    fixed = dict(self.fixed)
    if self.seed is not None and "seed" in self.parameters() and "seed" not in self.axes:
      fixed.setdefault("seed", self.seed)
    return fixed

  def group_key(self, params: dict) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in params.items() if k not in self.vectorized))

  def run_group(self, params_list: list[dict]) -> list[dict]:
    if self.group_fn is not None and len(params_list) > 1:
      return self.group_fn(params_list)
    return [self.point_fn(**p) for p in params_list]


def _qualname(fn) -> str:
  mod = getattr(fn, "__module__", "")
  return f"{mod}.{getattr(fn, '__qualname__', repr(fn))}".lstrip(".")
