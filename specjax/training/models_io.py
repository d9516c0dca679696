"""Load a model trained by specjax (an orbax checkpoint written by the Trainer).

    model = load_trained(ckpt_dir)   # TrainedModel(config, params, tokenizer, metadata, step)
    module = model.module()                   # nnx.Transformer with those parameters

Parameters are stored in float32; they come back cast to config.dtype.
"""

from __future__ import annotations

import dataclasses
import pathlib

from flax import nnx

from specjax.checkpoints import orbax_io
from specjax.data.tokenizer import Tokenizer, tokenizer_from_spec
from specjax.models.transformer import ModelConfig, Transformer
from specjax.training.losses import cast_floats
from specjax.training.trainer import CHECKPOINT_KIND, abstract_params


@dataclasses.dataclass
class TrainedModel:
  config: ModelConfig
  params: nnx.State
  tokenizer: Tokenizer
  metadata: dict
  step: int

  def module(self) -> Transformer:
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(self.config, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, self.params)


def read_model_config(directory: str | pathlib.Path, step: int | None = None) -> ModelConfig:
  meta = orbax_io.read_meta(directory, step)
  return orbax_io.config_from_json(meta["config"], ModelConfig)


def load_trained(directory: str | pathlib.Path, *, step: int | None = None,
                 config: ModelConfig | None = None) -> TrainedModel:
  """Restore a Trainer checkpoint (latest step by default).

  config: if given, the stored config must equal it (the error lists differing fields).
  """
  directory = pathlib.Path(directory)
  if orbax_io.latest_step(directory) is None:
    raise ValueError(f"no specjax checkpoint found in {str(directory)!r}")
  meta = orbax_io.read_meta(directory, step)
  if meta.get("metadata", {}).get("kind") != CHECKPOINT_KIND:
    raise ValueError(f"{str(directory)!r} is not a specjax training checkpoint")
  stored = orbax_io.config_from_json(meta["config"], ModelConfig)
  _, target = abstract_params(stored)
  restored = orbax_io.restore(directory, params_target=target, config=config or stored,
                              step=step)
  params = restored.params
  if stored.dtype != "float32":
    params = cast_floats(params, stored.jnp_dtype)
  tokenizer = tokenizer_from_spec(restored.metadata["tokenizer"], directory)
  return TrainedModel(stored, params, tokenizer, restored.metadata, restored.step)
