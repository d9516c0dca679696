"""The published EAGLE-3 head format (SafeAILab/EAGLE's EAGLE-3 heads, as vLLM and SGLang
load them): import into a specjax head directory (`eagle3:DIR` / `eagle:DIR`) and export back.

A published head is a directory with config.json (`LlamaForCausalLMEagle3`: hidden_size,
intermediate_size, num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps, rope,
vocab_size, draft_vocab_size; optional target_hidden_size and
eagle_config.eagle_aux_hidden_state_layer_ids) and its tensors in model.safetensors
(or shards with an index) or pytorch_model.bin (read through torch, the `[hf]` extra).
torch's Linear stores [out, in]; specjax's Dense kernel is [in, out] (transposed here).

    fc.weight                                   [D, 3D]   -> fc.kernel
    midlayer.input_layernorm.weight             [D]       -> input_layernorm.scale (embedding)
    midlayer.hidden_norm.weight                 [D]       -> hidden_norm.scale (fused hidden)
    midlayer.self_attn.{q,k,v}_proj.weight      [n·hd, 2D] -> attn.{q,k,v}.kernel
    midlayer.self_attn.o_proj.weight            [D, H·hd] -> attn.o.kernel
    midlayer.post_attention_layernorm.weight    [D]       -> post_attention_layernorm.scale
    midlayer.mlp.{gate,up,down}_proj.weight               -> mlp.{gate,up,down}.kernel
    norm.weight                                 [D]       -> norm.scale
    lm_head.weight                              [Vd, D]   -> lm_head.kernel
    d2t                                         [Vd] int  -> draft_ids = arange(Vd) + d2t
    t2d                                         [V] bool  -> checked: true exactly at draft_ids
    embed_tokens.weight (optional)              [V, D]    -> must equal the target's embedding

The three target layers the head reads are Hugging Face hidden-state indices (the residual
stream entering layer i; default 2, N // 2, N - 3), stored as specjax capture indices i - 1
(index N, transformers' normed last hidden state, is specjax's capture index N).
Every tensor is checked against the shape the target and config.json imply; a mismatch is
refused in one line naming the tensor and both shapes, and an unknown tensor is refused.
"""

from __future__ import annotations

import pathlib
from typing import Mapping

import jax.numpy as jnp
import numpy as np

from specjax.training.published import files
from specjax.drafters.eagle3 import Eagle3Head, check_draft_ids, eagle3_layers
from specjax.checkpoints.hf.config import rope_fields_of
from specjax.training.eagle3 import Eagle3Heads
from specjax.training.heads import read_head_meta
from specjax.data.json_files import field

FORMAT = "eagle3"
ARCHITECTURE = "LlamaForCausalLMEagle3"

# published name -> specjax module path: linear layers (weight transposed into a kernel), norms
_LINEAR = {"fc": "fc", "midlayer.self_attn.q_proj": "attn.q",
           "midlayer.self_attn.k_proj": "attn.k",
           "midlayer.self_attn.v_proj": "attn.v", "midlayer.self_attn.o_proj": "attn.o",
           "midlayer.mlp.gate_proj": "mlp.gate", "midlayer.mlp.up_proj": "mlp.up",
           "midlayer.mlp.down_proj": "mlp.down", "lm_head": "lm_head"}
_NORMS = {"midlayer.input_layernorm": "input_layernorm", "midlayer.hidden_norm": "hidden_norm",
          "midlayer.post_attention_layernorm": "post_attention_layernorm", "norm": "norm"}


# ----------------------------------------------------------------------------- reading


def _layers(config: Mapping, n_layers: int) -> tuple[int, ...]:
  """specjax capture indices of the three layers the head reads (module doc)."""
  eagle = config.get("eagle_config") or {}
  key = "eagle_aux_hidden_state_layer_ids"
  hf = config.get(key, eagle.get(key))
  if hf is None:
    return eagle3_layers(n_layers)
  if (not isinstance(hf, list) or not hf or not all(isinstance(i, int) for i in hf)
      or min(hf) < 0 or max(hf) > n_layers):
    raise ValueError(f"config.json: eagle_aux_hidden_state_layer_ids={hf!r} must list hidden-"
                     f"state indices in [0, {n_layers}] of the {n_layers}-layer target")
  return tuple(hidden_state_to_capture(i, n_layers) for i in hf)


def hidden_state_to_capture(i: int, n_layers: int) -> int:
  """The specjax capture index of Hugging Face hidden state i: the embedding output (-1) for
  i = 0, the output of block i - 1 for 0 < i < N, the final norm's output for i = N
  (transformers' last hidden state is normed)."""
  return i - 1 if i < n_layers else n_layers


