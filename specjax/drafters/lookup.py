"""Prompt lookup (n-gram) drafting: propose what followed the latest earlier occurrence of
the context's own suffix. No model, no KV cache, no weights; drafting costs a few vector
operations over the token buffer (c ≈ 0).

Matching. Per row, the committed context is tokens[0..L] (L = the pending token's index;
token L is known, it is the tree's root). For an end index j < L, the match length ℓ(j) is
the largest n in [min_ngram, max_ngram] such that

    tokens[j - n + 1 .. j] == tokens[L - n + 1 .. L]        (0 if there is none).

Candidate matches are ranked by (ℓ(j), j): the longest suffix first, then the most recent
occurrence. All of it is computed over the whole buffer with static shapes: one shifted
comparison per n (a cumulative AND over t < max_ngram), then a top-k over the buffer.
Matches may overlap the suffix itself (a repetition "x y x y x" matches with period 2).

Continuation. Match j proposes tokens[j + 1], tokens[j + 2], ...; where this would run past
L (into tokens not generated yet) the match's period p = L - j is continued: draft i is
tokens[j + 1 + (i mod p)]. A run of one repeated token thus keeps proposing it, and a cycle
"a b c a b c" keeps cycling, which is what the text would do if the repetition went on.

Trees (a static `TreeSpec`; a chain of k is `trees.chain(k)`). The candidates form a trie
laid onto the tree's shape by rank. Each node carries the set of matches consistent with its
path (their continuations start with the path's tokens; the root: every match found). A
node's rank-r child is the r-th distinct next token among its consistent matches, in match
rank order, and its consistent set narrows to the matches that continue with that token.
So the root's children are the next tokens of the best distinct matches (longest, then most
recent), and the rank-0 path from each child follows its best match's continuation; a chain
is exactly the continuation of the best match. Siblings are distinct tokens wherever there
are enough distinct continuations.

No match (or fewer distinct continuations than a node has children): the missing
candidates are the pending token x_L repeated, and so are their descendants. Harmless: the
candidates are a deterministic function of the context, so the point-mass rule keeps the
output exact whatever they are (a duplicate sibling is never accepted: its residual mass is
zero after the first copy's rejection).

Candidates are deterministic: `Proposal.q = None` (the point-mass rule). Dynamic trees are
not supported: they are shaped by a draft's confidence, and a lookup has none.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.drafters.base import Context, Drafter, Proposal
from specjax.verify.trees import TreeSpec, chain

Array = jax.Array

# Candidate matches kept per drafted node of a branching tree: enough that duplicates (many
# occurrences followed by the same token) rarely leave a branch without a distinct match.
MATCHES_PER_NODE = 4


def check_ngram(max_ngram, min_ngram) -> tuple[int, int]:
  """Validates the n-gram sizes (host side); returns them as ints."""
  for name, value in (("max_ngram", max_ngram), ("min_ngram", min_ngram)):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
        or value < 1:
      raise ValueError(f"{name} must be an int >= 1 (an n-gram has at least one token), got "
                       f"{value!r}")
  if min_ngram > max_ngram:
    raise ValueError(f"min_ngram ({min_ngram}) must be <= max_ngram ({max_ngram}): the "
                     f"lookup tries suffix lengths n = max_ngram down to min_ngram")
  return int(max_ngram), int(min_ngram)


def find_matches(tokens_BS: Array, length_B: Array, count: int, *, max_ngram: int,
                 min_ngram: int) -> tuple[Array, Array]:
  """The `count` best earlier occurrences of the context's suffix, best first.

  tokens_BS: int32 token buffer; length_B: int32 L (token L is the last one of the context).
  Returns (end_BM, ngram_BM): the end index j < L of each match and its length ℓ(j)
  (module doc), ranked by (ℓ, j) descending; ngram 0 marks "no match" (end is then junk).
  """
  b, s = tokens_BS.shape
  pos_S = jnp.arange(s, dtype=jnp.int32)
  run_BS = pos_S[None] < length_B[:, None]  # end index j <= L - 1
  ngram_BS = jnp.zeros((b, s), jnp.int32)
  for t in range(max_ngram):  # suffix token L - t against buffer token j - t
    suffix_B1 = jnp.take_along_axis(tokens_BS, jnp.maximum(length_B - t, 0)[:, None], axis=1)
    shifted_BS = tokens_BS if t == 0 else jnp.concatenate(
        [jnp.full((b, t), -1, tokens_BS.dtype), tokens_BS[:, :s - t]], axis=1)  # j - t < 0: -1
    run_BS = run_BS & (shifted_BS == suffix_B1)
    if t + 1 >= min_ngram:
      ngram_BS = jnp.where(run_BS, t + 1, ngram_BS)
  score_BS = jnp.where(ngram_BS > 0, ngram_BS * s + pos_S[None], -1)
  top_BM, end_BM = jax.lax.top_k(score_BS, min(count, s))
  return end_BM.astype(jnp.int32), jnp.maximum(top_BM // s, 0).astype(jnp.int32)


def continuations(tokens_BS: Array, length_B: Array, end_BM: Array, depth: int) -> Array:
  """Tokens [B, M, depth] each match proposes: tokens[j + 1 + (i mod (L - j))] (module doc)."""
  b, s = tokens_BS.shape
  m = end_BM.shape[1]
  period_BM = jnp.maximum(length_B[:, None] - end_BM, 1)
  i_D = jnp.arange(depth, dtype=jnp.int32)
  idx_BMD = end_BM[:, :, None] + 1 + i_D[None, None] % period_BM[:, :, None]
  idx = jnp.clip(idx_BMD, 0, s - 1).reshape(b, m * depth)
  return jnp.take_along_axis(tokens_BS, idx, axis=1).reshape(b, m, depth)


def fill_tree(tree: TreeSpec, cont_BMD: Array, valid_BM: Array, filler_B: Array) -> Array:
  """The drafted node tokens [B, N] of a static tree: the trie of the ranked matches laid
  onto the tree by rank (module doc). cont_BMD: continuations, best match first; valid_BM:
  which matches exist; filler_B: the token for a node without a consistent match."""
  m = cont_BMD.shape[1]
  parents = np.asarray(tree.parents)
  depth, ranks, n_children = tree.depth, tree.ranks, tree.n_children
  earlier_MM = jnp.asarray(np.tri(m, k=-1, dtype=bool))  # [m, m']: m' ranks before m
  consistent = {0: valid_BM}
  tokens = {}
  for d in range(tree.max_depth):
    fed = [int(i) for i in np.flatnonzero((depth == d) & (n_children > 0))]
    kids = np.flatnonzero(np.isin(parents, fed))
    row_of = {node: r for r, node in enumerate(fed)}
    cons_BPM = jnp.stack([consistent[i] for i in fed], axis=1)
    tok_BM = cont_BMD[:, :, d]
    same_BMM = tok_BM[:, :, None] == tok_BM[:, None, :]
    dup_BPM = jnp.any(cons_BPM[:, :, None, :] & same_BMM[:, None] & earlier_MM[None, None],
                      axis=-1)
    first_BPM = cons_BPM & ~dup_BPM  # the first consistent match of each distinct token
    drank_BPM = jnp.cumsum(first_BPM.astype(jnp.int32), axis=-1) - 1
    rows = np.asarray([row_of[int(parents[c])] for c in kids])
    sel_BCM = first_BPM[:, rows] & (drank_BPM[:, rows] == jnp.asarray(ranks[kids])[None, :, None])
    has_BC = jnp.any(sel_BCM, axis=-1)
    tok_BC = jnp.sum(jnp.where(sel_BCM, tok_BM[:, None, :], 0), axis=-1)
    tok_BC = jnp.where(has_BC, tok_BC, filler_B[:, None])
    cons_BCM = cons_BPM[:, rows] & (tok_BM[:, None, :] == tok_BC[:, :, None]) & has_BC[:, :, None]
    for j, c in enumerate(kids):
      tokens[int(c)] = tok_BC[:, j]
      consistent[int(c)] = cons_BCM[:, j]
  return jnp.stack([tokens[i] for i in range(1, tree.n_nodes)], axis=1).astype(jnp.int32)


@struct.dataclass
class LookupDrafter(Drafter):
  """Prompt lookup: drafts the continuation of the context's longest, most recent earlier
  suffix match (module doc). Deterministic candidates (q = None); chains and static trees;
  no model and no cache (`config` is None). n-gram sizes are static (they set the number of
  shifted comparisons)."""

  max_ngram: int = struct.field(pytree_node=False, default=3)
  min_ngram: int = struct.field(pytree_node=False, default=1)

  def __post_init__(self):
    check_ngram(self.max_ngram, self.min_ngram)

  def validate(self, tree, batch: int) -> None:
    """Static trees and chains only."""
    del batch
    if not isinstance(tree, TreeSpec):
      raise ValueError(f"the lookup drafter drafts chains and static trees (trees.TreeSpec); "
                       f"got {tree}: a dynamic tree is shaped by a draft's confidence, which a "
                       f"lookup does not have")

  def init(self, prompt_BP, prompt_len_B, cache_len: int, tree=None):
    del prompt_BP, prompt_len_B, cache_len, tree
    return None  # stateless: everything it needs is in the token buffer

  def propose(self, state, ctx: Context, tree: TreeSpec, sampler, key):
    del sampler, key  # deterministic candidates
    count = 1 if tree.is_chain else MATCHES_PER_NODE * tree.size
    end_BM, ngram_BM = find_matches(ctx.tokens, ctx.length, count, max_ngram=self.max_ngram,
                                    min_ngram=self.min_ngram)
    cont_BMD = continuations(ctx.tokens, ctx.length, end_BM, tree.max_depth)
    filler_B = jnp.take_along_axis(ctx.tokens, ctx.length[:, None], axis=1)[:, 0]
    tokens_BN = fill_tree(tree, cont_BMD, ngram_BM > 0, filler_B)
    return Proposal(tokens=tokens_BN, q=None), state

  def commit(self, state, ctx: Context, tree, path_BP, n_accepted_B):
    del ctx, tree, path_BP, n_accepted_B
    return state

  lazy_catch_up = True  # stateless: skipping plain steps leaves nothing to catch up

  def catch_up(self, state, ctx: Context, behind_B, width: int, sampler):
    """Nothing to bring up to date; the guesses (for the adaptive policy) are the one-token
    lookups from each skipped step's context, all `width` of them in one vmapped pass."""
    del sampler
    size = ctx.tokens.shape[1]
    one = chain(1)

    def guess_at(j):
      length = jnp.clip(ctx.length - behind_B + j, 0, size - 1)
      proposal, _ = self.propose(state, Context(tokens=ctx.tokens, length=length), one,
                                 None, None)
      return proposal.tokens[:, 0]

    tokens_PB = jax.vmap(guess_at)(jnp.arange(width, dtype=jnp.int32))
    return state, Proposal(tokens=tokens_PB.T, q=None)
