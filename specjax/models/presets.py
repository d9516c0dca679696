"""Named model shapes and the `NAME[:field=value,...]` / JSON config syntax of the CLI."""

from __future__ import annotations

import dataclasses
import difflib
import json
import os

from specjax.models.transformer import ModelConfig

PRESETS: dict[str, ModelConfig] = {
    # GPT-2 small's shape (124M parameters); the benchmark target.
    "gpt2-small": ModelConfig.gpt2(),
    # A 2-layer, width-256 draft: c ~ 0.10-0.15 against gpt2-small on XLA:CPU
    # (the measured cost ratio c; see docs/cost_model.md).
    "gpt2-draft": ModelConfig.gpt2(d_model=256, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=1024),
    # GPT-2 medium's shape (355M parameters, 1.42 GB in float32): memory-bound on a CPU; the
    # scaled-down check of benchmarks/bench_scaled_cpu.py.
    "gpt2-medium": ModelConfig.gpt2(d_model=1024, n_layers=24, n_heads=16, n_kv_heads=16,
                                    d_ff=4096),
    "llama-small": ModelConfig.llama(),
    "llama-draft": ModelConfig.llama(d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=688),
    # An 8B-class Llama-3 shape (32 layers, d 4096, GQA 32/8, vocab 128,256; ~8.0B
    # parameters, 16 GB in bf16): the accelerator check's target (benchmarks/device_check.sh).
    "llama3-8b": ModelConfig.llama(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                                   n_kv_heads=8, d_ff=14336, max_len=8192, rope_theta=500000.0,
                                   dtype="bfloat16"),
    # A 2-layer draft with the same vocabulary (its LM head dominates its cost).
    "llama3-draft": ModelConfig.llama(vocab_size=128256, d_model=1024, n_layers=2, n_heads=16,
                                      n_kv_heads=8, d_ff=3584, max_len=8192,
                                      rope_theta=500000.0, dtype="bfloat16"),
    # Test-sized models.
    "tiny-gpt2": ModelConfig.gpt2(vocab_size=264, d_model=64, n_layers=2, n_heads=4,
                                  n_kv_heads=4, d_ff=256, max_len=512),
    "tiny-llama": ModelConfig.llama(vocab_size=264, d_model=64, n_layers=2, n_heads=4,
                                    n_kv_heads=2, d_ff=172, max_len=512),
}


def _coerce(field: dataclasses.Field, text: str):
  """The value of `field=text` in a `NAME:field=value` spec; ValueError naming the field
  when the text is not of the field's type (ranges are ModelConfig's to check)."""
  kind = field.type if isinstance(field.type, type) else str(field.type)
  try:
    if kind == "int | None":  # sliding_window=none, head_dim_override=64
      return None if text.lower() in ("none", "null") else int(text)
    if kind in (int, "int"):
      return int(text)
    if kind in (float, "float"):
      return float(text)
  except ValueError:
    allowed = "an int" if "int" in str(kind) else "a number"
    raise ValueError(f"{field.name} must be {allowed}"
                     f"{' or none' if kind == 'int | None' else ''}, got {text!r}") from None
  if kind in (bool, "bool"):
    if text.lower() not in ("true", "false", "1", "0"):
      raise ValueError(f"{field.name} must be true or false, got {text!r}")
    return text.lower() in ("true", "1")
  return text


def _items(rest: str) -> list[tuple[str, str, str]]:
  """The (field, '=', value) items of the `field=value,...` part of a NAME spec."""
  return [item.partition("=") for item in filter(None, rest.split(","))]


def spec_sets(spec: str, field: str) -> bool:
  """Whether a `NAME:field=value,...` spec sets `field` itself (JSON specs: never)."""
  if spec.lstrip().startswith("{") or os.path.isfile(spec):
    return False
  return any(key == field for key, _, _ in _items(spec.partition(":")[2]))


def parse_config(spec: str, **overrides) -> ModelConfig:
  """A ModelConfig from `NAME`, `NAME:field=value,...`, a JSON object, or a JSON file path."""
  if spec.lstrip().startswith("{"):
    base = ModelConfig.from_dict(json.loads(spec))
  elif os.path.isfile(spec):
    with open(spec) as f:
      base = ModelConfig.from_dict(json.load(f))
  else:
    name, _, rest = spec.partition(":")
    if name not in PRESETS:
      close = difflib.get_close_matches(name, PRESETS, n=3)
      hint = f" (did you mean {', '.join(close)}?)" if close else ""
      raise ValueError(f"unknown model config {name!r}{hint}; presets: {sorted(PRESETS)}, "
                       f"or a JSON object / file of ModelConfig fields")
    base = PRESETS[name]
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    for key, eq, value in _items(rest):
      if not eq or key not in fields:
        raise ValueError(f"bad config override {key + eq + value!r} in {spec!r}: expected "
                         f"field=value with field one of {sorted(fields)}")
      overrides.setdefault(key, _coerce(fields[key], value))
  return base.replace(**overrides) if overrides else base
