"""Self-distillation data: a target's own answers to instruction prompts, as token shards.

A data directory (written by `specjax train selfdistill-data`, `training.selfdistill`):

    manifest.json      the run (recipe, target identity, tokenizer, sizes), one entry per
                       shard (rows, tokens, temperature, seconds, sha256) and the totals
    shard-000000.npz   one batch of rows: `tokens` int32 [N] (each row's prompt ids then its
                       answer ids, rows one after another), `row_lengths` int32 [R],
                       `prompt_lengths` int32 [R], `loss_mask` uint8 [N] (1 on answer
                       tokens, EOS included), `prompt_index` int64 [R] (the recipe's index)

Tokens only: the head trainers recompute the target's features by a teacher-forced forward
inside their step (`training.heads.target_pass`), as they do on corpus text, so hidden
states are never stored (BUILD_NOTES.md, "Self-distillation data").

As training data (`token_data`, the corpus reference `selfdistill:DIR` of `specjax train`):
rows become one stream, prompt then answer, row after row, with a loss mask aligned to it;
a row goes to validation when the bucket of its prompt index falls under `val_fraction`
(`corpus._bucket`, stable as the data grow). The trainers weight each predicted token by
its mask: only the target's answers are learned, the prompts are context.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import pathlib
import zipfile

import numpy as np

from specjax.data.batches import TokenData
from specjax.data.corpus import _bucket

FORMAT = "specjax-selfdistill-v1"
MANIFEST = "manifest.json"
PREFIX = "selfdistill:"
_EPOCH = (1980, 1, 1, 0, 0, 0)  # zip entry time: shards are byte-identical run to run


def shard_name(index: int) -> str:
  return f"shard-{index:06d}.npz"


def shard_bytes(arrays: dict[str, np.ndarray]) -> bytes:
  """An .npz (stored, fixed entry times) of `arrays`: the same arrays give the same bytes."""
  buf = io.BytesIO()
  with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
    for name in sorted(arrays):
      with z.open(zipfile.ZipInfo(name + ".npy", date_time=_EPOCH), "w") as f:
        np.lib.format.write_array(f, np.ascontiguousarray(arrays[name]), allow_pickle=False)
  return buf.getvalue()


def make_shard(prompts: list[list[int]], answers: list[list[int]],
               prompt_index: list[int]) -> dict[str, np.ndarray]:
  """The arrays of one shard (module doc) from each row's prompt and answer ids."""
  rows = [list(p) + list(a) for p, a in zip(prompts, answers)]
  mask = [np.r_[np.zeros(len(p), np.uint8), np.ones(len(a), np.uint8)]
          for p, a in zip(prompts, answers)]
  return {"tokens": np.asarray([t for r in rows for t in r], np.int32),
          "row_lengths": np.asarray([len(r) for r in rows], np.int32),
          "prompt_lengths": np.asarray([len(p) for p in prompts], np.int32),
          "loss_mask": np.concatenate(mask) if mask else np.zeros((0,), np.uint8),
          "prompt_index": np.asarray(prompt_index, np.int64)}


def read_manifest(directory: str | pathlib.Path) -> dict | None:
  """The manifest of a data directory, None where there is none; ValueError if unreadable."""
  path = pathlib.Path(directory) / MANIFEST
  if not path.is_file():
    return None
  try:
    meta = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise ValueError(f"{str(path)!r} is not a readable manifest: {e}") from None
  if meta.get("format") != FORMAT:
    raise ValueError(f"{str(path)!r} is not a self-distillation manifest (format "
                     f"{meta.get('format')!r}, expected {FORMAT!r})")
  return meta


@dataclasses.dataclass(frozen=True)
class Rows:
  """Every row of a data directory: per-row token arrays and masks, in shard order."""
  tokens: tuple[np.ndarray, ...]
  masks: tuple[np.ndarray, ...]
  prompt_index: np.ndarray
  manifest: dict

  @property
  def fingerprint(self) -> str:
    """sha256 over the shards' digests, 16 hex digits: the data's identity."""
    h = hashlib.sha256()
    for s in self.manifest["shards"]:
      h.update(f"{s['file']}\0{s['sha256']}\0".encode())
    return h.hexdigest()[:16]


def read_rows(directory: str | pathlib.Path) -> Rows:
  """The rows of every shard the manifest lists (each checked against its sha256)."""
  directory = pathlib.Path(directory)
  meta = read_manifest(directory)
  if meta is None:
    raise ValueError(f"{str(directory)!r} holds no self-distillation data ({MANIFEST} "
                     "missing): write it with `specjax train selfdistill-data`")
  tokens, masks, index = [], [], []
  for entry in meta["shards"]:
    blob = (directory / entry["file"]).read_bytes()
    if hashlib.sha256(blob).hexdigest() != entry["sha256"]:
      raise ValueError(f"shard {entry['file']} of {str(directory)!r} does not match its "
                       "manifest digest: regenerate it (rerun the data command)")
    with np.load(io.BytesIO(blob)) as z:
      ends = np.cumsum(z["row_lengths"])
      tokens += np.split(z["tokens"], ends[:-1])
      masks += np.split(z["loss_mask"], ends[:-1])
      index.append(z["prompt_index"])
  if not tokens:
    raise ValueError(f"{str(directory)!r} holds no rows yet")
  return Rows(tuple(tokens), tuple(masks), np.concatenate(index), meta)


def token_data(directory: str | pathlib.Path, tokenizer, *, val_fraction: float = 0.05,
               max_tokens: int | None = None) -> TokenData:
  """The rows as a TokenData with loss masks (module doc). `tokenizer` must be the one the
  data were made with (the target's); max_tokens caps the training stream (whole rows)."""
  rows = read_rows(directory)
  made_with = rows.manifest["run"]["tokenizer"]
  if tokenizer.to_spec() != made_with:
    raise ValueError(f"{PREFIX}{directory} was made with tokenizer {made_with}, not "
                     f"{tokenizer.to_spec()}: train with the target that made it")
  val = [_bucket(f"prompt-{int(i)}") < val_fraction for i in rows.prompt_index]
  if not any(val) and len(val) >= 2:
    val[-1] = True
  if all(val):
    raise ValueError(f"{PREFIX}{directory} holds {len(val)} row(s): too few to split into "
                     "train and validation")
  split = {True: ([], []), False: ([], [])}
  size = 0
  for t, m, v in zip(rows.tokens, rows.masks, val):
    if not v and max_tokens is not None and size >= max_tokens:
      continue
    split[v][0].append(t)
    split[v][1].append(m)
    size += 0 if v else len(t)
  cat = lambda parts, dtype: np.concatenate(parts).astype(dtype)  # noqa: E731
  return TokenData(cat(split[False][0], np.int32), cat(split[True][0], np.int32),
                   f"{PREFIX}{pathlib.Path(directory).name}", rows.fingerprint,
                   train_mask=cat(split[False][1], np.uint8),
                   validation_mask=cat(split[True][1], np.uint8))
