"""The EAGLE-3 head structure: the published EAGLE-3 format's head (SafeAILab/EAGLE's
EAGLE-3, as vLLM and SGLang run it), driven by the same `EagleDrafter` as our `EagleHead`.

With f_t = the target's residual streams entering three of its layers at position t (the
published default: Hugging Face `output_hidden_states` indices 2, N // 2 and N - 3 of an
N-layer target, i.e. specjax `capture` indices 1, N // 2 - 1 and N - 4, -1 being the embedding
output: `eagle3_layers`),
e(x) the target's token embedding, and the head's own weights:

    u_t   = fc(concat_3 f_t)                       (3D -> D, no bias)
    a_t   = concat[input_layernorm(e(x_{t+1})), hidden_norm(u_t)]        (2D: q/k/v read it)
    x_t   = u_t + o(Attention(q(a), k(a), v(a)))   (residual from the un-normed u_t; own cache)
    h_t   = x_t + mlp(post_attention_layernorm(x_t))   (SwiGLU)
    q_t   = softmax over the target vocabulary of lm_head(norm(h_t)) placed at draft_ids

so, as with `EagleHead`, head position t reads (feature of t, token t + 1) and predicts token
t + 2, and drafting steps 2+ feed the head's own h_t (pre-`norm`) back in place of u. The
LM head is the head's own, over a reduced draft vocabulary of Vd tokens: draft id i is target
token draft_ids[i] (the format's `d2t` offsets: draft_ids[i] = i + d2t[i]); every other
target token gets draft probability 0 (logit -inf), so the draft's law lives on the mapped
ids and verification, unchanged, keeps the output law exactly the target's.

The head is always float32 (as trained heads are); its decoder-layer shape (heads, KV heads,
MLP width, norm eps, rope) may differ from the target's (`eagle3_config`) but its width is
the target's d_model. The format and its import/export live in
`specjax.training.published.eagle3`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models import attention
from specjax.models.transformer import (MLP, Attention, Dense, ModelConfig, Norm, rope,
                                        rope_frequencies)

Array = jax.Array

# the head's decoder-layer fields that may differ from the target's (config.json names them)
HEAD_FIELDS = ("n_heads", "n_kv_heads", "d_ff", "norm_eps", "head_dim_override", "rope_theta",
               "rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
               "rope_original_max_len")


class DraftIds(nnx.Variable):
  """int32 [Vd]: the target token id of each draft id (not trained)."""


def eagle3_layers(n_layers: int) -> tuple[int, ...]:
  """The format's three target layers as specjax `capture` indices: Hugging Face
  `output_hidden_states[i]` for i in (2, N // 2, N - 3), where hidden_states[0] is the
  embedding output (capture -1) and hidden_states[i] the output of block i - 1 (capture
  i - 1; i = N, the normed last state, is capture N). N = 4, 5 and 6 name a state twice, as
  the format does; N < 3 names an index below 0 or past the last one, which the format does
  not define (ValueError)."""
  ids = (2, n_layers // 2, n_layers - 3)
  if n_layers < 3:
    raise ValueError(f"the EAGLE-3 format reads the target's hidden states {ids} "
                     f"(2, N // 2, N - 3), which a {n_layers}-layer target does not have: "
                     f"it needs 3 layers or more")
  return tuple(i - 1 for i in ids)


def eagle3_config(target: ModelConfig, head: dict | None = None) -> ModelConfig:
  """The head's decoder-layer config: one Llama layer (RMSNorm, SwiGLU, RoPE, no biases,
  float32) at the target's d_model, with `head` (a dict of `HEAD_FIELDS`) overriding the
  target's heads, MLP width, eps and rope."""
  head = dict(head or {})
  unknown = sorted(set(head) - set(HEAD_FIELDS))
  if unknown:
    raise ValueError(f"head fields must be among {HEAD_FIELDS}, got {unknown}")
  return target.replace(n_layers=1, norm="rmsnorm", mlp="swiglu", positions="rope",
                        use_bias=False, qkv_bias=False, qk_norm=False, sliding_window=None,
                        window_first_layer=0, tie_embeddings=False, dtype="float32", **head)


