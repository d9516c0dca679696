"""`specjax train`: train a target LM, distill (or plainly train) a draft, build or measure pairs.

  specjax train target   --preset tiny --corpus code|prose|DIR --out CKPT
  specjax train draft    --preset tiny --corpus code --out CKPT [--teacher CKPT] [--plain]
  specjax train defaults --preset tiny --corpus code [--rebuild]   (the cached default pair)
  specjax train measure  --target CKPT --draft CKPT --corpus code [--k 4]
  specjax train medusa   --target CKPT|default --heads 4 --steps 60 --out DIR
                         (draft heads on a frozen target; `specjax generate --draft medusa:DIR`)
  specjax train eagle    --target CKPT|default --ttt-steps 3 --width 128 --steps 120 --out DIR
                         (an EAGLE head; `specjax generate --draft eagle:DIR`)
  specjax train eagle3   --target CKPT|default --draft-vocab 1024 --steps 120 --out DIR
                         (an EAGLE-3-structured head; `--draft eagle3:DIR`, `export-head`)
  specjax train selfdistill-data --target REF --out DIR --prompts N --max-new-tokens M
                         (the target's own answers as token shards: --corpus selfdistill:DIR)

A run that is interrupted (Ctrl-C, SIGTERM) saves a checkpoint; rerunning the same command
resumes from the newest checkpoint in --out with the same data order.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import re
import sys


def _preset_name(args) -> str:
  from specjax.training.presets import DEFAULT_PRESET
  return args.preset or DEFAULT_PRESET


def _resolve_corpus(args) -> None:
  """--corpus unset: the preset's own corpus (`defaults.corpus_of`)."""
  from specjax.training.defaults import corpus_of
  if getattr(args, "corpus", "") is None:
    args.corpus = corpus_of(_preset_name(args), None)


def _common(p: argparse.ArgumentParser) -> None:
  p.add_argument("--preset", default=None,
                 help="size preset: base, tiny or small (default: the embedded pair's, base)")
  p.add_argument("--corpus", default=None,
                 help="'code', 'code+tests', 'prose' (embedded, from Python's standard library), "
                      "a directory of text files, or selfdistill:DIR (a target's own answers, "
                      "`train selfdistill-data`; loss on the answers only) (default: the "
                      "preset's own corpus)")
  p.add_argument("--max-bytes", type=int, default=None,
                 help="cap on the training text in bytes (default: the whole corpus)")


def _schedule_args(p: argparse.ArgumentParser, defaults: str, evaluation: str,
                   dtype: bool = True) -> None:
  """--out and the TrainConfig overrides (`_train_config`; unset: the `defaults`' value)."""
  p.add_argument("--out", required=True, help="checkpoint directory (resumed if it exists)")
  p.add_argument("--steps", type=int, help=f"optimizer steps (default: {defaults})")
  p.add_argument("--batch-size", type=int, help="windows per step")
  p.add_argument("--seq-len", type=int, help="tokens per window")
  p.add_argument("--grad-accum", type=int, help="micro-batches per step")
  p.add_argument("--lr", type=float, help="peak learning rate")
  if dtype:
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="compute dtype")
  p.add_argument("--seed", type=int, help="initialisation and data-order seed")
  p.add_argument("--eval-every", type=int, help=f"{evaluation} every N steps (0: at the end)")
  p.add_argument("--ckpt-every", type=int, help="checkpoint every N steps (0: at the end)")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  p.add_argument("--data-parallel", type=int, default=None, metavar="D",
                 help="train data-parallel over D devices (weights replicated, each step's "
                 "rows split; D must divide the micro-batch; default: one device)")


def _mesh(args):
  """The data-parallel mesh of --data-parallel D (None: one device); one-line errors."""
  d = getattr(args, "data_parallel", None)
  if d is None:
    return None
  if d < 1:
    raise ValueError(f"--data-parallel must be an int >= 1 (devices), got {d}")
  from specjax import sharding
  try:
    return sharding.make_mesh(d, 1)
  except ValueError as e:
    raise ValueError(f"--data-parallel {d}: {e}") from None


