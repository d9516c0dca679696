"""Model flags shared by the commands that load a target and a draft (`generate`,
`check-exact`): --target / --target-config and --draft / --draft-config (the word
'default', a checkpoint directory, or a random model from a config spec), errors naming the
flag."""

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


def add_config_flags(p, draft_config_help: str = "as --target-config") -> None:
  """--target-config and --draft-config: the random models used when --target / --draft
  name none."""
  p.add_argument("--target-config", default="tiny-gpt2",
                 help="preset name, NAME:field=value,..., a JSON object or JSON file "
                 "(default: %(default)s)")
  p.add_argument("--draft-config", default="tiny-gpt2:n_layers=1", help=draft_config_help)


def default_models(target_flag, draft_flag):
  """What the 'default' flags need, built or loaded once: the default pair when --draft is
  'default', the default target alone when only --target is (its draft is never trained
  for nothing), else None. Pass it to `target_from_flags` / `draft_from_flags`."""
  from specjax.training import defaults
  from specjax.training.presets import DEFAULT_PRESET
  if draft_flag == "default":
    return defaults.load_default_pair(DEFAULT_PRESET)
  if target_flag == "default":
    return defaults.load_default_target(DEFAULT_PRESET)
  return None


def target_from_flags(args, pair=None):
  """(target Transformer, tokenizer or None) for --target: 'default' (the target of
  `default_models`), a checkpoint directory, or, when absent, a random model from --target-config on
  the byte vocabulary (seed --seed)."""
  if args.target == "default":
    return pair.target_module(), pair.tokenizer
  if args.target is not None:
    return load_from_flag("--target", args.target)
  from flax import nnx

  from specjax.data.tokenizer import ByteTokenizer
  from specjax.models.transformer import Transformer
  tok = ByteTokenizer()
  return (Transformer(config_from_flag("--target-config", args.target_config, tok.vocab_size),
                      rngs=nnx.Rngs(args.seed)), tok)


def draft_from_flags(spec: str | None, args, target, pair=None):
  """The draft Transformer for the --draft value `spec`: 'self' (the target itself),
  'default' (the default `pair`'s draft), a checkpoint directory, or, when None, a random
  model from --draft-config on the target's vocabulary (seed --seed + 1, wrapped into the
  int64 range that a JAX key takes)."""
  if spec == "self":
    return target
  if spec == "default":
    return pair.draft_module()
  if spec is not None:
    return load_from_flag("--draft", spec)[0]
  from flax import nnx

  from specjax.models.transformer import Transformer
  config = config_from_flag("--draft-config", args.draft_config, target.config.vocab_size)
  return Transformer(config, rngs=nnx.Rngs((args.seed + 1) % 2**63))
