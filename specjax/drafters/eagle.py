"""The EAGLE head (EAGLE-3 style): one decoder layer on the target's own features, drafting
chains, static trees and EAGLE-2 dynamic trees with the level machinery of `levels.py`.

The head. With f_t = the target's residual streams at a low, a middle and a high layer at
position t (`feature_layers`, captured in the passes the target makes anyway), e(x) the
target's token embedding (shared) and lm_head the target's LM head (folded with `out` into
one matrix when a drafter is built, see below), and `norm` the head's own final norm:

    u_t   = fuse(concat_C f_t)                      (C·D -> W, one linear layer: EAGLE-3's fc)
    x_t   = combine(concat[n1(u_t), n2(e(x_{t+1}))])  (W + D -> W, EAGLE's [feature,
                                                     embedding]; n1, n2 the head's norms)
    h_t   = Block(x_{≤t})                           (one pre-norm decoder layer of width W,
                                                     own KV cache)
    q_t   = softmax(lm_head(out(norm(h_t))))        (the target's LM head after the head's
                                                     norm and, when W < D, out: W -> D)

so head position t reads (feature of t, token t + 1) and predicts token t + 2. At drafting
step 2 and later the head's own output h replaces the fused target feature u:
x_{t+1} = combine(concat[h_t, e(x̂_{t+2})]). Training unrolls exactly this ("training-time
test", `EagleHead.unroll`; the loss is the `EagleHeads` kind's, `specjax.training.eagle`), so
step 2+ sees at training what it sees at run time.

W (`width`) is the target's d_model by default (no `out`); a narrower head costs less per
drafting pass (`head_config`). A drafter folds out and the LM head into one float32 W x V
matrix once (`folded_lm_head`).

Bookkeeping per row (L = the pending token's index, as everywhere). The head's cache holds
true entries (built from target features) for positions [0, start); the features of
positions [start, L) arrived with the last commit and wait in `pending` (at most D + 1 of
them, D = the tree depth). Every proposal opens with one causal block over those positions
(`_root`: inputs (f_t, e(x_{t+1})), t = start..L-1, padded to D + 1 rows); the output at
t = L - 1 predicts the root's children and its h is the root's carried state. Tree levels
then follow as in `levels.py` with the root at slot and position L - 1 (`root_offset = -1`):
level d's nodes at position L - 1 + d, fed (h of the parent, e(node)). Entries written
while drafting use h in place of target features, so `commit` never keeps them: it only
records the verified path's features (path nodes 0..m-1 are positions L..L'-1) and rolls
the committed length back to L; the next proposal re-feeds those positions with the
target's features. No cache compaction is needed.

Sampling. At T > 0 sampled candidates (a chain, or a static tree with `deterministic=False`)
are i.i.d. draws of the head's warped law q (the stochastic rule); top-k candidates
(`deterministic=True`, and every dynamic tree: top-k by cumulative confidence, `levels.py`)
use the point-mass rule (q = None). Either way the output law is exactly the target's.

Reduced vocabulary (FR-Spec, optional): with `vocab` (token ids, e.g. the corpus's most
frequent, `frequent_vocab`) the head computes only those rows of the LM head; every other
token gets draft probability 0. Verification is unchanged, so the output law stays exact;
what changes is the head's cost (a Vr x D product instead of V x D) and its acceptance
(a target token outside the subset can never be drafted).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from specjax.drafters import eagle3
from specjax.models.lm import LM
from specjax.drafters.base import Context, Proposal, finite_rows
from specjax.drafters.eagle3 import Eagle3Head
from specjax.drafters.levels import LevelDrafter, _plan
from specjax.models import attention
from specjax.models import cache as kv
from specjax.models.transformer import Block, Dense, ModelConfig, Norm, rope

Array = jax.Array


def head_config(target: ModelConfig, width: int | None = None) -> ModelConfig:
  """The head's decoder-layer shape: one layer of the target's kind (heads of its head_dim,
  norm, positions, dtype) at `width` (None: the target's d_model), with width ÷ head_dim
  heads and the MLP scaled with the width. A head narrower than the target costs less per
  drafting pass; its output is projected back to d_model for the target's LM head."""
  if width is None or width == target.d_model:
    return target.replace(n_layers=1)
  hd = target.head_dim
  if (isinstance(width, bool) or not isinstance(width, (int, np.integer)) or width < hd
      or width % hd or width > target.d_model):
    raise ValueError(f"width must be a multiple of the target's head_dim ({hd}) up to its "
                     f"d_model ({target.d_model}), or None for d_model, got {width!r}")
  n = int(width) // hd
  return target.replace(n_layers=1, d_model=int(width), n_heads=n, n_kv_heads=n,
                        d_ff=max(1, target.d_ff * int(width) // target.d_model))


# The head's structures: "specjax" (the head above, today's default) and "eagle" (the
# published EAGLE-1/2 head, SafeAILab/EAGLE: combine = `fc` over [e(x_{t+1}); f_t] with a
# bias, f the target's final-norm output alone (no fuse), no feature/embedding norms, the
# decoder layer without its input norm, and no final norm: lm_head reads h itself).
STRUCTURES = ("specjax", "eagle")


class Identity(nnx.Module):
  """A norm the structure leaves out (float32, like the norms it stands for)."""

  def __call__(self, x: Array) -> Array:
    return x.astype(jnp.float32)


def default_layers(n_layers: int) -> tuple[int, ...]:
  """A low, a middle and a high target layer: the first block's output, the middle block's,
  and the final norm's output (index n_layers, what the target's LM head reads); duplicates
  dropped for very shallow targets."""
  return tuple(sorted({0, n_layers // 2, n_layers}))


def check_layers(target: ModelConfig, layers) -> tuple[int, ...]:
  if (not isinstance(layers, (tuple, list)) or not layers or not all(
      isinstance(i, int) and not isinstance(i, bool) and -1 <= i <= target.n_layers
      for i in layers)):
    raise ValueError(f"layers must be a non-empty sequence of target layer indices in "
                     f"[-1, {target.n_layers}] (-1 = the embedding output, {target.n_layers} = "
                     f"the final norm's output), got {layers!r}")
  return tuple(int(i) for i in layers)


class EagleHead(nnx.Module):
  """fuse (C·D -> W), two input norms, combine (W + D -> W), one decoder `Block` of width W,
  its own final norm, and out (W -> D) when W < D (W = `width`, default D).

  structure "eagle" (`STRUCTURES`): the published EAGLE-1/2 head instead, one feature at
  the target's width: combine over [embedding; feature] (with a bias when `bias`), the
  block's input norm and the final norm absent, no fuse, no input norms."""

  def __init__(self, target: ModelConfig, n_features: int, *, width: int | None = None,
               structure: str = "specjax", bias: bool = False, rngs: nnx.Rngs):
    c = head_config(target, width)
    self.config = c
    d, w, dt = target.d_model, c.d_model, c.jnp_dtype
    if structure not in STRUCTURES:
      raise ValueError(f"structure must be one of {STRUCTURES}, got {structure!r}")
    self.structure = structure
    if structure == "eagle":
      if n_features != 1 or w != d:
        raise ValueError(f"the EAGLE-1/2 structure reads one target feature at the target's "
                         f"width {d}, got {n_features} features at width {w}")
      self.fuse = self.feature_norm = self.embed_norm = self.out = None
      self.combine = Dense(d + w, w, bias=bool(bias), dtype=dt, rngs=rngs)
      self.block = Block(c, rngs=rngs)
      self.block.attn_norm = Identity()
      self.norm = Identity()
      return
    self.fuse = Dense(n_features * d, w, bias=False, dtype=dt, rngs=rngs)
    self.combine = Dense(w + d, w, bias=False, dtype=dt, rngs=rngs)
    norm = dict(kind=c.norm, bias=c.norm == "layernorm" and c.use_bias, eps=c.norm_eps,
                dtype=dt)
    self.feature_norm = Norm(w, **norm)
    self.embed_norm = Norm(d, **norm)
    self.block = Block(c, rngs=rngs)
    self.norm = Norm(w, **norm)
    self.out = None if w == d else Dense(w, d, bias=False, dtype=dt, rngs=rngs)

  def fused(self, features_BTCD: Array) -> Array:
    """u = fuse(concat of the C captured layers): [B, T, C, D] -> [B, T, W] float32."""
    b, t, c, d = features_BTCD.shape
    if self.fuse is None:  # structure "eagle": the one feature itself
      return features_BTCD[:, :, 0].astype(jnp.float32)
    return self.fuse(features_BTCD.reshape(b, t, c * d))

  def __call__(self, u_BTD, emb_BTD, positions_BT, cache=None, block_mask=None):
    """h_BTD (the carried state, pre-norm) and the cache: one decoder layer over
    combine([u, e]) (u a fused target feature or a previous step's h)."""
    return self.block(self._input(u_BTD, emb_BTD), positions_BT, cache, 0, block_mask)

  def _input(self, u_BTD, emb_BTD):
    """combine([feature_norm(u), embed_norm(e)]): both normalised first (as EAGLE-3 does),
    so a fused target feature and the head's own h enter at the same scale. Structure
    "eagle": fc([e; u]) with neither normalised, as the published head."""
    if self.structure == "eagle":
      return self.combine(jnp.concatenate([emb_BTD, u_BTD], axis=-1))
    return self.combine(jnp.concatenate([self.feature_norm(u_BTD), self.embed_norm(emb_BTD)],
                                        axis=-1))

  def unroll(self, features_BTCD, emb_next_BTD, positions_BT, steps: int) -> list[Array]:
    """Training-time test, cache-free: the head's h at drafting steps 1..steps for every
    start position (list of [B, T, D]).

    Step 1 at position t reads (u_t, e(x_{t+1})). Step j > 1 at position t is the (j)-th
    step of a chain rooted at p = t - j + 1: it reads (h^{j-1}_{t-1}, e(x_{t+1})) and, as at
    run time, attends to the true (step-1) entries at positions <= p and to the chain's own
    entries of steps 2..j (step i at position p + i - 1). Valid for t >= j - 1 (earlier rows
    compute padding)."""
    blk = self.block
    attn, c = blk.attn, self.config
    b, t, _ = emb_next_BTD.shape
    u = self.fused(features_BTCD)
    rows = jnp.arange(t, dtype=jnp.int32)[:, None]
    cols = jnp.arange(t, dtype=jnp.int32)[None, :]
    keys, values, outs, g = [], [], [], u
    for j in range(steps):
      x = self._input(g, emb_next_BTD)
      xn = blk.attn_norm(x)
      q = attn.q(xn).reshape(b, t, c.n_heads, c.head_dim)
      k = attn.k(xn).reshape(b, t, c.n_kv_heads, c.head_dim)
      v = attn.v(xn).reshape(b, t, c.n_kv_heads, c.head_dim)
      if c.positions == "rope":
        q = rope(q, positions_BT, c.rope_theta)
        k = rope(k, positions_BT, c.rope_theta)
      keys.append(k)
      values.append(v)
      masks = [cols <= rows - j] + [cols == rows - j + i for i in range(1, j + 1)]
      out = attention.causal_attention(q, jnp.concatenate(keys, axis=1),
                                       jnp.concatenate(values, axis=1),
                                       jnp.concatenate(masks, axis=1))
      x = x + attn.o(out.reshape(b, t, c.n_heads * c.head_dim))
      h = x + blk.mlp(blk.mlp_norm(x))
      outs.append(h)
      g = jnp.concatenate([jnp.zeros_like(h[:, :1]), h[:, :-1]], axis=1)  # h^{j}_{t-1}
    return outs


def init_head(target: ModelConfig, layers: tuple[int, ...], seed: int = 0,
              width: int | None = None, structure: str = "specjax",
              bias: bool = False) -> EagleHead:
  return EagleHead(target, len(layers), width=width, structure=structure, bias=bias,
                   rngs=nnx.Rngs(seed))


@functools.lru_cache(maxsize=16)
def _head_graphdef(target: ModelConfig, n_features: int, width: int,
                   structure: str = "specjax", bias: bool = False):
  return nnx.split(nnx.eval_shape(
      lambda: EagleHead(target, n_features, width=width, structure=structure, bias=bias,
                        rngs=nnx.Rngs(0))))[0]


def head_from_params(target: ModelConfig, params) -> EagleHead:
  """The head module holding `params` (an nnx.State of an `EagleHead` for this target; its
  width and feature count read from the fuse kernel's shape; without a fuse, the "eagle"
  structure, its bias read from combine's)."""
  if "fuse" not in params:  # structure "eagle": one feature, the target's width
    graph = _head_graphdef(target.replace(dtype="float32"), 1, target.d_model, "eagle",
                           "bias" in params["combine"])
    return nnx.merge(graph, params)
  n_in, width = jnp.shape(params["fuse"]["kernel"])
  n_features = n_in // target.d_model
  return nnx.merge(_head_graphdef(target.replace(dtype="float32"), int(n_features),
                                  int(width)), params)


def embed(target_module, tokens: Array) -> Array:
  """The target's token embedding (shared weights), float32."""
  return jnp.take(target_module.embed[...], tokens, axis=0).astype(jnp.float32)


def lm_head_DV(target_module) -> Array:
  """The target's LM head as a [D, V] matrix (the tied embedding transposed)."""
  if target_module.lm_head is not None:
    return target_module.lm_head.kernel[...]
  return target_module.embed[...].T


def head_logits(head: EagleHead, target_module, h: Array, vocab: Array | None = None) -> Array:
  """Logits [B, T, V] of carried states h [B, T, W]: the head's norm, its output map (W < D),
  then the target's LM head. vocab (int32 [Vr], optional): only those rows of the LM head are
  computed (FR-Spec); every other token gets -inf, i.e. draft probability 0. Training and
  references use this; the drafter uses the same map folded once (`folded_lm_head`)."""
  x = head.norm(h)
  if head.out is not None:
    x = head.out(x)
  if vocab is None:
    return target_module.logits(x)
  w_DR = jnp.take(lm_head_DV(target_module), vocab, axis=1)
  return _scatter_vocab(jnp.einsum("btd,dr->btr", x.astype(w_DR.dtype), w_DR,
                                   preferred_element_type=jnp.float32),
                        vocab, target_module.config.vocab_size)


def _scatter_vocab(sub: Array, vocab: Array | None, vocab_size: int) -> Array:
  """Logits over a reduced vocabulary placed into the full one (-inf elsewhere)."""
  if vocab is None:
    return sub
  full = jnp.full(sub.shape[:-1] + (vocab_size,), -jnp.inf, jnp.float32)
  return full.at[..., vocab].set(sub)


def folded_lm_head(head: EagleHead, target_module, vocab: Array | None = None) -> Array:
  """float32 [W, V] (or [W, Vr] with a reduced vocabulary): the head's output map times the
  target's LM head, computed once when a drafter is built, so that a drafting pass is one
  W-wide product instead of out (W -> D) then the D-wide head in the target's dtype. Measured
  on the 2-core CPU with the bf16 default target (chain k = 4, random heads, per cycle):
  width 64 2.13 -> 1.73 ms, width 256 2.88 -> 2.61 ms; the separate draft model's cycle
  1.82 ms, a plain step 1.2 ms. Same function as `head_logits` up to float rounding (x is
  not rounded to the target's dtype), which changes the draft law q only: the output law
  stays exactly the target's."""
  w_DV = lm_head_DV(target_module).astype(jnp.float32)
  if vocab is not None:
    w_DV = jnp.take(w_DV, vocab, axis=1)
  if head.out is None:
    return w_DV
  return jnp.matmul(head.out.kernel[...].astype(jnp.float32), w_DV,
                    precision=jax.lax.Precision.HIGHEST)


def frequent_vocab(tokens, size: int) -> "np.ndarray":
  """FR-Spec's reduced draft vocabulary: the `size` most frequent ids of a token stream
  (ties to the lower id), sorted."""
  tokens = np.asarray(tokens).ravel()
  if not isinstance(size, int) or isinstance(size, bool) or size < 1:
    raise ValueError(f"size must be an int >= 1, got {size!r}")
  counts = np.bincount(tokens, minlength=size)
  order = np.lexsort((np.arange(len(counts)), -counts))
  return np.sort(order[:size]).astype(np.int32)


@struct.dataclass
class EagleState:
  cache: kv.KVCache  # the head's own (one layer); true entries for positions [0, start)
  node_slots: Array | None  # unused (no compaction); the level machinery's field
  pending: Array  # float32 [B, D+1, C, Dm] target features of positions [start, L)
  start: Array  # int32 [B]
  length: Array  # int32 [B] L at the last commit (to count what a cycle emitted)


@struct.dataclass
class EagleDrafter(LevelDrafter):
  """Drafts from an EAGLE head on the target's features (module doc).

  head: the head as an `LM` (graph static, weights leaves); target: the target it reads
  (its embedding and LM head are used, shared); layers: the captured target layers.
  Build with `EagleDrafter.of(target, head, layers)`.
  """

  head: LM
  target: LM
  layers: tuple[int, ...] = struct.field(pytree_node=False)
  deterministic: bool = struct.field(pytree_node=False, default=False)
  vocab: Array | None = None  # int32 [Vr]: a reduced draft vocabulary (FR-Spec), or None
  lm: Array | None = None  # float32 [W, V or Vr]: `folded_lm_head`, set by `of`
  stop_below: Array | None = None  # dynamic draft stopping threshold (`with_stopping`)

  root_offset = -1  # head position t reads token t + 1: the root x_L is read at L - 1

  @classmethod
  def of(cls, target, head: EagleHead | LM | None = None, layers=None, *,
         deterministic: bool = False, seed: int = 0, vocab=None) -> "EagleDrafter":
    """A drafter for `target` (a Transformer or LM). head: an `EagleHead`, an LM of one, or
    trained params (`training.eagle.EagleHeads`); None: an untrained head; or an
    `eagle3.Eagle3Head` (the EAGLE-3 structure, which carries its own LM head and draft
    vocabulary). vocab: token ids the head may draft (FR-Spec, e.g. `frequent_vocab`); None:
    the whole vocabulary."""
    target = LM.of(target)
    layers = check_layers(target.config, default_layers(target.config.n_layers)
                          if layers is None else layers)
    if head is None:
      head = init_head(target.config, layers, seed)
    elif not isinstance(head, (EagleHead, Eagle3Head, LM)):  # trained params (nnx.State)
      head = head_from_params(target.config, head)
    head = LM.of(head)
    if isinstance(head.module(), Eagle3Head):  # the EAGLE-3 structure: own LM head and vocab
      vocab, lm = eagle3.drafter_parts(head.module(), target.config, layers, vocab)
      return cls(head=head, target=target, layers=layers, deterministic=bool(deterministic),
                 vocab=vocab, lm=lm)
    have = head.config.to_dict()
    try:
      want = head_config(target.config, head.config.d_model).to_dict()
    except ValueError:
      want = head_config(target.config).to_dict()
    diff = [f"{k}: head {have[k]!r}, target's {want[k]!r}" for k in want
            if k != "dtype" and have[k] != want[k]]
    d = target.config.d_model
    combine_in = head.module().combine.kernel[...].shape[0]
    if combine_in != head.config.d_model + d:
      diff.append(f"token embedding width: head {combine_in - head.config.d_model}, "
                  f"target's {d}")
    if diff:
      raise ValueError("the EAGLE head does not fit this target: " + "; ".join(diff))
    fuse = head.module().fuse
    fuse_in = d if fuse is None else fuse.kernel[...].shape[0]
    if fuse_in != len(layers) * d:
      raise ValueError(f"the head fuses {fuse_in // d} target layers but layers "
                       f"has {len(layers)}: {layers!r}")
    if vocab is not None:
      v = np.asarray(vocab)
      n = target.config.vocab_size
      if (v.ndim != 1 or v.size == 0 or not np.issubdtype(v.dtype, np.integer)
          or v.min() < 0 or v.max() >= n or len(np.unique(v)) != v.size):
        raise ValueError(f"vocab must be a non-empty 1-D array of distinct token ids in "
                         f"[0, {n}), got {vocab!r}")
      vocab = jnp.asarray(v, jnp.int32)
    return cls(head=head, target=target, layers=layers, deterministic=bool(deterministic),
               vocab=vocab, lm=folded_lm_head(head.module(), target.module(), vocab))

  def validate(self, tree, batch: int) -> None:
    """A reduced vocabulary must hold the tree's widest node's candidates."""
    del batch
    if self.vocab is not None and tree.max_width > self.vocab.shape[0]:
      raise ValueError(f"tree has a node with {tree.max_width} candidates but the reduced "
                       f"draft vocabulary has only {self.vocab.shape[0]} tokens")

  @property
  def feature_layers(self) -> tuple[int, ...]:
    return self.layers

  @property
  def config(self) -> ModelConfig:
    return self.head.config

  def slots_needed(self, tree) -> int:
    """Slots written from L in a cycle: the tree levels (from slot L - 1) and the opening
    block (D + 1 rows from start >= L - D - 1, so up to slot L + D - 1)."""
    return max(tree.n_nodes, _plan(tree).extent, tree.max_depth + 1)

  # -- the protocol
  def init(self, prompt_BP, prompt_len_B, cache_len: int, tree=None, features=None):
    b, p = prompt_BP.shape
    depth = 1 if tree is None else tree.max_depth
    head = self.head.module()
    cache = kv.init(self.head.config, b, cache_len)
    nxt = jnp.concatenate([prompt_BP[:, 1:], jnp.zeros((b, 1), prompt_BP.dtype)], axis=1)
    pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    _, cache = head(head.fused(features), embed(self.target.module(), nxt), pos, cache)
    start = (prompt_len_B - 1).astype(jnp.int32)
    first = jnp.take_along_axis(features, start[:, None, None, None], axis=1)  # [B, 1, C, D]
    pending = jnp.zeros((b, depth + 1) + features.shape[2:], jnp.float32).at[:, :1].set(first)
    slots = None if tree is None else _plan(tree).node_slots(b)
    return EagleState(cache=kv.set_lengths(cache, start), node_slots=slots, pending=pending,
                      start=start, length=prompt_len_B.astype(jnp.int32))

  def _root(self, state: EagleState, ctx: Context):
    """One causal block over positions start..start+D (real up to L - 1): the head's cache
    catches up on the verified positions and the row at L - 1 scores the root's children."""
    head, tgt = self.head.module(), self.target.module()
    rows = state.pending.shape[1]
    j = jnp.arange(rows, dtype=jnp.int32)[None]
    pos = state.start[:, None] + j
    idx = jnp.minimum(pos + 1, ctx.tokens.shape[1] - 1)
    toks = jnp.take_along_axis(ctx.tokens, idx, axis=1)
    cache = kv.set_lengths(state.cache, state.start)
    h_BJD, cache = head(head.fused(state.pending), embed(tgt, toks), pos, cache)
    last = jnp.clip(ctx.length - state.start - 1, 0, rows - 1)
    root_h = jnp.take_along_axis(h_BJD, last[:, None, None], axis=1)[:, 0]
    return self._logits(head, root_h[:, None])[:, 0], root_h, cache

  def _step(self, tokens_BW, parent_h_BWH, positions_BW, cache, mask):
    head, tgt = self.head.module(), self.target.module()
    h, cache = head(parent_h_BWH, embed(tgt, tokens_BW), positions_BW, cache, mask)
    return self._logits(head, h), h, cache

  def _logits(self, head: EagleHead, h: Array) -> Array:
    """Draft logits [B, T, V] of carried states: the head's norm, then the folded LM head."""
    if self.lm is None:  # built without `of`
      return head_logits(head, self.target.module(), h, self.vocab)
    sub = jnp.einsum("btw,wv->btv", head.norm(h), self.lm, preferred_element_type=jnp.float32)
    return _scatter_vocab(sub, self.vocab, self.target.config.vocab_size)

  lazy_catch_up = True  # the loop keeps the skipped plain steps' features for `catch_up`

  def catch_up(self, state: EagleState, ctx: Context, behind_B, width: int, sampler,
               features=None):
    """Lazy catch-up (`base` module doc): the state `commit` would have left after the
    skipped plain steps, and the head's guesses for the tokens they emitted.

    Synced at L0 = L - behind, the state holds the features of positions [start, L0) in
    `pending`; `features` row j is position L0 + j's. The head's cache is filled from start
    to L - 2 in blocks of `pending`'s D + 1 rows (`_root`'s shape, so a block never writes
    past the slots a cycle may use; a row already synced while others are not rewrites
    slots past its committed length only), each position t reading (feature t, token
    t + 1). Position L0 - 1 + j
    predicts token L0 + 1 + j: row j of `guess`. After it: start = L - 1, `pending` holds
    position L - 1's features, as after a commit of one token."""
    head, tgt = self.head.module(), self.target.module()
    rows = state.pending.shape[1]
    length = ctx.length
    synced = length - behind_B  # L0
    source = jnp.concatenate([state.pending, features.astype(jnp.float32)], axis=1)
    size = ctx.tokens.shape[1]

    def feature_at(pos_BJ):
      i = jnp.where(pos_BJ < synced[:, None], pos_BJ - state.start[:, None],
                    rows + pos_BJ - synced[:, None])
      i = jnp.clip(i, 0, source.shape[1] - 1)
      return jnp.take_along_axis(source, i[:, :, None, None], axis=1)

    j = jnp.arange(rows, dtype=jnp.int32)[None]
    guess0 = jnp.zeros((length.shape[0], width, self.head.config.d_model), jnp.float32)

    def block(c):
      start, cache, guess_h = c
      pos = start[:, None] + j
      toks = jnp.take_along_axis(ctx.tokens, jnp.minimum(pos + 1, size - 1), axis=1)
      h, cache = head(head.fused(feature_at(pos)), embed(tgt, toks), pos,
                      kv.set_lengths(cache, start))
      # rows at positions L0 - 1 + i, i < behind, are the guesses' states
      i = pos - (synced[:, None] - 1)
      hit = (i >= 0) & (i < behind_B[:, None])
      slot = jnp.where(hit, i, width)  # out of range: dropped
      guess_h = guess_h.at[jnp.arange(i.shape[0])[:, None], slot].set(h, mode="drop")
      return jnp.minimum(start + rows, length - 1), cache, guess_h

    _, cache, guess_h = jax.lax.while_loop(lambda c: jnp.any(c[0] < length - 1), block,
                                           (state.start, state.cache, guess0))
    logits = self._logits(head, guess_h)
    valid = jnp.arange(width)[None, :, None] < behind_B[:, None, None]
    guess = Proposal(tokens=jnp.argmax(logits, axis=-1).astype(jnp.int32),
                     q=None if self.deterministic else self.draft_law(logits, sampler),
                     finite=finite_rows(jnp.where(valid, logits, 0.0)))
    last = feature_at((length - 1)[:, None])  # [B, 1, C, D]
    pending = jnp.zeros_like(state.pending).at[:, :1].set(last)
    return state.replace(cache=kv.set_lengths(cache, length - 1), pending=pending,
                         start=(length - 1).astype(jnp.int32), length=length), guess

  def commit(self, state: EagleState, ctx: Context, tree, path_BP, n_accepted_B,
             features=None) -> EagleState:
    """Keeps the verified path's features (positions L..L'-1 = path nodes 0..m-1) for the
    next proposal and rolls the head's cache back to L (drafted entries are discarded)."""
    del tree, n_accepted_B
    moved = ctx.length > state.length  # m = L' - L > 0 (0 for a finished row)
    feats = jnp.take_along_axis(features, path_BP[:, :, None, None], axis=1)  # [B, d+1, C, D]
    rows = state.pending.shape[1]  # D + 1 of the deepest shape `init` was given
    if feats.shape[1] > rows:
      raise ValueError(f"a path of {feats.shape[1] - 1} nodes is deeper than the tree the "
                       f"drafter was initialised for (depth {rows - 1})")
    # a shallower shape (an adaptive menu's other entries, its plain step): rows past the
    # path are never read as real positions (`_root` reads up to L - 1)
    feats = jnp.pad(feats, ((0, 0), (0, rows - feats.shape[1]), (0, 0), (0, 0)))
    start = jnp.where(moved, state.length, state.start)
    pending = jnp.where(moved[:, None, None, None], feats, state.pending)
    return state.replace(cache=kv.set_lengths(state.cache, start), pending=pending, start=start,
                         length=ctx.length)

