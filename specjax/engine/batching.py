"""The inputs of one call of a decoding loop, validated at the Python boundary: prompts
padded to a length bucket, token budgets, the cache length (`cache_len_for`, the engine's
rule), the context limit of the models (`context_limits`), the EOS ids (`eos_ids`) and the
seed. `plan` (a speculation plan's checks) and `decoding` (the host API) build on it; it
imports no other specjax module.

Runtime values are arrays of fixed shapes, so changing them reuses the compiled loop: the
EOS ids are `EOS_SLOTS` int32 slots padded with -1 (more ids: the next power of two).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

MIN_BUCKET = 8
EOS_SLOTS = 8  # EOS ids a loop compares against; unused slots hold -1

def _bucket(n: int, cap: int) -> int:
  """The prompt bucket: the power of two >= max(n, MIN_BUCKET), capped at `cap` (what the
  cache / the model's positions allow) when n fits under it, so a bucket never refuses a
  prompt that fits."""
  b = MIN_BUCKET
  while b < n:
    b *= 2
  return min(b, cap) if cap >= n else b


def cache_len_for(prompt_len: int, max_new_tokens: int, slots: int = 1,
                  limit: int | None = None) -> int:
  """The engine's cache-length rule: the prompt's bucket + the token budget + the `slots`
  one cycle writes from the pending token (1 for plain decoding, k + 1 for a chain of k, a
  tree's nodes or its drafter's extent), rounded up to a power of two, so budgets that change
  within it do not recompile; capped at `limit` (the positions the model allows, e.g. its
  max_len) when given. Experiments use this rule too, so what they time is what the engine
  runs."""
  n = _bucket(_bucket(prompt_len, 1 << 62) + max_new_tokens + slots, 1 << 62)
  return n if limit is None else min(n, limit)


def check_int(name: str, value, lo: int) -> int:
  """value as an int >= lo; ValueError naming `name` otherwise (bools refused)."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
    raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
  return int(value)


@dataclasses.dataclass(frozen=True)
class Batch:
  """Validated, padded inputs for one call of a loop. `padded`: the last rows that only
  pad the batch for a mesh (`pad_rows`), dropped from the result."""

  prompt_BP: np.ndarray
  prompt_len_B: np.ndarray
  budget_B: np.ndarray
  cache_len: int
  padded: int = 0


def prepare_batch(prompts: Sequence[Sequence[int]], *, vocab_size: int, max_len: int,
                  max_new_tokens, slots: int = 1, cache_len: int | None = None,
                  positions_limited: bool = True, max_len_opt_in: bool = False) -> Batch:
  """Validates prompts and budgets at the Python boundary and pads to a length bucket.

  slots: the cache slots one cycle writes from the pending token (1 for plain decoding,
  k + 1 for a chain of k, a tree's nodes or its drafter's extent). The longest row needs
  `prompt + max budget + slots` positions; the prompt bucket (a power of two, so prompt
  lengths share compiled loops) is capped at what the cache or the model allows, so it
  never refuses a request that fits. By default the cache length is `cache_len_for` (a
  power of two, so budgets that change within it do not recompile), capped at max_len.
  positions_limited: positions may not reach max_len (learned position embeddings, or a
  RoPE model held to its trained length). max_len_opt_in: max_len is a RoPE model's trained
  length, which `allow_beyond_max_len=True` lifts; the error says so.
  """
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) and not isinstance(
      prompts, np.ndarray):
    raise ValueError(f"prompts must be a sequence of token-id sequences, got {type(prompts)}")
  if len(prompts) < 1:
    raise ValueError("prompts: batch must be >= 1 prompt, got an empty batch")
  rows = []
  for i, p in enumerate(prompts):
    p = np.asarray(p)
    if p.ndim != 1 or p.size == 0:
      raise ValueError(f"prompts[{i}] must be a non-empty 1-D sequence of token ids, "
                       f"got shape {p.shape}")
    if not np.issubdtype(p.dtype, np.integer):
      raise ValueError(f"prompts[{i}] must hold integer token ids, got dtype {p.dtype}")
    bad = (p < 0) | (p >= vocab_size)
    if bad.any():
      raise ValueError(f"prompts[{i}] has token id {int(p[bad][0])} out of range "
                       f"[0, {vocab_size})")
    rows.append(p.astype(np.int32))
  batch = len(rows)
  slots = check_int("slots", slots, 1)
  if np.ndim(max_new_tokens) == 0:
    budgets = [check_int("max_new_tokens", max_new_tokens, 1)] * batch
  else:
    budgets = [check_int(f"max_new_tokens[{i}]", v, 1) for i, v in enumerate(max_new_tokens)]
    if len(budgets) != batch:
      raise ValueError(f"max_new_tokens has {len(budgets)} entries for {batch} prompts")
  longest, budget = max(len(r) for r in rows), max(budgets)
  need = longest + budget + slots
  position_limit = max_len if positions_limited else None
  if cache_len is None:
    cache_len = cache_len_for(longest, budget, slots, limit=position_limit)
  else:
    cache_len = check_int("cache_len", cache_len, 1)
  limit = cache_len if position_limit is None else min(cache_len, position_limit)
  if need > limit:
    if position_limit is not None and position_limit < need and position_limit <= cache_len:
      what = f"the model's max_len {position_limit}"
      if max_len_opt_in:
        what += (" (the length this RoPE model was trained for; pass allow_beyond_max_len="
                 "True, --allow-beyond-max-len on the command line, to generate past it "
                 "anyway: quality past the trained length is not guaranteed)")
      else:
        what += " (learned position embeddings end there)"
    else:
      what = f"cache_len {cache_len}"
    raise ValueError(
        f"prompt length {longest} + max_new_tokens {budget} + slots {slots} (cache slots one "
        f"cycle writes: k + 1 for a chain of k, a tree's nodes) = {need} exceeds the "
        f"cache/context length {limit}, {what}: shorten the prompt or lower max_new_tokens "
        f"or k")
  bucket = _bucket(longest, limit)
  prompt = np.zeros((batch, bucket), np.int32)
  for i, r in enumerate(rows):
    prompt[i, :len(r)] = r
  return Batch(prompt_BP=prompt, prompt_len_B=np.asarray([len(r) for r in rows], np.int32),
               budget_B=np.asarray(budgets, np.int32), cache_len=cache_len)


