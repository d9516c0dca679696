"""`specjax run CONFIG.gin` and `specjax merge RUN_DIR... --out DIR`."""

from __future__ import annotations

import argparse
import json

from specjax.commands.models import add_mesh_flag
from specjax.sweeps import overrides


def add_parsers(subparsers) -> None:
  p = subparsers.add_parser(
      "run", help="run an experiment sweep from a gin config (resumes if re-run)",
      description="Runs the sweep a gin config binds (configs/NAME.gin or a path). Results go "
      "to runs/NAME/TIMESTAMP/ (results.jsonl, report.md, plots); re-running the same command "
      "resumes: finished points are skipped, failed ones retried. One run at a time per directory: "
      "a second run into a directory in use is refused. A point's numbers depend on its "
      "parameters and seed only (not on its group, shard or device count). The command "
      "line changes the config's sweep key by key: --gin_param bindings first, then --set "
      "and --axis in the order given. --set KEY=VALUE fixes one parameter (the config's "
      "other fixed values are kept; an axis of that name is dropped); --axis KEY=V1,V2 "
      "sweeps one (added, or replacing that axis; a fixed value of that name is dropped). "
      "A --gin_param binding of sweeps.Sweep.fixed = {...} is a --set per key; one of "
      "sweeps.Sweep.axes = {...} replaces the axes and drops their keys from the fixed "
      "values. Values are Python literals (0.05, None, (2, 1), 'text') or else plain "
      "strings (eagle:default); see docs/run_directories.md.")
  p.add_argument("config", nargs="?", default=None,
                 help="a .gin file, or the name of a shipped config (--list shows them)")
  p.add_argument("--list", action="store_true", dest="list_configs",
                 help="list the shipped configs (name and first comment line) and exit")
  p.add_argument("--gin_param", "--gin-param", action="append", default=[], dest="gin_param",
                 metavar="BINDING",
                 help="extra gin binding, e.g. 'sweeps.Sweep.seed = 3' (every point's seed); "
                 "Sweep.fixed and Sweep.axes bindings merge into the config's (see above)")
  p.add_argument("--set", action="append", default=[], dest="changes", metavar="KEY=VALUE",
                 type=_typed(overrides.parse_set),
                 help="fix one parameter of every point, e.g. --set max_new_tokens=32 "
                 "(repeatable)")
  p.add_argument("--axis", action="append", dest="changes", metavar="KEY=V1,V2",
                 type=_typed(overrides.parse_axis),
                 help="sweep one parameter over the values given, e.g. --axis "
                 "drafter=eagle,model or --axis batch=1,8 (repeatable)")
  p.add_argument("--out", default=None, help="run directory (default runs/NAME/TIMESTAMP)")
  p.add_argument("--root", default="runs", help="where run directories go (default runs/)")
  p.add_argument("--shard-index", type=int, default=0)
  p.add_argument("--num-shards", type=int, default=1)
  p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                 help="multi-host: jax.distributed coordinator address; every process runs "
                 "the shard --process-id of --num-processes on its local devices (join the "
                 "shard directories with `specjax merge`)")
  p.add_argument("--num-processes", type=int, default=None)
  p.add_argument("--process-id", type=int, default=None)
  p.add_argument("--no-progress", action="store_true")
  p.add_argument("--json", action="store_true", help="print the run summary as JSON")
  add_mesh_flag(p)
  p.set_defaults(func=_run)

  m = subparsers.add_parser("merge", help="join the results of sweep shards",
                            description="Joins shard run directories of one config into one.")
  m.add_argument("run_dirs", nargs="+")
  m.add_argument("--out", required=True)
  m.set_defaults(func=_merge)


def _typed(parse):
  """An argparse type from an `overrides` parser: its ValueError becomes argparse's one-line
  usage error (`specjax: error: argument --set: ...`, exit 2)."""
  def convert(text: str):
    try:
      return parse(text)
    except ValueError as e:
      raise argparse.ArgumentTypeError(str(e)) from None
  convert.__name__ = parse.__name__.removeprefix("parse_")  # argparse's name for the type
  return convert


