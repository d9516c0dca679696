"""Static-size KV cache with ragged rows.

Contract (everything outside this file relies on this and nothing else):
- `KVCache.lengths[B]` (int32) is the number of committed entries of each row. Queries see
  slots `[0, lengths[b])` plus the block of new tokens being written.
- `write` puts T new keys/values at slots `[lengths[b], lengths[b] + T)` of each row without
  moving `lengths`; committing is `commit` (or `set_lengths`), rollback is moving the index
  back. Rejected entries are never erased: they lie beyond `lengths` and get overwritten.
- A block mask may be wider than the block: `block_mask[T, R]` (or per row `[B, T, R]`)
  with R >= T covers the R - T slots just before `lengths` and then the T new ones, so a
  token-tree level written at `lengths` sees only its ancestors among the earlier levels
  (slots before the window are committed and always visible). R == T is the plain block.
- `gather_block` moves selected entries of a block into contiguous slots starting at
  `lengths` (token trees compact the accepted path with it); `lengths` is unchanged.

Buffer layout (private, chosen by measurement; docs/xla_notes.md, traps 1 and 2): one
buffer per layer, batch and KV heads merged, K stored transposed:
    K[layer]: (B·Hkv, head_dim, S)     V[layer]: (B·Hkv, S, head_dim)
so q·Kᵀ and p·V are plain batched NN matmuls and per-layer buffers are updated in place
inside the generation loop (a stacked [L, B, S, H, D] buffer made XLA copy the whole cache
every step). Grouped-query heads sharing one KV head are stacked as extra query rows.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
from flax import struct

Array = jax.Array

_NEG_INF = -1e30


@struct.dataclass
class KVCache:
  k: tuple[Array, ...]  # per layer (B·Hkv, head_dim, S)
  v: tuple[Array, ...]  # per layer (B·Hkv, S, head_dim)
  lengths: Array  # int32 [B]

  @property
  def batch(self) -> int:
    return self.lengths.shape[0]

  @property
  def max_len(self) -> int:
    return self.v[0].shape[1]

  @property
  def n_kv_heads(self) -> int:
    return self.v[0].shape[0] // self.batch


def cache_dtype(config):
  """The storage dtype of a model's cache (`ModelConfig.cache_dtype`, float32 by default)."""
  return jnp.dtype(getattr(config, "cache_dtype", "float32"))


def cache_bytes(config, batch: int, max_len: int, dtype=None) -> int:
  """Bytes the cache of `batch` rows × `max_len` slots occupies (dtype: the config's)."""
  per_token = 2 * config.n_layers * config.n_kv_heads * config.head_dim
  dtype = cache_dtype(config) if dtype is None else jnp.dtype(dtype)
  return per_token * batch * max_len * dtype.itemsize


def available_memory_bytes(device=None) -> int | None:
  """Memory the device can still give us (accelerator limit or host MemAvailable)."""
  device = device or jax.local_devices()[0]
  try:
    stats = device.memory_stats() or {}
  except Exception:  # noqa: BLE001 - some backends do not implement memory_stats
    stats = {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  try:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError, AttributeError):
    return None


def check_fits(config, batch: int, max_len: int, dtype=None, *, extra_bytes: int = 0,
               available: int | None = None, what: str = "cache") -> int:
  """Refuses (ValueError) a cache that would not fit, before anything is allocated.

  `extra_bytes` is whatever else must fit beside it (weights, other caches). Keeps 10% of
  the available memory as headroom for activations and XLA temporaries.
  """
  need = cache_bytes(config, batch, max_len, dtype) + extra_bytes
  available = available_memory_bytes() if available is None else available
  if available is not None and need > 0.9 * available:
    raise ValueError(
        f"{what}: batch={batch} × max_len={max_len} needs {need / 2**30:.2f} GiB "
        f"(KV cache {cache_bytes(config, batch, max_len, dtype) / 2**30:.2f} GiB + "
        f"{extra_bytes / 2**30:.2f} GiB other), but only {available / 2**30:.2f} GiB is "
        f"available: lower batch or max_len")
  return need


def init(config, batch: int, max_len: int, dtype=None) -> KVCache:
  """An empty cache (all lengths 0) stored in `dtype`, by default the config's
  `cache_dtype`: float32 unless asked otherwise, also for bf16 weights (on XLA:CPU a bf16
  cache at large batch was upcast to float32 on every step, docs/xla_notes.md, trap 4;
  accelerators read bf16 natively and a bf16 cache halves the memory)."""
  dtype = cache_dtype(config) if dtype is None else dtype
  rows, hd = batch * config.n_kv_heads, config.head_dim
  k = tuple(jnp.zeros((rows, hd, max_len), dtype) for _ in range(config.n_layers))
  v = tuple(jnp.zeros((rows, max_len, hd), dtype) for _ in range(config.n_layers))
  return KVCache(k=k, v=v, lengths=jnp.zeros((batch,), jnp.int32))


def set_lengths(cache: KVCache, lengths_B: Array) -> KVCache:
  return cache.replace(lengths=lengths_B.astype(jnp.int32))


def commit(cache: KVCache, n_B: Array) -> KVCache:
  """Advances each row by n_B entries (the ones `write` put there)."""
  return cache.replace(lengths=cache.lengths + n_B.astype(jnp.int32))


def _row_offsets(cache: KVCache) -> Array:
  return jnp.repeat(cache.lengths, cache.n_kv_heads)  # [B·Hkv]