def pad_rows(batch: Batch, multiple: int) -> Batch:
  """`batch` with rows appended up to the next multiple of `multiple` (a mesh's `data`
  axis, which must divide the rows): copies of its last prompt with a budget of one token,
  so they end at the first cycle, counted in `padded` (the host API drops them). Rows are
  appended, never interleaved: with partitionable threefry (JAX's default) a draw of shape
  [B', ...] begins with the draw of shape [B, ...], so the kept rows see the same random
  numbers as an unpadded run."""
  rows = len(batch.budget_B)
  extra = -rows % check_int("multiple", multiple, 1)
  if not extra:
    return batch

  def more(x, fill=None):
    tail = np.repeat(x[-1:], extra, axis=0) if fill is None else np.full(extra, fill, x.dtype)
    return np.concatenate([x, tail], axis=0)

  return dataclasses.replace(batch, prompt_BP=more(batch.prompt_BP),
                             prompt_len_B=more(batch.prompt_len_B),
                             budget_B=more(batch.budget_B, 1), padded=batch.padded + extra)


def key_of(seed) -> Array:
  """The loop's PRNG key: a typed key as given, else `jax.random.key(seed)`, seed an int >= 0."""
  if isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
    return seed
  return jax.random.key(check_int("seed", seed, 0))


def eos_ids(eos_id, vocab_size: int) -> Array:
  """The EOS ids a loop stops a row on, as int32 [E] padded with -1 (E = `EOS_SLOTS`, or
  the next power of two above more ids): from None (no EOS), an int or a sequence of ints
  (an HF generation_config's `eos_token_id` list), each in [0, vocab_size)."""
  if eos_id is None:
    ids = []
  elif isinstance(eos_id, (int, np.integer)) and not isinstance(eos_id, bool):
    ids = [check_int("eos_id", eos_id, 0)]
    if ids[0] >= vocab_size:
      raise ValueError(f"eos_id must be in [0, {vocab_size}), got {ids[0]}")
  elif isinstance(eos_id, (Sequence, np.ndarray)) and not isinstance(eos_id, (str, bytes)):
    ids = []
    for i, v in enumerate(eos_id):
      if (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not
          0 <= v < vocab_size):
        raise ValueError(f"eos_id[{i}] must be an int in [0, {vocab_size}), got {v!r}")
      ids.append(int(v))
  else:
    raise ValueError(f"eos_id must be None, an int in [0, {vocab_size}) or a sequence of "
                     f"them, got {eos_id!r}")
  slots = EOS_SLOTS
  while slots < len(ids):
    slots *= 2
  return jnp.asarray(ids + [-1] * (slots - len(ids)), jnp.int32)


def check_opt_in(value) -> bool:
  """allow_beyond_max_len as a bool; ValueError otherwise."""
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"allow_beyond_max_len must be True or False, got {value!r}")
  return bool(value)


def context_limits(configs, allow_beyond_max_len: bool) -> tuple[int, bool, bool]:
  """(max_len, positions_limited, max_len_opt_in) for the models of one call.

  Learned position embeddings end at max_len: a hard limit. A RoPE model has no table, but
  past the length it was trained for its outputs are not to be trusted, so it is held to
  max_len too unless the caller opts in (`allow_beyond_max_len=True`)."""
  allow = check_opt_in(allow_beyond_max_len)
  shortest = min(c.max_len for c in configs)
  hard = [c.max_len for c in configs if c.positions == "learned"]
  if allow:
    return (min(hard), True, False) if hard else (shortest, False, False)
  return shortest, True, not hard or min(hard) > shortest


def sized_batch(configs, prompts, *, max_new_tokens, cache_len=None,
                allow_beyond_max_len: bool = False, slots: int = 1) -> Batch:
  """`prepare_batch` against the context of the models of one call (`configs`, the target's
  first: its vocabulary): the shortest max_len, held or lifted as `context_limits` says."""
  max_len, limited, opt_in = context_limits(configs, allow_beyond_max_len)
  return prepare_batch(prompts, slots=slots, vocab_size=configs[0].vocab_size, max_len=max_len,
                       max_new_tokens=max_new_tokens, cache_len=cache_len,
                       positions_limited=limited, max_len_opt_in=opt_in)