def _training_args(p: argparse.ArgumentParser) -> None:
  _common(p)
  _schedule_args(p, "the preset's", "validation")


def add_parser(subparsers) -> None:
  parser = subparsers.add_parser(
      "train", help="train target and draft models (LM training, distillation)",
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="what", metavar="WHAT")
  sub.required = True

  p = sub.add_parser("target", help="train a target language model")
  _training_args(p)
  p.add_argument("--tokenizer", default="byte",
                 help="'byte' (default), 'bpe:SIZE' (train a BPE of SIZE ids on the corpus; "
                      "needs the `tokenizers` extra) or a tokenizer.json path")
  p.set_defaults(func=run_target)

  p = sub.add_parser("draft", help="train a draft: distilled from a target (default) or plain")
  _training_args(p)
  p.add_argument("--teacher", default=None,
                 help="the model to distill from: a trainer checkpoint or any target reference "
                      "(a Hugging Face or specjax model directory, random:SPEC) (default: the "
                      "cached default target of --preset/--corpus, trained on first use)")
  p.add_argument("--plain", action="store_true",
                 help="plain next-token training instead of distillation (a baseline)")
  _recipe_arg(p, "smollm2-draft", "its shape and schedule, instead of --preset's")
  p.set_defaults(func=run_draft)

  p = sub.add_parser("defaults", help="load the shipped default pair, or build (first use) "
                                      "or load a cached one")
  p.add_argument("--preset", default=None,
                 help="size preset (default: the shipped pair's, shipped)")
  p.add_argument("--corpus", default=None, choices=("code", "code+tests", "prose"),
                 help="embedded corpus (default: the preset's own)")
  p.add_argument("--rebuild", action="store_true",
                 help="ignore a shipped pair, discard the cached one and train from the recipe")
  p.add_argument("--no-progress", action="store_true")
  p.set_defaults(func=run_defaults)

  p = sub.add_parser("measure", help="validation bits/byte and greedy acceptance of a pair")
  p.add_argument("--target", required=True, help="target checkpoint ('default' for the cache)")
  p.add_argument("--draft", required=True, help="draft checkpoint ('default' for the cache)")
  p.add_argument("--preset", default=None,
                 help="preset of 'default' checkpoints (default: the shipped pair's, shipped)")
  p.add_argument("--corpus", default=None,
                 help="'code', 'code+tests', 'prose' or a directory (default: the preset's own "
                      "corpus)")
  p.add_argument("--k", type=int, default=4, help="draft length of the simulated chain")
  p.add_argument("--prompts", type=int, default=64, help="validation prompts")
  p.add_argument("--prompt-len", type=int, default=64)
  p.add_argument("--new-tokens", type=int, default=128)
  p.add_argument("--windows", type=int, default=256, help="validation windows for bits/byte")
  p.add_argument("--json", action="store_true", help="print one JSON object")
  p.set_defaults(func=run_measure)

  from specjax.commands import selfdistill
  selfdistill.add_parser(sub)

  for name, (help_text, add_kind_args, _) in HEAD_KINDS.items():
    p = sub.add_parser(name, help=help_text)
    _head_args(p)
    add_kind_args(p)
    p.set_defaults(func=functools.partial(run_head, kind=name))


# ----------------------------------------------------------------------------- draft heads
#
# One entry per head kind: (help, its own flags, args -> the kind). Everything else (target,
# data, schedule, checkpoints, resume, progress) is shared: `specjax.training.heads`.


def _medusa_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--heads", type=int, default=None, help="K: heads (draft depth), default 4")
  p.add_argument("--decay", type=float, default=None,
                 help="loss weight of head j is decay^j (default 0.8)")


