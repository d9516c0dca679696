"""Decoding over a device mesh: the partition rules of every weight and where state is placed.

A mesh has two axes, `data` (the batch's rows) and `model` (tensor parallelism, the
Megatron layout). This file decides every sharding; the loops never name one:

- weights (`param_spec`, by the parameter's name in the NNX state): q/k/v and the MLP's
  up/gate are split by output column (whole attention heads per device), o and the MLP's
  down by input row, so each block needs one reduction of its output over `model` and no
  weight moves; the embedding is split over the vocabulary (over d_model when the
  vocabulary does not divide, replicated when neither does), an untied LM head over the
  vocabulary too; norms, position tables and anything unnamed are replicated. Drafters' own
  weights follow the same rules (a draft model, the EAGLE head's block and its folded LM
  head, Medusa heads split by column); arrays a drafter shares with the target stay one
  copy.
- the batch (`place_batch`): prompts, lengths and budgets split by row over `data`.
- the KV caches are built inside the loop: `models/cache.py` reads the active mesh
  (`on(mesh)`, i.e. `jax.set_mesh`) and splits them over KV heads (`model`) and rows
  (`data`).

The host API (`decoding.generate`, `speculative_generate`, `mesh=`) places the weights
and the batch, then calls the compiled loop under `on(mesh)`: XLA's SPMD partitioner
propagates these shardings through the loop, which compiles once per mesh and shapes.
The target's attention heads must divide by the `model` axis (refused in one line
otherwise); KV heads that do not divide (grouped-query attention with fewer KV heads than
devices) are replicated over `model`: k/v weights and the KV cache then split over `data`
only. A draft model or head whose attention heads do not divide keeps its attention
replicated. A batch that `data` does not divide is padded by the host API
(`batching.pad_rows`, `data_size`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from specjax.models.transformer import ModelConfig

AXES = ("data", "model")

_COLUMN = {"q", "k", "v", "up", "gate", "fuse", "combine"}  # split by output column
_ROW = {"o", "down"}  # split by input row
_QUERY = {"q", "o"}  # split with the attention heads
_KV = {"k", "v"}  # split with the KV heads


def parse_mesh(text: str) -> tuple[int, int]:
  """(data, model) from 'data=D,model=M' (either may be left out: 1); ValueError naming the
  flag and what is allowed."""
  sizes = {"data": 1, "model": 1}
  seen = set()
  for part in str(text).split(","):
    name, eq, value = part.strip().partition("=")
    name = name.strip()
    if not eq or name not in sizes or name in seen or not value.strip().isdigit() or \
        int(value) < 1:
      raise ValueError(f"--mesh must be 'data=D,model=M' with integers >= 1 (each axis at "
                       f"most once), got {text!r}")
    seen.add(name)
    sizes[name] = int(value)
  return sizes["data"], sizes["model"]


def make_mesh(data: int = 1, model: int = 1, devices: Sequence | None = None) -> Mesh:
  """A (data, model) mesh over the first data·model devices (default: `jax.devices()`, all
  processes'); ValueError when there are fewer."""
  for name, n in (("data", data), ("model", model)):
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
      raise ValueError(f"mesh {name} must be an int >= 1, got {n!r}")
  devices = list(jax.devices() if devices is None else devices)
  if data * model > len(devices):
    raise ValueError(f"mesh data={data}, model={model} needs {data * model} devices, "
                     f"only {len(devices)} are available")
  grid = np.asarray(devices[:data * model], dtype=object).reshape(data, model)
  return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))


_DEFAULT: list = [None]  # the process default of `default_mesh` (the CLI's --mesh)


@contextlib.contextmanager
def default_mesh(mesh: Mesh | tuple[int, int] | None):
  """Within this context, host-API calls given no `mesh=` run on `mesh`, a Mesh or (data,
  model) sizes, built on first use over this process's devices (after a multi-host run has
  started `jax.distributed`; its processes decode different points).
  The CLI's --mesh sets it around a command, so every study and `bench` decodes on it;
  restored after."""
  old = _DEFAULT[0]
  _DEFAULT[0] = mesh if isinstance(mesh, tuple) else check_mesh(mesh)
  try:
    yield
  finally:
    _DEFAULT[0] = old


def default_mesh_shape() -> tuple[int, int] | None:
  """(data, model) of the `default_mesh` in effect (the CLI's --mesh), None when there is
  none: what a run directory records and fingerprints."""
  mesh = _DEFAULT[0]
  if mesh is None:
    return None
  if isinstance(mesh, tuple):
    return tuple(int(n) for n in mesh)
  return int(mesh.shape["data"]), int(mesh.shape["model"])


