"""Fused products: layers that read the same input (q, k, v; gate, up) computed as one
product of their concatenated kernels on XLA:CPU (`one_row_bf16.fuse_products`), and the
concatenations made once before a decoding loop (`prefused`; docs/xla_notes.md, traps 7b
and 12). The models' own layers are `specjax.models.transformer`'s."""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from typing import Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models import one_row_bf16, row_kernel, switches

Array = jax.Array


def bcast(v_D: Array, like: Array) -> Array:
  """A [D] vector shaped to broadcast against [..., D] (explicit: strict rank promotion)."""
  return v_D.reshape((1,) * (like.ndim - 1) + v_D.shape)


def project(x: Array, layers: Sequence) -> list[Array]:
  """x through Dense layers that share it as input (q, k, v; gate, up), one output each.

  Where `one_row_bf16.fuse_products()` (XLA:CPU by default): one product of their kernels
  concatenated along the output axis, then split; the concatenation is the one `prefused`
  computed before a decoding loop where there is one, else made here (inside a loop, XLA
  hoists it out of a simple loop body, but not out of a loop nested in another: docs/
  xla_notes.md, trap 12). One-row results are bit-identical to separate products; products
  of several rows may round differently (another GEMM blocking). Elsewhere: one product
  each."""
  if len(layers) == 1 or not one_row_bf16.fuse_products():
    return [layer(x) for layer in layers]
  w = _fused_kernel(layers)
  y = one_row_bf16.one_row_safe_matmul("...i,io->...o", x.astype(w.dtype), w)
  if layers[0].bias is not None:
    b = jnp.concatenate([layer.bias[...].astype(jnp.float32) for layer in layers])
    y = y + bcast(b, y)
  ends = np.cumsum([layer.kernel.shape[1] for layer in layers])[:-1]
  return jnp.split(y, [int(e) for e in ends], axis=-1)


# prefused kernels of the current trace: {ids of the kernels: (kernels, concatenation)}
_PREFUSED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("prefused",
                                                                       default=None)


def _fused_kernel(layers: Sequence) -> Array:
  """The layers' kernels concatenated along the output axis: `prefused`'s array for these
  very kernel arrays where it made one, else a new concatenation."""
  kernels = tuple(layer.kernel[...] for layer in layers)
  found = (_PREFUSED.get() or {}).get(tuple(map(id, kernels)))
  if found is not None and all(a is b for a, b in zip(found[0], kernels)):
    return found[1]
  return jnp.concatenate(kernels, axis=1)


def product_groups(module) -> Iterator[tuple]:
  """The layer groups `project` fuses in a module graph: every node's `projections()` of two
  or more layers (`transformer.Attention`'s q, k, v; a SwiGLU MLP's gate, up), as their
  `__call__`s pass them."""
  for _, node in nnx.iter_graph(module):
    group = node.projections() if hasattr(node, "projections") else ()
    if len(group) > 1:
      yield tuple(group)


def row_kernel_weights(module) -> Iterator[tuple[Array, bool]]:
  """(weight, stored [n, d]) of every float32 product in a module graph the row kernel can
  compute: each Dense-like node's 2-D `kernel`, and a tied LM head's embedding (a node with
  an `embed` and no `lm_head`)."""
  for _, node in nnx.iter_graph(module):
    kernel = getattr(node, "kernel", None)
    if isinstance(kernel, nnx.Param) and kernel[...].ndim == 2:
      yield kernel[...], False
    if getattr(node, "lm_head", False) is None and isinstance(getattr(node, "embed", None),
                                                               nnx.Param):
      yield node.embed[...], True


def _packing(module, fuse: bool, table: dict) -> list[tuple[Array, bool]]:
  """(weight, stored [n, d]) of every float32 product of `module` the row kernel takes, in
  a fixed order (the graph's), each pair once: where `fuse`, the fused groups'
  concatenations (made into `table` where it has none) in place of their kernels (`project`
  never uses those alone), then the other `row_kernel_weights`."""
  weights, seen = [], set()
  if fuse:
    for layers in product_groups(module):
      kernels = tuple(layer.kernel[...] for layer in layers)
      key = tuple(map(id, kernels))
      if key not in table:
        table[key] = (kernels, jnp.concatenate(kernels, axis=1))
      weights.append((table[key][1], False))
      seen.update((k, False) for k in key)
  weights.extend(row_kernel_weights(module))
  out = []
  for w, transposed in weights:
    if w.dtype == jnp.float32 and (id(w), transposed) not in seen:
      seen.add((id(w), transposed))
      out.append((w, transposed))
  return out


