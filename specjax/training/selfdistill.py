"""Making self-distillation data: a target answers the instruction recipe's prompts
(`specjax.data.instructions`), batch by batch, into the shards of `specjax.data.selfdistill`.

    make_data("/path/to/hf-model", out, prompts=4096, max_new_tokens=256, batch=16,
              recipe=Recipe(seed=0), exclude=["specbench_questions.jsonl"])

Prompts: the recipe's prompts 0, 1, 2, ... rendered with the target tokenizer's chat
template, skipping any that shares an 8-gram of words with an `exclude` file (an evaluation
set; `instructions.shared_ngrams`); the first `prompts` kept. Shard k holds kept prompts
[kB, (k + 1)B), answered by one `decoding.generate` call at the recipe's temperature for
batch k (T = 1 with probability `sample_fraction`, else greedy; no top-k / top-p), seed
(recipe seed, k), stopping at the target's EOS ids or after max_new_tokens. Every shard is
a pure function of (recipe, target, max_new_tokens, batch, exclude files, k).

Resume: each shard is written all or nothing (`checkpoints.dirs.atomic_write`), then the
manifest that lists it. A rerun skips the shards the manifest lists and makes the rest, so
a run killed at any point and rerun ends with the shards of an uninterrupted run; asking
for more prompts extends the data. A directory made with another recipe, target (parameter
fingerprint), tokenizer, max_new_tokens, batch or exclude files is refused in one line.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import sys
import time
from typing import Callable, Sequence

from specjax.files import atomic_write, file_sha256
from specjax.data import instructions, selfdistill
from specjax.data.instructions import Recipe
from specjax.data.chat import stop_ids
from specjax.models.transformer import cast_floats
from specjax.training.trainer import params_fingerprint
from specjax.engine import decoding
from specjax.verify import sampling
from specjax.data.chat import encode_messages

NGRAM = 8  # words in a run shared with an evaluation set that excludes a prompt


def _log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def _check_int(name: str, value, low: int) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < low:
    raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
  return value


def batch_seed(seed: int, k: int) -> int:
  """The sampling seed of batch k (an int in [0, 2^31))."""
  return int.from_bytes(hashlib.sha256(f"{seed}/{k}".encode()).digest()[:4], "big") >> 1


def select_prompts(recipe: Recipe, count: int,
                   reference=frozenset()) -> tuple[list[int], list[int]]:
  """(kept, skipped) recipe indices: the first `count` prompts sharing no NGRAM-gram with
  `reference` (`instructions.reference_ngrams`), and those passed over."""
  kept, skipped, i = [], [], 0
  while len(kept) < count:
    if reference and instructions.shared_ngrams([recipe.item(i)["text"]], reference, NGRAM):
      skipped.append(i)
    else:
      kept.append(i)
    i += 1
    if len(skipped) > 10 * count + 100:
      raise ValueError(f"the exclude files rule out {len(skipped)} of {i} prompts: check them")
  return kept, skipped


def _run_spec(recipe: Recipe, target, tokenizer, max_new_tokens: int, batch: int,
              exclude: Sequence[pathlib.Path]) -> dict:
  """What decides the shards (module doc), as the manifest records it."""
  from flax import nnx

  import jax.numpy as jnp
  return {"recipe": recipe.spec(),
          "target": {"fingerprint": params_fingerprint(
                         cast_floats(nnx.state(target, nnx.Param), jnp.float32)),
                     "config": target.config.to_dict()},
          "tokenizer": tokenizer.to_spec(), "eos_ids": list(stop_ids(tokenizer)),
          "max_new_tokens": max_new_tokens, "batch": batch,
          "sampler": {"top_k": 0, "top_p": 1.0},
          "exclude": sorted(file_sha256(p) for p in exclude),  # by content, not by path
          "ngram": NGRAM}


def _differences(stored: dict, now: dict) -> list[str]:
  keys = sorted(set(stored) | set(now))
  return [k for k in keys if stored.get(k) != now.get(k)]


def make_data(target_ref: str, out: str | pathlib.Path, *, prompts: int, max_new_tokens: int,
              batch: int, recipe: Recipe | None = None, exclude: Sequence[str] = (),
              stop_after: int | None = None, log: Callable[[str], None] = _log,
              loaded) -> dict:
  """Make (or continue) the data directory `out` (module doc); returns the manifest.
  stop_after: make at most this many new shards, then return (as if killed there).
  loaded: the (target, tokenizer) of `target_ref`, or a callable returning them (called once
  the arguments are checked; `specjax.resolve` sits above this layer, so the caller loads)."""
  recipe = Recipe() if recipe is None else recipe
  _check_int("prompts", prompts, 1)
  _check_int("max_new_tokens", max_new_tokens, 1)
  _check_int("batch", batch, 1)
  if prompts % batch:
    raise ValueError(f"prompts must be a multiple of batch ({batch}), got {prompts}")
  exclude = [pathlib.Path(p) for p in exclude]
  for p in exclude:
    if not p.is_file():
      raise ValueError(f"exclude file {str(p)!r} does not exist")
  out = pathlib.Path(out)
  if out.exists() and not out.is_dir():
    raise ValueError(f"out {str(out)!r} exists and is not a directory")
  stored = selfdistill.read_manifest(out) if out.is_dir() else None
  if stored is None and out.is_dir() and any(out.iterdir()):
    raise ValueError(f"out {str(out)!r} is not empty and holds no {selfdistill.MANIFEST}: "
                     "choose an empty or new directory")
  target, tokenizer = loaded() if callable(loaded) else loaded
  run = _run_spec(recipe, target, tokenizer, max_new_tokens, batch, exclude)
  if stored is not None:
    diff = _differences(stored["run"], run)
    if diff:
      raise ValueError(f"out {str(out)!r} holds data of another run (differs in "
                       f"{', '.join(diff)}): choose another directory")
  out.mkdir(parents=True, exist_ok=True)
  for stale in out.glob(".shard-*"):  # a temporary file a killed run left
    stale.unlink(missing_ok=True)
  reference = instructions.reference_ngrams(
      (t for p in exclude for t in instructions.evaluation_texts(p)), NGRAM)
  kept, skipped = select_prompts(recipe, prompts, reference)
  manifest = stored or {"format": selfdistill.FORMAT, "run": run, "shards": []}
  # names, not paths: a data directory can be committed or moved (identity: `run`'s
  # fingerprint and the excluded files' sha256)
  manifest["target_ref"] = pathlib.PurePath(str(target_ref)).name or str(target_ref)
  manifest["exclude_files"] = [p.name for p in exclude]
  manifest["prompts_requested"] = max(prompts, manifest.get("prompts_requested", 0))
  done = {s["index"] for s in manifest["shards"]}
  made = 0
  for k in range(prompts // batch):
    if k in done:
      continue
    if stop_after is not None and made >= stop_after:
      break
    index = kept[k * batch:(k + 1) * batch]
    ids = [encode_messages(tokenizer, recipe.messages(i)) for i in index]
    temperature = recipe.batch_temperature(k)
    gen = decoding.generate(target, ids, max_new_tokens=max_new_tokens,
                            sampler=sampling.make_sampler(temperature),
                            seed=batch_seed(recipe.seed, k), eos_id=run["eos_ids"])
    arrays = selfdistill.make_shard(ids, gen.tokens, index)
    blob = selfdistill.shard_bytes(arrays)
    name = selfdistill.shard_name(k)
    atomic_write(out / name, blob)
    eos = set(run["eos_ids"])
    answer = sum(len(t) for t in gen.tokens)
    manifest["shards"].append({
        "index": k, "file": name, "rows": len(index),
        "prompt_tokens": sum(len(p) for p in ids), "answer_tokens": answer,
        "eos_rows": sum(1 for t in gen.tokens if t and t[-1] in eos),
        "temperature": temperature, "seconds": round(gen.seconds, 3),
        "sha256": hashlib.sha256(blob).hexdigest()})
    manifest["shards"].sort(key=lambda s: s["index"])
    _totals(manifest, skipped)
    atomic_write(out / selfdistill.MANIFEST, json.dumps(manifest, indent=1) + "\n")
    made += 1
    t = manifest["totals"]
    log(f"shard {k + 1}/{prompts // batch}: {answer} answer tokens in {gen.seconds:.1f} s "
        f"(T={temperature:g}); total {t['answer_tokens']:,} tokens, "
        f"{t['answer_tokens_per_s']:.1f} tokens/s")
  _totals(manifest, skipped)
  atomic_write(out / selfdistill.MANIFEST, json.dumps(manifest, indent=1) + "\n")
  return manifest


def _totals(manifest: dict, skipped: list[int]) -> None:
  shards = manifest["shards"]
  seconds = sum(s["seconds"] for s in shards)
  answer = sum(s["answer_tokens"] for s in shards)
  manifest["skipped_prompts"] = skipped  # recipe indices sharing an n-gram with `exclude`
  manifest["complete"] = (len(shards) * manifest["run"]["batch"]
                          >= manifest["prompts_requested"])
  manifest["totals"] = {
      "shards": len(shards), "rows": sum(s["rows"] for s in shards),
      "prompt_tokens": sum(s["prompt_tokens"] for s in shards), "answer_tokens": answer,
      "eos_rows": sum(s["eos_rows"] for s in shards), "seconds": round(seconds, 3),
      "answer_tokens_per_s": round(answer / seconds, 2) if seconds else 0.0}