def _given(value, default):
  """A kind flag's value: as given, else its default (the flags default to None so that a
  --recipe can tell what the command line set)."""
  return default if value is None else value


def _medusa_kind(args):
  from specjax.training.medusa import MedusaHeads
  return MedusaHeads(heads=_given(args.heads, 4), decay=_given(args.decay, 0.8))


def _eagle_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--ttt-steps", type=int, default=None,
                 help="drafting steps unrolled in training (training-time test), default 3")
  p.add_argument("--decay", type=float, default=None,
                 help="loss weight of unrolled step j is decay^j (default 0.8)")
  p.add_argument("--layers", default=None, metavar="I,J,K",
                 help="target layers the head reads (default: first block, middle block, "
                      "final norm)")
  p.add_argument("--width", type=int, default=None,
                 help="the head's decoder-layer width, a multiple of the target's head_dim "
                      "(default: the target's d_model)")
  p.add_argument("--structure", choices=("specjax", "eagle"), default="specjax",
                 help="the head's structure: 'specjax' (default: fused layers, own norms) or "
                      "'eagle', the published EAGLE-1/2 head (reads the final norm's output; "
                      "exports with `specjax export-head --format eagle`)")


def _layers(args) -> tuple[int, ...] | None:
  """--layers I,J,K as a tuple of ints (None when not given); one line naming the flag."""
  if args.layers is None:
    return None
  try:
    return tuple(int(x) for x in args.layers.split(","))
  except ValueError:
    raise ValueError(f"--layers must be comma-separated layer indices, got "
                     f"{args.layers!r}") from None


def _eagle_kind(args):
  from specjax.training.eagle import EagleHeads
  layers = _layers(args)
  return EagleHeads(steps=_given(args.ttt_steps, 3), decay=_given(args.decay, 0.8),
                    layers=layers, width=args.width, structure=args.structure,
                    bias=args.structure == "eagle")  # EAGLE's fc has a bias


def _eagle3_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--ttt-steps", type=int, default=None,
                 help="drafting steps unrolled in training (training-time test), default 3")
  p.add_argument("--decay", type=float, default=None,
                 help="loss weight of unrolled step j is decay^j (default 0.8)")
  p.add_argument("--layers", default=None, metavar="I,J,K",
                 help="target layers the head reads (capture indices; default: the EAGLE-3 "
                      "format's, the residual streams entering layers 2, N//2 and N-3)")
  p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                 help="draft vocabulary: the N most frequent tokens of the training split "
                      "(default: the whole vocabulary)")


def _eagle3_kind(args):
  from specjax.training.eagle3 import Eagle3Heads
  layers = _layers(args)
  if args.draft_vocab is not None and args.draft_vocab < 1:
    raise ValueError(f"--draft-vocab must be an int >= 1, got {args.draft_vocab}")
  return Eagle3Heads(steps=_given(args.ttt_steps, 3), decay=_given(args.decay, 0.8),
                     layers=layers)


HEAD_KINDS = {
    "medusa": ("train Medusa heads on a frozen target", _medusa_args, _medusa_kind),
    "eagle": ("train an EAGLE head on a frozen target", _eagle_args, _eagle_kind),
    "eagle3": ("train an EAGLE-3-structured head (three-layer fusion, reduced draft "
               "vocabulary, training-time test) on a frozen target", _eagle3_args,
               _eagle3_kind),
}


def _head_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--target", required=True, metavar="REF|default",
                 help="the frozen target: a checkpoint directory (trainer, specjax or Hugging "
                      "Face), any target reference (random:SPEC, ...) or 'default' (the "
                      "cached default target of --preset/--corpus)")
  _common(p)
  _schedule_args(p, "the default heads'", "acceptance", dtype=False)
  _recipe_arg(p, "smollm2-eagle3", "its kind flags and schedule, under the flags given")
  p.add_argument("--tree-budget", type=int, default=16,
                 help="print the best static tree of this many nodes for the measured "
                      "acceptance (default 16)")