def packs_of(module) -> tuple[Array, ...]:
  """The row kernel's packed copies of `module`'s float32 products (`_packing`'s order), as
  `prefused` would make them: computed once per model by `packed_lm`, outside any loop."""
  return tuple(row_kernel.pack(w, t)
               for w, t in _packing(module, one_row_bf16.fuse_products(), {}))


@contextlib.contextmanager
def prefused(modules: Iterable, packs: Sequence | None = None):
  """Within the block, `project` takes the concatenated kernels of every group of `modules`
  (`product_groups`) from arrays computed here, once, instead of concatenating at each call;
  and, where `row_kernel.active()`, every float32 product of `modules` with few rows takes
  the row kernel with a packed copy of its weight (`_packing`, the concatenations included):
  from `packs[i]`, module i's copies made before the call by `packs_of` (`packed_lm`), where
  given and not None, else made here.

  A decoding loop traces its body with the models' weights closed over; called at the top
  of the loop function, before `lax.while_loop`, this puts each concatenation (and packing)
  outside the loop as a loop-invariant value. XLA does that itself for a loop whose body
  calls the model directly, but not where the call sits in a loop nested inside another (the
  adaptive loop's zero-or-one-trip entries): there every outer iteration concatenated every
  fused weight again, 0.7 of a plain step of SmolLM2-135M on XLA:CPU. Packing here still
  costs every call a copy of the weights (0.3 s on SmolLM2-135M): the host API passes
  `packs` made once per model. No-op unless `fuse_products()` or `row_kernel.active()`; a
  copy nothing uses is dropped by XLA. A product inside a nested `jax.jit` sees new tracers,
  not these weights: it keeps XLA's kernels and the concatenation."""
  fuse, pack = one_row_bf16.fuse_products(), row_kernel.active()
  modules = list(modules)
  packs = list(packs) if packs is not None else [None] * len(modules)
  table = dict(_PREFUSED.get() or {})
  made, weights = [], []
  for module, module_packs in zip(modules, packs):
    pairs = _packing(module, fuse, table)  # the concatenations go into `table`
    if not pack:
      continue
    if module_packs is None:
      weights.extend(pairs)
      continue
    if len(module_packs) != len(pairs) or any(
        p.shape != row_kernel.packed_shape(w, t) for (w, t), p in zip(pairs, module_packs)):
      raise ValueError(f"packs: {len(module_packs)} packed copies do not match the model's "
                       f"{len(pairs)} row-kernel products (made by `fused.packs_of` of "
                       f"another model?)")
    made.extend((w, t, p) for (w, t), p in zip(pairs, module_packs))
  with switches.setting(_PREFUSED, table), row_kernel.packed(weights, made):
    yield


# packed copies per model: {ids of its weight leaves: (weak references to them, packs)}
_PACKS: dict[tuple, tuple] = {}


def packed_lm(lm):
  """`lm` (a `models.lm.LM`) carrying its row kernel's packed copies (`packs_of`, made once
  per model and kept while its weights live; the same weights, the same copies), for a
  decoding loop to take as an argument (`prefused`'s `packs`); `lm` itself where the kernel
  is not `row_kernel.active()` or the model has no float32 product for it."""
  if not row_kernel.active() or lm.packs is not None:
    return lm
  leaves = jax.tree_util.tree_leaves(lm.params)
  key = tuple(map(id, leaves))
  found = _PACKS.get(key)
  if found is None or any(r() is not x for r, x in zip(found[0], leaves)):
    drop = lambda _ref, key=key: _PACKS.pop(key, None)
    try:
      refs = [weakref.ref(x, drop) for x in leaves]
    except TypeError:  # a leaf that cannot be watched (a Python scalar): packed in the loop
      return lm
    _PACKS[key] = found = (refs, _pack_jit(lm))
  return lm.replace(packs=found[1]) if found[1] else lm


@jax.jit
def _pack_jit(lm):
  return packs_of(lm.module())
