"""The shipped embedded pair: default models committed with the package instead of trained
on first use.

    specjax/embedded/<preset>-<corpus>/
        manifest.json         recipes, bits/byte, build time and hardware, data hashes,
                              the sha256 of every file below
        tokenizer.json
        target.safetensors    bfloat16 weights (`checkpoints.flat`), no optimizer state
        draft.safetensors
        eagle.safetensors     the default heads, where built
        medusa.safetensors

`export_shipped.export(preset, corpus, out)` writes this layout from the model cache
(building what is missing there by the preset's recipe: `specjax train defaults --preset
shipped --corpus code+tests` and the default heads). `training.defaults` reads it: a
shipped entry whose recipes equal the ones the code computes now is used instead of the
cache, its files checked against the manifest's digests; anything else (another recipe, a
damaged file) falls back to the cache and the recipe, saying why in one line.

Weights are stored in bfloat16 (the quickstart serves the target in bf16) and loaded as the
float32 values those bf16 numbers are; the manifest records both the fingerprint of the
float32 weights the recipe trained (what a rebuild's cache entry holds) and that of the
shipped, rounded ones (what a shipped load yields).
"""

from __future__ import annotations

import json
import pathlib
import sys

import jax

from specjax.checkpoints.flat import load_flat
from specjax.data.tokenizer import load_tokenizer
from specjax.files import file_sha256
from specjax.models.transformer import ModelConfig
from specjax.training.heads import HeadAcceptance, TargetBinding, TrainedHead, kind_from_spec
from specjax.training.trainer import abstract_params

SHIPPED_FORMAT = 1
MANIFEST = "manifest.json"
ROLES = ("target", "draft")
HEAD_KINDS = ("eagle", "medusa")


def embedded_root() -> pathlib.Path:
  return pathlib.Path(__file__).resolve().parent.parent / "embedded"


def shipped_dir(preset: str, corpus: str) -> pathlib.Path:
  return embedded_root() / f"{preset}-{corpus}"


class ShippedError(ValueError):
  """A shipped entry that cannot be used (the caller falls back to the recipe)."""


def read_manifest(directory: pathlib.Path, fmt: int = SHIPPED_FORMAT) -> dict:
  """directory/manifest.json of format `fmt` (ShippedError, one line, otherwise)."""
  try:
    manifest = json.loads((directory / MANIFEST).read_text())
  except (OSError, ValueError) as e:
    raise ShippedError(f"cannot read {directory / MANIFEST}: {e}") from None
  if manifest.get("format") != fmt:
    raise ShippedError(f"{directory / MANIFEST} has format {manifest.get('format')!r}, this "
                       f"version reads {fmt}")
  return manifest


def check_file(directory: pathlib.Path, manifest: dict, name: str) -> pathlib.Path:
  """`directory/name`, after checking its sha256 against the manifest."""
  path = directory / name
  want = (manifest.get("files") or {}).get(name)
  if want is None:
    raise ShippedError(f"{directory / MANIFEST} lists no {name}")
  if not path.is_file():
    raise ShippedError(f"{path} is missing")
  if file_sha256(path) != want:
    raise ShippedError(f"{path} does not match its digest in {MANIFEST} (damaged or edited)")
  return path


def load_params(directory: pathlib.Path, manifest: dict, name: str, like):
  """The float32 parameters stored in `directory/name.safetensors` in the tree of `like`."""
  path = check_file(directory, manifest, f"{name}.safetensors")
  f32 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jax.numpy.float32), like)
  try:
    return load_flat(path, like=f32)
  except ValueError as e:
    raise ShippedError(str(e)) from None


def _log(msg: str) -> None:
  print(f"specjax: {msg}", file=sys.stderr, flush=True)


def entry(preset: str, corpus: str, recipe: dict, role: str) -> tuple[pathlib.Path, dict] | None:
  """(directory, manifest) of the shipped entry for (preset, corpus) when its `role` recipe
  ("target", "draft" or a head kind) equals `recipe`; None when nothing is shipped for it,
  or (said in one line) when the shipped recipe differs or the manifest cannot be read."""
  directory = shipped_dir(preset, corpus)
  if not (directory / MANIFEST).is_file():
    return None
  try:
    manifest = read_manifest(directory)
  except ShippedError as e:
    _log(f"the shipped {preset!r} pair is unusable ({e}); using the model cache")
    return None
  stored = (manifest.get(role) or manifest.get("heads", {}).get(role) or {}).get("recipe")
  if stored != recipe:
    if stored is not None:
      _log(f"the shipped {preset!r} {role} was built by another recipe than this version's; "
           "using the model cache (built from the recipe on first use)")
    return None
  return directory, manifest


def target_fingerprint_float32(manifest: dict) -> str:
  """The fingerprint of the float32 target the recipe trained (what the draft's and the
  heads' recipes are bound to)."""
  return manifest["target"]["fingerprint_float32"]


# ----------------------------------------------------------------------------- loading
# (for training.defaults, which decides when a shipped entry is used and turns a
# ShippedError into its CacheEntryError)


def load_model_params(directory: pathlib.Path, manifest: dict, name: str, config: dict | None,
                      like=None):
  """The float32 parameters of shipped `name` (a model of `config`, or the tree `like`);
  `ShippedError` (one line saying what to do) when a file is damaged."""
  if like is None:
    like = abstract_params(ModelConfig.from_dict(config))[1]
  try:
    return load_params(directory, manifest, name, like)
  except ShippedError as e:
    raise ShippedError(f"the shipped {name} is damaged ({e}): reinstall specjax, or run "
                       "`specjax train defaults --rebuild` to build it from its "
                       "recipe") from None


def load_target(directory: pathlib.Path, manifest: dict, recipe: dict):
  """The shipped target: (ModelConfig, float32 weights, tokenizer); `ShippedError` when a
  file is damaged."""
  params = load_model_params(directory, manifest, "target", recipe["target"])
  try:
    tokenizer = load_tokenizer(check_file(directory, manifest, "tokenizer.json"))
  except ShippedError as e:
    raise ShippedError(f"the shipped tokenizer is damaged ({e}): reinstall specjax") from None
  return ModelConfig.from_dict(recipe["target"]), params, tokenizer


def load_head(directory: pathlib.Path, manifest: dict, kind: str, recipe: dict, target):
  """The shipped `kind` heads as a `heads.TrainedHead`, bound to the shipped `target` (a
  DefaultTarget: the bf16-rounded weights they draft for)."""
  head_kind = kind_from_spec(kind, recipe["spec"])
  cfg = target.target_config.replace(dtype="float32")
  like = jax.eval_shape(lambda: head_kind.init(cfg, jax.random.key(0)))
  params = load_model_params(directory, manifest, kind, None, like)
  built = manifest["heads"][kind]["trained"]
  acc = built.get("acceptance")
  return TrainedHead(head_kind, params, TargetBinding.of(target.target_config,
                                                         target.target_params),
                     None if acc is None else HeadAcceptance.from_dict(acc), target.tokenizer,
                     {"shipped": str(directory), **built}, recipe["train"]["steps"])
