"""Exporting the shipped embedded pair (`training.shipped`'s layout) from the model cache,
building what is missing there by the recipes of `training.defaults`. It sits above both:
`defaults` reads a shipped entry through `shipped`, and this module writes one from what
`defaults` builds.

    python -c "from specjax.training import export_shipped; export_shipped.export(
        'shipped', 'code+tests', 'OUT')"      (benchmarks/train_shipped.sh on an accelerator)
"""

from __future__ import annotations

import json
import pathlib
import platform
import shutil
import time

import jax

from specjax.checkpoints.flat import save_flat
from specjax.files import file_sha256
from specjax.training import defaults, shipped
from specjax.training.heads import TargetBinding
from specjax.training.trainer import params_fingerprint


def export(preset: str, corpus: str, out: str | pathlib.Path, *, heads=shipped.HEAD_KINDS,
           progress: bool = True) -> dict:
  """Write the shipped layout for (preset, corpus) into `out` from the model cache, building
  what is missing there first. Returns the manifest."""
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  t0 = time.perf_counter()
  pair = defaults.load_default_pair(preset, corpus, progress=progress)
  target_fp = params_fingerprint(pair.target_params)
  entries = {"target": defaults.entry_dir(preset, corpus),
             "draft": defaults.draft_entry_dir(preset, corpus, target_fp)}
  manifest: dict = {"format": shipped.SHIPPED_FORMAT, "preset": preset, "corpus": corpus,
                    "exported": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "backend": jax.default_backend(),
                    "device": str(jax.devices()[0].device_kind),
                    "jax": jax.__version__, "python": platform.python_version()}
  for role, entry in entries.items():
    built = json.loads((entry / defaults.MANIFEST).read_text())
    params = getattr(pair, f"{role}_params")
    save_flat(out / f"{role}.safetensors", params, dtype="bfloat16")
    manifest[role] = {"recipe": built["recipe"], "trained": {k: v for k, v in built.items()
                                                            if k not in ("recipe", "files")},
                      "fingerprint_float32": params_fingerprint(params)}
  shutil.copyfile(entries["target"] / "tokenizer.json", out / "tokenizer.json")
  manifest["heads"] = {}
  for kind in heads:
    head = defaults.load_default_heads(kind, preset, corpus, progress=progress)
    entry = defaults.heads_entry_dir(kind, preset, corpus,
                                     TargetBinding.of(pair.target_config,
                                                      pair.target_params).fingerprint)
    built = json.loads((entry / defaults.MANIFEST).read_text())
    save_flat(out / f"{kind}.safetensors", head.params, dtype="bfloat16")
    manifest["heads"][kind] = {"recipe": built["recipe"],
                               "trained": {k: v for k, v in built.items()
                                           if k not in ("recipe", "files")},
                               "spec": built["recipe"]["spec"]}
  manifest["export_seconds"] = round(time.perf_counter() - t0, 1)
  manifest["files"] = {p.name: file_sha256(p) for p in sorted(out.iterdir())
                       if p.is_file() and p.name != shipped.MANIFEST}
  (out / shipped.MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
  return manifest
