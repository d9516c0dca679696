"""Static-size KV cache with ragged rows.

Contract (everything outside this file relies on this and nothing else):
- `KVCache.lengths[B]` (int32) is the number of committed entries of each row. Queries see
  slots `[0, lengths[b])` plus the block of new tokens being written.
- `write` puts T new keys/values at slots `[lengths[b], lengths[b] + T)` of each row without
  moving `lengths`; committing is `commit` (or `set_lengths`), rollback is moving the index
  back. Rejected entries are never erased: they lie beyond `lengths` and get overwritten.
- Attention (`attention.py`: block masks, sliding windows, the prefix-bucket read) reads a
  layer through `layer_view` and nothing else.
- `gather_block` moves selected entries of a block into contiguous slots starting at
  `lengths` (token trees compact the accepted path with it); `lengths` is unchanged.

Buffer layout (private, chosen by measurement; docs/xla_notes.md, traps 1 and 2): one
buffer per layer, batch and KV heads merged, K stored transposed:
    K[layer]: (B·Hkv, head_dim, S)     V[layer]: (B·Hkv, S, head_dim)
so q·Kᵀ and p·V are plain batched NN matmuls and per-layer buffers are updated in place
inside the generation loop (a stacked [L, B, S, H, D] buffer made XLA copy the whole cache
every step). Grouped-query heads sharing one KV head are stacked as extra query rows
(`LayerView.group`).

Over a device mesh (an active `jax.set_mesh` with axes `data` and `model`, set by the host
API when it is given `mesh=`; `specjax/sharding.py`) the merged rows are ordered
(group, batch, head within the group) with `groups` = the model axis' size, so that one
contiguous block of rows is one (KV-head group, batch block): splitting that axis over
('model', 'data') puts each device's KV heads of its own rows on it. With one group (no
mesh, or KV heads not divisible by the model axis: then the cache is split over the batch
only) the order is today's (batch, head).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec

from specjax.models import row_kernel

Array = jax.Array


@struct.dataclass
class KVCache:
  k: tuple[Array, ...]  # per layer (B·Hkv, head_dim, S)
  v: tuple[Array, ...]  # per layer (B·Hkv, S, head_dim)
  lengths: Array  # int32 [B]
  groups: int = struct.field(pytree_node=False, default=1)  # KV-head groups (module doc)

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
  the available memory as headroom for activations and XLA temporaries. Under a mesh on
  accelerators each device holds its share (`_shares`; CPU devices share one host).
  """
  need = cache_bytes(config, batch, max_len, dtype) + extra_bytes
  available = available_memory_bytes() if available is None else available
  if available is not None and need > 0.9 * available * _shares(config, batch):
    raise ValueError(
        f"{what}: batch={batch} × max_len={max_len} needs {need / 2**30:.2f} GiB "
        f"(KV cache {cache_bytes(config, batch, max_len, dtype) / 2**30:.2f} GiB + "
        f"{extra_bytes / 2**30:.2f} GiB other), but only {available / 2**30:.2f} GiB is "
        f"available: lower batch or max_len")
  return need


def _mesh_axes() -> dict[str, int]:
  """{axis: size} of the active mesh's `data` and `model` axes ({} without a mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return {}
  return {a: n for a, n in mesh.shape.items() if a in ("data", "model")}


def layout_for(n_kv_heads: int, batch: int) -> tuple[int, PartitionSpec | None]:
  """(groups, the merged rows' partition spec) of a cache under the active mesh (module
  doc): KV heads over `model` when they divide, rows over `data` when the batch divides;
  (1, None) without a mesh."""
  axes = _mesh_axes()
  if not axes:
    return 1, None
  model, data = axes.get("model", 1), axes.get("data", 1)
  split_heads = model > 1 and n_kv_heads % model == 0
  names = (("model",) if split_heads else ()) + (("data",) if batch % data == 0 else ())
  return (model if split_heads else 1), PartitionSpec(names or None, None, None)


def constrain(cache: KVCache) -> KVCache:
  """The cache's buffers pinned to their shardings under the active mesh (a no-op without
  one): helps sharding propagation through the loop's carry."""
  groups, spec = layout_for(cache.n_kv_heads, cache.batch)
  if spec is None or groups != cache.groups:
    return cache
  pin = lambda x: jax.lax.with_sharding_constraint(x, spec)
  return cache.replace(k=tuple(map(pin, cache.k)), v=tuple(map(pin, cache.v)))


