"""The `specjax theory` subcommands' flags: their definitions (hardware and workload, α, k
and c), lists and ranges checked with errors that name the flag, work sizes refused before
any work, and the roofline's `Hardware` and `Workload` built from them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any

from specjax.analysis import roofline, theory


def add_model_args(s: argparse.ArgumentParser, context_default: int = 640) -> None:
  g = s.add_argument_group("hardware and workload (default: the lecture's H100 and 7B)")
  g.add_argument("--hardware", default="h100", choices=(*roofline.HARDWARE, "calibrate"),
                 help="a preset, or 'calibrate' to measure this machine with JAX")
  g.add_argument("--bandwidth-tbs", type=float, help="override memory bandwidth, TB/s")
  g.add_argument("--tflops", type=float, help="override usable TFLOP/s")
  g.add_argument("--memory-gb", type=float, help="override device memory, GB")
  g.add_argument("--model-config", metavar="FILE.json",
                 help="a ModelConfig as JSON (ModelConfig.to_dict) instead of the lecture 7B")
  g.add_argument("--weight-gb", type=float, help="override weight bytes, GB (1e9)")
  g.add_argument("--kv-bytes-per-token", type=float,
                 help="override KV bytes per token per sequence (lecture: 131072)")
  g.add_argument("--gflops-per-token", type=float, help="override FLOPs per token, GFLOP")
  g.add_argument("--context-len", type=int, default=context_default)


def add_spec_args(s: argparse.ArgumentParser) -> None:
  s.add_argument("--alpha", type=float, default=0.8)
  s.add_argument("--k", type=int, default=4)
  s.add_argument("--c", type=float, default=0.15)


def floats(name: str, text: str) -> list[float]:
  try:
    values = [float(x) for x in str(text).split(",") if x.strip()]
  except ValueError:
    raise ValueError(f"{name} must be comma-separated numbers, got {text!r}") from None
  if not values:
    raise ValueError(f"{name} must list at least one number, got {text!r}")
  return values


def ints(name: str, text: str) -> list[int]:
  values = floats(name, text)
  if any(v != int(v) for v in values):
    raise ValueError(f"{name} must be comma-separated integers, got {text!r}")
  return [int(v) for v in values]


def check_flag(flag: str, value: Any, ok: bool, allowed: str) -> None:
  """ValueError naming the flag (not the library argument behind it) and what is allowed."""
  if not ok:
    raise ValueError(f"{flag} must be {allowed}, got {value!r}")


def finite(x: Any) -> bool:
  return isinstance(x, (int, float)) and math.isfinite(x)


def check_size(flags: str, value: int, limit: int, what: str) -> None:
  """A work size checked before any work (`theory.MAX_*`), the error naming the flags."""
  if value > limit:
    raise ValueError(f"{flags} = {value:,} exceeds the limit of {limit:,} ({what}): lower it")


def max_policy_k() -> int:
  """The largest k_max whose adaptive-policy tables fit: (k + 1)·k² <= MAX_TABLE_CELLS."""
  k = int(round(theory.MAX_TABLE_CELLS ** (1 / 3)))
  while (k + 1) * k * k > theory.MAX_TABLE_CELLS:
    k -= 1
  return k


def check_alpha(flag: str, a: float) -> None:
  check_flag(flag, a, finite(a) and 0.0 <= a <= 1.0, "a number in [0, 1]")


def check_k(flag: str, k: int, lo: int = 1) -> None:
  check_flag(flag, k, k >= lo, f"an integer >= {lo}")


def check_spec(args) -> None:
  """--alpha, --k, --c of the roofline subcommands, checked before the model is built."""
  check_alpha("--alpha", args.alpha)
  check_k("--k", args.k)
  check_flag("--c", args.c, finite(args.c) and args.c >= 0, "a finite number >= 0")
  if getattr(args, "context_len", None) is not None:
    check_k("--context-len", args.context_len)
  if getattr(args, "k_max", None) is not None:
    check_k("--k-max", args.k_max, 0)


def hardware(args) -> roofline.Hardware:
  hw = roofline.calibrate() if args.hardware == "calibrate" else roofline.HARDWARE[args.hardware]
  changes = {}
  if args.bandwidth_tbs is not None:
    changes["bandwidth"] = args.bandwidth_tbs * 1e12
  if args.tflops is not None:
    changes["flops"] = args.tflops * 1e12
  if args.memory_gb is not None:
    changes["memory"] = args.memory_gb * 1e9
  if changes:
    hw = dataclasses.replace(hw, name=hw.name + "*", **changes)
  return hw


def workload(args) -> roofline.Workload:
  if args.model_config:
    from specjax.models.transformer import ModelConfig  # lazy: pulls in JAX
    path = args.model_config
    try:
      with open(path) as f:
        doc = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"--model-config {path}: not valid JSON ({e}): give a ModelConfig as "
                       f"a JSON object (ModelConfig.to_dict)") from None
    except UnicodeDecodeError:
      raise ValueError(f"--model-config {path}: not a text file: give a ModelConfig as a "
                       f"JSON object (ModelConfig.to_dict)") from None
    except OSError as e:
      raise path_error("--model-config", path, e, "give a readable JSON file") from None
    if not isinstance(doc, dict):
      raise ValueError(f"--model-config {path}: expected a JSON object of ModelConfig fields, "
                       f"got {type(doc).__name__}")
    try:
      config = ModelConfig.from_dict(doc)
    except (TypeError, ValueError) as e:
      raise ValueError(f"--model-config {path}: {e}") from None
    wl = roofline.Workload.from_model_config(config, args.context_len)
  else:
    wl = roofline.Workload.lecture_7b(args.context_len)
  changes = {}
  if args.weight_gb is not None:
    changes["weight_bytes"] = args.weight_gb * 1e9
  if args.kv_bytes_per_token is not None:
    changes["kv_bytes_per_token"] = args.kv_bytes_per_token
  if args.gflops_per_token is not None:
    changes["flops_per_token"] = args.gflops_per_token * 1e9
  if changes:
    wl = dataclasses.replace(wl, name=wl.name + "*", **changes)
  return wl


def path_error(flag: str, path: str, e: OSError, todo: str) -> OSError:
  """`e` again, naming the flag and the path and saying what to do (the CLI prints it as
  one line: `FLAG PATH: reason; todo`)."""
  return OSError(e.errno, f"{e.strerror or e}; {todo}", f"{flag} {path}")
