"""`specjax run`: gin config -> Sweep -> validated points -> run directory -> report.

This is the gin entry point: the only library module that imports gin. Everything below it
(`Sweep`, the runner, the engine) is plain Python called with plain values.

Everything that can be checked is checked before any work starts: the config parses, every
binding names a real configurable and parameter (with the closest valid names suggested),
every point's parameters have valid types and ranges, each point fits in memory, and the
output directory is writable and not another run's.

Configs named on the command line without a path are looked up among the shipped configs
(`CONFIG_DIR`: the checkout's `configs/`, installed as `specjax/configs/`).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import json
import pathlib
import re
import sys
import tokenize
import types
from typing import Mapping, Sequence

import gin

from specjax import sharding
from specjax.sweeps import inputs, overrides, report, run_directory, runner
from specjax.sweeps.sweep import Sweep
from specjax.models import cache as kv

def _config_dir() -> pathlib.Path:
  """The shipped configs: specjax/configs/ in an installed wheel (setup.py's package data),
  else the checkout's top-level configs/ (an editable install, or a run from the checkout)."""
  package = pathlib.Path(__file__).resolve().parents[1]
  packaged = package / "configs"
  return packaged if packaged.is_dir() else package.parent / "configs"


CONFIG_DIR = _config_dir()


def available_configs() -> list[str]:
  return sorted(p.stem for p in CONFIG_DIR.glob("*.gin")) if CONFIG_DIR.is_dir() else []


def resolve_config(config: str) -> pathlib.Path:
  path = pathlib.Path(config)
  if path.is_file():
    return path
  named = CONFIG_DIR / f"{config.removesuffix('.gin')}.gin"
  if named.is_file():
    return named
  names = available_configs()
  close = difflib.get_close_matches(path.stem, names, n=3)
  hint = f" (did you mean {', '.join(close)}?)" if close else ""
  raise ValueError(f"unknown experiment config {config!r}{hint}; available: "
                   f"{', '.join(names) or 'none'} (or a path to a .gin file)")


def _imports(text: str) -> dict[str, str]:
  """alias -> module for the `import a.b as c` lines of a gin config."""
  out = {}
  for m in re.finditer(r"^\s*import\s+([\w.]+)(?:\s+as\s+(\w+))?\s*$", text, re.M):
    out[m.group(2) or m.group(1)] = m.group(1)
  return out


def _explain_gin_error(err: Exception, texts: list[str]) -> str:
  """Adds the closest valid names to gin's message about an unknown binding."""
  msg = str(err)
  aliases = {}
  for t in texts:
    aliases.update(_imports(t))
  m = re.search(r"No configurable matching '([\w.]+)'|Couldn't resolve selector ([\w.]+)", msg)
  if m:
    candidates = []
    for alias, module_name in aliases.items():
      try:
        module = importlib.import_module(module_name)
      except ImportError:
        continue
      exported = set(getattr(module, "__all__", ()))  # a package's re-exports count too
      candidates += [f"{alias}.{n}" for n, v in vars(module).items()
                     if not n.startswith("_") and callable(v)
                     and (n in exported or getattr(v, "__module__", None) == module.__name__)]
    close = difflib.get_close_matches(m.group(1) or m.group(2), candidates, n=3, cutoff=0.5)
    if close:
      msg += f"\nclosest valid names: {', '.join(close)}"
    return msg
  m = re.search(r"Configurable '([\w.]+)' doesn't have a parameter named '(\w+)'", msg)
  if m:
    alias, _, attr = m.group(1).rpartition(".")
    try:
      target = getattr(importlib.import_module(aliases.get(alias, alias)), attr)
      params = [f.name for f in dataclasses.fields(target)] if dataclasses.is_dataclass(
          target) else list(inspect.signature(target).parameters)
      close = difflib.get_close_matches(m.group(2), params, n=3)
      msg += (f"\nclosest valid names: {', '.join(close)}" if close else "") + (
          f"\nvalid parameters of {m.group(1)}: {', '.join(params)}")
    except (ImportError, AttributeError, ValueError, TypeError):
      pass
  return msg


# What gin raises for text it cannot parse or bind; tokenize.TokenError (an unclosed bracket
# or string) is not wrapped by gin and derives from Exception only.
_GIN_ERRORS = (ImportError, ValueError, TypeError, AttributeError, SyntaxError, KeyError,
               IndexError, tokenize.TokenError)


def _read_config(path: pathlib.Path) -> str:
  """The text of a gin config file; a binary or non-UTF-8 file raises ValueError naming it
  (an unreadable one raises OSError naming it)."""
  data = path.read_bytes()
  nul = data.find(b"\0")
  if nul >= 0:
    raise ValueError(f"gin config {str(path)!r} is a binary file (a NUL byte at offset "
                     f"{nul}), not gin text: give a .gin config")
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"gin config {str(path)!r} is not UTF-8 text (byte 0x{data[e.start]:02x} "
                     f"at offset {e.start}): give a .gin config") from None


