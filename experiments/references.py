"""What every study takes by reference: its target, its draft and its prompts.

target (`target=`; `models=` is its older name, still accepted: `target` wins when both
are given, so `specjax run CONFIG --set target=DIR` overrides a config's `models`):
  "default"       the shipped embedded target (its held-out corpus split, its heads)
  "random"        random tiny Llama weights on the byte vocabulary: the studies' fast model
                  for tests and smoke runs (the preset "tiny-llama", seed 0)
  anything else   a reference `specjax.resolve.load_target` takes: "random:SPEC", a Hugging
                  Face model directory (imported once, cached) or a specjax checkpoint
draft (`draft=`, where a study decodes with a separate draft model):
  "default"       the target's own default draft: the embedded pair's distilled draft with
                  the default target, a random 1-layer model of the target's config otherwise
  anything else   a draft reference `specjax.resolve.draft_model` takes ("self",
                  "random:SPEC", a model directory on the target's vocabulary)
prompts (`prompts=`):
  "code", "prose" the embedded held-out sets, cut into windows of `prompt_len` ids (the
                  "random" target keeps its fixed code snippet, as it always had)
  a JSONL path    a Spec-Bench / MT-Bench question file or a plain prompt file
                  (`specjax.data.prompts`), each prompt's first turn rendered with the target
                  tokenizer's chat template when it has one; its question ids and
                  categories travel into the result rows (`Workload.row_fields`)
  an int          the older spelling of "code" with that many prompts.

Validation is cheap and loads no weights (`check_target`, `target_config`): a directory's
config is read from its files, so a sweep refuses a bad reference before any point runs.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Mapping

from specjax.experiments import study_prompts
from specjax.training.presets import DEFAULT_PRESET, PRESETS
from specjax.resolve import random_target_config
from specjax.checkpoints import describe
from specjax.models import presets as model_presets
from specjax.models.transformer import ModelConfig
from specjax.data.tokenizer import ByteTokenizer
from specjax.models.transformer import Transformer
from specjax import resolve
from specjax.data.prompts import held_out_texts
from specjax.training.defaults import load_default_pair
from specjax.data.prompts import load_prompts
from specjax.data.prompts import encode_prompt

RANDOM = "random"  # the studies' random test target (preset RANDOM_PRESET, seed 0)
RANDOM_PRESET = "tiny-llama"
EMBEDDED = ("code", "prose")
LEGACY = ("default", RANDOM)  # the references whose quantities the studies know without files


def target_ref(target: str | None, models: str | None = None) -> str:
  """The target reference of a point: `target`, else its older name `models` (which the
  shipped configs still fix, so `--set target=DIR` wins over it), else "default"."""
  return target if target is not None else (models if models is not None else "default")


def check_target(params: Mapping, name: str = "target") -> str:
  """The point's target reference (`target_ref` of params' target / models), validated
  without loading weights: ValueError naming the argument, the value and what is allowed."""
  ref = target_ref(params.get("target"), params.get("models"))
  target_config(ref, name=name)
  return ref


@functools.lru_cache(maxsize=16)
def target_config(ref: str, name: str = "target"):
  """The target's ModelConfig without loading its weights (for memory estimates and
  length checks); ValueError for a reference that names no model."""
  if not isinstance(ref, str) or not ref:
    raise ValueError(f"{name} must be 'default', 'random', 'random:SPEC' or a model "
                     f"directory, got {ref!r}")
  if ref == "default":
    return PRESETS[DEFAULT_PRESET].target
  if ref == RANDOM:
    return model_presets.PRESETS[RANDOM_PRESET]
  kind, sep, spec = ref.partition(":")
  if kind == "random" and sep:
    return random_target_config(name, spec)
  if not os.path.isdir(ref):
    raise ValueError(f"{name} must be 'default', 'random', 'random:SPEC' or a model directory "
                     f"(Hugging Face or specjax), got {ref!r} (no such directory)")
  try:
    return ModelConfig.from_dict(describe(ref)["config"])
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f"{name} {ref}: {e}") from None


def check_embedded_only(params: Mapping, what: str, ref: str | None = None,
                        instead: str = "") -> None:
  """A study quantity only the embedded pair (or the random test models) has: one line
  saying so for any other target (`instead`: what to use for it)."""
  ref = ref or target_ref(params.get("target"), params.get("models"))
  if ref not in LEGACY:
    raise ValueError(f"target {ref!r}: {what} exists for the embedded target only "
                     f"(target='default'; 'random' in tests){'; ' + instead if instead else ''}")


# ----------------------------------------------------------------------------- models


@functools.lru_cache(maxsize=4)
def load_target(ref: str):
  """(Transformer as stored, tokenizer, held-out texts or None) of a target reference: the
  texts the embedded "code" prompts are cut from (None: the random target's snippet)."""
  if ref == RANDOM:
    from flax import nnx

    tok = ByteTokenizer()
    cfg = model_presets.PRESETS[RANDOM_PRESET].replace(vocab_size=tok.vocab_size)
    return Transformer(cfg, rngs=nnx.Rngs(0)), tok, None
  model, tok = resolve.load_target(ref)
  return model, tok, list(held_out_texts("code"))


def draft_for(ref: str, target, tokenizer, draft: str = "default"):
  """The draft model of `draft` (module doc) for a target reference `ref` (`target`: its
  module as stored, `tokenizer`: its tokenizer)."""
  from flax import nnx

  if draft == "default" and ref == "default":
    return load_default_pair().draft_module()
  if draft == "default":
    return Transformer(target.config.replace(n_layers=1), rngs=nnx.Rngs(1))
  return resolve.draft_model(draft, target, tokenizer=tokenizer)


def check_draft(params: Mapping, name: str = "draft", default: str = "default",
                also: str = "") -> str:
  """The draft reference of a point, its syntax checked (a directory must exist); `also`
  names what else the study allows, in the message."""
  ref = params.get(name, default)
  allowed = f"'default', 'self', 'random:SPEC'{also} or a draft model directory"
  if not isinstance(ref, str) or not ref:
    raise ValueError(f"{name} must be {allowed}, got {ref!r}")
  kind, arg = resolve.draft_kind(ref, name)
  if kind not in ("default", "self", "random", "model"):
    raise ValueError(f"{name} must name a draft model ('default', 'self', 'random:SPEC' or a "
                     f"directory) here, got {ref!r}: this study's other drafters have their "
                     f"own parameter")
  if kind == "random":
    resolve.config_from_ref(name, arg, 2 ** 16)
  if kind == "model" and not os.path.isdir(arg):
    raise ValueError(f"{name} must be {allowed}, got {ref!r} (no such directory)")
  return ref


# ----------------------------------------------------------------------------- prompts


def prompt_spec(prompts: Any, count: int | None = None, name: str = "prompts"
                ) -> tuple[str, int | None]:
  """(reference, count) of a study's `prompts` parameter (an int is the older spelling of
  "code" with that many prompts); ValueError for anything else."""
  if isinstance(prompts, int) and not isinstance(prompts, bool):
    if prompts < 1:
      raise ValueError(f"{name} must be an int >= 1 (a count of 'code' prompts), 'code', "
                       f"'prose' or a JSONL path, got {prompts!r}")
    return "code", prompts
  if not isinstance(prompts, (str, os.PathLike)) or not str(prompts):
    raise ValueError(f"{name} must be 'code', 'prose' or a path to a JSONL prompt file, "
                     f"got {prompts!r}")
  prompts = str(prompts)
  if prompts not in EMBEDDED:
    file_prompts(prompts)  # reads and validates the file (a line number for a bad line)
  return prompts, count


@functools.lru_cache(maxsize=8)
def file_prompts(path: str) -> tuple:
  """The prompts of a JSONL file (`specjax.data.prompts.load_prompts`: first turns)."""
  return tuple(load_prompts(path))


@dataclasses.dataclass(frozen=True)
class Workload:
  """A study's prompts as token ids, and for a prompt file each row's question id and
  category (None for the embedded sets)."""
  ids: list
  meta: tuple | None = None

  def row_fields(self) -> dict:
    """What a result row says about its prompts: the set, and from a file the question id
    and category of every decoded row."""
    if self.meta is None:
      return {}
    return {"question_ids": [m["question_id"] for m in self.meta],
            "categories": [m["category"] for m in self.meta]}


def check_prompts(params: Mapping, default_count: int = 8, count_name: str = "prompt_count"
                  ) -> tuple[str, int]:
  """(reference, count) of a point's `prompts` and `prompt_count` (`prompt_spec`), both
  checked; a file is read and validated."""
  count = params.get(count_name, default_count)
  if isinstance(count, bool) or not isinstance(count, int) or count < 1:
    raise ValueError(f"{count_name} must be an int >= 1, got {count!r}")
  ref, legacy = prompt_spec(params.get("prompts", "code"))
  chat = params.get("chat_template", True)
  if not isinstance(chat, bool):
    raise ValueError(f"chat_template must be a bool, got {chat!r}")
  return ref, legacy or count


def batched_workload(ref: str, tok, texts, prompts, count, batch: int, prompt_len: int, *,
                     chat_template: bool = True) -> Workload:
  """`workload` of `prompts` (a reference or the older int count, `prompt_spec`) with
  `count` prompts rounded up to whole batches of `batch` rows (at least one batch): what a
  point decodes with `measure.compare(..., batch=batch)`, so points of different batch
  sizes decode the same prompts."""
  name, legacy = prompt_spec(prompts)
  count = legacy or count
  return workload(ref, tok, texts, name, batch * -(-max(count, batch) // batch), prompt_len,
                  chat_template=chat_template)


def embedded_texts(ref: str, name: str, texts):
  """The texts an embedded set `name` is cut from for target `ref`: the target's own
  (`load_target`: held-out code, or the random target's snippet) for "code", the held-out
  prose documents for "prose"."""
  if name == "code":
    return texts
  return list(held_out_texts(name))


def workload(ref: str, tok, texts, prompts: str, count: int, prompt_len: int, *,
             chat_template: bool = True) -> Workload:
  """`count` prompts of the set `prompts` for target `ref`: an embedded set's windows of
  `prompt_len` ids (`study_prompts.prompts`, the studies' rule), or a file's first `count`
  prompts encoded for the target (its chat template unless `chat_template` is False),
  the file read again from its start when it holds fewer."""
  if prompts in EMBEDDED:
    return Workload(study_prompts.prompts(tok, embedded_texts(ref, prompts, texts), count,
                                          prompt_len))
  items = file_prompts(prompts)
  chosen = [items[i % len(items)] for i in range(count)]
  encoded = {}
  ids = []
  for p in chosen:
    if p.question_id not in encoded:
      encoded[p.question_id] = encode_prompt(p, tok, use_chat_template=chat_template)
    ids.append(encoded[p.question_id])
  return Workload(ids, tuple(p.row() for p in chosen))