class Eagle3Head(nnx.Module):
  """fc (C·D -> D), input_layernorm and hidden_norm, one attention whose q/k/v read 2D, the
  post-attention norm and SwiGLU MLP, the final norm and the own lm_head (D -> Vd), and
  `draft_ids` (module doc). Same call contract as `EagleHead` (`fused`, `__call__`, `norm`,
  `unroll`), so `EagleDrafter` drives it."""

  def __init__(self, target: ModelConfig, n_features: int, draft_ids, *,
               head: dict | None = None, rngs: nnx.Rngs):
    c = eagle3_config(target, head)
    self.config = c
    d = c.d_model
    ids = np.asarray(draft_ids)
    norm = dict(kind="rmsnorm", bias=False, eps=c.norm_eps, dtype=jnp.float32)
    self.fc = Dense(n_features * d, d, bias=False, dtype=jnp.float32, rngs=rngs)
    self.input_layernorm = Norm(d, **norm)
    self.hidden_norm = Norm(d, **norm)
    self.attn = Attention(c, rngs=rngs)
    for name, n in (("q", c.n_heads), ("k", c.n_kv_heads), ("v", c.n_kv_heads)):
      setattr(self.attn, name, Dense(2 * d, n * c.head_dim, bias=False, dtype=jnp.float32,
                                     rngs=rngs))
    self.post_attention_layernorm = Norm(d, **norm)
    self.mlp = MLP(c, rngs=rngs)
    self.norm = Norm(d, **norm)
    self.lm_head = Dense(d, int(ids.shape[0]), bias=False, dtype=jnp.float32, rngs=rngs)
    self.draft_ids = DraftIds(jnp.asarray(ids, jnp.int32))

  def fused(self, features_BTCD: Array) -> Array:
    """u = fc(concat of the C captured layers): [B, T, C, D] -> [B, T, D] float32."""
    b, t, c, d = features_BTCD.shape
    return self.fc(features_BTCD.reshape(b, t, c * d))

  def _attn_input(self, u_BTD: Array, emb_BTD: Array) -> Array:
    """[input_layernorm(e); hidden_norm(u)]: what q, k and v read (2D wide)."""
    return jnp.concatenate([self.input_layernorm(emb_BTD), self.hidden_norm(u_BTD)], axis=-1)

  def _after_attention(self, u_BTD: Array, attended_BTD: Array) -> Array:
    x = u_BTD.astype(jnp.float32) + attended_BTD
    return x + self.mlp(self.post_attention_layernorm(x))

  def __call__(self, u_BTD, emb_BTD, positions_BT, cache=None, block_mask=None):
    """(h_BTD, cache): the midlayer over (u, e) (u a fused target feature or a previous
    step's h); h is pre-`norm`, the state the next drafting step reads."""
    a, cache = self.attn(self._attn_input(u_BTD, emb_BTD), positions_BT, cache, 0, block_mask)
    return self._after_attention(u_BTD, a), cache

  def unroll(self, features_BTCD, emb_next_BTD, positions_BT, steps: int) -> list[Array]:
    """Training-time test, cache-free: h at drafting steps 1..steps for every start position
    (list of [B, T, D]); the same attention pattern as `EagleHead.unroll` (step j > 1 at t
    reads h^{j-1}_{t-1} and attends to the true entries at <= t - j + 1 and to its chain's
    own entries of steps 2..j). Valid for t >= j - 1."""
    attn, c = self.attn, self.config
    b, t, _ = emb_next_BTD.shape
    freqs = c.rope_theta if c.rope_scaling == "none" else rope_frequencies(c)
    rows = jnp.arange(t, dtype=jnp.int32)[:, None]
    cols = jnp.arange(t, dtype=jnp.int32)[None, :]
    keys, values, outs, g = [], [], [], self.fused(features_BTCD)
    for j in range(steps):
      a = self._attn_input(g, emb_next_BTD)
      q = rope(attn.q(a).reshape(b, t, c.n_heads, c.head_dim), positions_BT, freqs)
      keys.append(rope(attn.k(a).reshape(b, t, c.n_kv_heads, c.head_dim), positions_BT, freqs))
      values.append(attn.v(a).reshape(b, t, c.n_kv_heads, c.head_dim))
      masks = [cols <= rows - j] + [cols == rows - j + i for i in range(1, j + 1)]
      out = attention.causal_attention(q, jnp.concatenate(keys, axis=1),
                                       jnp.concatenate(values, axis=1),
                                       jnp.concatenate(masks, axis=1))
      h = self._after_attention(g, attn.o(out.reshape(b, t, c.n_heads * c.head_dim)))
      outs.append(h)
      g = jnp.concatenate([jnp.zeros_like(h[:, :1]), h[:, :-1]], axis=1)  # h^{j}_{t-1}
    return outs