def _shares(config, batch: int) -> int:
  """Into how many parts the active mesh splits a cache (`layout_for`: KV-head groups x
  data shards), on accelerators; 1 without a mesh or on CPU devices (one host's memory)."""
  groups, spec = layout_for(config.n_kv_heads, batch)
  if spec is None or "bytes_limit" not in (_device_stats() or {}):
    return 1
  data = _mesh_axes().get("data", 1) if "data" in (spec[0] or ()) else 1
  return groups * data


def _device_stats() -> dict | None:
  try:
    return jax.local_devices()[0].memory_stats()
  except Exception:  # noqa: BLE001 - backends without memory stats (CPU)
    return None


def init(config, batch: int, max_len: int, dtype=None) -> KVCache:
  """An empty cache (all lengths 0) stored in `dtype`, by default the config's
  `cache_dtype`: float32 unless asked otherwise, also for bf16 weights (on XLA:CPU a bf16
  cache at large batch was upcast to float32 on every step, docs/xla_notes.md, trap 4;
  accelerators read bf16 natively and a bf16 cache halves the memory)."""
  dtype = cache_dtype(config) if dtype is None else dtype
  rows, hd = batch * config.n_kv_heads, config.head_dim
  k = tuple(jnp.zeros((rows, hd, max_len), dtype) for _ in range(config.n_layers))
  v = tuple(jnp.zeros((rows, max_len, hd), dtype) for _ in range(config.n_layers))
  groups, _ = layout_for(config.n_kv_heads, batch)
  return constrain(KVCache(k=k, v=v, lengths=jnp.zeros((batch,), jnp.int32), groups=groups))


def set_lengths(cache: KVCache, lengths_B: Array) -> KVCache:
  return cache.replace(lengths=lengths_B.astype(jnp.int32))


def commit(cache: KVCache, n_B: Array) -> KVCache:
  """Advances each row by n_B entries (the ones `write` put there)."""
  return cache.replace(lengths=cache.lengths + n_B.astype(jnp.int32))