def _import_hint(message: str) -> str:
  """The new home of what a config written before packaging imports: `Sweep` (from
  `experiments.common`), a study (`experiments.NAME`, now `specjax.experiments.NAME`)."""
  if "experiments.common" in message:
    return ("\n`Sweep` now lives in the library: `import specjax.sweeps as sweeps` and bind "
            "`sweeps.Sweep`")
  m = re.search(r"import\s+experiments\.(\w+)", message)
  if m and "experiments" in message.split(" In file ")[0]:  # the import itself failed
    return (f"; the studies now install inside the package: write `import "
            f"specjax.experiments.{m.group(1)}` (was `import experiments.{m.group(1)}`)")
  return ""


def _gin_message(err: Exception, texts: list[str]) -> str:
  """One message for anything in _GIN_ERRORS: the closest valid names for an unknown
  binding, the line of an unclosed bracket, the new home of `Sweep` for an old import."""
  if isinstance(err, tokenize.TokenError):
    what = err.args[0] if err.args else "cannot be tokenized"
    where = err.args[1] if len(err.args) > 1 else None
    line = f" (line {where[0]})" if isinstance(where, tuple) and where else ""
    return f"{what}{line}: an unclosed bracket, brace or string?"
  if isinstance(err, ImportError):  # gin re-raises it with the config line appended
    return f"{err}{_import_hint(str(err))}"
  return _explain_gin_error(err, texts)


def load_sweep(config: str, bindings: Sequence[str] = (),
               changes: Sequence[overrides.Override] = ()) -> tuple[Sweep, str]:
  """Parses the config, then each command-line binding, then makes each `--set`/`--axis`
  change, and builds the Sweep they bind (as gin.parse_config_files_and_bindings does, but
  a binding of `Sweep.axes` or `Sweep.fixed` is merged into the config's: see
  `overrides`). An error names its source: the .gin file, or the --gin_param binding it is
  in."""
  path = resolve_config(config)
  bindings = list(bindings)
  text = _read_config(path)
  gin.clear_config()
  try:
    gin.parse_config_file(str(path))
  except _GIN_ERRORS as e:
    raise ValueError(f"bad gin config {str(path)!r}: {_gin_message(e, [text])}") from None
  axes_before = _bound("axes")
  for binding in bindings:
    before = (_bound("axes"), _bound("fixed"))
    try:
      gin.parse_config(binding)
    except _GIN_ERRORS as e:
      raise ValueError(f"bad --gin_param {binding!r}: "
                       f"{_gin_message(e, [text, *bindings])}") from None
    _rebind(*overrides.merge_binding(before, (_bound("axes"), _bound("fixed"))))
  try:
    _apply(changes, axes_before)
    gin.finalize()
    sweep = gin.get_configurable(Sweep)()
  except _GIN_ERRORS as e:
    given = f" with --gin_param {', '.join(map(repr, bindings))}" if bindings else ""
    raise ValueError(f"bad gin config {str(path)!r}{given}: "
                     f"{_gin_message(e, [text, *bindings])}") from None
  sweep = sweep.with_default_axes()
  sweep.check()
  return sweep, gin.config_str()


# What `_bound` returns for a Sweep field the config leaves at its default (an empty dict);
# one object, so that `overrides.merge_binding` sees it unchanged.
_UNBOUND = types.MappingProxyType({})


def _bound(field: str):
  """The value the config binds to `Sweep.<field>` so far (`_UNBOUND` when none)."""
  try:
    return gin.query_parameter(f"Sweep.{field}")
  except ValueError:
    return _UNBOUND


def _rebind(axes, fixed) -> None:
  """Binds the merged axes and fixed values where they differ from what is bound (an
  unchanged config keeps its operative text, and so its run directory's fingerprint)."""
  for field, value in (("axes", axes), ("fixed", fixed)):
    if value is not _UNBOUND and value != _bound(field):
      gin.bind_parameter(f"Sweep.{field}", value)


