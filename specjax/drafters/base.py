"""The drafter protocol shared by every draft kind (`Drafter`, with defaults). The jit
handle of a model, `LM`, is `specjax.models.lm`'s.

A drafter is a pytree: its arrays (weights) are leaves, its static description (graph
definition, flags) is auxiliary data, so it passes through `jax.jit` as an ordinary
argument and a different drafter of the same kind and shape does not recompile.

Protocol (all pure and jittable; B = batch, N = drafted nodes per cycle, T = N + 1 nodes
with the root, V = vocabulary; `tree` is a static `trees.TreeSpec` or `trees.DynamicTree`,
a chain of k drafts being `trees.chain(k)`):

    state = drafter.init(prompt_BP, prompt_len_B, cache_len, tree[, features=F_BPCD])
    proposal, state = drafter.propose(state, ctx, tree, sampler, key)
    state = drafter.commit(state, ctx_after, tree, path_BP, n_accepted_B[, features=F_BTCD])

and, on the host, with defaults in `Drafter`:

    drafter.config -> ModelConfig | None   (the draft model's; None: no model, no KV cache)
    drafter.slots_needed(tree) -> int      (cache slots one cycle writes from L; default
                                            the verified nodes, tree.n_nodes)
    drafter.validate(tree, batch) -> None  (raises ValueError for a tree / batch the drafter
                                            cannot draft; default: accepts all)
    drafter.feature_layers -> tuple[int]   (target layers it reads; default none. When set,
                                            `features=` carries their outputs, see below)
    drafter.lazy_catch_up -> bool          (static; default False. True: the adaptive loop's
                                            plain steps may leave the drafter behind and
                                            bring it up to date later with `catch_up`)
    drafter.with_stopping(threshold) -> Drafter
                                           (dynamic draft stopping, below; default: the
                                            drafter itself, which never stops early)
    drafter.shares_target_cache -> bool    (static; default False. True: the drafter keeps no
                                            cache of its own and drafts in the target's,
                                            below)

Sharing the target's cache (optional). A drafter whose own cache would hold exactly what the
target's holds for the committed prefix (layer-skip: the target's first m layers) may draft
in the target's cache instead. The loop then calls, around every `propose`,

    state = drafter.borrow_cache(state, target_cache)
    state, target_cache = drafter.return_cache(state, target_cache)

The drafter may write the target's cache only at slots >= L (the pending token and its
drafts): the verify pass, or the plain step, rewrites those before it reads them, and the
committed prefix [0, L) stays the target's own, so the target computes exactly what it
computes alone. Such a drafter has no cache to size (`config` still describes its model) and
catches up eagerly in the adaptive loop (a lazy catch-up would have to rewrite committed
entries).

Dynamic draft stopping (optional; the adaptive loop's `threshold`). A drafter returned by
`with_stopping(threshold)` (threshold a float32 array, 0 = never) may stop drafting a chain
once the cumulative confidence of every row's newest drafted node (the product along the
chain of the max probability of the draft's softmax at each node's parent) is below the
threshold.
The nodes it did not draft are fillers, point masses (q one-hot at the filler token), and
`Proposal.drafted` says how many nodes were drafted; the loop emits at most drafted + 1
tokens (module doc of `specjax.engine.adaptive.policy`: why this stays exact).

Lazy catch-up (optional, adaptive loop only). A plain (k = 0) step of the adaptive loop emits
one token without drafting. A drafter that declares `lazy_catch_up` is not told about such
steps: it stays as the last `commit` (or `catch_up`) left it, synced at a context length
L - behind[b] per row, and before it drafts again (or when `behind` would exceed the loop's
static bound P) the loop calls

    state, guess = drafter.catch_up(state, ctx, behind_B, P, sampler[, features=F_BPCD])

with the current context and 0 <= behind_B <= P. It must return the state `commit` would
have left at the current L (after the skipped steps), and its guesses for the skipped
tokens, for the adaptive policy's acceptance estimate: `guess` is a `Proposal` with tokens
[B, P] and q [B, P, V] (or None: point masses at the tokens), row j being the draft's
prediction of token L - behind + 1 + j (the j-th token emitted since it was last synced)
from the context before it; rows j >= behind are padding. `guess = None`: no estimate.
A drafter that reads target features also receives `features`: row j holds the features
of position L - behind + j (the pending token the j-th skipped step fed); rows j >= behind
are padding.

`ctx` is the committed context the engine sees: the token buffer `tokens_BS` and per row
`length_B` = L, the index of the pending token. Tokens `[0, L)` are in the target's cache;
token L (the last one emitted, the tree's root) is not yet. `Proposal.q = None` means
deterministic distinct candidates (point masses); the acceptance rule then treats them
exactly (accept x with probability r(x); on rejection remove x from r). `commit` receives
the context after the cycle (new L), the accepted root-to-node path (node indices, root
first, padded by repeating the deepest node) and the number of drafted nodes accepted.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from specjax.models.lm import LM  # noqa: F401 - drafters build on it; the old path
from specjax.models.transformer import ModelConfig

Array = jax.Array


@struct.dataclass
class Context:
  tokens: Array  # int32 [B, S] token buffer: prompt, then emitted tokens
  length: Array  # int32 [B] index of the pending token L (= the target's committed length)


@struct.dataclass
class Proposal:
  """What a drafter proposes for one cycle.

  tokens: int32 [B, N], the drafted nodes 1..N (node 0, the root, is the pending token).
  q: float32 [B, T, V] or None. Row i is the draft law node i's children were sampled from,
    i.i.d. (rows of leaves are unused); None = deterministic distinct candidates.
  parents, depth: int32 [B, T] for trees whose shape differs per row and cycle (dynamic
    trees; `DynamicTree.layout(proposal)` builds the verify layout from them), None for a
    static TreeSpec.
  drafted: int32 [B] nodes actually drafted when drafting stopped early (`with_stopping`;
    the rest are point-mass fillers), None: every node was drafted.
  finite: bool [B], False for a row whose draft logits held a NaN or +inf (`finite_rows`):
    its candidates are meaningless even where q is None or a point mass (an argmax of NaNs).
    The loops count such rows and the host API refuses the run; None: no logits (lookup).
  """

  tokens: Array
  q: Array | None = None
  parents: Array | None = None
  depth: Array | None = None
  drafted: Array | None = None
  finite: Array | None = None


def finite_rows(logits_BXV: Array) -> Array:
  """bool [B]: the rows of draft logits [B, ..., V] without a NaN or +inf (`x < inf` is
  False for both). -inf is a mask, not a fault (padded or reduced vocabularies), so it
  passes. One comparison and reduction over logits the drafter computed anyway."""
  return jnp.all(logits_BXV < jnp.inf, axis=tuple(range(1, logits_BXV.ndim)))


class Drafter:
  """Base of every drafter: the protocol (module doc) with the host-side defaults.

  Subclasses are pytrees (`flax.struct.dataclass`) and implement init / propose / commit;
  `decoding.speculative_generate` reads `config`, `slots_needed` and `validate` on the host
  before it calls the loop.
  """

  @property
  def config(self) -> ModelConfig | None:
    """The draft model's config (vocabulary, max_len, KV cache size), None for a drafter
    without a model of its own."""
    return None

  def slots_needed(self, tree: Any) -> int:
    """Cache slots one cycle writes from L (the root): by default the verified nodes."""
    return tree.n_nodes

  def validate(self, tree: Any, batch: int) -> None:
    """Raises ValueError if this drafter cannot draft `tree` for `batch` rows (host side,
    before tracing). Default: every tree and batch is fine."""
    del tree, batch

  @property
  def feature_layers(self) -> tuple[int, ...]:
    """The target layers whose outputs this drafter reads (static; `Transformer.__call__`'s
    `capture`: i < n_layers the residual stream after block i, n_layers the final norm's
    output). Empty (the default): the loop computes nothing extra and calls `init` /
    `commit` without `features`. Non-empty: the loop passes `features=` to both — the
    prompt's [B, P, C, D] to `init`, the verify pass's [B, T, C, D] (node order, root
    first) to `commit` — taken from passes the target makes anyway."""
    return ()

  @property
  def lazy_catch_up(self) -> bool:
    """Whether the adaptive loop may skip this drafter on plain (k = 0) steps and bring it up
    to date later with `catch_up` (module doc, "Lazy catch-up"). Default False: every plain
    step drafts one token and commits it as rejected (eager catch-up), which fits any
    drafter."""
    return False

  @property
  def shares_target_cache(self) -> bool:
    """Whether the drafter drafts in the target's KV cache (module doc, "Sharing the
    target's cache"; static). Default False: it keeps its own, if any."""
    return False

  def borrow_cache(self, state: Any, target_cache: Any) -> Any:
    """The state `propose` needs, with the target's cache lent to it (only called when
    `shares_target_cache`)."""
    raise NotImplementedError(f"{type(self).__name__} shares the target's cache but has no "
                              f"borrow_cache")

  def return_cache(self, state: Any, target_cache: Any) -> tuple[Any, Any]:
    """(state without the lent cache, the target's cache with the drafter's writes at slots
    >= L) after `propose` (only called when `shares_target_cache`)."""
    raise NotImplementedError(f"{type(self).__name__} shares the target's cache but has no "
                              f"return_cache")

  def with_stopping(self, threshold: Array) -> "Drafter":
    """This drafter with dynamic draft stopping at `threshold` (module doc). Default: itself
    (a drafter that cannot stop early drafts every node, which is always exact)."""
    del threshold
    return self

  def catch_up(self, state: Any, ctx: Context, behind_B: Array, width: int,
               sampler: Any, features: Array | None = None) -> tuple[Any, Proposal | None]:
    """Brings a drafter that is behind_B[b] <= width (static) emitted tokens behind up to the
    context `ctx` (module doc, "Lazy catch-up"). Only called when `lazy_catch_up` is True."""
    raise NotImplementedError(f"{type(self).__name__} declares lazy_catch_up but has no "
                              f"catch_up")

  def init(self, prompt_BP: Array, prompt_len_B: Array, cache_len: int, tree: Any) -> Any:
    raise NotImplementedError

  def propose(self, state: Any, ctx: Context, tree: Any, sampler: Any,
              key: Array) -> tuple[Proposal, Any]:
    raise NotImplementedError

  def commit(self, state: Any, ctx: Context, tree: Any, path_BP: Array,
             n_accepted_B: Array) -> Any:
    raise NotImplementedError
