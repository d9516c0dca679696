"""Model flags shared by the commands that load a target and a draft (`generate`,
`check-exact`): --target / --target-config and --draft / --draft-config (the word
'default', a checkpoint directory, or a random model from a config spec), errors naming the
flag."""

from __future__ import annotations

import argparse

from specjax.resolve import config_from_ref as config_from_flag  # the CLI's names
from specjax.resolve import load_from_ref as load_from_flag


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


def draft_from_flags(spec: str | None, args, target, pair=None, tokenizer=None):
  """The draft Transformer for the --draft value `spec`: 'self' (the target itself),
  'default' (the default `pair`'s draft), a checkpoint directory, or, when None, a random
  model from --draft-config on the target's vocabulary (seed --seed + 1, wrapped into the
  int64 range that a JAX key takes): `resolve.draft_model` with the CLI's flag names
  (`tokenizer`: the target's, to refuse a directory draft with another one)."""
  if spec == "default":
    return pair.draft_module()
  from specjax.resolve import draft_model
  return draft_model(spec, target, seed=args.seed, default_config=args.draft_config,
                     flag="--draft", tokenizer=tokenizer)


def add_mesh_flag(p) -> None:
  """--mesh data=D,model=M: decode over a device mesh (`specjax.sharding`); `cli.main` runs
  the command under it (`mesh_context`)."""
  p.add_argument("--mesh", type=mesh_arg, default=None, metavar="data=D,model=M",
                 help="decode over a mesh of D x M devices: weights tensor-parallel over "
                 "model, prompts split over data (default: one device)")


def mesh_arg(text: str) -> tuple[int, int]:
  """The argparse type of --mesh: (data, model) (`sharding.parse_mesh`, one-line errors)."""
  from specjax.sharding import parse_mesh
  try:
    return parse_mesh(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e).replace("--mesh must", "must")) from None


def mesh_context(args):
  """The context a command runs in: the default mesh of --mesh when the command has the flag
  and it was given (built, and the devices counted, at the first decoding call), else
  nothing."""
  sizes = getattr(args, "mesh", None)
  if sizes is None:
    import contextlib
    return contextlib.nullcontext()
  from specjax import sharding
  return sharding.default_mesh(tuple(sizes))


def ints_arg(count: int):
  """An argparse type: ints >= 1 separated by commas, exactly `count` of them (1: one or
  more): tree widths, a dynamic tree's budget,depth,width."""
  def parse(text: str) -> tuple[int, ...]:
    try:
      values = tuple(int(v) for v in text.split(","))
    except ValueError:
      values = ()
    if not values or any(v < 1 for v in values) or (count > 1 and len(values) != count):
      want = f"{count} ints >= 1" if count > 1 else "ints >= 1"
      raise argparse.ArgumentTypeError(f"must be {want} separated by commas (e.g. 2,1,1), "
                                       f"got {text!r}")
    return values
  return parse