# ----------------------------------------------------------------------------- helpers


def _recipe_arg(p: argparse.ArgumentParser, example: str, what: str) -> None:
  p.add_argument("--recipe", default=None, metavar="NAME",
                 help=f"a recipe for a real target (`training.presets.RECIPES`, e.g. "
                      f"{example}): {what}")


def _train_config(base, args, objective: str):
  """`base` with the schedule flags given; TrainConfig's refusal of a value names the flag
  (`--seed must be an int >= 0, got -1`, not `TrainConfig.seed ...`)."""
  changes = {"objective": objective}
  flags = {}  # field -> the flag that set it
  for field, name in (("steps", "steps"), ("batch_size", "batch_size"), ("seq_len", "seq_len"),
                      ("grad_accum", "grad_accum"), ("lr", "lr"), ("dtype", "dtype"),
                      ("seed", "seed"), ("eval_every", "eval_every"),
                      ("ckpt_every", "ckpt_every")):
    value = getattr(args, name, None)
    if value is not None:
      changes[field] = value
      flags[field] = "--" + name.replace("_", "-")
  if "steps" in changes and "warmup_steps" not in changes:
    changes["warmup_steps"] = min(base.warmup_steps, max(0, changes["steps"] // 10))
  try:
    return base.replace(**changes)
  except ValueError as e:
    message = str(e)
    for field, flag in flags.items():
      message = re.sub(rf"\bTrainConfig\.{field}\b", flag, message)
    raise ValueError(message) from None


def _load_data(args, tokenizer):
  """(corpus, TokenData) of --corpus: a text corpus, or `selfdistill:DIR` (a target's own
  answers, `specjax.data.selfdistill`; corpus None), loss-masked to the answers."""
  from specjax.data import selfdistill
  from specjax.data.batches import TokenData
  from specjax.data.corpus import load_corpus
  if str(args.corpus).startswith(selfdistill.PREFIX):
    if args.max_bytes is not None:
      raise ValueError(f"--max-bytes caps a text corpus; --corpus {args.corpus} is token "
                       "data (make fewer prompts instead)")
    data = selfdistill.token_data(args.corpus[len(selfdistill.PREFIX):], tokenizer)
    print(f"corpus {args.corpus}: {len(data.train):,} train tokens "
          f"({int(data.train_mask.sum()):,} answer tokens), {len(data.validation):,} "
          f"validation tokens, fingerprint {data.fingerprint}", file=sys.stderr)
    return None, data
  corpus = load_corpus(args.corpus, max_bytes=args.max_bytes)
  print(corpus.summary(), file=sys.stderr)
  return corpus, TokenData.from_corpus(corpus, tokenizer)


def _frozen_target(ref: str, flag: str):
  """(config, params, tokenizer) of a frozen model: a trainer checkpoint as it stores it
  (`load_trained`), else any target reference (`specjax.resolve.load_target`: a Hugging
  Face or specjax model directory, random:SPEC, ...)."""
  from specjax.checkpoints.orbax_io import latest_step, read_meta
  from specjax.checkpoints.trained import TRAINED_KIND, load_trained
  path = pathlib.Path(ref)
  if (path.is_dir() and latest_step(path) is not None
          and read_meta(path).get("metadata", {}).get("kind") == TRAINED_KIND):
    trained = load_trained(path)
    return trained.config, trained.params, trained.tokenizer
  from flax import nnx

  from specjax.resolve import load_target
  model, tokenizer = load_target(ref, flag=flag)
  return model.config, nnx.state(model, nnx.Param), tokenizer


def _make_tokenizer(spec: str, out: pathlib.Path, corpus_spec: str, max_bytes):
  from specjax.data.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer
  if spec == "byte":
    return ByteTokenizer()
  if (out / "tokenizer.json").is_file():  # resuming: the run's own tokenizer
    return load_tokenizer(out)
  if spec.startswith("bpe:"):
    try:
      size = int(spec[4:])
    except ValueError:
      raise ValueError(f"--tokenizer bpe:SIZE needs an integer SIZE, got {spec!r}") from None
    from specjax.data.corpus import load_corpus
    corpus = load_corpus(corpus_spec, max_bytes=max_bytes)
    return BPETokenizer.train((d.text for d in corpus.train), size)
  return load_tokenizer(spec)


def _out_dir(path: str) -> pathlib.Path:
  """--out: a directory to create or resume, never an existing file (checked before any
  work)."""
  out = pathlib.Path(path)
  if out.exists() and not out.is_dir():
    raise ValueError(f"--out {path} exists and is not a directory: give a checkpoint "
                     f"directory (created, or resumed if it exists)")
  return out


def _run_trainer(trainer, out, report=None) -> int:
  """trainer.run() and its summary (then report(result) if given), exit 0; interrupted
  (Ctrl-C / SIGTERM, a checkpoint saved in `out`), how to resume, exit 130."""
  try:
    result = trainer.run()
  except KeyboardInterrupt:
    print(f"interrupted: a checkpoint was saved in {out}; rerun the same command to resume",
          file=sys.stderr)
    return 130
  print(result.summary())
  if report is not None:
    report(result)
  return 0


def _train_model(config, tc, args, tokenizer, out, vocab_size=None, **trainer_kwargs) -> int:
  """Train `config` on --corpus into `out`, on the tokenizer's vocabulary (or `vocab_size`:
  a teacher's, whose embedding rows may outnumber its tokenizer's ids)."""
  from specjax.training.trainer import Trainer
  mesh = _mesh(args)  # before the data
  _, data = _load_data(args, tokenizer)
  vocab_size = tokenizer.vocab_size if vocab_size is None else vocab_size
  trainer = Trainer(config.replace(vocab_size=vocab_size), tc, data, tokenizer,
                    out_dir=out, progress=not args.no_progress, mesh=mesh,
                    **trainer_kwargs)
  return _run_trainer(trainer, out)


def _default_target(args, refusal: str):
  """The default target of --preset for --corpus (ValueError `refusal` unless it is an
  embedded corpus: the cached default targets exist for 'code' and 'prose')."""
  from specjax.data.corpus import EMBEDDED
  from specjax.training.defaults import corpus_of, load_default_target
  args.corpus = corpus_of(_preset_name(args), args.corpus)
  if args.corpus not in EMBEDDED:
    raise ValueError(refusal)
  return load_default_target(_preset_name(args), args.corpus, progress=not args.no_progress)


# ----------------------------------------------------------------------------- commands


def run_target(args) -> int:
  _resolve_corpus(args)
  from specjax.training.presets import get_preset
  preset = get_preset(_preset_name(args))
  out = _out_dir(args.out)
  tokenizer = _make_tokenizer(args.tokenizer, out, args.corpus, args.max_bytes)
  tc = _train_config(preset.target_train, args, "lm")
  return _train_model(preset.target, tc, args, tokenizer, out, role="target")


def run_draft(args) -> int:
  _resolve_corpus(args)
  from specjax.training.presets import get_preset
  from specjax.training.trainer import Teacher
  preset = get_preset(_preset_name(args))
  draft_cfg, base = preset.draft, preset.draft_train
  if args.recipe is not None:
    recipe = _apply_recipe(args, "draft")
    draft_cfg, base = recipe.model, recipe.schedule
  out = _out_dir(args.out)
  teacher = None
  if args.teacher is not None:
    teacher_cfg, teacher_params, tokenizer = _frozen_target(args.teacher, "--teacher")
  else:
    teacher_cfg, teacher_params, tokenizer = _default_target(
        args, "--teacher is required when --corpus is a directory (the cached default "
        "targets exist for 'code' and 'prose')")
  if not args.plain:
    import jax.numpy as jnp

    from specjax.models.transformer import cast_floats
    teacher = Teacher(teacher_cfg, cast_floats(teacher_params, jnp.float32))
  tc = _train_config(base, args, "lm" if args.plain else "distill")
  # the student's logits line up with the teacher's, padding rows included
  return _train_model(draft_cfg, tc, args, tokenizer, out, vocab_size=teacher_cfg.vocab_size,
                      teacher=teacher,
                      role="draft (plain)" if args.plain else "draft (distilled)")


def run_defaults(args) -> int:
  _resolve_corpus(args)
  from specjax.training import defaults
  from specjax.training.trainer import params_fingerprint
  from specjax.training import shipped
  preset = _preset_name(args)
  corpus = defaults.corpus_of(preset, args.corpus)
  pair = defaults.load_default_pair(preset, corpus, progress=not args.no_progress,
                                    rebuild=args.rebuild)
  found = None if args.rebuild else shipped.entry(preset, corpus,
                                                  defaults._recipe(preset, corpus), "target")
  print(f"default {preset} pair for corpus {corpus!r}"
        + (f" (shipped: {found[0]})" if found else "") + ":")
  for role in ("target", "draft"):
    if found:
      manifest, where = found[1][role]["trained"], f"on {found[1]['device']}"
    else:
      entry = (defaults.entry_dir(preset, corpus) if role == "target" else
               defaults.draft_entry_dir(preset, corpus, params_fingerprint(pair.target_params)))
      manifest, where = json.loads((entry / defaults.MANIFEST).read_text()), str(entry)
    cfg = getattr(pair, f"{role}_config")
    val = manifest[role].get("val") or {}
    print(f"  {role}: d_model={cfg.d_model} n_layers={cfg.n_layers} d_ff={cfg.d_ff}, "
          f"validation {val.get('bpb', float('nan')):.3f} bits/byte; built in "
          f"{manifest['build_seconds']} s with Python {manifest['python']}; {where}")
  return 0


def _head_target(args):
  """(config, params, tokenizer) of --target."""
  if args.target == "default":
    return tuple(_default_target(args, "--target default needs --corpus code or prose (the "
                                 "cached default targets)"))
  return _frozen_target(args.target, "--target")  # a checkpoint, HF directory or .gguf


def run_head(args, kind: str) -> int:
  _resolve_corpus(args)
  from specjax.training.defaults import DEFAULT_HEADS
  from specjax.training.heads import HeadTrainer
  if args.tree_budget < 1:
    raise ValueError(f"--tree-budget must be an int >= 1, got {args.tree_budget}")
  base = DEFAULT_HEADS.get(kind, DEFAULT_HEADS["eagle"])[1]
  if args.recipe is not None:
    base = _apply_recipe(args, kind).schedule
  head_kind = HEAD_KINDS[kind][2](args)  # validates the kind's own flags first
  out = _out_dir(args.out)
  mesh = _mesh(args)  # before the target
  config, params, tokenizer = _head_target(args)
  tc = _train_config(base, args, "lm")
  _, data = _load_data(args, tokenizer)
  if getattr(args, "draft_vocab", None) is not None:  # eagle3: the frequent tokens
    head_kind = head_kind.with_frequent_vocab(data.learned_tokens(), args.draft_vocab,
                                              config.vocab_size)
  trainer = HeadTrainer(head_kind, config, params, tc, data, tokenizer, out_dir=out,
                        progress=not args.no_progress, mesh=mesh)

  def report(result) -> None:
    if result.acceptance is not None:
      tree = result.acceptance.tree(args.tree_budget)
      print(f"best static tree of <= {args.tree_budget} nodes for this acceptance: {tree}")

  return _run_trainer(trainer, out, report)


def _apply_recipe(args, kind: str):
  """The --recipe (`presets.Recipe`), its kind flags set on `args` where the command line
  gave none (a flag given wins; so do the schedule flags, applied over its schedule by
  `_train_config`)."""
  from specjax.training.presets import get_recipe
  recipe = get_recipe(args.recipe, kind)
  for dest, value in recipe.flags:
    if getattr(args, dest, None) is None:
      setattr(args, dest, value)
  return recipe


def _load_for_measure(spec: str, role: str, args):
  if spec == "default":
    from specjax.training import defaults
    load = defaults.load_default_pair if role == "draft" else defaults.load_default_target
    models = load(_preset_name(args), args.corpus)
    return (getattr(models, f"{role}_config"), getattr(models, f"{role}_params"),
            models.tokenizer)
  from specjax.checkpoints.trained import load_trained
  trained = load_trained(spec)
  return trained.config, trained.params, trained.tokenizer


def run_measure(args) -> int:
  _resolve_corpus(args)
  import jax.numpy as jnp

  from specjax.data.batches import TokenData
  from specjax.data.corpus import load_corpus
  from specjax.training import evaluate as ev
  from specjax.models.transformer import cast_floats
  from specjax.training.trainer import evaluate as eval_bpb
  from specjax.training.trainer import compiled_steps
  from specjax.training.config import TrainConfig

  if args.k < 1 or args.prompts < 1 or args.new_tokens < args.k or args.prompt_len < 1:
    raise ValueError("need --k >= 1, --prompts >= 1, --prompt-len >= 1, --new-tokens >= k")
  t_cfg, t_params, tok = _load_for_measure(args.target, "target", args)
  d_cfg, d_params, d_tok = _load_for_measure(args.draft, "draft", args)
  if tok.to_spec() != d_tok.to_spec():
    raise ValueError("target and draft were trained with different tokenizers")
  t_params, d_params = cast_floats(t_params, jnp.float32), cast_floats(d_params, jnp.float32)
  data = TokenData.from_corpus(load_corpus(args.corpus), tok)
  seq_len = min(t_cfg.max_len, d_cfg.max_len, 128)
  windows = data.validation_windows(seq_len, args.windows)
  out = {"corpus": args.corpus, "target": args.target, "draft": args.draft}
  byte_len = tok.token_byte_lengths()
  for role, cfg, params in (("target", t_cfg, t_params), ("draft", d_cfg, d_params)):
    tc = TrainConfig(seq_len=seq_len, batch_size=16)
    _, eval_step = compiled_steps(cfg, tc)
    out[f"{role}_val_bpb"] = eval_bpb(eval_step, params, windows, 16, byte_len)["bpb"]
  tf = ev.teacher_forced_agreement((t_cfg, t_params), (d_cfg, d_params), windows[:, :-1])
  prompts = data.validation_windows(args.prompt_len, args.prompts)[:, :args.prompt_len]
  chain = ev.greedy_chain((t_cfg, t_params), (d_cfg, d_params), prompts,
                          new_tokens=args.new_tokens, k=args.k)
  if args.json:
    out.update(alpha_teacher_forced=tf.to_dict(),
               chain={k: (v.to_dict() if isinstance(v, ev.Estimate) else v)
                      for k, v in chain.items()})
    print(json.dumps(out))
    return 0
  print(f"corpus {args.corpus}: target {out['target_val_bpb']:.3f} bits/byte, "
        f"draft {out['draft_val_bpb']:.3f} bits/byte")
  print(f"teacher-forced greedy agreement on validation text: {tf}")
  print(f"T=0 chain, k={args.k}, {chain['prompts']} prompts x {args.new_tokens} greedy tokens:")
  print(f"  alpha (accepted/drafted)       {chain['alpha']}")
  print(f"  alpha_trial (accepted/trials)  {chain['alpha_trial']}")
  print(f"  tau (tokens per verification)  {chain['tau']:.3f}")
  return 0
