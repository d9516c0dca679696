"""Draft heads shipped for a real target: `--draft eagle3:NAME` with the target's own file
(the SmolLM2 GGUF file of `benchmarks/real_model.sh`), no training.

    specjax/embedded/heads/<NAME>/
        config.json           the head in the published EAGLE-3 layout (`export-head
        model.safetensors     --format eagle3 --dtype bfloat16`: what SGLang and vLLM load)
        manifest.json         name, kind, the recipe (`presets.RECIPES`), the training
                              data's run and totals, the trained head's schedule, seconds and
                              held-out acceptance, the target's config and float32 parameter
                              fingerprint, the sha256 of both files above

`ship(head_dir, target, out, ...)` writes this layout from a trained head directory.
`bound_dir(name, target)` checks the files against the manifest and the target against the
fingerprint it was trained for (another model, or the same model's weights changed, is
refused in one line), then imports the head once into the model cache
(`$SPECJAX_CACHE_DIR/heads/<NAME>-<digest>`, `published.import_head`) and returns that
directory, which `eagle3:DIR` loads. The shipped weights are bfloat16: the head that runs is
the bf16-rounded one, and the manifest's acceptance is measured on it.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import platform
import shutil
import time

import jax.numpy as jnp
from flax import nnx

from specjax.data import selfdistill
from specjax.files import atomic_write, file_sha256, make_temp_dir
from specjax.models.transformer import cast_floats
from specjax.training import published
from specjax.training.defaults import cache_dir
from specjax.training.heads import read_head_meta
from specjax.training.presets import RECIPES
from specjax.training import shipped
from specjax.training.shipped import MANIFEST, embedded_root
from specjax.training.trainer import params_fingerprint

FORMAT = 1
FILES = ("config.json", "model.safetensors")


def heads_root() -> pathlib.Path:
  return embedded_root() / "heads"


def names() -> list[str]:
  """The shipped heads' names (`eagle3:NAME`)."""
  root = heads_root()
  if not root.is_dir():
    return []
  return sorted(p.name for p in root.iterdir() if (p / MANIFEST).is_file())


def is_shipped(where: str) -> bool:
  """Whether `eagle3:WHERE` names a shipped head: a shipped name that is not also a path
  (a directory of that name wins, as it always did)."""
  return where in names() and not pathlib.Path(where).exists()


def target_fingerprint(module) -> str:
  """The float32 parameter fingerprint of a target module (what the manifest records)."""
  return params_fingerprint(cast_floats(nnx.state(module, nnx.Param), jnp.float32))


def read_manifest(name: str) -> dict:
  try:
    return shipped.read_manifest(heads_root() / name, FORMAT)
  except shipped.ShippedError as e:
    raise ValueError(f"shipped head {name!r}: {e}") from None


def bound_dir(name: str, target, tokenizer=None) -> pathlib.Path:
  """The cached specjax head directory of shipped head `name` for `target` (a Transformer
  or `LM`), imported on first use; ValueError when the files are damaged or `target` is not
  the model the head was trained for."""
  module, _ = published.files.target_of(target)
  manifest = read_manifest(name)
  src = heads_root() / name
  for f in FILES:
    if not (src / f).is_file() or file_sha256(src / f) != manifest["files"].get(f):
      raise ValueError(f"shipped head {name!r}: {src / f} is missing or does not match its "
                       f"digest in {MANIFEST}")
  want = manifest["target"]["fingerprint_float32"]
  have = target_fingerprint(module)
  if have != want:
    raise ValueError(f"eagle3:{name} drafts for {manifest['target']['name']} (float32 "
                     f"parameter fingerprint {want}); this target's is {have}: load that "
                     f"model, or train a head for this one (`specjax train eagle3`)")
  digest = manifest["files"]["model.safetensors"][:16]  # checked above
  out = cache_dir() / "heads" / f"{name}-{digest}"
  if not out.is_dir():
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(out.parent, out.name)
    try:
      published.import_head(src, module, tmp / "head", kind="eagle3", tokenizer=tokenizer)
      try:
        (tmp / "head").rename(out)
      except OSError:  # another process imported it first: theirs is the same head
        if not out.is_dir():
          raise
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
  return out


def ship(head_dir, target, out, *, name: str, recipe: str, target_name: str,
         data_dir=None, acceptance: dict | None = None,
         training_seconds: float | None = None) -> dict:
  """Write shipped head `name` into `out` (module doc) from the trained eagle3 head in
  `head_dir` (bound to `target`, a Transformer); `data_dir`: its selfdistill data (the run
  and totals go into the manifest); `acceptance`: figures measured with the shipped bf16
  head (e.g. the real-model benchmark's); `training_seconds`: the training run's wall time.
  Returns the manifest."""
  module, _ = published.files.target_of(target)
  if recipe not in RECIPES:
    raise ValueError(f"recipe must be one of {sorted(RECIPES)}, got {recipe!r}")
  out = pathlib.Path(out)
  published.export_head(head_dir, module, out, format="eagle3", dtype="bfloat16",
                        overwrite=True)
  meta = read_head_meta(head_dir)
  manifest = {
      "format": FORMAT, "name": name, "kind": "eagle3",
      "recipe": {"name": recipe, **_jsonable(dataclasses.asdict(RECIPES[recipe]))},
      "trained": {**{k: meta[k] for k in ("train_config", "data", "acceptance") if k in meta},
                  "seconds": training_seconds},
      "target": {"name": target_name, "fingerprint_float32": target_fingerprint(module),
                 "config": module.config.to_dict()},
      "shipped": {"dtype": "bfloat16", "exported": time.strftime("%Y-%m-%d"),
                  "python": platform.python_version()},
  }
  if data_dir is not None:
    data = selfdistill.read_manifest(data_dir)
    manifest["data"] = {"run": data["run"], "totals": data.get("totals"),
                        "shards": len(data["shards"]),
                        "sha256": sorted(s["sha256"] for s in data["shards"])}
  if acceptance is not None:
    manifest["measured"] = acceptance
  manifest["files"] = {f: file_sha256(out / f) for f in FILES}
  atomic_write(out / MANIFEST, json.dumps(_jsonable(manifest), indent=1, sort_keys=True) + "\n")
  return manifest


def _jsonable(x):
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, (str, int, float, bool)) or x is None:
    return x
  return str(x)
