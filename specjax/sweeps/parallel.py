"""Spreading independent work over all local devices (data parallel, no collectives).

`device_map(fn, *stacked, shared=())` runs `fn(*shared, *row)` on every row of its stacked
inputs: rows are split over a one-axis mesh of the local devices with `jax.shard_map` and
vectorised with `jax.vmap` inside each device; `shared` arguments (model weights, prompts)
are replicated, not mapped. With one device it is a jitted vmap. The row count is padded
to a multiple of the device count (the padding repeats the last row and is dropped).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P


@functools.lru_cache(maxsize=None)
def _mapped(fn, n_devices: int, n_shared: int, n_stacked: int):
  vfn = jax.vmap(fn, in_axes=(None,) * n_shared + (0,) * n_stacked)
  if n_devices == 1:
    return jax.jit(vfn)
  mesh = Mesh(np.array(jax.local_devices()[:n_devices]), ("points",))
  # check_vma=False: loop carries start as device-invariant constants and become per-device
  # values; the computation is plain data parallelism.
  specs = (P(),) * n_shared + (P("points"),) * n_stacked
  return jax.jit(jax.shard_map(vfn, mesh=mesh, in_specs=specs, out_specs=P("points"),
                               check_vma=False))


def device_map(fn, *stacked, shared: tuple = (), n_devices: int | None = None):
  """fn(*shared, *row) for each row of the stacked pytrees `stacked`, rows spread over
  devices; `shared` pytrees are passed whole to every row (replicated).

  `fn` must be a hashable callable (a module-level function or functools.partial of one) so
  the compiled program is reused across calls.
  """
  leaves = jax.tree.leaves(stacked)
  if not leaves:
    raise ValueError("device_map needs at least one stacked array")
  rows = leaves[0].shape[0]
  n = n_devices or min(jax.local_device_count(), rows)
  pad = (-rows) % n
  if pad:
    stacked = jax.tree.map(
        lambda x: jnp.concatenate([x, jnp.repeat(x[-1:], pad, axis=0)], axis=0), stacked)
  out = _mapped(fn, n, len(shared), len(stacked))(*shared, *stacked)
  return jax.tree.map(lambda x: x[:rows], out)


def point_keys(seeds) -> jax.Array:
  """One PRNG key per row, `jax.random.key(seed_i)`: row i's key depends on its own seed only
  (use `runner.point_seed` of the point's parameters), never on the row's position or the
  group's size, so a point draws the same numbers alone or in any group."""
  return jnp.stack([jax.random.key(int(s)) for s in seeds])
