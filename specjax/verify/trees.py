"""Token trees: static shapes (`TreeSpec`), shape builders, the Sequoia-style optimiser,
dynamic (EAGLE-2 style) trees, and the verify layout both kinds build
(`verify_layout.VerifyLayout`, its own module).

Node convention (one for the whole code base):
- Node 0 is the **root**: the pending token x_L (the last emitted token, not yet in the
  target's cache). Nodes 1..N are drafted tokens. `parents[0] = -1` and
  `parents[i] ∈ [0, i)` for i ≥ 1 (topological order). N = `size` is the node budget.
- Node i sits at position L + depth[i] (depth[root] = 0) and attends to the committed prefix
  and to its own ancestors (itself included) only: the ancestor mask.
- Siblings are ordered by index; a node's **rank** is its order among its siblings (0 =
  first tried). For deterministic candidates rank r is the draft's (r+1)-th most probable
  token; for sampled candidates the ranks are i.i.d. draws tried in index order.
- A chain of k drafts is `(-1, 0, 1, ..., k-1)`; its verify pass is a causal block of k+1
  tokens, as before trees existed.
- `theory.tree_expected_tokens` takes the parents of the drafted nodes only, with -1 for a
  child of the root (`TreeSpec.draft_parents`).

τ for trees counts the target's own token, as for chains: τ = accepted path length + 1 per
verification. Node utilisation = accepted nodes / verified nodes (= τ−1 over N per cycle).

Everything derived from a TreeSpec is a numpy constant: the spec is hashable and static
under jit, so a shape compiles once and values never recompile.

Verify layout. One verify pass scores [root, nodes] under a layout: each node's depth (its
position is L + depth), the attention mask, the children table and the depth bound.
`tree.layout(proposal)` gives it for either kind of tree: a constant for a `TreeSpec`
(the proposal is not read), built in-graph from the proposal's `parents` / `depth` for a
`DynamicTree`. The acceptance rule and the loop see only the layout, never the tree type
(`specjax/verify/layout.py`). The measured tree statistics (`metrics.TreeSummary`) live in
metrics.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from specjax.analysis import theory
from specjax.verify.layout import VerifyLayout

__all__ = ["TreeSpec", "DynamicTree", "chain", "branching", "from_paths",
           "rank_paths", "cover",
           "optimal", "expected_tokens", "pretty"]


def _is_int(x: Any) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_count(name: str, value: Any, lo: int = 1) -> int:
  if not _is_int(value) or value < lo:
    raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
  return int(value)


def _validate_parents(parents: Any) -> tuple[int, ...]:
  """The checks behind TreeSpec; raises ValueError naming `parents`."""
  if isinstance(parents, (str, bytes)) or not isinstance(parents, (Sequence, np.ndarray)):
    raise ValueError(f"parents must be a sequence of ints, got {parents!r}")
  p = list(parents)
  if not p:
    raise ValueError("parents must not be empty: it needs the root (-1) and at least one node")
  for i, x in enumerate(p):
    if not _is_int(x):
      raise ValueError(f"parents[{i}] must be an int, got {x!r}")
  p = [int(x) for x in p]
  n = len(p)
  bad = [i for i, x in enumerate(p) if x < -1 or x >= n]
  if bad:
    raise ValueError(f"parents[{bad[0]}] = {p[bad[0]]} is out of range: entries must be -1 "
                     f"(the root) or a node index in [0, {n})")
  roots = [i for i, x in enumerate(p) if x == -1]
  if len(roots) > 1:
    shown = ", ".join(map(str, roots[:8])) + (", ..." if len(roots) > 8 else "")
    raise ValueError(f"parents has several roots (-1 at nodes [{shown}]): only node 0, the "
                     f"pending token, may be the root")
  if p[0] != -1:
    raise ValueError(f"parents[0] must be -1 (node 0 is the root), got {p[0]}")
  # Node 0 is the root and every other node points at an earlier one: then the parent
  # pointers are acyclic. Only if some pointer goes forward (or to itself) can there be a
  # cycle; find it by walking each node once (linear: a walk stops at a visited node).
  if any(p[i] >= i for i in range(1, n)):
    state = [0] * n  # 0 unvisited, 1 on the current walk, 2 finished
    for i in range(n):
      walk, j = [], i
      while j != -1 and state[j] == 0:
        state[j] = 1
        walk.append(j)
        j = p[j]
      if j != -1 and state[j] == 1:  # the walk came back to itself: a cycle
        raise ValueError(f"parents has a cycle through nodes {sorted(walk[walk.index(j):])}")
      for node in walk:
        state[node] = 2
  late = [i for i in range(1, n) if p[i] >= i]
  if late:
    i = late[0]
    raise ValueError(f"parents must be in topological order (parents[i] < i), got "
                     f"parents[{i}] = {p[i]}")
  if n < 2:
    raise ValueError("parents must hold at least one drafted node besides the root, got "
                     f"{tuple(p)}")
  return tuple(p)


def _readonly(a: np.ndarray) -> np.ndarray:
  a.setflags(write=False)
  return a


@dataclasses.dataclass(frozen=True)
class TreeSpec:
  """A static token-tree shape: parent indices in topological order, node 0 = the root.

  Hashable (usable as a static jit argument). Derived numpy arrays (T = N + 1 nodes,
  D = max_depth, W = max_width):
    depth[T], ranks[T], ancestors[T, T] (ancestor-or-self mask), children[T, W] (-1 padded,
    in rank order), n_children[T], paths[T, D+1] (path[i, d] = i's ancestor at depth d,
    padded with i), level_sizes[D+1], bfs_order[T] / bfs_pos[T] (nodes sorted by
    (depth, index) and the inverse permutation).
  """

  parents: tuple[int, ...]

  def __post_init__(self):
    object.__setattr__(self, "parents", _validate_parents(self.parents))

  # -- sizes
  @property
  def n_nodes(self) -> int:
    """T = N + 1: nodes including the root (the verify width)."""
    return len(self.parents)

  @property
  def size(self) -> int:
    """N: drafted nodes (the node budget)."""
    return len(self.parents) - 1

  @functools.cached_property
  def depth(self) -> np.ndarray:
    d = np.zeros(self.n_nodes, np.int32)
    for i in range(1, self.n_nodes):
      d[i] = d[self.parents[i]] + 1
    return _readonly(d)

  @property
  def max_depth(self) -> int:
    return int(self.depth.max())

  @functools.cached_property
  def n_children(self) -> np.ndarray:
    c = np.zeros(self.n_nodes, np.int32)
    for q in self.parents[1:]:
      c[q] += 1
    return _readonly(c)

  @property
  def max_width(self) -> int:
    return int(self.n_children.max())

  @functools.cached_property
  def ranks(self) -> np.ndarray:
    r = np.zeros(self.n_nodes, np.int32)
    seen = np.zeros(self.n_nodes, np.int32)
    for i in range(1, self.n_nodes):
      r[i] = seen[self.parents[i]]
      seen[self.parents[i]] += 1
    return _readonly(r)

  @functools.cached_property
  def children(self) -> np.ndarray:
    c = np.full((self.n_nodes, self.max_width), -1, np.int32)
    for i in range(1, self.n_nodes):
      c[self.parents[i], self.ranks[i]] = i
    return _readonly(c)

  @functools.cached_property
  def ancestors(self) -> np.ndarray:
    """mask[i, j]: node j is node i or one of its ancestors (what node i attends to)."""
    a = np.eye(self.n_nodes, dtype=bool)
    for i in range(1, self.n_nodes):
      a[i] |= a[self.parents[i]]
    return _readonly(a)

  @functools.cached_property
  def paths(self) -> np.ndarray:
    d = self.max_depth
    out = np.zeros((self.n_nodes, d + 1), np.int32)
    for i in range(self.n_nodes):
      out[i, :] = i
      j = i
      while j >= 0:
        out[i, self.depth[j]] = j
        j = self.parents[j]
    return _readonly(out)

  @functools.cached_property
  def level_sizes(self) -> np.ndarray:
    return _readonly(np.bincount(self.depth, minlength=self.max_depth + 1).astype(np.int32))

  @functools.cached_property
  def bfs_order(self) -> np.ndarray:
    return _readonly(np.lexsort((np.arange(self.n_nodes), self.depth)).astype(np.int32))

  @functools.cached_property
  def bfs_pos(self) -> np.ndarray:
    pos = np.empty(self.n_nodes, np.int32)
    pos[self.bfs_order] = np.arange(self.n_nodes, dtype=np.int32)
    return _readonly(pos)

  @property
  def is_chain(self) -> bool:
    return self.parents == tuple(range(-1, self.n_nodes - 1))

  @property
  def draft_parents(self) -> tuple[int, ...]:
    """Parents of the drafted nodes with -1 for a child of the root (theory.py's form)."""
    return tuple(q - 1 for q in self.parents[1:])

  @property
  def deterministic_candidates(self) -> bool:
    """False: the drafter chooses how a static shape's candidates are drawn (sampled i.i.d.
    or its top-k)."""
    return False

  @functools.cached_property
  def _layout(self) -> VerifyLayout:
    return VerifyLayout(depth=self.depth, mask=None if self.is_chain else self.ancestors,
                        children=self.children, max_depth=self.max_depth,
                        is_chain=self.is_chain)

  def layout(self, proposal: Any = None) -> VerifyLayout:
    """The verify layout: a numpy constant (depth [T], ancestor mask [T, T] or None for a
    chain, children [T, W]); the proposal is not read."""
    del proposal
    return self._layout

  def expected_tokens(self, rank_probs: Any) -> float:
    """E[τ] under Sequoia's positional model (theory.tree_expected_tokens)."""
    return theory.tree_expected_tokens(self.draft_parents, rank_probs)

  def pretty(self, tokens: Sequence[Any] | None = None) -> str:
    return pretty(self, tokens)

  def __str__(self) -> str:
    return (f"TreeSpec({self.size} nodes, depth {self.max_depth}, width {self.max_width})\n"
            + self.pretty())


@dataclasses.dataclass(frozen=True)
class DynamicTree:
  """An EAGLE-2 style tree grown per step from the draft's own confidence.

  Each cycle: the root's top-`width` draft tokens form level 1; for `depth` − 1 more levels
  the `width` candidates with the highest cumulative draft log-probability of the newest
  level are expanded with their own top-`width` tokens; finally the `budget` candidates
  with the highest cumulative log-probability (ancestors always before descendants) are
  verified. Candidates are deterministic and distinct among siblings (point-mass rule).
  Shapes are static: budget + 1 verified nodes, max depth `depth`, max width `width`.

  `confidence`: the temperature of the draft softmax the scores are taken from (1: the
  draft's own law, EAGLE-2's choice, right when the sampler draws at T = 1). Below 1 it
  sharpens them: at T = 0 a draft token is accepted only when it is the target's argmax, so
  a draft trained to match the target's T = 1 law underrates its top choice and overrates
  the runners-up (the tree comes out wide and shallow). It only moves which candidates are
  verified (they stay point masses), so the output law is exact at every value.
  """

  budget: int
  depth: int
  width: int
  confidence: float = 1.0

  def __post_init__(self):
    for name in ("budget", "depth", "width"):
      object.__setattr__(self, name, _check_count(name, getattr(self, name)))
    c = self.confidence
    if isinstance(c, bool) or not isinstance(c, (int, float, np.floating)) or not (
        math.isfinite(c) and c > 0):
      raise ValueError(f"confidence must be a finite number > 0 (the scoring temperature), "
                       f"got {c!r}")
    object.__setattr__(self, "confidence", float(c))
    if self.budget > self.pool_size:
      raise ValueError(f"budget must be <= width + (depth - 1) * width^2 = {self.pool_size} "
                       f"(the candidates a {self.depth}-deep, {self.width}-wide expansion "
                       f"produces), got {self.budget}")

  @property
  def pool_size(self) -> int:
    """Candidates scored per cycle (root excluded)."""
    return self.width + (self.depth - 1) * self.width ** 2

  @property
  def size(self) -> int:
    return self.budget

  @property
  def n_nodes(self) -> int:
    return self.budget + 1

  @property
  def max_depth(self) -> int:
    return self.depth

  @property
  def max_width(self) -> int:
    return self.width

  @property
  def is_chain(self) -> bool:
    return False

  @property
  def deterministic_candidates(self) -> bool:
    """True: the shape is chosen from the draft's top-k, so candidates are point masses."""
    return True

  @property
  def region(self) -> int:
    """Draft-cache slots the expansion writes beyond L: root + width per expanded level."""
    return 1 + (self.depth - 1) * self.width

  def layout(self, proposal: Any) -> VerifyLayout:
    """The verify layout of this cycle's per-row trees, from the proposal's `parents` and
    `depth` (int32 [B, T], parents[:, 0] = -1, topological): depth [B, T], the
    ancestor-or-self mask [B, T, T] (pointer jumping, `depth` steps up from every node) and
    the children table [B, T, W] (child r of node i = the r-th node, in index order, whose
    parent is i). Traceable; static shapes."""
    parents_BT, depth_BT = proposal.parents, proposal.depth
    b, t = parents_BT.shape
    rows = jnp.arange(b)[:, None]
    nodes = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = nodes[:, :, None] == nodes[:, None, :]
    up = nodes
    for _ in range(self.max_depth):
      up = jnp.maximum(jnp.take_along_axis(parents_BT, up, axis=1), 0)
      mask = mask | (up[:, :, None] == nodes[:, None, :])
    same = parents_BT[:, :, None] == parents_BT[:, None, :]  # [B, T, T]
    earlier = nodes[:, None, :] < nodes[:, :, None]
    rank = jnp.sum(same & earlier, axis=2)  # [B, T]
    par = jnp.where(parents_BT >= 0, parents_BT, t)  # the root's entry goes out of range
    children = jnp.full((b, t, self.max_width), -1, jnp.int32).at[rows, par, rank].set(
        nodes, mode="drop")
    return VerifyLayout(depth=depth_BT, mask=mask, children=children,
                        max_depth=self.max_depth, is_chain=False)

  def __str__(self) -> str:
    conf = "" if self.confidence == 1.0 else f", confidence={self.confidence:g}"
    return (f"DynamicTree(budget={self.budget}, depth={self.depth}, width={self.width}{conf}; "
            f"{self.pool_size} candidates scored per cycle)")


# ----------------------------------------------------------------------------- builders


def chain(k: int) -> TreeSpec:
  """k drafted tokens in a row: parents (-1, 0, 1, ..., k-1)."""
  k = _check_count("k", k)
  return TreeSpec(tuple(range(-1, k)))


def branching(widths: Sequence[int]) -> TreeSpec:
  """Every node at depth d has widths[d] children (d = 0 is the root), e.g. (3, 2, 2, 1).

  Nodes are numbered level by level, siblings contiguous and in rank order.
  """
  if isinstance(widths, (str, bytes)) or not isinstance(widths, (Sequence, np.ndarray)) or \
      len(widths) == 0:
    raise ValueError(f"widths must be a non-empty sequence of ints >= 1, got {widths!r}")
  ws = [_check_count(f"widths[{d}]", w) for d, w in enumerate(widths)]
  parents, level = [-1], [0]
  for w in ws:
    nxt = []
    for node in level:
      for _ in range(w):
        parents.append(node)
        nxt.append(len(parents) - 1)
    level = nxt
  return TreeSpec(tuple(parents))


def from_paths(paths: Sequence[Sequence[int]]) -> TreeSpec:
  """A tree from root-to-node paths of candidate ranks (the Medusa / EAGLE "choices" format).

  `[(0,), (1,), (0, 0), (0, 1)]`: the draft's top-2 at depth 1, then the top-2 after the
  top-1. Every prefix of a path must be listed too, and the ranks under one node must be
  0, 1, ..., m-1. Nodes are numbered by (length, path) order: level by level.
  """
  if isinstance(paths, (str, bytes)) or not isinstance(paths, (Sequence, np.ndarray)) or \
      len(paths) == 0:
    raise ValueError(f"paths must be a non-empty sequence of rank tuples, got {paths!r}")
  norm = []
  for i, path in enumerate(paths):
    if isinstance(path, (str, bytes)) or not isinstance(path, (Sequence, np.ndarray)) or \
        len(path) == 0:
      raise ValueError(f"paths[{i}] must be a non-empty sequence of ranks, got {path!r}")
    for r in path:
      if not _is_int(r) or r < 0:
        raise ValueError(f"paths[{i}] must hold ints >= 0 (candidate ranks), got {path!r}")
    norm.append(tuple(int(r) for r in path))
  known: set = set()
  for p in norm:
    if p in known:
      raise ValueError(f"paths lists {p} more than once")
    known.add(p)
  for p in norm:
    if len(p) > 1 and p[:-1] not in known:
      raise ValueError(f"paths has {p} but not its prefix {p[:-1]}")
    if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in known:
      raise ValueError(f"paths has {p} but not its elder sibling {p[:-1] + (p[-1] - 1,)}: "
                       f"ranks under one node must be 0, 1, ..., m-1")
  order = sorted(norm, key=lambda p: (len(p), p))
  index = {(): 0}
  parents = [-1]
  for p in order:
    index[p] = len(parents)
    parents.append(index[p[:-1]])
  return TreeSpec(tuple(parents))


def rank_paths(tree: TreeSpec) -> list[tuple[int, ...]]:
  """Every node's root-to-node path of sibling ranks (root excluded): `from_paths`' format,
  so `from_paths(rank_paths(t)) == t`."""
  out: list[tuple[int, ...]] = [()]
  for i in range(1, tree.n_nodes):
    out.append(out[tree.parents[i]] + (int(tree.ranks[i]),))
  return out[1:]


def cover(shapes: Sequence[TreeSpec]) -> TreeSpec:
  """The smallest static tree holding each of `shapes` as a subtree (the union of their rank
  paths): at least each one's nodes, the deepest one's depth, the widest node's width. What
  a drafter that serves several shapes in one loop (an adaptive menu) sizes its state for."""
  if not shapes or not all(isinstance(t, TreeSpec) for t in shapes):
    raise ValueError(f"shapes must be a non-empty sequence of trees.TreeSpec, got {shapes!r}")
  paths = {p for t in shapes for p in rank_paths(t)}
  return from_paths(sorted(paths, key=lambda p: (len(p), p)))


def _check_rank_probs(rank_probs: Any) -> np.ndarray:
  try:
    a = np.asarray(rank_probs, dtype=np.float64)
  except (TypeError, ValueError):
    raise ValueError(f"rank_probs must be numbers in [0, 1], got {rank_probs!r}") from None
  if a.ndim not in (1, 2) or a.shape[-1] == 0 or a.size == 0:
    raise ValueError(f"rank_probs must have shape [R] or [D, R] with R >= 1, got shape "
                     f"{a.shape}")
  if not np.all(np.isfinite(a)) or np.any((a < 0) | (a > 1)):
    raise ValueError(f"rank_probs must be in [0, 1], got {rank_probs!r}")
  if np.any(a.sum(axis=-1) > 1.0 + 1e-9):
    raise ValueError(f"rank_probs must sum to at most 1 over ranks (at most one sibling is "
                     f"accepted), got sums {a.sum(axis=-1)}")
  return a


def optimal(budget: int, rank_probs: Any, *, max_depth: int | None = None) -> TreeSpec:
  """The tree of at most `budget` nodes with the largest E[τ] (Sequoia's dynamic program).

  rank_probs[r] (or rank_probs[d-1, r] per depth d): probability that, once a node is
  accepted, its rank-r child is the one accepted next (`theory.tree_node_probs`). With
  best(d, n) = the largest expected number of accepted nodes in a subtree of exactly n
  nodes hanging below an accepted node at depth d, and g(d, n, r) the same restricted to
  children of rank ≥ r:

      g(d, 0, r) = 0,  g(d, n > 0, R) = -inf
      g(d, n, r) = max_{1 <= j <= n} p_{d+1, r} (1 + best(d+1, j-1)) + g(d, n-j, r+1)
      best(d, n) = g(d, n, 0);  best(max_depth, n > 0) = -inf

  (a child of rank r gets j nodes: itself and a subtree of j-1). The answer uses the n ≤
  budget with the largest best(0, n) (the largest n on ties: a node of zero probability
  costs only a verified row). Ties between allocations go to the lower ranks (deeper
  trees), so acceptance (1, 0, 0, ...) gives a chain. E[τ] = 1 + best(0, n) =
  theory.tree_expected_tokens(tree.draft_parents, rank_probs). O(D·R·budget²) numpy work.
  """
  budget = _check_count("budget", budget)
  probs = _check_rank_probs(rank_probs)
  if max_depth is None:
    max_depth = budget if probs.ndim == 1 else probs.shape[0]
  max_depth = _check_count("max_depth", max_depth)
  if probs.ndim == 2 and max_depth > probs.shape[0]:
    raise ValueError(f"max_depth ({max_depth}) exceeds the {probs.shape[0]} depths rank_probs "
                     f"gives")
  max_depth = min(max_depth, budget)
  R = min(probs.shape[-1], budget)
  n_all = np.arange(budget + 1)
  neg = -np.inf
  best = np.full((max_depth + 1, budget + 1), neg)
  best[max_depth, 0] = 0.0
  # choice[d][r][n] = nodes given to the rank-r child (itself included) under a depth-d node.
  choice = np.zeros((max_depth, R + 1, budget + 1), np.int64)
  for d in range(max_depth - 1, -1, -1):
    row = probs if probs.ndim == 1 else probs[d]
    sub = best[d + 1]  # best(d+1, j-1) for j = 1..budget is sub[:budget]
    g = np.full(budget + 1, neg)
    g[0] = 0.0  # g(d, ., R)
    for r in range(R - 1, -1, -1):
      gain = np.full(budget + 1, neg)  # gain[j] = p (1 + best(d+1, j-1)) for j >= 1
      with np.errstate(invalid="ignore"):
        gain[1:] = np.where(np.isfinite(sub[:budget]), row[r] * (1.0 + sub[:budget]), neg)
      # total[n, j] = gain[j] + g[n - j] for 1 <= j <= n; iterate j from large to small so
      # argmax (first maximum) prefers the largest subtree for the lower rank.
      js = n_all[::-1][:-1]  # budget, ..., 1
      nj = n_all[:, None] - js[None, :]
      total = np.where(nj >= 0, gain[js][None, :] + g[np.clip(nj, 0, None)], neg)
      k = np.argmax(total, axis=1)
      new_g = total[n_all, k]
      new_g[0] = 0.0
      choice[d, r] = np.where(np.isfinite(new_g), js[k], 0)
      choice[d, r, 0] = 0
      g = new_g
    best[d] = g
  values = best[0]
  top = np.nanmax(np.where(np.isfinite(values[1:]), values[1:], neg))
  n_best = max(n for n in range(1, budget + 1) if values[n] == top)
  parents: list[int] = [-1]

  def build(parent: int, d: int, n: int, queue: list):
    r = 0
    while n > 0:
      j = int(choice[d, r, n])
      parents.append(parent)
      queue.append((len(parents) - 1, d + 1, j - 1))
      n -= j
      r += 1

  # Breadth-first numbering: children of a node contiguous and in rank order.
  queue: list = []
  build(0, 0, n_best, queue)
  head = 0
  while head < len(queue):
    node, d, n = queue[head]
    head += 1
    build(node, d, n, queue)
  return TreeSpec(tuple(parents))


def expected_tokens(tree: TreeSpec, rank_probs: Any) -> float:
  """E[τ] of a static tree under Sequoia's positional model."""
  return tree.expected_tokens(rank_probs)


def pretty(tree: TreeSpec, tokens: Sequence[Any] | None = None) -> str:
  """An ASCII drawing, one node a line: `node (rank r)` or the token when given.

      root
      ├── 1
      │   └── 3
      └── 2
  """
  if tokens is not None and len(tokens) != tree.n_nodes:
    raise ValueError(f"tokens must have one entry per node ({tree.n_nodes}), got {len(tokens)}")
  lines = ["root" if tokens is None else f"root {tokens[0]!r}"]

  def walk(node: int, prefix: str):
    kids = [c for c in tree.children[node] if c >= 0]
    for i, c in enumerate(kids):
      last = i == len(kids) - 1
      label = f"{c}" if tokens is None else f"{c}: {tokens[c]!r}"
      lines.append(f"{prefix}{'└── ' if last else '├── '}{label}")
      walk(int(c), prefix + ("    " if last else "│   "))

  walk(0, "")
  return "\n".join(lines)