def capture_to_hidden_state(c: int, n_layers: int) -> int:
  """The inverse of `hidden_state_to_capture`; the last block's un-normed output (capture
  N - 1) has no hidden-state index (ValueError)."""
  if c == n_layers - 1:
    raise ValueError(f"the head reads target layer {c}, the last block's output before the "
                     f"final norm, which the EAGLE-3 format cannot name (it names the "
                     f"residual stream entering a layer, or the final norm's output)")
  return c + 1 if c < n_layers else n_layers


def _head_fields(config: Mapping, d_model: int) -> dict:
  """The decoder-layer fields config.json gives (`eagle3.HEAD_FIELDS`)."""
  act = field(config, "hidden_act", "str", where="config.json", default="silu", null_ok=True)
  if act != "silu":
    raise ValueError(f"config.json: hidden_act={act!r} is not supported (EAGLE-3 heads use "
                     "silu)")
  for flag in ("attention_bias", "mlp_bias"):
    if config.get(flag):
      raise ValueError(f"config.json: {flag}=true is not supported (EAGLE-3 heads have none)")
  w = "config.json"
  heads = field(config, "num_attention_heads", "positive int", where=w)
  fields = {"n_heads": heads,
            "n_kv_heads": field(config, "num_key_value_heads", "positive int", where=w,
                                default=heads, null_ok=True),
            "d_ff": field(config, "intermediate_size", "positive int", where=w),
            "norm_eps": float(field(config, "rms_norm_eps", "positive number", where=w,
                                    default=1e-6, null_ok=True)), **rope_fields_of(config)}
  head_dim = field(config, "head_dim", "positive int", where=w, default=None, null_ok=True)
  fields["head_dim_override"] = (None if head_dim is None or heads * int(head_dim) == d_model
                                 else int(head_dim))
  return fields


def head_params(config: Mapping, tensors: Mapping[str, np.ndarray], target) -> tuple:
  """(layers, head fields, draft_ids, params) of a published head for `target` (a
  Transformer), every tensor checked (module doc)."""
  from flax import nnx
  tc = target.config
  d, v = tc.d_model, tc.vocab_size
  layers = _layers(config, tc.n_layers)
  fields = _head_fields(config, d)
  vd = (field(config, "draft_vocab_size", "positive int", where="config.json", default=None,
              null_ok=True)
        or field(config, "vocab_size", "positive int", where="config.json", default=None,
                 null_ok=True) or v)
  if "d2t" in tensors:
    d2t = np.asarray(tensors["d2t"])
    if d2t.shape != (vd,):
      raise ValueError(f"tensor d2t has shape {d2t.shape} but draft_vocab_size needs {(vd,)}")
    ids = np.arange(vd, dtype=np.int64) + d2t.astype(np.int64)
  elif vd == v:
    ids = np.arange(v)
  else:
    raise ValueError(f"the head has draft_vocab_size {vd} but no d2t tensor (target vocabulary "
                     f"{v})")
  ids = check_draft_ids(ids, v, "d2t")
  _check_t2d(tensors, ids, config, v)
  files.check_embedding(tensors, target)
  module = nnx.eval_shape(lambda: Eagle3Head(tc, len(layers), ids, head=fields,
                                             rngs=nnx.Rngs(0)))
  where = f"a head for this target ({tc.n_layers} layers, d_model {d}, vocabulary {v})"
  known = set(_LINEAR) | set(_NORMS)
  extra = sorted(n for n in tensors if n not in {"d2t", "t2d", "embed_tokens.weight"}
                 and (not n.endswith(".weight") or n[:-len(".weight")] not in known))
  if extra:
    raise ValueError(f"unknown tensor {extra[0]} in the EAGLE-3 head ({len(extra)} unknown)")
  for name, path in {**_LINEAR, **_NORMS}.items():
    key = f"{name}.weight"
    if key not in tensors:
      raise ValueError(f"the EAGLE-3 head lacks tensor {key}")
    param = _param(module, path + (".kernel" if name in _LINEAR else ".scale"))
    shape = tuple(param.get_value().shape)
    arr = np.asarray(tensors[key], np.float32)
    files.check_shape(key, arr, shape[::-1] if name in _LINEAR else shape, where)
    param.set_value(jnp.asarray(np.ascontiguousarray(arr.T if name in _LINEAR else arr)))
  return layers, fields, ids, nnx.state(module, nnx.Param)


def _param(module, path: str):
  node = module
  for part in path.split("."):
    node = getattr(node, part)
  return node


def _check_t2d(tensors, ids: np.ndarray, config: Mapping, v: int) -> None:
  """t2d (when present) is true exactly at the mapped target ids."""
  if "t2d" not in tensors:
    return
  t2d = np.asarray(tensors["t2d"]).astype(bool)
  n = int(config.get("vocab_size") or v)
  if t2d.ndim != 1 or t2d.shape[0] not in (n, v):
    raise ValueError(f"tensor t2d has shape {t2d.shape} but vocab_size needs {(n,)}")
  mask = np.zeros(max(v, t2d.shape[0]), bool)
  mask[ids] = True
  if not np.array_equal(mask[:t2d.shape[0]], t2d) or mask[t2d.shape[0]:].any():
    raise ValueError("tensor t2d does not mark exactly the target ids d2t maps to")