def check_draft_ids(draft_ids, vocab_size: int, what: str = "draft_ids") -> np.ndarray:
  """int32 [Vd] distinct target ids in [0, vocab_size) (ValueError naming the problem)."""
  ids = np.asarray(draft_ids)
  if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"{what} must be a non-empty 1-D integer array, got shape {ids.shape} "
                     f"dtype {ids.dtype}")
  if ids.min() < 0 or ids.max() >= vocab_size:
    bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
    raise ValueError(f"{what} maps a draft id to target id {bad}, outside [0, {vocab_size})")
  if len(np.unique(ids)) != ids.size:
    raise ValueError(f"{what} maps two draft ids to one target id: the map must be one-to-one")
  return ids.astype(np.int32)


def build_head(target: ModelConfig, n_features: int, draft_ids, head: dict | None = None,
               params=None, seed: int = 0) -> Eagle3Head:
  """An `Eagle3Head` for `target` (float32): random weights (seed), or `params` (an
  nnx.State of its nnx.Param leaves) merged in."""
  ids = check_draft_ids(draft_ids, target.vocab_size)
  if params is None:
    return Eagle3Head(target, n_features, ids, head=head, rngs=nnx.Rngs(seed))
  graphdef, _, ids_state = nnx.split(nnx.eval_shape(
      lambda: Eagle3Head(target, n_features, ids, head=head, rngs=nnx.Rngs(0))),
      nnx.Param, DraftIds)
  module = nnx.merge(graphdef, params, ids_state)
  module.draft_ids = DraftIds(jnp.asarray(ids, jnp.int32))
  return module


def drafter_parts(module: Eagle3Head, target: ModelConfig, layers: tuple[int, ...],
                  vocab) -> tuple[Array, Array]:
  """(vocab ids int32 [Vd], the LM matrix float32 [D, Vd]) an `EagleDrafter` drafts with,
  after checking the head fits `target` and `layers` (ValueError naming the mismatch)."""
  if vocab is not None:
    raise ValueError("vocab: an EAGLE-3 head carries its own draft vocabulary (draft_ids); "
                     "pass vocab=None")
  d = target.d_model
  fc_in, width = module.fc.kernel[...].shape
  if width != d:
    raise ValueError(f"the EAGLE-3 head's width {width} is not the target's d_model {d}")
  if fc_in != len(layers) * d:
    raise ValueError(f"the EAGLE-3 head fuses {fc_in // d} target layers but layers has "
                     f"{len(layers)}: {layers!r}")
  ids = module.draft_ids[...]
  check_draft_ids(np.asarray(ids), target.vocab_size)
  return ids, module.lm_head.kernel[...].astype(jnp.float32)