def _distributed(args: argparse.Namespace) -> None:
  """jax.distributed for a sweep spanning hosts: process i of n runs shard i of n."""
  given = [args.coordinator is not None, args.num_processes is not None,
           args.process_id is not None]
  if not any(given):
    return
  if not all(given):
    raise ValueError("multi-host runs need all of --coordinator, --num-processes and "
                     "--process-id")
  if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
    raise ValueError(f"--process-id must be in [0, --num-processes={args.num_processes}), "
                     f"got {args.process_id}")
  if args.num_shards != 1 and (args.num_shards, args.shard_index) != (
      args.num_processes, args.process_id):
    raise ValueError("with --coordinator the shard is the process: leave --shard-index and "
                     "--num-shards unset")
  import jax
  jax.distributed.initialize(coordinator_address=args.coordinator,
                             num_processes=args.num_processes, process_id=args.process_id)
  args.num_shards, args.shard_index = args.num_processes, args.process_id


XLA_CACHE_MB = 2048  # the persistent compilation cache's default bound


def xla_cache_bytes() -> int:
  """The persistent compilation cache's bound in bytes: $SPECJAX_XLA_CACHE_MB (a number > 0
  of MiB, or -1 for no bound), default `XLA_CACHE_MB`. ValueError naming the variable."""
  import os
  text = os.environ.get("SPECJAX_XLA_CACHE_MB", str(XLA_CACHE_MB)).strip()
  try:
    mb = float(text)
  except ValueError:
    mb = float("nan")
  if mb == -1:
    return -1
  if not mb > 0 or mb == float("inf"):
    raise ValueError(f"SPECJAX_XLA_CACHE_MB must be a number of MiB > 0, or -1 for no bound, "
                     f"got {text!r}")
  return max(1, int(mb * 2**20))


def _compilation_cache() -> None:
  """JAX's persistent compilation cache under $SPECJAX_CACHE_DIR/xla (~/.cache/specjax/xla):
  a re-run of an experiment (or the next experiment with the same shapes) loads its compiled
  programs instead of compiling them again. Bounded by `xla_cache_bytes` (JAX evicts the
  least recently used programs). SPECJAX_NO_COMPILATION_CACHE=1 turns it off."""
  import os
  if os.environ.get("SPECJAX_NO_COMPILATION_CACHE"):
    return
  import jax
  from specjax.training.defaults import cache_dir
  bound = xla_cache_bytes()
  try:
    path = cache_dir() / "xla"
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_compilation_cache_max_size", bound)
  except OSError:  # an unwritable cache only costs compile time
    pass


def _list_configs() -> int:
  """`specjax run --list`: each shipped config's name and the first line of its comment."""
  from specjax.sweeps import launch
  for name in launch.available_configs():
    lines = (launch.CONFIG_DIR / f"{name}.gin").read_text(encoding="utf-8").splitlines()
    first = next((ln.lstrip("# ").strip() for ln in lines if ln.startswith("#")), "")
    print(f"{name:16s} {first}")
  return 0


def _run(args: argparse.Namespace) -> int:
  if args.list_configs:
    return _list_configs()
  if args.config is None:
    raise ValueError("specjax run needs a CONFIG: a .gin file or a shipped config's name "
                     "(specjax run --list shows them)")
  from specjax.sweeps import launch
  _distributed(args)
  _compilation_cache()
  summary = launch.run(args.config, args.gin_param, out=args.out, root=args.root,
                       shard_index=args.shard_index, num_shards=args.num_shards,
                       progress=not args.no_progress, changes=args.changes)
  if args.json:
    print(json.dumps(summary.to_dict(), indent=2))
  else:
    if summary.table:
      print(summary.table)
    print(f"{summary.ok} points finished, {summary.failed} failed, {summary.skipped} already "
          f"done; report: {summary.run_dir / 'report.md'}")
  return 1 if summary.failed else 0


def _merge(args: argparse.Namespace) -> int:
  from specjax.sweeps import launch, runner
  out = runner.merge(args.run_dirs, args.out)
  sweep, _ = launch.load_sweep(str(out / "config.gin"))
  launch.write_report(sweep, out)
  print(f"merged {len(args.run_dirs)} runs into {out}")
  return 0