# ----------------------------------------------------------------------------- head directories


def import_head(src_dir, target, out_dir, *, tokenizer=None, overwrite: bool = False,
                steps: int = 3, decay: float = 0.8) -> pathlib.Path:
  """Import the published EAGLE-3 head in `src_dir` for `target` (a Transformer or a target
  reference, `files.target_of`) into the specjax head directory `out_dir` (written all or
  nothing), loadable as `eagle3:DIR` or `eagle:DIR`; returns its path. The head's kind
  (`Eagle3Heads`) records the layers, head fields and draft vocabulary; steps/decay are
  what further training of it would unroll."""
  model, tokenizer = files.target_of(target, tokenizer)
  config, tensors = files.read_config(src_dir), files.read_weights(src_dir)
  arch = [str(a) for a in config.get("architectures") or []]
  if "midlayer.hidden_norm.weight" not in tensors:
    raise ValueError(f"{str(src_dir)!r} is not an EAGLE-3 head (no midlayer.hidden_norm.weight"
                     f"; architectures {arch})")
  layers, fields, ids, params = head_params(config, tensors, model)
  full = np.array_equal(ids, np.arange(model.config.vocab_size))
  kind = Eagle3Heads(steps=steps, decay=decay, layers=layers,
                     head=tuple(sorted(fields.items())),
                     draft_ids=None if full else tuple(int(i) for i in ids))
  return files.save_bound_head(out_dir, kind, params, model, tokenizer,
                               {"source": {"format": FORMAT, "dir": pathlib.Path(src_dir).name,
                                           "architectures": arch}}, overwrite=overwrite)


def export_head(head_dir, target, out_dir, *, overwrite: bool = False,
                dtype: str = "float32") -> pathlib.Path:
  """Write the EAGLE-3-structured specjax head in `head_dir` (bound to `target`, a
  Transformer or a target reference) as a published EAGLE-3 directory: model.safetensors
  and config.json. A head of another structure is refused in one line."""
  model, _ = files.target_of(target)
  name = read_head_meta(head_dir)["head"]["kind"]
  if name != "eagle3":
    raise ValueError(f"the head in {str(head_dir)!r} is a {name!r} head; only an eagle3 head "
                     "(the EAGLE-3 structure) exports to the eagle3 format")
  head = files.load_bound_head(head_dir, model, "eagle3")
  module = head.kind.module(model.config, head.params)
  tensors = {}
  for pub, path in _LINEAR.items():
    tensors[f"{pub}.weight"] = files.floats(np.asarray(_param(module, path + ".kernel")[...]).T,
                                            dtype)
  for pub, path in _NORMS.items():
    tensors[f"{pub}.weight"] = files.floats(_param(module, path + ".scale")[...], dtype)
  ids = np.asarray(module.draft_ids[...], np.int64)
  tensors["d2t"] = ids - np.arange(len(ids), dtype=np.int64)
  t2d = np.zeros(model.config.vocab_size, bool)
  t2d[ids] = True
  tensors["t2d"] = t2d
  n = model.config.n_layers
  aux = [capture_to_hidden_state(c, n) for c in head.kind.feature_layers(model.config)]
  config = published_config(module.config, model.config, aux, len(ids), dtype)
  return files.write_dir(out_dir, tensors, "model.safetensors", config, overwrite)


def published_config(c, target, aux: list[int], draft_vocab: int,
                     dtype: str = "float32") -> dict:
  """config.json of an exported head (head config `c`, target config `target`, the
  hidden-state indices `aux` it reads)."""
  rope = None
  if c.rope_scaling == "llama3":
    rope = {"rope_type": "llama3", "factor": c.rope_factor,
            "low_freq_factor": c.rope_low_freq_factor,
            "high_freq_factor": c.rope_high_freq_factor,
            "original_max_position_embeddings": c.rope_original_max_len}
  return {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": c.d_model,
          "intermediate_size": c.d_ff, "num_attention_heads": c.n_heads,
          "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim,
          "num_hidden_layers": 1, "rms_norm_eps": c.norm_eps, "rope_theta": c.rope_theta,
          "rope_scaling": rope, "hidden_act": "silu", "attention_bias": False,
          "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": dtype,
          "max_position_embeddings": target.max_len, "vocab_size": target.vocab_size,
          "draft_vocab_size": draft_vocab, "target_hidden_size": target.d_model,
          "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux),
                           "use_aux_hidden_state": True}}
