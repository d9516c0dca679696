"""Trainer checkpoints (orbax, kind 'specjax-lm'): the kind constant and loading them.

    model = load_trained(ckpt_dir)   # TrainedModel(config, params, tokenizer, metadata, step)
    module = model.module()          # nnx Transformer with those parameters

The trainer (`specjax.training.trainer`) writes these checkpoints with `TRAINED_KIND`;
parameters are stored in float32 and come back cast to config.dtype. Imports point one way:
training imports checkpoints, never the reverse.
"""

from __future__ import annotations

import dataclasses
import pathlib

from flax import nnx

from specjax.checkpoints import orbax_io
from specjax.checkpoints.hf.tokenizer import recorded_tokenizer
from specjax.data.tokenizer import Tokenizer
from specjax.models.transformer import (ModelConfig, Transformer, abstract_model, cast_floats,
                                        from_params)
from specjax import sharding

TRAINED_KIND = "specjax-lm"  # metadata "kind" of a checkpoint written by the trainer


@dataclasses.dataclass
class TrainedModel:
  config: ModelConfig
  params: nnx.State
  tokenizer: Tokenizer
  metadata: dict
  step: int

  def module(self) -> Transformer:
    return from_params(self.config, self.params)


def stored_config(directory: str | pathlib.Path, meta: dict) -> ModelConfig:
  """The ModelConfig of a checkpoint's meta item; ValueError naming the directory."""
  try:
    return orbax_io.config_from_json(meta["config"], ModelConfig)
  except ValueError as e:
    raise ValueError(f"checkpoint {str(directory)!r} is damaged or from another version: "
                     f"{e}") from None


def read_model_config(directory: str | pathlib.Path, step: int | None = None) -> ModelConfig:
  return stored_config(directory, orbax_io.read_meta(directory, step))


def load_trained(directory: str | pathlib.Path, *, step: int | None = None,
                 config: ModelConfig | None = None, mesh=None) -> TrainedModel:
  """Restore a trainer checkpoint (latest step by default).

  config: if given, the stored config must equal it (the error lists differing fields).
  mesh: read every array straight into its shards on this ('data', 'model') mesh
  (`sharding.abstract_params`); None: one device.
  """
  directory = pathlib.Path(directory)
  if orbax_io.latest_step(directory) is None:
    raise ValueError(f"no specjax checkpoint found in {str(directory)!r}")
  meta = orbax_io.read_meta(directory, step)
  if meta.get("metadata", {}).get("kind") != TRAINED_KIND:
    raise ValueError(f"{str(directory)!r} is not a specjax training checkpoint")
  stored = stored_config(directory, meta)
  _, target = abstract_model(stored.replace(dtype="float32"))  # stored in float32
  if mesh is not None:
    target = sharding.abstract_params(mesh, stored, target)
  restored = orbax_io.restore(directory, params_target=target, config=config or stored,
                              step=step)
  params = restored.params
  if stored.dtype != "float32":
    params = cast_floats(params, stored.jnp_dtype)
  tokenizer = recorded_tokenizer(restored.metadata["tokenizer"], directory)
  return TrainedModel(stored, params, tokenizer, restored.metadata, restored.step)
