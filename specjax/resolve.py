"""Targets and drafters by reference: one resolver for the CLI, the studies and Python.

    import specjax
    run = specjax.load(target="default", draft="eagle:default", k=4)
    out = decoding.speculative_generate(run.target, run.drafter, ids, **run.shape,
                                        max_new_tokens=64)

target:
  "default"        the shipped embedded target (`training.defaults`)
  "random:SPEC"    random weights of a model config spec (`models.presets.parse_config`:
                   a preset name, NAME:field=value,..., JSON), byte vocabulary; or a
                   larger one that NAME:...,vocab_size=N names (a padded vocabulary: the
                   prompts are bytes, the LM head has the shape's N rows, e.g.
                   "random:llama3-8b:vocab_size=128256")
  a directory      a Hugging Face model directory (imported on first use and cached under
                   $SPECJAX_CACHE_DIR/hf, keyed by the sha256 of its files: `imported_hf`)
                   or a specjax checkpoint (`checkpoints.load_model`)
  a .gguf file     a GGUF model file (llama.cpp's format), imported on first use and cached
                   under $SPECJAX_CACHE_DIR/gguf, keyed by the sha256 of the file:
                   `imported_gguf`
draft:
  "default"        the embedded pair's distilled draft model (with the default target)
  "self"           the target as its own draft
  "lookup"         prompt lookup (n-gram matches in the context; no model)
  "layer-skip:M"   the target's first M layers, final norm and head (its own cache)
  "eagle:DIR"      an EAGLE head (`specjax train eagle`; "eagle:default": the default
                   target's), a chain of k
  "eagle3:DIR"     an EAGLE-3-structured head (`specjax import-head --kind eagle3`, or
                   trained; "eagle:DIR" also loads one)
  "medusa:DIR"     Medusa heads ("medusa:default"); k is the node budget of the best static
                   tree for their measured acceptance
  "random:SPEC"    a random draft model on the target's vocabulary
  a directory      a draft model checkpoint (or a .gguf file, as for the target)
The shape: `k` (a chain; "auto" for adaptive speculation) or `tree` (a `trees` spec),
returned as the keyword arguments `decoding.speculative_generate` takes (`Loaded.shape`).
Errors name the argument (`flag`: the CLI passes its flag names) and what is allowed.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from specjax.training.defaults import load_default_target
from specjax.data.tokenizer import ByteTokenizer
from specjax.models.transformer import Transformer
from specjax.checkpoints import is_hf_dir
from specjax.files import dir_sha256, file_sha256
from specjax.checkpoints import hf, save_model
from specjax.training.defaults import cache_dir
from specjax.models.presets import parse_config
from specjax.models.presets import spec_sets
from specjax.checkpoints import load_model
from specjax.training.defaults import load_default_pair
from specjax.data.tokenizer import vocab_mismatch
from specjax.verify import trees
from specjax.drafters.medusa import MedusaDrafter
from specjax.training.defaults import load_default_heads
from specjax.training.heads import load_head
from specjax.training import shipped_heads
from specjax.drafters.eagle import EagleDrafter
from specjax.drafters.layer_skip import LayerSkipDrafter
from specjax.drafters.lookup import LookupDrafter
from specjax.drafters.model import ModelDrafter
from specjax.models.transformer import with_dtype
from specjax.checkpoints.gguf import open_gguf, save_gguf
from specjax.checkpoints.gguf.read import is_gguf_file

HEAD_DRAFTS = ("medusa", "eagle", "eagle3")  # draft heads on the target: KIND:DIR, KIND:default


@dataclasses.dataclass
class Loaded:
  """What `load` resolved: the target module, its tokenizer (None for a random model without
  one), the draft model (None for drafters without a model of their own), the drafter object
  and the speculation shape (`speculative_generate`'s k= / tree= keyword)."""
  target: Any
  tokenizer: Any
  draft: Any
  drafter: Any
  shape: dict
  target_ref: str
  draft_ref: str


def draft_kind(spec: str | None, flag: str = "draft") -> tuple[str, Any]:
  """("lookup", None), ("layer-skip", M), (head kind, DIR or "default"), ("self", None),
  ("default", None), ("random", SPEC) or ("model", DIR) from a draft reference (syntax
  checked; None is "random" with no spec: the caller's default config)."""
  spec = spec or ""
  if spec == "lookup":
    return "lookup", None
  if spec == "layer-skip" or spec.startswith("layer-skip:"):
    _, sep, m = spec.partition(":")
    if not sep or not m.strip().isdigit() or int(m) < 1:
      raise ValueError(f"{flag} {spec!r}: write layer-skip:M with M an int >= 1, the number "
                       f"of the target's first layers the draft runs (e.g. layer-skip:2)")
    return "layer-skip", int(m)
  kind, sep, where = spec.partition(":")
  if sep and kind in HEAD_DRAFTS:
    if not where:
      raise ValueError(f"{flag} {spec!r}: write {kind}:DIR or {kind}:default")
    if kind == "eagle3" and where == "default":
      raise ValueError(f"{flag} {spec!r}: no default eagle3 head ships; write eagle3:DIR (a "
                       f"head from `specjax import-head` or `specjax train eagle3`) or "
                       f"eagle3:NAME, a head shipped for a real target "
                       f"({', '.join(shipped_heads.names()) or 'none'})")
    return kind, where
  if spec in ("self", "default"):
    return spec, None
  if kind == "random" and sep:
    return "random", where
  if not spec:
    return "random", None
  return "model", spec


def load_target(ref: str = "default", *, seed: int = 0, flag: str = "target"):
  """(Transformer, tokenizer) of a target reference (module doc)."""
  if ref == "default":
    t = load_default_target()
    return t.target_module(), t.tokenizer
  kind, sep, spec = ref.partition(":")
  if kind == "random" and sep:
    from flax import nnx

    tok = ByteTokenizer()
    return Transformer(random_target_config(flag, spec), rngs=nnx.Rngs(seed)), tok
  return load_from_ref(flag, ref)


def _model_dir(ref: str) -> str:
  """A model directory to load: a Hugging Face one's cached import (`imported_hf`), else
  the reference itself (a GGUF file is imported by `load_from_ref`)."""
  return str(imported_hf(ref)) if is_hf_dir(ref) else ref


def imported_hf(directory):
  """The specjax checkpoint of a Hugging Face model directory: imported once into
  $SPECJAX_CACHE_DIR/hf/<name>-<key> (key: `files.dir_sha256`, so an edited file is imported
  again) and reused after; written all or nothing (`checkpoints.save_model`)."""
  import pathlib

  src = pathlib.Path(directory)
  entry = cache_dir() / "hf" / f"{src.resolve().name}-{dir_sha256(src)[:16]}"
  if not entry.is_dir():
    imported = hf.import_hf(src)  # names what is missing or broken
    save_model(entry, imported.model(), tokenizer_dir=src,
               metadata={"family": imported.family, "source_layout": imported.layout,
                         "source": str(src.resolve()), "hf_config": imported.hf_config})
  return entry


def imported_gguf(path):
  """The specjax checkpoint of a GGUF file: imported once (float32) into
  $SPECJAX_CACHE_DIR/gguf/<file stem>-<first 16 hex digits of the file's sha256> and reused
  after; written all or nothing (`gguf.save_gguf`)."""
  import pathlib

  src = pathlib.Path(path)
  open_gguf(src)  # a missing, foreign or truncated file is named before it is hashed
  key = file_sha256(src)
  entry = cache_dir() / "gguf" / f"{src.name.removesuffix('.gguf')}-{key[:16]}"
  if not entry.is_dir():
    entry.parent.mkdir(parents=True, exist_ok=True)
    save_gguf(src, entry, metadata={"source": str(src.resolve()), "sha256": key})
  return entry


def config_from_ref(flag: str, spec: str, vocab_size: int | None):
  """parse_config (with `vocab_size` unless None), its errors naming the argument."""
  try:
    return parse_config(spec, **({} if vocab_size is None else {"vocab_size": vocab_size}))
  except (ValueError, TypeError) as e:  # bad JSON, unknown preset or field, bad value
    raise ValueError(f"{flag} {spec!r}: {e}") from None
  except OSError as e:
    raise OSError(e.errno, e.strerror, f"{flag} {spec}") from None


def random_target_config(flag: str, spec: str):
  """The config of a "random:SPEC" target: the byte tokenizer's vocabulary, unless a
  NAME:field=value spec sets vocab_size (at least the tokenizer's; the rows past it are a
  padded vocabulary no prompt uses). ValueError naming `flag` otherwise."""
  byte_vocab = ByteTokenizer.vocab_size
  if not spec_sets(spec, "vocab_size"):
    return config_from_ref(flag, spec, byte_vocab)
  config = config_from_ref(flag, spec, None)
  if config.vocab_size < byte_vocab:
    raise ValueError(f"{flag} {spec!r}: vocab_size must be >= {byte_vocab} (the byte "
                     f"tokenizer's ids), got {config.vocab_size}")
  return config


def load_from_ref(flag: str, path: str):
  """checkpoints.load_model of a model directory (a Hugging Face one through its cached
  import, `imported_hf`; a GGUF file through `imported_gguf`), its errors naming the
  argument."""
  try:
    if str(path).endswith(".gguf") or is_gguf_file(path):
      return load_model(imported_gguf(path))
    return load_model(_model_dir(path))
  except ValueError as e:
    raise ValueError(f"{flag} {path}: {e}") from None
  except OSError as e:
    raise OSError(e.errno, e.strerror or str(e), f"{flag} {path}") from None


def draft_model(spec: str | None, target, *, seed: int = 0, default_config: str | None = None,
                flag: str = "draft", tokenizer=None):
  """The draft Transformer of a model reference ("self", "default", "random:SPEC", a
  directory; None: a random model of `default_config`), or None for drafters without a
  model of their own. tokenizer: the target's, if known; a directory's draft must spell its
  ids the same way (its vocabulary may be shorter: padded rows, docs/exactness.md)."""
  kind, arg = draft_kind(spec, flag)
  if kind == "self":
    return target
  if kind == "default":
    return load_default_pair().draft_module()
  if kind == "model":
    net, draft_tok = load_from_ref(flag, _model_dir(arg))
    why = vocab_mismatch(tokenizer, draft_tok)
    if why:
      raise ValueError(f"{flag} {arg}: the draft's tokenizer is not the target's ({why}): "
                       f"speculative decoding needs one vocabulary")
    return net
  if kind == "random":
    from flax import nnx

    config = config_from_ref(flag if arg else "--draft-config", arg or default_config,
                             target.config.vocab_size)
    return Transformer(config, rngs=nnx.Rngs((seed + 1) % 2**63))
  return None


def head_drafter(spec: str, target, kind: str, where: str, *, k, deterministic: bool = False,
                 tree=None, flag: str = "draft", serving=None):
  """(drafter, shape) of trained draft heads: an EAGLE head drafts a chain of k (or `tree`);
  for Medusa heads k is the node budget of the best tree for their measured acceptance.
  The heads are checked against `target` (what they were trained for) and draft for
  `serving` (the same target served in another dtype; default `target`)."""
  serving = target if serving is None else serving
  from flax import nnx

  if where == "default":
    head = load_default_heads(kind)
  else:
    if kind == "eagle3" and shipped_heads.is_shipped(where):  # eagle3:NAME, a shipped head
      try:
        where = str(shipped_heads.bound_dir(where, target))
      except ValueError as e:
        raise ValueError(f"{flag} {spec}: {e}") from None
    try:
      # eagle:DIR takes either EAGLE structure (the head records which); eagle3:DIR only its own
      head = load_head(where, target=(target.config, nnx.state(target, nnx.Param)),
                       kind=None if kind == "eagle" else kind)
    except ValueError as e:
      raise ValueError(f"{flag} {spec}: {e}") from None
    if head.kind.name not in (kind, "eagle3"):
      raise ValueError(f"{flag} {spec}: {where!r} holds a {head.kind.name!r} head, not an "
                       f"EAGLE head")
  if head.kind.name in ("eagle", "eagle3"):  # a chain of k (or the adaptive menu, or the tree)
    layers = head.kind.feature_layers(target.config)
    params = (head.kind.module(target.config, head.params) if head.kind.name == "eagle3"
              else head.params)
    return (EagleDrafter.of(serving, params, layers, deterministic=deterministic),
            _shape(k, tree))
  drafter = MedusaDrafter.of(serving, head.params)
  if tree is not None or k == "auto":
    return drafter, _shape(k, tree)
  depth = head.kind.heads
  best = (head.acceptance.tree(k, max_depth=depth) if head.acceptance is not None
          else trees.chain(min(k, depth)))
  return drafter, {"tree": best}


def _shape(k, tree) -> dict:
  return {"tree": tree} if tree is not None else {"k": k}


def make_drafter(spec: str | None, target, draft=None, *, k=4, tree=None,
                 deterministic: bool = False, ngram: tuple[int, int] = (3, 1),
                 flag: str = "draft", serving=None):
  """(drafter, shape) for a draft reference; `draft` is the draft model where the reference
  names one (`draft_model`); `serving`: the target as served (another dtype), default
  `target`."""
  serving = target if serving is None else serving
  kind, arg = draft_kind(spec, flag)
  if kind == "lookup":
    return LookupDrafter(max_ngram=ngram[0], min_ngram=ngram[1]), _shape(k, tree)
  if kind == "layer-skip":
    try:
      drafter = LayerSkipDrafter.of(serving, arg, deterministic=deterministic)
    except ValueError as e:
      raise ValueError(f"{flag} {spec}: {e}") from None
    return drafter, _shape(k, tree)
  if kind in HEAD_DRAFTS:
    return head_drafter(spec, target, kind, arg, k=k, deterministic=deterministic, tree=tree,
                        flag=flag, serving=serving)
  return ModelDrafter.of(draft, deterministic=deterministic), _shape(k, tree)


def load(target: str = "default", draft: str = "eagle:default", *, k=4, tree=None,
         deterministic: bool = False, ngram: tuple[int, int] = (3, 1), seed: int = 0,
         target_dtype: str | None = None) -> Loaded:
  """Target, drafter and tokenizer from two references, in one call (module doc).
  target_dtype: serve the target's weights in "float32" or "bfloat16" (None: as stored)."""
  if not draft:
    raise ValueError("draft must name a drafter: default, self, lookup, layer-skip:M, "
                     "eagle:DIR, medusa:DIR, random:SPEC or a model directory")
  kind, _ = draft_kind(draft)
  if kind in HEAD_DRAFTS and str(draft).endswith(":default") and target != "default":
    raise ValueError(f"draft {draft} holds heads for the default target: pass "
                     f"target='default', or {kind}:DIR with heads trained for target "
                     f"{target!r}")
  model, tok = load_target(target, seed=seed)
  serving = model
  if target_dtype is not None:
    serving = with_dtype(model, target_dtype)
  draft_net = draft_model(draft, serving if kind == "self" else model, seed=seed,
                          tokenizer=tok)
  drafter, shape = make_drafter(draft, model, draft_net, k=k, tree=tree,
                                deterministic=deterministic, ngram=ngram, serving=serving)
  return Loaded(serving, tok, draft_net, drafter, shape, target, draft)
