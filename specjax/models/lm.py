"""`LM`: the jit handle of any model (a `Transformer` split once into its static graph and
its weights), taken by the loops, the drafters, training and calibration alike."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from specjax.models.transformer import ModelConfig

Array = jax.Array


@struct.dataclass
class LM:
  """A Transformer split once into a static graph and its weights.

  The jit boundary (docs/architecture.md): the graph definition and config are static
  auxiliary data, the weights are leaves, so a jitted loop takes the model as an ordinary
  argument and new weights of the same shapes do not recompile.
  """

  graphdef: Any = struct.field(pytree_node=False)
  config: ModelConfig = struct.field(pytree_node=False)
  params: Any
  # the row kernel's packed copies of the float32 products (`fused.packed_lm`, made once per
  # model for the host API's loops), or None: the loops pack in the trace (`fused.prefused`)
  packs: Any = None

  @classmethod
  def of(cls, model) -> "LM":
    if isinstance(model, LM):
      return model
    graphdef, params = nnx.split(model)
    return cls(graphdef=graphdef, config=model.config, params=params)

  def module(self):
    return nnx.merge(self.graphdef, self.params)

  def __call__(self, tokens_BT, positions_BT, cache=None, block_mask_TT=None, capture=()):
    return self.module()(tokens_BT, positions_BT, cache, block_mask_TT, capture)

  def prefill(self, cache, prompt_BP: Array, prompt_len_B: Array, capture: tuple[int, ...] = ()):
    """Runs the padded prompts through the model; returns (last hidden_BD, cache), and with
    a non-empty `capture` also the captured features_BPCD of every prompt position
    (`Transformer.__call__`).

    Rows are right-padded to a common bucket length P; padding sits after every real token,
    so causal attention keeps it invisible to them, and committing `prompt_len` leaves the
    padding beyond the row's length, to be overwritten.
    """
    b, p = prompt_BP.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    _, hidden_BPD, cache, *features = self(prompt_BP, positions, cache, capture=capture)
    last = jnp.take_along_axis(hidden_BPD, (prompt_len_B - 1)[:, None, None], axis=1)[:, 0]
    cache = cache.replace(lengths=prompt_len_B.astype(jnp.int32))
    return (last, cache, features[0]) if capture else (last, cache)

  def head(self, hidden_BD: Array) -> Array:
    return self.module().logits(hidden_BD[:, None])[:, 0]
