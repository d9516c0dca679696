"""Attention: which slots a query may see (block masks, sliding windows), attention over the
KV cache (reading only its live prefix) and cache-free attention over the tokens themselves.

Masks. Queries of a block of T new tokens, written at each row's `lengths[b]`, see the
committed prefix `[0, lengths[b])` and the block. A block mask may be wider than the block:
`block_mask[T, R]` (or per row `[B, T, R]`) with R >= T covers the R - T slots just before
`lengths` and then the T new ones, so a token-tree level written at `lengths` sees only its
ancestors among the earlier levels (slots before the window are committed and always
visible). R == T is the plain block; None is causal. A sliding window W hides keys W or
more positions before the query (`attention_mask`).

The cache's buffer layout is private to `cache.py`: `attend` reads one layer through
`cache.layer_view` (queries grouped as the buffers' rows, the two products over a prefix of
slots) and never indexes a buffer itself.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from specjax.models import cache as kv
from specjax.models import row_kernel

Array = jax.Array

_NEG_INF = -1e30


def attention_mask(lengths_B: Array, t: int, s: int, block_mask: Array | None,
                   window: int | None = None) -> Array:
  """mask[b, i, j]: query i (at slot lengths[b] + i) may attend to slot j.

  block_mask None: causal over the new block, every slot before lengths[b] visible.
  block_mask [T, R] or [B, T, R], R >= T: column c is slot lengths[b] - (R - T) + c (the
  last T columns are the new tokens). Slot j is visible if it lies before the window
  (committed) or block_mask[i, j - lengths[b] + R - T] is True.

  window W (sliding-window attention, `transformers`' convention kv > q - W): of the slots
  visible so, only those whose position is within W - 1 of the query's stay visible. The
  slots a query sees hold exactly the positions 0..p of its own sequence in increasing slot
  order (committed prefix, then its ancestors in the block), so the distance p - p_j is the
  number of visible slots after j: `lengths + i - j` when causal, else the count of visible
  block columns after j (plus, for a committed slot, the committed slots after it).
  """
  slots = jnp.arange(s, dtype=jnp.int32)[None, :]  # [1, S]
  if block_mask is None:
    rel = slots - lengths_B[:, None]  # [B, S] index of the slot within the new block
    allowed = rel[:, None, :] <= jnp.arange(t, dtype=jnp.int32)[None, :, None]  # [B, T, S]
    allowed = allowed | (rel < 0)[:, None, :]
    if window is not None:  # distance = (lengths + i) - j
      allowed = allowed & (jnp.arange(t, dtype=jnp.int32)[None, :, None] - rel[:, None, :]
                           < window)
    return allowed
  r = block_mask.shape[-1]
  rel = slots - lengths_B[:, None] + (r - t)  # [B, S] column of the slot in the window
  committed = rel < 0
  in_window = (rel >= 0) & (rel < r)
  rel = jnp.clip(rel, 0, r - 1)
  b = lengths_B.shape[0]
  index = jnp.broadcast_to(rel[:, None, :], (b, t, s))
  if block_mask.ndim == 2:
    allowed = jnp.take(block_mask, rel, axis=1).transpose(1, 0, 2)  # [B, T, S]
  else:  # per-row masks [B, T, R]
    allowed = jnp.take_along_axis(block_mask, index, axis=2)
  allowed = committed[:, None, :] | (in_window[:, None, :] & allowed)
  if window is None:
    return allowed
  visible = jnp.broadcast_to(block_mask, (b, t, r)).astype(jnp.int32)
  after_BTR = jnp.cumsum(visible[..., ::-1], axis=-1)[..., ::-1] - visible  # visible cols > c
  n_win_BT = jnp.sum(visible, axis=-1)
  start = (lengths_B - (r - t))[:, None, None]  # slot of column 0
  distance = jnp.where(committed[:, None, :], start - 1 - slots[:, None, :] + n_win_BT[..., None],
                       jnp.take_along_axis(after_BTR, index, axis=2))
  return allowed & (distance < window)


# Attention reads only the live prefix of the cache: the S slots are split into a few
# static prefix sizes (S, S/2, S/4, ... down to BUCKET_MIN) and each call reads the smallest
# one that holds every row's visible slots, chosen at run time with `lax.switch` (one
# compiled program; a long cache early in a generation costs what its content costs, not
# what its capacity costs). Caches below 2 * BUCKET_MIN slots use one path. 128: on XLA:CPU
# the switch costs nothing measurable even for the 6-layer embedded target, and a GPT-2-small
# step at context 64 in a 512-slot cache drops from 21.5 to 20.0 ms (BUILD_NOTES.md).
BUCKET_MIN = 128
BUCKETS_MAX = 4


def prefix_buckets(s: int) -> tuple[int, ...]:
  """The ascending static prefix sizes attention may read from a cache of s slots."""
  sizes = [s]
  while (len(sizes) < BUCKETS_MAX and sizes[-1] % 2 == 0 and sizes[-1] // 2 >= BUCKET_MIN):
    sizes.append(sizes[-1] // 2)
  return tuple(reversed(sizes))


def attend(cache: kv.KVCache, layer: int, q_BTHD: Array, block_mask_TT: Array | None,
           window: int | None = None) -> Array:
  """Attention of T queries over the committed prefix and the new block. Returns [B,T,H,D].

  block_mask_TT: None (causal), [T, R] or [B, T, R]; window: sliding window or None (see
  attention_mask). Reads the smallest prefix bucket holding slots [0, max(lengths) + T)
  (`prefix_buckets`); the slots beyond it are masked for every query anyway."""
  b, t, h, d = q_BTHD.shape
  view = kv.layer_view(cache, layer)
  # [B, T, H, D] -> rows of the buffers: GQA groups become query rows.
  q = view.group(q_BTHD)
  q = (q * (1.0 / math.sqrt(d))).astype(view.dtype)
  rows = q.shape[1]
  if (rows <= row_kernel.MAX_ATTENTION_ROWS and view.dtype == jnp.float32
      and row_kernel.in_loop()):  # few rows in a decoding loop on XLA:CPU: the kernel
    mask = attention_mask(view.lengths, t, view.slots, block_mask_TT, window)
    return view.ungroup(view.kernel_attention(q, view.group_mask(mask, h)), h)
  if rows == 1:  # XLA:CPU runs a one-row product on a ~10x slower path: pad to 2 rows
    # (docs/xla_notes.md, trap 3).
    q = jnp.concatenate([q, q], axis=1)

  def over(s: int):
    def run(q, view):
      scores = view.scores(q, s)[:, :rows]
      mask = attention_mask(view.lengths, t, s, block_mask_TT, window)  # [B, T, S]
      mask = view.group_mask(mask, h)
      probs = jax.nn.softmax(jnp.where(mask, scores, _NEG_INF), axis=-1)
      if rows == 1:
        probs = jnp.concatenate([probs, probs], axis=1)
      return view.mix(probs, s)[:, :rows]
    return run

  sizes = prefix_buckets(view.slots)
  if len(sizes) == 1:
    out = over(sizes[0])(q, view)
  else:
    needed = jnp.max(view.lengths) + t  # every query's visible slots lie below this
    index = jnp.sum(jnp.asarray(sizes[:-1], jnp.int32) < needed)
    out = jax.lax.switch(index, [over(s) for s in sizes], q, view)
  return view.ungroup(out, h)


def causal_attention(q_BTHD: Array, k_BTKD: Array, v_BTKD: Array,
                     block_mask_TT: Array | None = None, window: int | None = None) -> Array:
  """Cache-free attention over the T tokens themselves (training and scoring); block_mask_TT
  [T, T] (None: causal) and window as in `attention_mask` with an empty cache."""
  b, t, h, d = q_BTHD.shape
  hkv = k_BTKD.shape[2]
  q = q_BTHD.reshape(b, t, hkv, h // hkv, d) * (1.0 / math.sqrt(d))
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k_BTKD.astype(jnp.float32),
                      preferred_element_type=jnp.float32)
  if window is not None:
    mask = attention_mask(jnp.zeros((1,), jnp.int32), t, t, block_mask_TT, window)[0]
  elif block_mask_TT is None:
    mask = jnp.tril(jnp.ones((t, t), bool))
  else:
    mask = block_mask_TT
  scores = jnp.where(mask, scores, _NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v_BTKD.astype(jnp.float32),
                   preferred_element_type=jnp.float32)
  return out.reshape(b, t, h, d)