def check_mesh(mesh) -> Mesh | None:
  """The mesh a host-API call runs on: `mesh`, or when None the `default_mesh` (None unless
  set: one device, today's behaviour). Refuses anything but a `jax.sharding.Mesh` with
  exactly the axes ('data', 'model')."""
  if mesh is None:
    if isinstance(_DEFAULT[0], tuple):  # this process's devices: `specjax run`'s processes
      _DEFAULT[0] = make_mesh(*_DEFAULT[0], devices=jax.local_devices())  # run other points
    return _DEFAULT[0]
  if not isinstance(mesh, Mesh) or tuple(mesh.axis_names) != AXES:
    names = getattr(mesh, "axis_names", None)
    raise ValueError(f"mesh must be a jax.sharding.Mesh with axes {AXES} "
                     f"(sharding.make_mesh(data, model)), got {type(mesh).__name__} with "
                     f"axes {names!r}")
  if any(t != AxisType.Auto for t in mesh.axis_types):
    mesh = Mesh(mesh.devices, AXES, axis_types=(AxisType.Auto, AxisType.Auto))
  return mesh


def data_size(mesh: Mesh | None) -> int:
  """The rows a batch on `mesh` is padded to a multiple of (`batching.pad_rows`): the
  `data` axis; 1 without a mesh."""
  return 1 if mesh is None else int(mesh.shape["data"])


def on(mesh: Mesh | None):
  """The context a mesh run is traced and run in (`jax.set_mesh`; nothing for None)."""
  return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def check_heads(config, mesh: Mesh, what: str = "target") -> None:
  """Refuses (one line) a model whose attention heads do not divide by `model`."""
  m = mesh.shape["model"]
  if config.n_heads % m:
    raise ValueError(f"mesh model={m} must divide the {what}'s n_heads ({config.n_heads}): "
                     f"pick a model axis that divides {config.n_heads}")


def _is_lm(x) -> bool:
  """A model handle (`drafters.base.LM`: a config and its params), by shape: this file sits
  beside the models so that checkpoints and training can place weights too."""
  return isinstance(getattr(x, "config", None), ModelConfig) and hasattr(x, "params") and \
      hasattr(x, "graphdef")


def _names(path) -> list[str]:
  """The names along a pytree path ('blocks', '0', 'attn', 'q', 'kernel', ...)."""
  return [n for n in re.findall(r"[A-Za-z_][A-Za-z0-9_]*|\d+", jax.tree_util.keystr(path))
          if n != "value"]


def param_spec(names: Sequence[str], shape: tuple[int, ...], model: int,
               heads: int | None = None, kv_heads: int | None = None) -> P:
  """The partition spec of one weight, from its names along the state's path and its shape
  (module doc), in a model of `heads` attention and `kv_heads` KV heads (None: divisible).
  A dimension that does not divide by `model` is never split, nor are q/o when the heads
  do not divide, nor k/v when the KV heads do not."""
  def split(dim: int) -> P:
    if len(shape) <= dim or shape[dim] % model:
      return P()
    spec = [None] * len(shape)
    spec[dim] = "model"
    return P(*spec)

  if model == 1 or not shape:
    return P()
  leaf, owner = names[-1], (names[-2] if len(names) > 1 else "")
  if (owner in _QUERY and (heads or 0) % model) or (owner in _KV and (kv_heads or 0) % model):
    return P()
  if leaf in ("kernel", "bias") and owner in _COLUMN:
    return split(len(shape) - 1)
  if leaf == "kernel" and owner in _ROW:
    return split(0)
  if leaf == "embed":  # [V, D]: the vocabulary, else d_model
    return split(0) if shape[0] % model == 0 else split(1)
  if leaf == "kernel" and owner == "lm_head":  # [D, V]
    return split(1) if shape[1] % model == 0 else split(0)
  if leaf == "lm" and len(shape) == 2:  # the EAGLE head's folded LM head [W, V]
    return split(1)
  if leaf in ("w", "b") and owner == "params" and len(shape) in (2, 3):  # Medusa heads
    return split(len(shape) - 1)
  return P()


class _Placer:
  """device_put of every array leaf to its NamedSharding, each distinct array once (a
  drafter's view of the target's weights stays the target's copy)."""

  def __init__(self, mesh: Mesh):
    self.mesh, self.model, self.done = mesh, mesh.shape["model"], {}
    self.heads: tuple[int | None, int | None] = (None, None)

  def array(self, x, spec: P):
    key = id(x)
    if key not in self.done:
      self.done[key] = (x, jax.device_put(x, NamedSharding(self.mesh, spec)))
    return self.done[key][1]

  def tree(self, tree):
    """`tree` (an LM, a drafter) with every array placed; an LM's heads decide its q/k/v/o."""
    outer = self.heads
    if _is_lm(tree):
      self.heads = (tree.config.n_heads, tree.config.n_kv_heads)

    def leaf(path, x):
      if _is_lm(x):
        return self.tree(x)
      if not isinstance(x, (jax.Array, np.ndarray)):
        return x
      return self.array(x, param_spec(_names(path), np.shape(x), self.model, *self.heads))

    try:
      return jax.tree_util.tree_map_with_path(
          leaf, tree, is_leaf=lambda x: _is_lm(x) and x is not tree)
    finally:
      self.heads = outer