def write(cache: KVCache, layer: int, k_BTHD: Array, v_BTHD: Array) -> KVCache:
  """Writes T new entries at each row's offset `lengths[b]` (lengths unchanged)."""
  b, t, h, d = k_BTHD.shape
  kbuf, vbuf = cache.k[layer], cache.v[layer]
  k_new = k_BTHD.transpose(0, 2, 3, 1).reshape(b * h, d, t).astype(kbuf.dtype)
  v_new = v_BTHD.transpose(0, 2, 1, 3).reshape(b * h, t, d).astype(vbuf.dtype)
  offsets = _row_offsets(cache)
  zero = jnp.zeros((), jnp.int32)
  kbuf = jax.vmap(lambda buf, u, o: jax.lax.dynamic_update_slice(buf, u, (zero, o)))(
      kbuf, k_new, offsets)
  vbuf = jax.vmap(lambda buf, u, o: jax.lax.dynamic_update_slice(buf, u, (o, zero)))(
      vbuf, v_new, offsets)
  ks = cache.k[:layer] + (kbuf,) + cache.k[layer + 1:]
  vs = cache.v[:layer] + (vbuf,) + cache.v[layer + 1:]
  return cache.replace(k=ks, v=vs)


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


def gather_block(cache: KVCache, index_BP: Array, span: int) -> KVCache:
  """Slot lengths[b] + j receives the entry at slot lengths[b] + index[b, j], j < P.

  Reads come from the buffer before the move, so overlapping sources are fine. Only the
  `span` slots from lengths[b] are touched (index < span, span static). Token trees use it to
  compact the accepted root-to-node path of a verified block to contiguous slots; the
  other entries stay beyond `lengths`, masked, to be overwritten. `lengths` is unchanged.
  """
  b, p = index_BP.shape
  h = cache.n_kv_heads
  idx = jnp.repeat(index_BP.astype(jnp.int32), h, axis=0)  # [B·Hkv, P]
  offsets = _row_offsets(cache)
  zero = jnp.zeros((), jnp.int32)

  def move_k(buf, i, o):  # buf (hd, S)
    window = jax.lax.dynamic_slice_in_dim(buf, o, span, axis=1)
    return jax.lax.dynamic_update_slice(buf, jnp.take(window, i, axis=1), (zero, o))

  def move_v(buf, i, o):  # buf (S, hd)
    window = jax.lax.dynamic_slice_in_dim(buf, o, span, axis=0)
    return jax.lax.dynamic_update_slice(buf, jnp.take(window, i, axis=0), (o, zero))

  ks = tuple(jax.vmap(move_k)(k, idx, offsets) for k in cache.k)
  vs = tuple(jax.vmap(move_v)(v, idx, offsets) for v in cache.v)
  return cache.replace(k=ks, v=vs)


def compact(cache: KVCache, path_BP: Array, span: int, new_lengths_B: Array) -> KVCache:
  """Moves each row's accepted path (block-relative slots path[b, :]) to
  [lengths[b], lengths[b] + P) and sets lengths to new_lengths (`gather_block` + commit)."""
  return set_lengths(gather_block(cache, path_BP, span), new_lengths_B)


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


def attend(cache: KVCache, layer: int, q_BTHD: Array, block_mask_TT: Array | None,
           window: int | None = None) -> Array:
  """Attention of T queries over the committed prefix and the new block. Returns [B,T,H,D].

  block_mask_TT: None (causal), [T, R] or [B, T, R]; window: sliding window or None (see
  attention_mask). Reads the smallest prefix bucket holding slots [0, max(lengths) + T)
  (`prefix_buckets`); the slots beyond it are masked for every query anyway."""
  b, t, h, d = q_BTHD.shape
  hkv = cache.n_kv_heads
  g = h // hkv
  kbuf, vbuf = cache.k[layer], cache.v[layer]
  # [B, T, Hkv, G, D] -> [B, Hkv, G, T, D] -> [B·Hkv, G·T, D]: GQA groups become query rows.
  q = q_BTHD.reshape(b, t, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b * hkv, g * t, d)
  q = (q * (1.0 / math.sqrt(d))).astype(kbuf.dtype)
  rows = g * t
  if rows == 1:  # XLA:CPU runs a one-row product on a ~10x slower path: pad to 2 rows
    # (docs/xla_notes.md, trap 3).
    q = jnp.concatenate([q, q], axis=1)

  def over(s: int):
    def run(q, kbuf, vbuf, lengths):
      scores = jnp.einsum("nrd,nds->nrs", q, kbuf[:, :, :s], preferred_element_type=jnp.float32)
      scores = scores[:, :rows]
      mask = attention_mask(lengths, t, s, block_mask_TT, window)  # [B, T, S]
      mask = jnp.broadcast_to(mask[:, None, None], (b, hkv, g, t, s)).reshape(b * hkv, rows, s)
      probs = jax.nn.softmax(jnp.where(mask, scores, _NEG_INF), axis=-1)
      if rows == 1:
        probs = jnp.concatenate([probs, probs], axis=1)
      return jnp.einsum("nrs,nsd->nrd", probs.astype(vbuf.dtype), vbuf[:, :s],
                        preferred_element_type=jnp.float32)[:, :rows]
    return run

  sizes = prefix_buckets(vbuf.shape[1])
  args = (q, kbuf, vbuf, cache.lengths)
  if len(sizes) == 1:
    out = over(sizes[0])(*args)
  else:
    needed = jnp.max(cache.lengths) + t  # every query's visible slots lie below this
    index = jnp.sum(jnp.asarray(sizes[:-1], jnp.int32) < needed)
    out = jax.lax.switch(index, [over(s) for s in sizes], *args)
  return out.reshape(b, hkv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


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
