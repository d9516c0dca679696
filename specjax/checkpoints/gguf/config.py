"""GGUF metadata and tensor names -> a Hugging Face config dict and tensor names.

A GGUF file describes the same models a Hugging Face directory does, under llama.cpp's key
and tensor names. Rather than a second mapping onto ModelConfig, the file is restated as the
config.json and the torch tensor names its Hugging Face original had; the Hugging Face
import (`hf.config_from_hf`, `hf.convert_in`) then does the checking and the conversion,
so both roads in build the same ModelConfig and refuse the same things.

Covered (`general.architecture`):
  llama    Llama 1-3.x, SmolLM2, ...; with `llama.attention.sliding_window` stated: Mistral
           (llama.cpp writes Mistral 7B as llama). Its converter permutes the rows of the q
           and k projections per head for its RoPE layout (interleaved pairs); `unpermute`
           undoes it.
  qwen2    q/k/v biases, no permutation (llama.cpp rotates Qwen in the half-split layout).
  qwen3    per-head q/k RMSNorm, no permutation.
RoPE: `{arch}.rope.freq_base` is θ; Llama 3.1's frequency scaling is stored by llama.cpp
as the tensor `rope_freqs.weight` (one factor per frequency), read back as the 'llama3'
rope scaling it was computed from (checked factor by factor); other scalings are refused.
Tied embeddings: no `output.weight` tensor (transformers' rule).
"""

from __future__ import annotations

import math

import numpy as np

from specjax.checkpoints.gguf.read import GGUFFile

ARCHITECTURES = ("llama", "qwen2", "qwen3")
ROPE_FREQS = "rope_freqs.weight"

_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm.weight": "input_layernorm.weight",
          "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
          "attn_v.weight": "self_attn.v_proj.weight",
          "attn_output.weight": "self_attn.o_proj.weight",
          "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
          "attn_v.bias": "self_attn.v_proj.bias",
          "attn_q_norm.weight": "self_attn.q_norm.weight",
          "attn_k_norm.weight": "self_attn.k_norm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight",
          "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
          "ffn_down.weight": "mlp.down_proj.weight"}


def hf_name(name: str) -> str:
  """The Hugging Face tensor name of a GGUF one (an unknown name is kept, so that the
  import's 'unexpected tensor' error names it as the file does)."""
  if name in _GLOBAL:
    return _GLOBAL[name]
  parts = name.split(".", 2)
  if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER:
    return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}"
  return name


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
  """Undo llama.cpp's q/k row permutation: per head, its converter reorders the rows from
  the half-split layout [x0..x_{h/2-1}, y0..] to interleaved pairs [x0, y0, x1, y1, ...]."""
  rows = w.shape[0]
  return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def architecture(f: GGUFFile) -> str:
  arch = f.meta("general.architecture")
  if arch not in ARCHITECTURES:
    raise ValueError(f"GGUF file {str(f.path)!r}: general.architecture={arch!r} is not "
                     f"supported (supported: {', '.join(ARCHITECTURES)}; Mistral is stored as "
                     f"llama)")
  return arch


def _int(f: GGUFFile, key: str, default=None) -> int:
  value = f.meta(key) if default is None else f.meta(key, default)
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
    raise ValueError(f"GGUF file {str(f.path)!r}: {key}={value!r} must be an int >= 0")
  return int(value)