def _per_row(x_B: Array, heads: int, groups: int) -> Array:
  """A per-batch-row array [B, ...] repeated onto the merged buffer rows [B·Hkv, ...] in
  their order (group, batch, head within the group)."""
  rows = jnp.repeat(x_B, heads // groups, axis=0)
  return rows if groups == 1 else jnp.tile(rows, (groups,) + (1,) * (x_B.ndim - 1))


def _to_rows(x_BH: Array, groups: int) -> Array:
  """[B, Hkv, ...] -> the merged buffer rows [B·Hkv, ...] (order: module doc)."""
  b, h = x_BH.shape[:2]
  if groups == 1:
    return x_BH.reshape((b * h,) + x_BH.shape[2:])
  x = x_BH.reshape((b, groups, h // groups) + x_BH.shape[2:])
  return jnp.swapaxes(x, 0, 1).reshape((b * h,) + x_BH.shape[2:])


def _from_rows(x_N: Array, b: int, groups: int) -> Array:
  """The merged rows [B·Hkv, ...] -> [B, Hkv, ...] (the inverse of `_to_rows`)."""
  h = x_N.shape[0] // b
  if groups == 1:
    return x_N.reshape((b, h) + x_N.shape[1:])
  x = x_N.reshape((groups, b, h // groups) + x_N.shape[1:])
  return jnp.swapaxes(x, 0, 1).reshape((b, h) + x_N.shape[1:])


def _row_offsets(cache: KVCache) -> Array:
  return _per_row(cache.lengths, cache.n_kv_heads, cache.groups)  # [B·Hkv]


def write(cache: KVCache, layer: int, k_BTHD: Array, v_BTHD: Array) -> KVCache:
  """Writes T new entries at each row's offset `lengths[b]` (lengths unchanged)."""
  b, t, h, d = k_BTHD.shape
  kbuf, vbuf = cache.k[layer], cache.v[layer]
  k_new = _to_rows(k_BTHD.transpose(0, 2, 3, 1), cache.groups).astype(kbuf.dtype)
  v_new = _to_rows(v_BTHD.transpose(0, 2, 1, 3), cache.groups).astype(vbuf.dtype)
  offsets = _row_offsets(cache)
  zero = jnp.zeros((), jnp.int32)
  kbuf = jax.vmap(lambda buf, u, o: jax.lax.dynamic_update_slice(buf, u, (zero, o)))(
      kbuf, k_new, offsets)
  vbuf = jax.vmap(lambda buf, u, o: jax.lax.dynamic_update_slice(buf, u, (o, zero)))(
      vbuf, v_new, offsets)
  ks = cache.k[:layer] + (kbuf,) + cache.k[layer + 1:]
  vs = cache.v[:layer] + (vbuf,) + cache.v[layer + 1:]
  return cache.replace(k=ks, v=vs)


def gather_block(cache: KVCache, index_BP: Array, span: int) -> KVCache:
  """Slot lengths[b] + j receives the entry at slot lengths[b] + index[b, j], j < P.

  Reads come from the buffer before the move, so overlapping sources are fine. Only the
  `span` slots from lengths[b] are touched (index < span, span static). Token trees use it to
  compact the accepted root-to-node path of a verified block to contiguous slots; the
  other entries stay beyond `lengths`, masked, to be overwritten. `lengths` is unchanged.
  """
  b, p = index_BP.shape
  h = cache.n_kv_heads
  idx = _per_row(index_BP.astype(jnp.int32), h, cache.groups)  # [B·Hkv, P]
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


# ----------------------------------------------------------------------------- reading
#
# What attention (`attention.attend`) reads of one layer. Queries enter the buffers' layout
# with `LayerView.group` and leave it with `ungroup`; in between they are rows [N, R, D]
# (N buffer rows, R query rows each) that only this file interprets.


@struct.dataclass
class LayerView:
  """One layer's keys and values and the committed lengths, as attention reads them: a
  pytree (an operand of `lax.switch`) whose arrays are in the private layout, so only its
  methods look into them."""

  k: Array  # (B·Hkv, head_dim, S)
  v: Array  # (B·Hkv, S, head_dim)
  lengths: Array  # int32 [B]
  groups: int = struct.field(pytree_node=False, default=1)  # KV-head groups (module doc)

  @property
  def slots(self) -> int:
    """S, the cache's capacity in slots."""
    return self.v.shape[1]

  @property
  def dtype(self):
    """The storage dtype (queries are cast to it for the products)."""
    return self.k.dtype

  def _groups(self, heads: int) -> tuple[int, int, int]:
    b = self.lengths.shape[0]
    hkv = self.v.shape[0] // b
    return b, hkv, heads // hkv

  def group(self, q_BTHD: Array) -> Array:
    """Queries [B, T, H, D] as buffer rows [B·Hkv, G·T, D]: the G = H ÷ Hkv query heads of
    one KV head become its extra query rows."""
    _, t, h, d = q_BTHD.shape
    b, hkv, g = self._groups(h)
    rows = q_BTHD.reshape(b, t, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
    return _to_rows(rows, self.groups)

  def group_mask(self, mask_BTS: Array, heads: int) -> Array:
    """A mask [B, T, S] on the rows of `group` for `heads` query heads: [B·Hkv, G·T, S]."""
    _, t, s = mask_BTS.shape
    b, hkv, g = self._groups(heads)
    rows = jnp.broadcast_to(mask_BTS[:, None, None], (b, hkv, g, t, s)).reshape(b, hkv, g * t, s)
    return _to_rows(rows, self.groups)

  def ungroup(self, out_NRD: Array, heads: int) -> Array:
    """Buffer rows [B·Hkv, G·T, D] back to [B, T, H, D] (the inverse of `group`)."""
    b, hkv, g = self._groups(heads)
    d = out_NRD.shape[-1]
    t = out_NRD.shape[1] // g
    out = _from_rows(out_NRD, b, self.groups)
    return out.reshape(b, hkv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, heads, d)

  def scores(self, q_NRD: Array, s: int) -> Array:
    """float32 [N, R, s]: each query row's products with the keys of slots [0, s)."""
    return jnp.einsum("nrd,nds->nrs", q_NRD, self.k[:, :, :s],
                      preferred_element_type=jnp.float32)

  def mix(self, probs_NRS: Array, s: int) -> Array:
    """float32 [N, R, D]: the values of slots [0, s) weighted by probs (cast to the storage
    dtype, accumulated in float32)."""
    return jnp.einsum("nrs,nsd->nrd", probs_NRS.astype(self.v.dtype), self.v[:, :s],
                      preferred_element_type=jnp.float32)

  def kernel_attention(self, q_NRD: Array, mask_NRS: Array) -> Array:
    """float32 [N, R, D]: softmax attention of query rows over slots [0, S) under the mask,
    by `row_kernel.attention` (a float32 cache; it reads only up to the last visible slot)."""
    return row_kernel.attention(q_NRD, self.k, self.v, mask_NRS)


def layer_view(cache: KVCache, layer: int) -> LayerView:
  """What attention reads of `layer` (`LayerView`)."""
  return LayerView(k=cache.k[layer], v=cache.v[layer], lengths=cache.lengths,
                   groups=cache.groups)
