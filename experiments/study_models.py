"""The studies' models by reference, loaded once per process: `target_model`, `models` (the
target and its draft model), `draft_model` (also a random draft of a preset size), `head` /
`eagle_drafter` (trained heads), and `model_configs` / `eagle_config` / `cache_bytes` (their
configs and KV bytes without loading weights, for memory estimates).

`which` is any target reference of `experiments/references.py` ("default" = the embedded
trained tiny pair, with held-out prompts from its corpus; "random" = random tiny Llama models
on the byte vocabulary, fast, for tests and smoke runs; a Hugging Face or specjax model
directory); `draft` any draft model reference there.
"""

from __future__ import annotations

import functools
import os
import time

from specjax.models import cache as kv

from specjax.experiments import references
from specjax.experiments.study_prompts import _held_out_texts
from specjax.models.transformer import with_dtype
from specjax.training.defaults import load_default_target
from specjax.models.presets import PRESETS
from specjax.models.transformer import Transformer
from specjax.training import defaults
from specjax.training import presets as training_presets
from specjax.data.batches import TokenData
from specjax.data.corpus import load_corpus
from specjax.training.config import TrainConfig
from specjax.training.defaults import default_head_spec
from specjax.training.heads import kind_from_spec, train_head
from specjax.drafters.eagle import EagleDrafter
from specjax.resolve import config_from_ref
from specjax.drafters.eagle import head_config


@functools.lru_cache(maxsize=2)
def target_model(which: str, target_dtype: str = "float32"):
  """(target, tokenizer, prompt texts) of the target reference `which`
  (`references.target_ref`: "default", "random", "random:SPEC", a model directory) without
  its draft (for "default" the default target alone, `load_default_target`: a first use does
  not train the draft); the target's weights served in `target_dtype` (float32 as stored,
  or bfloat16: `transformer.with_dtype`). One target object per (which, dtype) in a
  process. The texts are what the embedded "code" prompts are cut from (None: the random
  target's fixed snippet)."""
  if target_dtype != "float32":
    target, tok, texts = target_model(which)
    return with_dtype(target, target_dtype), tok, texts
  if which == "default":
    default = load_default_target()  # training.presets.DEFAULT_PRESET
    return default.target_module(), default.tokenizer, _held_out_texts()
  target, tok, texts = references.load_target(which)
  if target.config.dtype != "float32":  # a checkpoint stored in bf16: served as asked
    target = with_dtype(target, "float32")
  return target, tok, texts


@functools.lru_cache(maxsize=4)
def models(which: str, target_dtype: str = "float32", draft: str = "default"):
  """(target, draft, tokenizer, prompt texts): `target_model(which, target_dtype)` and the
  draft model `draft` names (`references.draft_for`: "default" is the distilled draft of
  the default pair, or a random 1-layer model of the target's shape for any other target;
  else a draft model reference)."""
  target, tok, texts = target_model(which, target_dtype)
  stored = target_model(which)[0]  # as trained (float32), whatever the target is served in
  return target, references.draft_for(which, stored, tok, draft), tok, texts


@functools.lru_cache(maxsize=8)
def draft_model(name: str, which: str):
  """The draft of `models(which)` ("default"), a random model of preset `name` on the
  target's vocabulary (its max_len at least the target's), or any draft model reference
  (`references.draft_for`)."""
  if name != "default" and (name not in PRESETS or os.path.isdir(name)):
    return models(which, draft=name)[1]
  target, draft, _, _ = models(which)
  if name == "default":
    return draft
  from flax import nnx

  cfg = PRESETS[name].replace(vocab_size=target.config.vocab_size,
                              max_len=max(PRESETS[name].max_len, target.config.max_len))
  return Transformer(cfg, rngs=nnx.Rngs(1))


def _default_head(kind: str):
  """The default target's cached heads and their training seconds (the manifest's
  build_seconds, else the time of this load, which built them, with progress bars)."""
  import json

  start = time.perf_counter()
  head = defaults.load_default_heads(kind, progress=True)
  elapsed = time.perf_counter() - start
  seconds = head.metadata.get("build_seconds") if isinstance(head.metadata, dict) else None
  if seconds is None:
    entry = defaults.heads_entry_dir(kind, defaults.DEFAULT_PRESET,
                                     defaults.corpus_of(defaults.DEFAULT_PRESET, None),
                                     head.target.fingerprint)
    try:
      seconds = float(json.loads((entry / defaults.MANIFEST).read_text())["build_seconds"])
    except (OSError, KeyError, TypeError, ValueError):
      seconds = elapsed
  return head.kind, head.params, head.acceptance, seconds


@functools.lru_cache(maxsize=8)
def head(kind: str, which: str, steps: int = 8):
  """(kind object, params, acceptance, training seconds) of `kind` heads ("eagle",
  "medusa") for the target of `models(which)`: the cached default heads (built on first
  use), or trained here for `steps` steps (random models: tests)."""
  if which == "default":
    return _default_head(kind)
  references.check_embedded_only({}, f"the study's {kind} head", which)  # trained here: tests
  from flax import nnx

  target, _, tok, _ = models(which)
  data = TokenData.from_corpus(load_corpus("code", max_bytes=60_000), tok)
  tc = TrainConfig(steps=steps, batch_size=4, seq_len=32, lr=1e-2, warmup_steps=1,
                   eval_every=0, ckpt_every=0, eval_windows=8)
  result = train_head(kind_from_spec(kind, default_head_spec(kind, target.config)), target.config,
                      nnx.state(target, nnx.Param), tc, data, tok, progress=False)
  return result.kind, result.params, result.acceptance, result.seconds


def eagle_drafter(target, which: str, deterministic: bool, steps: int = 8):
  """The EAGLE drafter of `head("eagle", which, steps)` over `target` (served in any dtype:
  the head reads its features and shares its embedding and LM head). deterministic: top-k
  candidates (trees at T = 0) instead of samples of the head's law."""
  kind, params, _, _ = head("eagle", which, steps)
  return EagleDrafter.of(target, params, kind.feature_layers(target.config),
                         deterministic=deterministic)


def model_configs(which: str, draft: str = "default"):
  """(target, draft) ModelConfigs of `models(which, draft=draft)`, without loading any
  weights (a directory's config is read from its files)."""
  if which == "default" and draft == "default":
    pair = training_presets.PRESETS[training_presets.DEFAULT_PRESET]
    return pair.target, pair.draft
  cfg = references.target_config(which)
  if draft == "default":
    if which == "default":
      return cfg, training_presets.PRESETS[training_presets.DEFAULT_PRESET].draft
    return cfg, cfg.replace(n_layers=1)
  if draft == "self":
    return cfg, cfg
  if draft.startswith("random:"):
    return cfg, config_from_ref("draft", draft.partition(":")[2], cfg.vocab_size)
  return cfg, references.target_config(draft, name="draft")


def eagle_config(which: str):
  """The ModelConfig of the default EAGLE head's decoder layer for the target of
  `models(which)` (its KV cache), without loading anything."""
  target_cfg = model_configs(which)[0]
  return head_config(target_cfg, default_head_spec("eagle", target_cfg).get("width"))


def cache_bytes(which: str, batch: int, cache_len: int, draft: str = "default"
                ) -> tuple[int, int]:
  """(target, draft) KV-cache bytes of `models(which, draft=draft)` for batch × cache_len
  slots."""
  target_cfg, draft_cfg = model_configs(which, draft)
  return kv.cache_bytes(target_cfg, batch, cache_len), kv.cache_bytes(draft_cfg, batch,
                                                                       cache_len)
