"""The tensor-name key maps: one declarative list of `Rule`s per family and file layout.

Layout conventions: torch `nn.Linear` stores [out, in], specjax and GPT-2's `Conv1D` store
[in, out]; Flax GPT-2's `FlaxConv1D` stores [out, in] (it transposes at call time); GPT-2
fuses q, k, v into one `c_attn` of width 3·D. RoPE uses the half-split (`rotate_half`) pair
layout in both libraries, so q/k weights need no permutation.

The Flax msgpack layout of the RoPE families is the one transformers' Flax Llama and Mistral
used (and its PyTorch -> Flax conversion applies to any of them): the same nesting as the
torch names, `nn.Dense` kernels [in, out] named `kernel`, embeddings named `embedding`,
RMSNorm weights kept as `weight` (Qwen2/Qwen3 had no Flax classes; the same convention).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping

import numpy as np

from specjax.models.transformer import ModelConfig



@dataclasses.dataclass(frozen=True)
class Rule:
  """One Hugging Face tensor <-> one or more specjax parameters.

  `ops` are applied in order on import and inverted in reverse order on export:
    "T"      transpose a matrix ([out, in] <-> [in, out])
    "split"  split the last axis into len(specjax) equal parts (<-> concatenate)
  """

  hf: str
  specjax: tuple[str, ...]
  ops: tuple[str, ...] = ()

  def hf_shape(self, shapes: Mapping[str, tuple]) -> tuple[int, ...]:
    """The shape the HF tensor must have, given the specjax parameter shapes."""
    parts = [tuple(shapes[p]) for p in self.specjax]
    shape = parts[0]
    for op in reversed(self.ops):
      if op == "split":
        shape = shape[:-1] + (sum(p[-1] for p in parts),)
      elif op == "T":
        shape = shape[::-1]
    return shape

  def to_specjax(self, x: np.ndarray) -> list[np.ndarray]:
    xs = [x]
    for op in self.ops:
      if op == "T":
        xs = [np.ascontiguousarray(a.T) for a in xs]
      elif op == "split":
        xs = np.split(xs[0], len(self.specjax), axis=-1)
    return list(xs)

  def to_hf(self, xs: list[np.ndarray]) -> np.ndarray:
    for op in reversed(self.ops):
      if op == "T":
        xs = [np.ascontiguousarray(a.T) for a in xs]
      elif op == "split":
        xs = [np.concatenate(xs, axis=-1)]
    return xs[0]


def _per_layer(n_layers: int, template: list[tuple]) -> list[Rule]:
  return [Rule(hf.format(i=i), tuple(p.format(i=i) for p in sj), ops)
          for i in range(n_layers) for hf, sj, ops in template]


def rules_for(family: str, config: ModelConfig, layout: str = "safetensors") -> list[Rule]:
  """The key map of a family and file layout ('safetensors': torch names, or 'flax')."""
  c = config
  qkv = ("blocks.{i}.attn.q.{w}", "blocks.{i}.attn.k.{w}", "blocks.{i}.attn.v.{w}")
  if family == "gpt2":
    flax = layout == "flax"
    w, emb, scale, T = ("kernel", "embedding", "scale", ("T",)) if flax else ("weight", "weight",
                                                                              "weight", ())
    p = "transformer.h.{i}."
    layer = [
        (p + f"ln_1.{scale}", ("blocks.{i}.attn_norm.scale",), ()),
        (p + "ln_1.bias", ("blocks.{i}.attn_norm.bias",), ()),
        (p + f"attn.c_attn.{w}", tuple(n.format(i="{i}", w="kernel") for n in qkv),
         T + ("split",)),
        (p + "attn.c_attn.bias", tuple(n.format(i="{i}", w="bias") for n in qkv), ("split",)),
        (p + f"attn.c_proj.{w}", ("blocks.{i}.attn.o.kernel",), T),
        (p + "attn.c_proj.bias", ("blocks.{i}.attn.o.bias",), ()),
        (p + f"ln_2.{scale}", ("blocks.{i}.mlp_norm.scale",), ()),
        (p + "ln_2.bias", ("blocks.{i}.mlp_norm.bias",), ()),
        (p + f"mlp.c_fc.{w}", ("blocks.{i}.mlp.up.kernel",), T),
        (p + "mlp.c_fc.bias", ("blocks.{i}.mlp.up.bias",), ()),
        (p + f"mlp.c_proj.{w}", ("blocks.{i}.mlp.down.kernel",), T),
        (p + "mlp.c_proj.bias", ("blocks.{i}.mlp.down.bias",), ()),
    ]
    rules = [Rule(f"transformer.wte.{emb}", ("embed",)),
             Rule(f"transformer.wpe.{emb}", ("pos_embed",)),
             *_per_layer(c.n_layers, layer),
             Rule(f"transformer.ln_f.{scale}", ("final_norm.scale",)),
             Rule("transformer.ln_f.bias", ("final_norm.bias",))]
    if not c.tie_embeddings:  # Flax Dense stores [in, out] like specjax; torch Linear [out, in]
      rules.append(Rule("lm_head.kernel", ("lm_head.kernel",)) if flax else
                   Rule("lm_head.weight", ("lm_head.kernel",), ("T",)))
    return rules
  if layout not in ("safetensors", "flax"):
    raise ValueError(f"layout must be 'safetensors' or 'flax', got {layout!r}")
  rules = _rope_family_rules(c)
  return [_flax_rule(r) for r in rules] if layout == "flax" else rules


def _flax_rule(rule: Rule) -> Rule:
  """A torch-named RoPE-family rule in the Flax layout: Linear weight [out, in] -> Dense
  kernel [in, out]; Embedding weight -> embedding; RMSNorm weight unchanged."""
  if "T" in rule.ops:
    return Rule(rule.hf[:-len("weight")] + "kernel", rule.specjax,
                tuple(op for op in rule.ops if op != "T"))
  if rule.specjax == ("embed",):
    return Rule(rule.hf[:-len("weight")] + "embedding", rule.specjax, rule.ops)
  return rule


def _rope_family_rules(c: ModelConfig) -> list[Rule]:
  """Llama, Mistral, Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm) in torch names."""
  p = "model.layers.{i}."
  layer = [(p + "input_layernorm.weight", ("blocks.{i}.attn_norm.scale",), ())]
  layer += [(p + f"self_attn.{n}_proj.weight", (f"blocks.{{i}}.attn.{n}.kernel",), ("T",))
            for n in "qkvo"]
  if c.qkv_bias:
    layer += [(p + f"self_attn.{n}_proj.bias", (f"blocks.{{i}}.attn.{n}.bias",), ())
              for n in "qkv"]
  if c.qk_norm:
    layer += [(p + f"self_attn.{n}_norm.weight", (f"blocks.{{i}}.attn.{n}_norm.scale",), ())
              for n in "qk"]
  layer += [(p + "post_attention_layernorm.weight", ("blocks.{i}.mlp_norm.scale",), ())]
  layer += [(p + f"mlp.{n}_proj.weight", (f"blocks.{{i}}.mlp.{n}.kernel",), ("T",))
            for n in ("gate", "up", "down")]
  rules = [Rule("model.embed_tokens.weight", ("embed",)), *_per_layer(c.n_layers, layer),
           Rule("model.norm.weight", ("final_norm.scale",))]
  if not c.tie_embeddings:
    rules.append(Rule("lm_head.weight", ("lm_head.kernel",), ("T",)))
  return rules


# The top-level module name of each family's *ForCausalLM; checkpoints of the base model
# (no LM head) store the same tensors without it.
PREFIX = {"gpt2": "transformer.", "llama": "model.", "mistral": "model.", "qwen2": "model.",
          "qwen3": "model."}
# Non-parameter buffers older checkpoints carry (causal-mask and rotary tables).
IGNORED_BUFFERS = re.compile(r"^((transformer\.)?h\.\d+\.attn\.(masked_)?bias"
                             r"|(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq)$")
# A head some exporters write although the config ties it to the embedding.
TIED_HEAD = ("lm_head.weight", "lm_head.kernel")