def named(mesh: Mesh, config: ModelConfig, names: Sequence[str], shape) -> NamedSharding:
  """The sharding of one parameter of a model with `config` (`param_spec` by its names, e.g.
  'blocks.0.attn.q.kernel'.split('.'))."""
  spec = param_spec(list(names), tuple(shape), mesh.shape["model"], config.n_heads,
                    config.n_kv_heads)
  return NamedSharding(mesh, spec)


def abstract_params(mesh: Mesh, config: ModelConfig, params):
  """A model's parameter state (arrays or shape structs, e.g. `transformer.abstract_model`'s)
  as `jax.ShapeDtypeStruct`s carrying their shardings: a restore target that reads every
  array straight into its shards (`checkpoints.orbax_io`)."""
  def leaf(path, x):
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype,
                                sharding=named(mesh, config, _names(path), np.shape(x)))
  return jax.tree_util.tree_map_with_path(leaf, params)


def place(mesh: Mesh | None, target, drafter=None):
  """(target, drafter) with their weights on `mesh` (module doc); unchanged for None.
  `target`: an `LM`; its heads must divide by the model axis (`check_heads`)."""
  if mesh is None:
    return target, drafter
  check_heads(target.config, mesh)
  placer = _Placer(mesh)
  target = placer.tree(target)
  return target, (None if drafter is None else placer.tree(drafter))


def place_args(mesh: Mesh | None, args: tuple, models: int) -> tuple:
  """A compiled loop's positional arguments placed on `mesh` (unchanged for None): the first
  `models` (the target, then the drafter and the adaptive policy) by `place`'s rules, the
  next three (prompts, prompt lengths, budgets) split by row over `data`, the rest (EOS ids,
  sampler, key) as they are (replicated by the compiled loop)."""
  if mesh is None:
    return args
  check_heads(args[0].config, mesh)
  batch = place_batch(mesh, *args[models:models + 3])
  placer = _Placer(mesh)
  return tuple(placer.tree(a) for a in args[:models]) + batch + tuple(args[models + 3:])


def place_batch(mesh: Mesh | None, *arrays_B):
  """The per-row arrays of a batch (prompts [B, P], lengths [B], budgets [B]) split by row
  over `data`; unchanged for None. ValueError when the batch does not divide."""
  if mesh is None:
    return arrays_B
  d = mesh.shape["data"]
  b = np.shape(arrays_B[0])[0]
  if b % d:
    raise ValueError(f"mesh data={d} must divide the batch ({b} prompts per call): pad it "
                     f"(`batching.pad_rows`, as the host API does) or pick a data axis that "
                     f"divides it")
  return tuple(jax.device_put(x, NamedSharding(mesh, P("data", *([None] * (np.ndim(x) - 1)))))
               for x in arrays_B)


def replicate(mesh: Mesh, tree):
  """Every array of `tree` replicated on every device of `mesh` (data-parallel training)."""
  every = NamedSharding(mesh, P())
  return jax.tree.map(lambda x: jax.device_put(x, every) if isinstance(x, jax.Array) else x,
                      tree)


def split_rows(mesh: Mesh, x, axis: int = 0):
  """`x` split over `data` along `axis` (its rows), replicated over `model`; ValueError
  when the rows do not divide."""
  d, rows = mesh.shape["data"], np.shape(x)[axis]
  if rows % d:
    raise ValueError(f"mesh data={d} must divide the {rows} rows of a batch: pick a data "
                     f"axis that divides {rows}")
  spec = [None] * np.ndim(x)
  spec[axis] = "data"
  return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def fetched(state):
  """A loop's final state readable on this host: with several processes (`jax.distributed`)
  every array the host reads is gathered from all of them (`process_allgather`, a
  collective every process makes); the caches and the key, which it does not read, are
  dropped. Unchanged in one process."""
  if jax.process_count() == 1:
    return state
  from jax.experimental import multihost_utils
  state = state.replace(cache=None, draft=None, key=None)

  def gather(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return multihost_utils.process_allgather(x, tiled=True)
    return x

  return jax.tree.map(gather, state)


def bytes_per_device(tree) -> dict:
  """{device: bytes} of the array leaves' shards each device holds (`addressable_shards`)."""
  out: dict = {}
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.Array):
      for shard in x.addressable_shards:
        out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
  return out
