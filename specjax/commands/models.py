"""Model flags shared by the commands that load a target and a draft (`generate`,
`check-exact`): a config spec or a checkpoint directory, errors naming the flag."""

from __future__ import annotations


def config_from_flag(flag: str, spec: str, vocab_size: int):
  """parse_config, its errors naming the flag."""
  from specjax.models.presets import parse_config
  try:
    return parse_config(spec, vocab_size=vocab_size)
  except (ValueError, TypeError) as e:  # bad JSON, unknown preset or field, bad value
    raise ValueError(f"{flag} {spec!r}: {e}") from None
  except OSError as e:
    raise OSError(e.errno, e.strerror, f"{flag} {spec}") from None


def load_from_flag(flag: str, path: str):
  """checkpoints.load_model, its errors naming the flag."""
  from specjax.checkpoints import load_model
  try:
    return load_model(path)
  except ValueError as e:
    raise ValueError(f"{flag} {path}: {e}") from None
  except OSError as e:
    raise OSError(e.errno, e.strerror or str(e), f"{flag} {path}") from None
