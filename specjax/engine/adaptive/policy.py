"""The adaptive speculation policy: which shape of a static menu to verify this cycle.

One object (`AdaptivePolicy`, built from a menu and its prices validated in
`specjax/engine/adaptive/pricing.py`), used inside the compiled loop
(`adaptive_loop.adaptive_loop`, pure jnp) and on the host (`choose`, `table`: what `specjax theory` prints, what the
experiments predict; those answers live in `specjax/engine/adaptive/planning.py`, mixed in). The
menu is static (each entry is traced once into the loop and the chosen one runs,
`adaptive_loop._run_chosen`); everything the choice reads is an array, so changing
costs, decay, prior, threshold or forced schedule reuses the compiled loop (turning draft
stopping on or off, threshold 0 vs > 0, is a static choice: `AdaptivePolicy.stopping`).

Menu. Entries are `None` (k = 0: a plain decoding step) or static `trees.TreeSpec`s (a chain
of k drafts is `trees.chain(k)`): `menu((0, 1, 2, 4, 6))`, optionally with one or two trees.

Acceptance estimate, per row b: exponentially weighted counts of candidates tried and
accepted (`acc`, `tried`, decay λ per cycle), turned into rates

    a(b) = (acc(b) + w·prior) / (tried(b) + w)

(prior with weight w), in two groups of columns (`columns` = R + D):

- per sibling rank r < R (all depths pooled): a_r is the acceptance of the rank-r sibling
  once ranks < r were rejected; a_0 is the per-trial α of a chain. Prior α₀.
- per depth d = 1..D (`max_depth`), the first (rank-0) candidate only: a0_d = P(the depth-d
  first candidate is accepted | the path reached depth d − 1). Prior: the profile α₀_d
  (`prior_depth`, from the calibration's chains: `calibration.LoopCosts.meta["depth_alpha"]`)
  at depth 1; at depths d >= 2 the profile shifted in log-odds by the row's own depth-1
  evidence, logit α₀_d + (logit a0_1(b) − logit α₀_1) (a row effect: the profile pools rows,
  and deep positions are reached mostly by rows that accept a lot).

Why per depth: acceptance is not the same at every draft position. The embedded distilled
draft at T = 0 on prose accepts its first draft 0.91 of the time, its second (given the
first) 0.24 and the third to sixth 0.90-0.97 (a chain of 6 over 8 held-out prompts); a
single α makes a chain of 2 look far better than a chain of 1, which it is not there
(docs/cost_model.md, "Adaptive speculation").

A speculative cycle observes the result's per-rank counts and, per depth, whether the
first candidate was tried and accepted; a k = 0 cycle observes the acceptance probability
the drafter's one-token catch-up draft would have had
(`adaptive_loop._draft_acceptance`: rank 0, depth 1), so a policy that switched itself off
keeps learning and switches back on. With lazy catch-up (`adaptive_loop.adaptive_loop`) a
k = 0 step observes nothing and leaves the estimate as it is; the catch-up pass (at most P
steps later) observes all the skipped tokens at once from the drafter's guesses.

Expected tokens of an entry (Sequoia's positional model, `theory.tree_expected_tokens`,
with the first candidate's rate per depth): the rank-0 child of an accepted depth-(d − 1)
node is accepted with probability a0_d, its rank-r sibling (r >= 1) with
p_r = (1 − a0_d)·a_r·Π_{1<=j<r}(1 − a_j); a node is on the accepted path with the product
of these along its root path, and E[τ] = 1 + Σ_nodes P(node). For a chain this is
1 + Σ_{i<=k} Π_{d<=i} a0_d (Σ_{i<=k} α^i when every depth accepts at α). k = 0: 1.

Cost: seconds per cycle of each entry at the compiled batch, interpolated (linear in
log batch, clamped) from a table over calibrated batch sizes (`from_costs`, one
`calibration.LoopCosts` per batch; each entry priced by the calibration's fitted cycle by
default). A k = 0 cycle costs a plain step plus the drafter's
catch-up: one draft pass per step when the drafter catches up eagerly (t_step + t_draft of
the fit), one pass per P steps when it catches up lazily (`lazy_slots` = P, the loop's bound
`loop.LAZY_SLOTS` for a drafter with `lazy_catch_up`: t_step + t_draft / P). The loop evaluates cost at the static batch it
computes: finished rows still flow through the static-shape computation, so they cost the
same; they only stop counting as tokens.

Choice: argmax over entries of the predicted tokens per second (ties to the earlier entry),
in one of two senses (`objective`, a runtime value):

- "batch" (the default): the batch's tokens ÷ the time until its last row is done. specjax
  decodes static batches (a finished row is not refilled), so that time is set by the row
  that needs longest: an entry is scored by min over active rows b of
  min(E[τ_b], r_b) ÷ r_b ÷ cycle seconds, r_b = the row's remaining budget (the pace at
  which its slowest row finishes). Rows that accept more finishing earlier buy nothing.
- "tokens": Σ_{active rows} E[τ_b](entry) ÷ cycle seconds(entry), the rate at which tokens
  appear right now: the right objective when finished rows are replaced at once
  (continuous batching).

With rows that all accept alike and have the same budget left (the host's `choose`), both
pick the same entry. `forced` (int32 [S], -1 = free) forces
entry forced[c mod S] at cycle c (tests alternate shapes with it).

Dynamic draft stopping: `threshold` (a float32 array, 0 = off). Within a cycle a model-like
drafter (model, layer-skip, EAGLE) stops extending a chain once every row's newest drafted
node has cumulative confidence (the product along the chain of the max probability of the
draft's softmax, at temperature 1, at each node's parent) below the threshold (`Drafter.with_stopping`: the draft's levels run in a
`while_loop`, so the passes it skips are not computed). Verification is unchanged: the
static shape is verified, the undrafted nodes being fillers with one-hot laws, and the
cycle emits at most drafted + 1 tokens (`Proposal.drafted`). Exact: every node's
(token, law) pair is a valid proposal (a filler is a point mass, and a point mass at any
token is accepted with the target's probability of it, the residual being the rest of the
target's law), and the cut depends only on the draft's laws and samples, fixed before the
target's pass, so it is a stopping time independent of the verification's randomness; the
cap also keeps a separate draft's cache whole (it fed every node but the last drafted
one). It acts on chains only; drafters without a draft law (lookup, Medusa) never stop.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.engine.adaptive import pricing
from specjax.engine.adaptive.planning import AdaptivePlanning
from specjax.engine.adaptive.pricing import (CYCLES, DEFAULT_CHAINS, DEFAULT_DECAY,
                                             DEFAULT_PRIOR_WEIGHT, OBJECTIVES, check_threshold,
                                             entry_name, menu)
from specjax.verify.trees import TreeSpec

# The menu's names and defaults are this module's public names too (`specjax.adaptive`).
__all__ = ["AdaptivePolicy", "CYCLES", "DEFAULT_CHAINS", "DEFAULT_DECAY", "DEFAULT_PRIOR_WEIGHT",
           "OBJECTIVES", "check_threshold", "entry_name", "menu"]

Array = jax.Array

_EPS = 1e-3  # probabilities clipped to [ε, 1 − ε] before log-odds


def _logit(p: Array) -> Array:
  return jnp.log(p) - jnp.log1p(-p)


def _entry_tables(entries, width: int):
  """Static tables of each entry: node rank [E, N], node depth [E, N] (1 = a root child),
  ancestor-or-self mask [E, N, N] over the drafted nodes (padded: rank 0, depth 1, no
  ancestors, masked out by `valid`), valid [E, N]."""
  n = max([1] + [e.size for e in entries if e is not None])
  rank = np.zeros((len(entries), n), np.int32)
  depth = np.ones((len(entries), n), np.int32)
  anc = np.zeros((len(entries), n, n), np.float32)
  valid = np.zeros((len(entries), n), np.float32)
  for i, e in enumerate(entries):
    if e is None:
      continue
    s = e.size
    rank[i, :s] = np.minimum(e.ranks[1:], width - 1)
    depth[i, :s] = e.depth[1:]
    anc[i, :s, :s] = e.ancestors[1:, 1:]
    valid[i, :s] = 1.0
  return rank, depth, anc, valid


@struct.dataclass
class AdaptivePolicy(AdaptivePlanning):
  """The per-cycle shape choice (module doc). A pytree: the menu is static, the rest arrays.

  menu: static entries (None = k = 0, else a TreeSpec). batches: float32 [NB] calibrated
  batch sizes, ascending. seconds: float32 [NB, E] seconds per cycle of each entry there.
  plain: float32 [NB] seconds of a step of plain decoding there (the reference of
  `predicted_speedup`; a k = 0 entry costs it plus the drafter's catch-up).
  decay: λ in [0, 1) per cycle. prior_alpha α₀ (every sibling rank), prior_depth [D] α₀_d
  (the first candidate at each depth 1..max(1, max_depth)), prior_weight w. threshold:
  draft stopping (0 = off). forced: int32 [S] forced entry per cycle (mod S), -1 = free
  choice. batch_pace: 1.0 for the "batch" objective, 0.0 for "tokens" (module doc).
  stopping (static): threshold > 0, i.e. draft stopping compiled into the loop.
  """

  menu: tuple = struct.field(pytree_node=False)
  batches: Array
  seconds: Array
  plain: Array
  decay: Array
  prior_alpha: Array
  prior_depth: Array
  prior_weight: Array
  threshold: Array
  forced: Array
  batch_pace: Array
  # Static: whether draft stopping is compiled in (threshold > 0). The threshold itself is a
  # runtime value, but at 0 the loop keeps the drafters' scan over levels: the stopping
  # machinery (a while_loop over levels, confidences, fillers) cost the default loop up to
  # ~6% at batch 8 (BUILD_NOTES.md), so turning stopping on or off is a new program, like
  # changing the menu, and changing a positive threshold is not.
  stopping: bool = struct.field(pytree_node=False, default=False)

  # ----------------------------------------------------------------------- construction

  @classmethod
  def create(cls, entries: Sequence[Any], seconds, batches: Sequence[int] = (1,), *,
             plain=None, decay: float = DEFAULT_DECAY, prior_alpha: float = 0.5,
             prior_depth: Sequence[float] | None = None,
             prior_weight: float = DEFAULT_PRIOR_WEIGHT, threshold: float = 0.0,
             forced: Sequence[int] | None = None,
             objective: str = "batch") -> "AdaptivePolicy":
    """From explicit costs: seconds [len(batches), len(menu)] (or [len(menu)] for one batch)
    seconds per cycle (any positive unit: only ratios matter). plain: [len(batches)] a plain
    decoding step in the same unit (default: the k = 0 entry's cost, else the cheapest).
    prior_depth: the first candidate's acceptance at depths 1, 2, ... (default α₀ at every
    depth; a shorter list repeats its last value, a longer one is cut at the menu's
    depth). objective: "batch" or "tokens" (module doc). Validated by
    `pricing.policy_fields`."""
    return cls(**pricing.policy_fields(
        entries, seconds, batches, plain=plain, decay=decay, prior_alpha=prior_alpha,
        prior_depth=prior_depth, prior_weight=prior_weight, threshold=threshold,
        forced=forced, objective=objective))

  @classmethod
  def from_costs(cls, entries: Sequence[Any], costs: Mapping[int, Any] | Any, *,
                 lazy_slots: int = 0, cycles: str = "fit", **kwargs) -> "AdaptivePolicy":
    """From calibrations (`calibration.LoopCosts`): one, or {batch: LoopCosts}
    (`pricing.calibrated_prices`). A tree entry costs, with cycles="fit" (the default), the
    calibration's fitted cycle t_fixed + t_verify·(N + 1) + t_draft·D (`cycle_fit.CycleFit`;
    a shape's own measurement where the calibrated shapes do not identify a fit), or with
    cycles="measured" `costs.cycle_seconds(tree)` (its own measurement if it was
    calibrated). Why the fit: one shape's own timing on a loaded CPU moves by 10-25%
    between calibrations (a chain of 6 has timed cheaper than a chain of 4), while the fit
    pools every calibrated shape and grows with N and D. On the side-by-side adaptive sweep
    it made no measurable difference by itself (BUILD_NOTES.md); it removes a source of
    noise the choice does not need. k = 0 costs t_step plus the
    drafter's catch-up pass (the fit's t_draft, 0 without a fit), divided by P = lazy_slots
    when the drafter catches up lazily (0: eagerly, every step). The prior α₀ is, unless
    `prior_alpha` is given, the mean first-draft acceptance the calibrations measured
    (`LoopCosts.meta["alpha"]`; 0.5 when none did): a fresh request starts from what this
    drafter achieved on the calibration's workload, not from a coin flip, which at α₀ = 0.5
    often prices speculation below plain decoding and spends the first run of plain steps
    finding out otherwise. Likewise the depth prior α₀_d (unless `prior_alpha` or
    `prior_depth` is given): the first candidate's acceptance at each depth in the
    calibrated chains (`LoopCosts.meta["depth_alpha"]`, averaged over the calibrations)."""
    return cls.create(**pricing.calibrated_prices(entries, costs, lazy_slots=lazy_slots,
                                                  cycles=cycles, **kwargs))

  @classmethod
  def from_model(cls, entries: Sequence[Any], *, c: float, v: float = 0.0,
                 fixed: float = 0.0, lazy_slots: int = 0, **kwargs) -> "AdaptivePolicy":
    """Uncalibrated costs in target steps: cycle(N, D) = 1 + fixed + v·N + c·D, k = 0 costs
    1 + c (the drafter's catch-up pass), 1 + c / P with lazy catch-up (P = lazy_slots > 0).
    c: a draft pass, v: one more verified node (`pricing.model_prices`)."""
    return cls.create(**pricing.model_prices(entries, c=c, v=v, fixed=fixed,
                                             lazy_slots=lazy_slots, **kwargs))

  def replace_runtime(self, **kwargs) -> "AdaptivePolicy":
    """The same menu with other runtime values (threshold, forced, decay...): no recompile
    as long as shapes stay (`forced` of the same length)."""
    new = AdaptivePolicy.create(self.menu, np.asarray(self.seconds),
                                np.asarray(self.batches).astype(int).tolist(),
                                **{"plain": np.asarray(self.plain).tolist(),
                                   "decay": float(self.decay),
                                   "prior_alpha": float(self.prior_alpha),
                                   "prior_depth": np.asarray(self.prior_depth).tolist(),
                                   "prior_weight": float(self.prior_weight),
                                   "threshold": float(self.threshold),
                                   "forced": None if int(self.forced[0]) == -1 and
                                   self.forced.size == 1 else np.asarray(self.forced).tolist(),
                                   "objective": self.objective,
                                   **kwargs})
    return new

  @property
  def objective(self) -> str:
    return "batch" if float(self.batch_pace) > 0 else "tokens"

  # ----------------------------------------------------------------------- static facts

  @property
  def width(self) -> int:
    """R: sibling ranks tracked (the widest menu tree, at least 1)."""
    return max([1] + [e.max_width for e in self.menu if e is not None])

  @property
  def max_nodes(self) -> int:
    """The largest drafted-node count of the menu (0 for a plain-only menu)."""
    return max([0] + [e.size for e in self.menu if e is not None])

  @property
  def max_depth(self) -> int:
    return max([0] + [e.max_depth for e in self.menu if e is not None])

  @property
  def depths(self) -> int:
    """D: depths whose first candidate is tracked (the deepest menu entry, at least 1)."""
    return max(1, self.max_depth)

  @property
  def columns(self) -> int:
    """Columns of the estimate's counts: R sibling ranks, then D depths (module doc)."""
    return self.width + self.depths

  @property
  def max_verify(self) -> int:
    """Verified nodes with the root of the largest entry (1 for k = 0)."""
    return 1 + self.max_nodes

  @property
  def names(self) -> list[str]:
    return [entry_name(e) for e in self.menu]

  # ----------------------------------------------------------------------- the estimate

  def init_state(self, batch: int) -> tuple[Array, Array]:
    """(acc, tried) [B, C], C = `columns` = R + D: no observations yet (the prior alone)."""
    z = jnp.zeros((batch, self.columns), jnp.float32)
    return z, z

  def rates(self, acc_BC: Array, tried_BC: Array) -> Array:
    """Per row [B, C]: a_r for ranks r < R, then a0_d for depths d = 1..D (module doc).

    Depths d >= 2 start from the row's own prior: the profile shifted in log-odds by how
    far the row's depth-1 rate lies from the profile's (a row effect: a row that accepts
    less than the calibration's rows at depth 1 is expected to accept less deeper too)."""
    w = self.prior_weight
    r = self.width
    ranks = (acc_BC[:, :r] + w * self.prior_alpha) / (tried_BC[:, :r] + w)
    prof = jnp.clip(self.prior_depth, _EPS, 1.0 - _EPS)
    first = (acc_BC[:, r:r + 1] + w * prof[0]) / (tried_BC[:, r:r + 1] + w)  # [B, 1]
    shift = _logit(jnp.clip(first, _EPS, 1.0 - _EPS)) - _logit(prof[0])
    prior_BD = jax.nn.sigmoid(_logit(prof)[None] + shift)
    prior_BD = jnp.concatenate([jnp.broadcast_to(prof[:1], first.shape), prior_BD[:, 1:]],
                               axis=1)
    deep = (acc_BC[:, r:] + w * prior_BD) / (tried_BC[:, r:] + w)
    return jnp.concatenate([ranks, deep], axis=1)

  def observe(self, acc_BR, tried_BR, accepted_BR, trials_BR, active_B):
    """One cycle's per-rank counts (active rows only), exponentially weighted."""
    a = active_B[:, None]
    lam = self.decay
    acc = jnp.where(a, lam * acc_BR + accepted_BR, acc_BR)
    tried = jnp.where(a, lam * tried_BR + trials_BR, tried_BR)
    return acc, tried

  def observation(self, ranks_BW: Array, depths_BD: Array | None = None) -> Array:
    """One cycle's counts as [B, C] columns: per-rank counts [B, W] of one entry (W <= R)
    and per-depth first-candidate counts [B, D'] (D' <= D; None: no depth observed)."""
    w = ranks_BW.shape[1]
    out = jnp.pad(ranks_BW.astype(jnp.float32), ((0, 0), (0, self.width - w)))
    d = 0 if depths_BD is None else depths_BD.shape[1]
    tail = (jnp.zeros((out.shape[0], self.depths), jnp.float32) if depths_BD is None else
            jnp.pad(depths_BD.astype(jnp.float32), ((0, 0), (0, self.depths - d))))
    return jnp.concatenate([out, tail], axis=1)

  def first_draft_observation(self, value_B: Array) -> Array:
    """[B, C] counts of a one-token draft (rank 0 at depth 1) observed as `value_B`."""
    v = value_B.astype(jnp.float32)[:, None]
    return self.observation(v, v)

  def cycle_observation(self, entry: TreeSpec, result) -> tuple[Array, Array]:
    """(accepted, tried) [B, C] of one cycle of `entry` (an `acceptance.TreeResult`): the
    result's per-rank counts and, per depth d, whether the first candidate was tried (the
    path reached d − 1 and has children) and accepted (the path's depth-d node has rank 0)."""
    d = entry.max_depth
    ranks = jnp.asarray(entry.ranks, jnp.int32)[result.path[:, 1:d + 1]]  # [B, D]
    reached = jnp.arange(1, d + 1, dtype=jnp.int32)[None] <= result.n_accepted[:, None]
    first_acc = reached & (ranks == 0)
    return (self.observation(result.rank_accepted, first_acc),
            self.observation(result.rank_tried, result.depth_tried))

  # ----------------------------------------------------------------------- the choice

  def expected_tokens(self, rates_BC, xp=jnp):
    """E[τ] per row and entry [B, E] from the rates [B, C] (`rates`: R ranks, then D
    depths; module doc). xp: jnp (in the loop) or np (on the host): one formula for both."""
    rank, depth, anc, valid = _entry_tables(self.menu, self.width)
    rates_BC = xp.clip(xp.asarray(rates_BC, xp.float32), 0.0, 1.0)
    r = self.width
    later = xp.concatenate([xp.zeros_like(rates_BC[:, :1]), rates_BC[:, 1:r]], axis=1)
    survive = xp.cumprod(1.0 - later, axis=1)
    before = xp.concatenate([xp.ones_like(survive[:, :1]), survive[:, :-1]], axis=1)
    sibling_BR = later * before  # a_r·Π_{1<=j<r}(1 − a_j); 0 for rank 0
    first_BEN = xp.take(rates_BC[:, r:], xp.asarray(depth) - 1, axis=1)  # a0 at node depth
    edge_BEN = xp.where(xp.asarray(rank)[None] == 0, first_BEN,
                        (1.0 - first_BEN) * xp.take(sibling_BR, xp.asarray(rank), axis=1))
    log_edge = xp.log(xp.maximum(edge_BEN, 1e-30))
    node_BEN = xp.exp(xp.einsum("ben,emn->bem", log_edge, xp.asarray(anc)))
    return 1.0 + xp.sum(node_BEN * xp.asarray(valid)[None], axis=-1)

  def cycle_seconds(self, batch, xp=jnp):
    """Seconds per cycle of each entry [E] at `batch` rows (linear in log batch, clamped);
    `batch` may be an array [Q] (then [Q, E])."""
    x = xp.log(xp.asarray(batch, xp.float32))
    xs = xp.log(xp.asarray(self.batches))
    secs = xp.asarray(self.seconds)
    cols = [xp.interp(x, xs, secs[:, e]) for e in range(secs.shape[1])]
    return xp.stack(cols, axis=-1)

  def scores(self, rates_BC, active_B, batch, xp=jnp, remaining_B=None):
    """Predicted tokens per second of each entry [E] (or [Q, E] for batches [Q]) under the
    policy's objective (module doc): Σ_active E[τ] ÷ cycle seconds ("tokens", or without
    `remaining_B`), or the pace of the row that finishes last ("batch"), scaled to be
    comparable across entries: min_active min(E[τ_b], r_b) ÷ r_b ÷ cycle seconds."""
    tau_BE = self.expected_tokens(rates_BC, xp)
    act = xp.asarray(active_B)[:, None]
    secs = self.cycle_seconds(batch, xp)
    tokens = xp.sum(tau_BE * act.astype(xp.float32), axis=0) / secs
    if remaining_B is None:
      return tokens
    r = xp.maximum(xp.asarray(remaining_B, xp.float32), 1.0)[:, None]
    pace = xp.min(xp.where(act, xp.minimum(tau_BE, r) / r, xp.inf), axis=0)
    pace = xp.where(xp.any(act), pace, 0.0) / secs
    return xp.where(self.batch_pace > 0, pace, tokens)

  def pick(self, rates_BC: Array, active_B: Array, batch, cycle: Array,
           remaining_B: Array | None = None) -> Array:
    """The entry index (int32) this cycle: forced[cycle mod S] if >= 0, else the argmax of
    `scores` (first entry among ties; `remaining_B`: each row's budget left, for the "batch"
    objective). Pure jnp: the loop's choice."""
    best = jnp.argmax(self.scores(rates_BC, active_B, batch, jnp, remaining_B)).astype(
        jnp.int32)
    f = self.forced[jnp.mod(cycle, self.forced.shape[0])]
    return jnp.where(f >= 0, f, best)

  # ----------------------------------------------------------------------- host answers
  # (the rates of rows that all accept alike; the answers: adaptive_plan.AdaptivePlanning)

  def _host_rates(self, alpha, rank_rates=None, depth_rates=None) -> np.ndarray:
    """[1, C] rates: every rank at α (or `rank_rates`), every depth's first candidate at the
    rank-0 rate (or `depth_rates`, `pricing.prior_by_depth`'s rules)."""
    if rank_rates is None:
      rates = np.full(self.width, pricing.check_float("alpha", alpha, 0.0, 1.0),
                      np.float32)
    else:
      rr = np.asarray(rank_rates, np.float32).ravel()
      if rr.size == 0 or np.any(~np.isfinite(rr)) or np.any(rr < 0) or np.any(rr > 1):
        raise ValueError(f"rank_rates must be probabilities in [0, 1], got {rank_rates!r}")
      rates = np.full(self.width, rr[-1], np.float32)
      rates[:min(rr.size, self.width)] = rr[:self.width]
    depth = pricing.prior_by_depth(float(rates[0]) if depth_rates is None else depth_rates,
                                   self.depths)
    return np.concatenate([rates, depth.astype(np.float32)])[None]
