"""The published Medusa-1 head format (FasterDecoding/Medusa): import into a specjax head
directory, export ours back.

The format. config.json holds `medusa_num_heads` (K), `medusa_num_layers` (R, default 1)
and `base_model_name_or_path`; the weights (`medusa_lm_head.safetensors`, or the older
`medusa_lm_head.pt` pickle; a whole-model checkpoint prefixes the names `medusa_head.`) are,
for each head i = 0..K-1,

    {i}.{r}.linear.weight [D, D], {i}.{r}.linear.bias [D]   r = 0..R-1: h <- h + SiLU(W h + b)
    {i}.{R}.weight [V, D]                                    the head's LM projection (no bias)

read from the target's last hidden state after its final norm; head i guesses the token
i + 2 positions ahead of that hidden state (the target's own LM head gives the next one).

In specjax these are `drafters.medusa` heads (kind `MedusaHeads`): w [K, D, D] and b [K, D]
(R = 1) or w [K, R, D, D] and b [K, R, D], and each head's own projection lm [K, D, V]
unless every one equals the target's LM head, in which case they share it (so our heads,
exported with the target's LM head copied in, come back as they were: round trip
bit-identical).
"""

from __future__ import annotations

import os
import pathlib
import re

import numpy as np

from specjax.training.published import files
from specjax.training.medusa import MedusaHeads
from specjax.data.json_files import field

FORMAT = "medusa"
WEIGHTS = "medusa_lm_head.safetensors"
_NAME = re.compile(r"^(?:medusa_head\.)?(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


def _sizes(hf: dict, names) -> tuple[int, int]:
  """(K, R): from config.json, else from the tensor names."""
  found = [m.groups() for m in map(_NAME.match, names) if m]
  if not found:
    raise ValueError("no Medusa head tensors ({i}.{r}.linear.weight, {i}.{R}.weight) found")
  k = field(hf, "medusa_num_heads", "positive int", where="config.json",
            default=1 + max(int(i) for i, _, _ in found))
  r = field(hf, "medusa_num_layers", "positive int", where="config.json",
            default=max(int(j) for _, j, _ in found))
  return k, r


def head_params(hf: dict, tensors: dict, module):
  """(MedusaHeads kind, params dict) of the published tensors for a target module; refuses
  a tensor of the wrong shape (naming it and both shapes), a missing or an unexpected one."""
  config = module.config
  d, v = config.d_model, config.vocab_size
  byname = {}
  for name, x in tensors.items():
    m = _NAME.match(name)
    if m is None:
      raise ValueError(f"unexpected tensor {name!r} (shape {tuple(x.shape)}): not part of "
                       "Medusa-1 heads")
    byname[m.groups()] = (name, x)
  k, r = _sizes(hf, [n for n, _ in byname.values()])

  def get(i, j, what, shape, role):
    key = (str(i), str(j), what)
    if key not in byname:
      raise ValueError(f"missing tensor '{i}.{j}.{what}' ({role}; config.json says "
                       f"{k} heads of {r} blocks)")
    name, x = byname.pop(key)
    files.check_shape(name, x, shape, role)
    return x

  w = np.stack([np.stack([get(i, j, "linear.weight", (d, d), "a residual block").T
                          for j in range(r)]) for i in range(k)]).astype(np.float32)
  b = np.stack([np.stack([get(i, j, "linear.bias", (d,), "a residual block's bias")
                          for j in range(r)]) for i in range(k)]).astype(np.float32)
  lm = np.stack([get(i, r, "weight", (v, d), "the head's LM projection").T
                 for i in range(k)]).astype(np.float32)
  if byname:
    name, x = next(iter(byname.values()))
    raise ValueError(f"unexpected tensor {name!r} (shape {tuple(x.shape)}): config.json says "
                     f"{k} heads of {r} blocks")
  target_lm = files.lm_head_DV(module)
  shared = all(np.array_equal(lm[i], target_lm) for i in range(k))
  kind = MedusaHeads(heads=k, blocks=r, own_lm=not shared)
  if r == 1 and shared:  # our structure
    return kind, {"w": w[:, 0], "b": b[:, 0]}
  params = {"w": w, "b": b}
  if not shared:
    params["lm"] = lm
  return kind, params


def import_head(src_dir: str | os.PathLike, target, out_dir: str | os.PathLike, *,
                tokenizer=None, overwrite: bool = False) -> pathlib.Path:
  """Read published Medusa-1 heads (config.json + safetensors or .pt) for `target` (a
  Transformer or a target reference) and write them as a specjax head directory
  (`medusa:OUT_DIR`)."""
  import jax.numpy as jnp
  module, tok = files.target_of(target, tokenizer)
  hf = files.read_config(src_dir, required=False)
  kind, params = head_params(hf, files.read_weights(src_dir), module)
  params = {k: jnp.asarray(v) for k, v in params.items()}
  meta = {"source": {"format": FORMAT, "path": str(pathlib.Path(src_dir).resolve()),
                     "config": hf}}
  return files.save_bound_head(out_dir, kind, params, module, tok, meta, overwrite)


def export_head(head_dir: str | os.PathLike, target, out_dir: str | os.PathLike, *,
                dtype: str = "float32", overwrite: bool = False,
                base_model: str | None = None) -> pathlib.Path:
  """Write specjax Medusa heads in the published format (config.json +
  medusa_lm_head.safetensors); heads sharing the target's LM head get a copy of it."""
  module, _ = files.target_of(target)
  head = files.load_bound_head(head_dir, module, "medusa")
  p = {k: np.asarray(v, np.float32) for k, v in head.params.items()}
  w, b = p["w"], p["b"]
  if w.ndim == 3:
    w, b = w[:, None], b[:, None]
  k, r = w.shape[:2]
  tensors = {}
  for i in range(k):
    for j in range(r):
      tensors[f"{i}.{j}.linear.weight"] = w[i, j].T
      tensors[f"{i}.{j}.linear.bias"] = b[i, j]
    tensors[f"{i}.{r}.weight"] = (p["lm"][i] if "lm" in p else files.lm_head_DV(module)).T
  tensors = {name: files.floats(x, dtype) for name, x in tensors.items()}
  config = {"medusa_num_heads": int(k), "medusa_num_layers": int(r),
            "base_model_name_or_path": base_model, "hidden_size": module.config.d_model,
            "vocab_size": module.config.vocab_size}
  return files.write_dir(out_dir, tensors, WEIGHTS, config, overwrite)