def hf_config(f: GGUFFile) -> dict:
  """The config.json of the file's model (module doc); ValueError naming the key for what
  specjax does not compute."""
  arch = architecture(f)
  a = f"{arch}."
  where = f"GGUF file {str(f.path)!r}"
  if "token_embd.weight" not in f.tensor_names:
    raise ValueError(f"{where} has no tensor 'token_embd.weight' (the token embedding)")
  vocab, d = f.shape("token_embd.weight")
  heads = _int(f, a + "attention.head_count")
  if heads == 0 or d % heads:
    raise ValueError(f"{where}: {a}attention.head_count={heads} must divide "
                     f"{a}embedding_length={d}")
  head_dim = _int(f, a + "attention.key_length", d // heads)
  for key in ("attention.value_length", "rope.dimension_count"):
    value = _int(f, a + key, head_dim)
    if value != head_dim:
      raise ValueError(f"{where}: {a}{key}={value} is not supported (specjax rotates and "
                       f"attends over the whole head: it must equal the head width {head_dim})")
  config = {
      "model_type": arch, "architectures": None, "hidden_size": d, "vocab_size": vocab,
      "num_hidden_layers": _int(f, a + "block_count"),
      "num_attention_heads": heads,
      "num_key_value_heads": _int(f, a + "attention.head_count_kv", heads),
      "head_dim": head_dim, "intermediate_size": _int(f, a + "feed_forward_length"),
      "max_position_embeddings": _int(f, a + "context_length", 2048),
      "rms_norm_eps": float(f.meta(a + "attention.layer_norm_rms_epsilon")),
      "rope_theta": float(f.meta(a + "rope.freq_base", 10000.0)), "hidden_act": "silu",
      "tie_word_embeddings": "output.weight" not in f.tensor_names,
  }
  embd = _int(f, a + "embedding_length", d)
  if embd != d:
    raise ValueError(f"{where}: {a}embedding_length={embd} but token_embd.weight has "
                     f"{d} columns")
  window = f.meta(a + "attention.sliding_window", None)
  if window is not None:
    if arch != "llama":
      raise ValueError(f"{where}: {a}attention.sliding_window={window} is not supported for "
                       f"{arch} (specjax windows llama-architecture files, as Mistral)")
    config.update(model_type="mistral", sliding_window=_int(f, a + "attention.sliding_window"))
  elif arch in ("qwen2", "qwen3"):
    config["use_sliding_window"] = False
  for key, field in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
    if f.has(f"tokenizer.ggml.{key}"):
      config[field] = _int(f, f"tokenizer.ggml.{key}")
  config["architectures"] = [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                              "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[
                                  config["model_type"]]]
  scaling = _rope_scaling(f, arch, head_dim, config["rope_theta"])
  if scaling is not None:
    config["rope_scaling"] = scaling
  return config


def _rope_scaling(f: GGUFFile, arch: str, head_dim: int, theta: float) -> dict | None:
  """Llama 3.1's 'llama3' scaling from `rope_freqs.weight`, or None; other scalings refused."""
  where = f"GGUF file {str(f.path)!r}"
  kind = f.meta(f"{arch}.rope.scaling.type", "none")
  if kind not in ("none", "llama3"):
    raise ValueError(f"{where}: {arch}.rope.scaling.type={kind!r} is not supported (specjax "
                     f"implements no RoPE scaling, or Llama 3.1's)")
  if ROPE_FREQS not in f.tensor_names:
    return None
  given = f.tensor(ROPE_FREQS).reshape(-1).astype(np.float64)
  if given.shape != (head_dim // 2,):
    raise ValueError(f"{where}: {ROPE_FREQS} has {given.size} entries, expected "
                     f"{head_dim // 2} (one per frequency)")
  if np.allclose(given, 1.0):
    return None
  scaling = {"rope_type": "llama3",
             "factor": float(f.meta(f"{arch}.rope.scaling.factor", float(given.max()))),
             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": _int(
                 f, f"{arch}.rope.scaling.original_context_length", 8192)}
  want = llama3_rope_factors(head_dim, theta, **{k: v for k, v in scaling.items()
                                                 if k != "rope_type"})
  if not np.allclose(given, want, rtol=1e-5, atol=0):
    raise ValueError(f"{where}: {ROPE_FREQS} is not Llama 3.1's frequency scaling (factor "
                     f"{scaling['factor']}, low/high frequency factors 1 and 4, original "
                     f"context {scaling['original_max_position_embeddings']}): not supported")
  return scaling


def llama3_rope_factors(head_dim: int, theta: float, *, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_position_embeddings: int
                        ) -> np.ndarray:
  """[head_dim/2] divisors of the rotary frequencies under Llama 3.1's scaling (what
  llama.cpp stores as `rope_freqs.weight`): 1 for short wavelengths, `factor` for long
  ones, a smooth blend between."""
  freqs = theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  wavelen = 2 * math.pi / freqs
  low_wavelen = original_max_position_embeddings / low_freq_factor
  high_wavelen = original_max_position_embeddings / high_freq_factor
  smooth = ((original_max_position_embeddings / wavelen - low_freq_factor)
            / (high_freq_factor - low_freq_factor))
  blended = 1.0 / ((1 - smooth) / factor + smooth)
  return np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, factor, blended))


def hf_tensors(f: GGUFFile, config: dict) -> dict[str, np.ndarray]:
  """Every tensor of the file, dequantized to float32, under its Hugging Face name, with
  llama's q/k permutation undone; `rope_freqs.weight` is read into the config instead."""
  arch = f.meta("general.architecture")
  heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
  out = {}
  for name in f.tensor_names:
    if name == ROPE_FREQS:
      continue
    x = f.tensor(name)
    if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
      x = unpermute(x, heads if ".attn_q." in name else kv)
    out[hf_name(name)] = x
  return out
