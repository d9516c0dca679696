"""The published EAGLE-1/2 head format (SafeAILab/EAGLE; what SGLang and vLLM load as an
EAGLE draft): import into a specjax head directory, export ours back.

The format. config.json is a Llama config of one layer (hidden_size, heads, KV heads,
intermediate_size, rms_norm_eps, rope_theta of the target, `bias` for the fc's bias); the
weights (`pytorch_model.bin` in the original releases, or safetensors) are

    fc.weight [D, 2D], fc.bias [D]               x_t = fc(concat[e(x_{t+1}); f_t])
    layers.0.self_attn.{q,k,v,o}_proj.weight      one Llama decoder layer ...
    layers.0.post_attention_layernorm.weight      ... whose input_layernorm is absent
    layers.0.mlp.{gate,up,down}_proj.weight
    embed_tokens.weight [V, D]                    (optional) a copy of the target's

with f_t the target's last hidden state at position t after its final norm (what its LM
head reads), e the target's token embedding, and the layer's output h_t read by the
target's LM head directly (no norm between). Drafting step 2 and later feed h back in place
of f; the layer keeps its own KV cache. Position t reads (f_t, token t + 1) and predicts
token t + 2. Qwen2 targets' heads carry q/k/v biases, Qwen3's q/k norms, as the target's
layers do (the key map is the target family's own, `checkpoints.hf.rules_for`).

In specjax this is `drafters.eagle.EagleHead` with structure "eagle" (kind `EagleHeads`,
layers = (n_layers,): the final norm's output); `fc` is its `combine`. Heads of today's
structure (fused layers, own norms) cannot be expressed and are refused on export.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np

from specjax.checkpoints.hf.tensor_files import flatten
from specjax.training.published import files
from specjax.checkpoints.hf import family_for, rules_for
from specjax.checkpoints.hf import nest
from specjax.drafters.eagle import init_head
from specjax.training.eagle import EagleHeads
from specjax.checkpoints.hf import hf_config_for
from specjax.data.json_files import field

FORMAT = "eagle"
WEIGHTS = "model.safetensors"
_IGNORED = ("embed_tokens.weight", "lm_head.weight", "layers.0.self_attn.rotary_emb.inv_freq")


def _rules(config):
  """[(published name, specjax head name, ops)] of the decoder layer: the target family's
  own key map for layer 0, less its input norm, renamed into the head."""
  family = family_for(config)
  if family == "gpt2":
    raise ValueError("the EAGLE-1/2 format holds a Llama-style decoder layer: the target "
                     "must be a RoPE-family model (llama, mistral, qwen2, qwen3), not gpt2")
  one = config.replace(n_layers=1)
  out = []
  for r in rules_for(family, one):
    if not r.hf.startswith("model.layers.0.") or "input_layernorm" in r.hf:
      continue
    out.append((r.hf[len("model."):], r.specjax[0].replace("blocks.0.", "block."), r.ops, r))
  return out


def fc_kernel(weight: np.ndarray) -> np.ndarray:
  """fc.weight [D, 2D] (torch's [out, in]) as the head's combine kernel [2D, D]."""
  return np.ascontiguousarray(weight.T)


def _check_config(hf: dict, config) -> None:
  """The head's config must describe the target's layer (one line naming the field)."""
  fields = [("num_attention_heads", config.n_heads), ("num_key_value_heads", config.n_kv_heads),
            ("rms_norm_eps", config.norm_eps), ("rope_theta", config.rope_theta)]
  for name, want in fields:
    have = field(hf, name, "number" if isinstance(want, float) else "positive int",
                 where="config.json", default=None, null_ok=True)
    if have is None:
      continue
    if (float(have) != float(want)) if isinstance(want, float) else have != want:
      raise ValueError(f"config.json {name} is {have!r} but the target's is {want!r}: the "
                       f"head was made for another model")


def head_params(hf: dict, tensors: dict, config):
  """(EagleHeads kind, params nnx.State) of the published tensors for a target `config`;
  refuses a tensor of the wrong shape (naming it and both shapes), a missing one, or one
  the format does not have."""
  from flax import nnx

  tensors = {k[len("model."):] if k.startswith("model.") else k: v for k, v in tensors.items()}
  d = config.d_model
  if "fc.weight" not in tensors:
    raise ValueError("missing tensor 'fc.weight': not an EAGLE-1/2 head")
  files.check_shape("fc.weight", tensors["fc.weight"], (d, 2 * d), "fc: [e; hidden] 2D -> D")
  bias = "fc.bias" in tensors
  kind = EagleHeads(layers=(config.n_layers,), structure="eagle", bias=bias)
  head = init_head(config.replace(dtype="float32"), kind.layers, structure="eagle", bias=bias)
  shapes = {k: tuple(v.shape) for k, v in
            flatten(nnx.to_pure_dict(nnx.state(head, nnx.Param))).items()}
  flat = {"combine.kernel": fc_kernel(tensors["fc.weight"])}
  if bias:
    files.check_shape("fc.bias", tensors["fc.bias"], (d,), "fc bias")
    flat["combine.bias"] = tensors["fc.bias"]
  used = {"fc.weight", "fc.bias"}
  for name, ours, _, rule in _rules(config):
    if name not in tensors:
      raise ValueError(f"missing tensor {name!r} (for the head's {ours})")
    want = rule.hf_shape({rule.specjax[0]: shapes[ours]})
    files.check_shape(name, tensors[name], want, ours)
    flat[ours] = rule.to_specjax(tensors[name])[0]
    used.add(name)
  for name in _IGNORED:  # the target's own embedding / head copies, the rotary table
    if name in tensors and name.endswith(".weight"):
      want = (config.vocab_size, d)
      files.check_shape(name, tensors[name], want, "a copy of the target's")
  unexpected = sorted(set(tensors) - used - set(_IGNORED))
  if unexpected:
    raise ValueError(f"unexpected tensor {unexpected[0]!r} (shape "
                     f"{tuple(tensors[unexpected[0]].shape)}): not part of an EAGLE-1/2 head"
                     + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
  _check_config(hf, config)  # the shapes fit: the fields they do not show
  state = nnx.state(head, nnx.Param)
  nnx.replace_by_pure_dict(state, nest({k: np.asarray(v, np.float32) for k, v in flat.items()}))
  return kind, state


def import_head(src_dir: str | os.PathLike, target, out_dir: str | os.PathLike, *,
                tokenizer=None, overwrite: bool = False) -> pathlib.Path:
  """Read a published EAGLE-1/2 head (config.json + safetensors or .bin) for `target` (a
  Transformer or a target reference) and write it as a specjax head directory
  (`eagle:OUT_DIR`)."""
  module, tok = files.target_of(target, tokenizer)
  hf = files.read_config(src_dir, required=False)
  tensors = files.read_weights(src_dir)
  kind, params = head_params(hf, tensors, module.config)
  files.check_embedding(tensors, module)  # a copy of another model's embedding: refused
  meta = {"source": {"format": FORMAT, "path": str(pathlib.Path(src_dir).resolve()),
                     "config": hf}}
  return files.save_bound_head(out_dir, kind, params, module, tok, meta, overwrite)


def export_head(head_dir: str | os.PathLike, target, out_dir: str | os.PathLike, *,
                dtype: str = "float32", overwrite: bool = False) -> pathlib.Path:
  """Write a specjax EAGLE head of the "eagle" structure in the published format
  (config.json + model.safetensors); other structures are refused in one line."""
  from flax import nnx

  module, _ = files.target_of(target)
  head = files.load_bound_head(head_dir, module, "eagle")
  if head.kind.structure != "eagle":
    raise ValueError(f"the head in {str(head_dir)!r} has the {head.kind.structure!r} "
                     "structure (fused target layers, its own norms), which the EAGLE-1/2 "
                     "format cannot express; only heads of the 'eagle' structure (imported "
                     "EAGLE-1/2 heads) export to it")
  config = module.config
  flat = flatten(nnx.to_pure_dict(head.params))
  tensors = {"fc.weight": flat["combine.kernel"].T}
  if "combine.bias" in flat:
    tensors["fc.bias"] = flat["combine.bias"]
  for name, ours, _, rule in _rules(config):
    tensors[name] = rule.to_hf([np.asarray(flat[ours])])
  tensors["embed_tokens.weight"] = np.asarray(module.embed[...], np.float32)
  tensors = {k: files.floats(v, dtype) for k, v in tensors.items()}
  hf = hf_config_for(config)
  hf.update(num_hidden_layers=1, bias="fc.bias" in tensors, torch_dtype=dtype)
  return files.write_dir(out_dir, tensors, WEIGHTS, hf, overwrite)
