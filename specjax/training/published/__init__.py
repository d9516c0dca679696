"""Draft heads in the formats other projects publish: import them into specjax head
directories (`eagle:DIR`, `medusa:DIR`), export ours to them.

    from specjax.checkpoints import published
    published.import_head("EAGLE-dir", target, "heads/eagle")        # kind read from the files
    published.FORMATS["medusa"].export_head("heads/medusa", target, "medusa-hf")

One module per format, each with `import_head(src_dir, target, out_dir)` and
`export_head(head_dir, target, out_dir)` (target: a Transformer or a target reference);
`FORMATS` maps the format's name to its module. What the formats share (reading
safetensors / PyTorch pickles and config.json, writing, refusals) is `files`. The tensors of
each format and what specjax maps them to: docs/checkpoints.md.
"""

from __future__ import annotations

import os
import pathlib

from specjax.training.published import eagle, eagle3, files, medusa
from specjax.checkpoints.hf import safetensors_specs

FORMATS = {
    "eagle": eagle,
    "eagle3": eagle3,
    "medusa": medusa,
}


def _format(name: str, flag: str):
  if name not in FORMATS:
    raise ValueError(f"{flag} must be one of {sorted(FORMATS)}, got {name!r}")
  return FORMATS[name]


def detect_kind(src_dir: str | os.PathLike) -> str:
  """The format of a published head directory, from its config.json and tensor names
  (ValueError when neither tells)."""
  hf = files.read_config(src_dir, required=False)
  if "medusa_num_heads" in hf:
    return "medusa"
  if "draft_vocab_size" in hf or any("eagle3" in str(a).lower()
                                     for a in hf.get("architectures") or []):
    return "eagle3"
  weights = files.weight_files(src_dir)
  names = set()
  for path in weights:
    if path.suffix == ".safetensors":
      names |= set(safetensors_specs(path))
    else:
      names |= set(files.read_weights(src_dir))
      break
  names = {n[len("model."):] if n.startswith("model.") else n for n in names}
  if any(n.startswith("midlayer.") or n in ("d2t", "t2d") for n in names):
    return "eagle3"
  if "fc.weight" in names:
    return "eagle"
  if any(medusa._NAME.match(n) for n in names):
    return "medusa"
  raise ValueError(f"cannot tell the format of {str(src_dir)!r} from its config.json and "
                   f"tensor names: pass the kind ({', '.join(sorted(FORMATS))})")


def import_head(src_dir: str | os.PathLike, target, out_dir: str | os.PathLike, *,
                kind: str | None = None, **kwargs) -> pathlib.Path:
  """Import a published head (kind None: `detect_kind`) as a specjax head directory."""
  kind = detect_kind(src_dir) if kind is None else kind
  return _format(kind, "kind").import_head(src_dir, target, out_dir, **kwargs)


def export_head(head_dir: str | os.PathLike, target, out_dir: str | os.PathLike, *,
                format: str, **kwargs) -> pathlib.Path:
  """Export a specjax head directory in a published format."""
  return _format(format, "format").export_head(head_dir, target, out_dir, **kwargs)
