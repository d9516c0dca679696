"""Tiny models shared by the tests (imported by test modules; pytest puts tests/ on sys.path)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models.transformer import ModelConfig, Transformer

TINY = {
    "gpt2": ModelConfig.gpt2(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4,
                             d_ff=64, max_len=128),
    "llama": ModelConfig.llama(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                               d_ff=64, max_len=128, rope_theta=500.0),
}


def model(config: ModelConfig, seed: int = 0, logit_scale: float = 1.0,
          mix: float = 20.0) -> Transformer:
  """A random model with non-trivial behaviour.

  At the usual init the blocks barely touch the residual stream, so a tied-embedding model
  just repeats its last token; `mix` scales the blocks' output projections so that the
  context matters. logit_scale > 1 sharpens next-token distributions (near-uniform p and q
  would make speculative acceptance trivially high).
  """
  m = Transformer(config, rngs=nnx.Rngs(seed))
  for block in m.blocks:
    block.attn.o.kernel[...] = block.attn.o.kernel[...] * mix
    block.mlp.down.kernel[...] = block.mlp.down.kernel[...] * mix
  if logit_scale != 1.0:
    if m.lm_head is not None:
      m.lm_head.kernel[...] = m.lm_head.kernel[...] * logit_scale
    else:
      m.final_norm.scale[...] = m.final_norm.scale[...] * logit_scale
  return m


def perturbed(m: Transformer, seed: int, noise: float) -> Transformer:
  """A copy of `m` with Gaussian noise (relative scale `noise`) on every weight: a draft of
  tunable quality, from α ≈ 1 (noise 0) down towards α ≈ 0."""
  graphdef, state = nnx.split(m)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  noisy = [x + noise * jnp.std(x) * jax.random.normal(kk, x.shape, x.dtype)
           for x, kk in zip(leaves, keys)]
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, noisy))
