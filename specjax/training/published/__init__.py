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
from specjax.files import prepare_output_dir

FORMATS = {
    "eagle": eagle,
    "eagle3": eagle3,
    "medusa": medusa,
}

_NAMES = {"eagle": "an EAGLE-1/2", "eagle3": "an EAGLE-3", "medusa": "a Medusa"}


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


def _check_out(out_dir, overwrite: bool, source, target) -> None:
  """The output directory's refusals (`dirs.prepare_output_dir`) before any reading, naming
  --out; it may not hold the source nor a target directory."""
  inputs = (source,) + ((target,) if isinstance(target, (str, os.PathLike))
                        and os.path.exists(target) else ())
  try:
    prepare_output_dir(out_dir, overwrite, inputs=inputs)
  except ValueError as e:
    raise ValueError(f"--out: {e}") from None


def import_head(src_dir: str | os.PathLike, target, out_dir: str | os.PathLike, *,
                kind: str | None = None, **kwargs) -> pathlib.Path:
  """Import a published head (kind None: `detect_kind`) as a specjax head directory."""
  if kind is not None and kind in FORMATS:
    try:
      found = detect_kind(src_dir)
    except ValueError:  # the files do not tell: the kind given is taken
      found = kind
    if found != kind:
      raise ValueError(f"--kind {kind}: {str(src_dir)!r} is {_NAMES[found]} head (its "
                       f"config.json and tensor names say so): use --kind {found}")
  kind = detect_kind(src_dir) if kind is None else kind
  _check_out(out_dir, kwargs.get("overwrite", False), src_dir, target)
  return _format(kind, "kind").import_head(src_dir, target, out_dir, **kwargs)


def export_head(head_dir: str | os.PathLike, target, out_dir: str | os.PathLike, *,
                format: str, **kwargs) -> pathlib.Path:
  """Export a specjax head directory in a published format."""
  _check_out(out_dir, kwargs.get("overwrite", False), head_dir, target)
  return _format(format, "format").export_head(head_dir, target, out_dir, **kwargs)