def _apply(changes: Sequence[overrides.Override], axes_before) -> None:
  """Makes the `--set`/`--axis` changes in order, then drops from `Sweep.vectorized` the
  axes the command line took away (a vectorised axis that is no longer swept). Values that
  are not dicts are left for `Sweep.check` to report."""
  axes, fixed = _bound("axes"), _bound("fixed")
  if not (isinstance(axes, Mapping) and isinstance(fixed, Mapping)):
    return
  for change in changes:
    axes, fixed = change.apply(axes, fixed)
  _rebind(axes, fixed)
  vectorized = _bound("vectorized")
  if isinstance(vectorized, (list, tuple)) and isinstance(axes_before, Mapping):
    kept = tuple(n for n in vectorized if n in axes or n not in axes_before)
    if len(kept) != len(vectorized):
      gin.bind_parameter("Sweep.vectorized", kept)


def plan(sweep: Sweep, shard_index: int = 0, num_shards: int = 1) -> list[runner.Point]:
  """The points this process runs, validated (types, ranges, memory) before any work."""
  points = runner.shard(runner.expand(sweep.axes, sweep.fixed_params()), shard_index,
                        num_shards)
  for p in points:
    if sweep.validate_fn is not None:
      try:
        sweep.validate_fn(p.params)
      except ValueError as e:
        raise ValueError(f"sweep point {p.params}: {e}") from None
  if sweep.memory_fn is not None:
    available = kv.available_memory_bytes()
    for p in points:
      need = int(sweep.memory_fn(p.params))
      if available is not None and need > 0.9 * available:
        raise ValueError(f"sweep point {p.params} needs about {need / 2**30:.2f} GiB but only "
                         f"{available / 2**30:.2f} GiB is available: shrink the sweep")
  return points


def run(config: str, bindings: Sequence[str] = (), out: str | None = None,
        root: str = "runs", shard_index: int = 0, num_shards: int = 1,
        progress: bool = True,
        changes: Sequence[overrides.Override] = ()) -> runner.RunSummary:
  sweep, config_text = load_sweep(config, bindings, changes)
  points = plan(sweep, shard_index, num_shards)
  mesh = sharding.default_mesh_shape()  # the CLI's --mesh: another mesh is another run
  digests = inputs.digests(sweep.axes, sweep.fixed_params())  # what its paths point at
  ident = run_directory.Identity(
      run_directory.fingerprint(config_text, shard_index, num_shards, mesh, digests),
      run_directory.fingerprint(config_text, shard_index, num_shards, mesh), tuple(digests))

  def init(run_dir: pathlib.Path) -> None:
    runner.atomic_write_text(run_dir / "config.gin", config_text)
    runner.atomic_write_text(run_dir / "config.json", json.dumps({
        "name": sweep.name, **ident.record(), "shard_index": shard_index,
        "num_shards": num_shards, "mesh": mesh, "axes": dict(sweep.axes), "fixed": dict(sweep.fixed),
        "vectorized": list(sweep.vectorized), "points": len(points)}, indent=2, default=repr))

  with run_directory.open_run_dir(root, sweep.name, ident, out, init=init) as (run_dir,
                                                                              resumed):
    runner.atomic_write_text(run_dir / "environment.json",
                             json.dumps(run_directory.environment(sweep.seed), indent=2,
                                        default=repr))
    print(f"specjax run: {sweep.name}: {len(points)} points -> {run_dir}"
          f"{' (resuming)' if resumed else ''}", file=sys.stderr)
    skipped, ok, failed = runner.run_points(
        points, run_dir, lambda group: sweep.run_group([p.params for p in group]),
        group_key=lambda p: sweep.group_key(p.params), progress=progress)
    write_report(sweep, run_dir)
  return runner.RunSummary(run_dir=run_dir, resumed=resumed, total=len(points),
                           skipped=skipped, ok=ok, failed=failed,
                           table=summary_table(sweep, run_dir))


def summary_table(sweep: Sweep, run_dir: pathlib.Path) -> str:
  """The sweep's axes and `summary_columns` of every finished point, as a markdown table."""
  if not sweep.summary_columns:
    return ""
  records = [r for r in runner.read_results(run_dir / runner.RESULTS).values()
             if r.get("status") == "ok"]
  rows = [{**r["params"], **r["metrics"]} for r in sorted(records, key=lambda r: r.get("index", 0))]
  return report.markdown_table(rows, list(sweep.axes) + list(sweep.summary_columns))


def write_report(sweep: Sweep, run_dir: pathlib.Path) -> pathlib.Path:
  records = list(runner.read_results(run_dir / runner.RESULTS).values())
  text = report.results_table(sweep.name, records, list(sweep.axes))
  if sweep.report_fn is not None:
    ok = [r for r in records if r.get("status") == "ok"]
    if ok:
      text += "\n" + sweep.report_fn(ok, run_dir)
  runner.atomic_write_text(run_dir / "report.md", text)
  return run_dir / "report.md"
