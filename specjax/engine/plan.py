"""A speculation plan: what a speculative run verifies each cycle, validated once.

A plan is one of four things: a chain of k drafts (`trees.chain(k)`), a static token tree
(`trees.TreeSpec`), a dynamic tree (`trees.DynamicTree`), or an adaptive policy that picks a
shape of its menu every cycle (an `adaptive.AdaptivePolicy`, or k = 'auto': the default
policy for the pair, `default_policy`). Two steps, each done once:

- `of(k=, tree=, policy=)` builds a `SpeculationPlan` from the host API's keywords and checks
  everything that needs no model: exactly one kind, k an int >= 1 (by `trees.chain`) or
  'auto', the tree's type, the policy's type, menu and threshold.
- `prepare(target, draft, prompts, plan, ...)` does every check that needs the models and the
  prompts, before anything compiles: the drafter fitted to the target's vocabulary, k = 'auto'
  resolved to its policy, every shape the run may verify (one tree, or the menu) within the
  vocabulary and drafted by this drafter at this batch, the prompts padded to a bucket and
  the cache sized for the most slots a cycle writes against both models' contexts, both KV
  caches within memory, the EOS ids, the seed. It returns a `Prepared` run: the arguments of
  the compiled loop (`loop_args`, `loop_kwargs`).

`decoding.speculative_generate` is `of` + `prepare` + the compiled loop + the result. A study
or tool that calls the loop itself (vmapped over a runtime value, or traced with planted
bugs) calls `prepare` and passes its `loop_args` on, so it runs what the host API checks.
Layering: trees, adaptive, drafters, loop, batching <- plan <- decoding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from specjax.engine.adaptive import policy as adaptive
from specjax.engine import loop
from specjax.verify import sampling, trees
from specjax.engine.batching import Batch, eos_ids, key_of, pad_rows, sized_batch
from specjax.models.lm import LM
from specjax.drafters.base import Drafter
from specjax.drafters.model import ModelDrafter
from specjax.models import cache as kv
from specjax.verify.trees import DynamicTree, TreeSpec
from specjax.analysis import roofline

Array = jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class SpeculationPlan:
  """One validated speculation plan (module doc): a fixed shape `tree` (a chain is
  `trees.chain(k)`), or adaptive: `policy`, or `auto` (k = 'auto' without a policy: the
  default policy for the pair, chosen by `prepare`). Build it with `of`."""

  tree: TreeSpec | DynamicTree | None = None
  policy: adaptive.AdaptivePolicy | None = None
  auto: bool = False

  @property
  def adaptive(self) -> bool:
    return self.tree is None

  @property
  def k(self) -> int:
    """Drafted nodes per cycle: the tree's size, or the menu's deepest shape (at least 1)."""
    return self.tree.size if self.tree is not None else max(self.policy.max_depth, 1)

  def shapes(self) -> list:
    """The shapes a run may verify: the tree, or the policy's menu (k = 0 drafts a chain(1))."""
    if self.tree is not None:
      return [self.tree]
    return [trees.chain(1) if e is None else e for e in self.policy.menu]

  def for_pair(self, target, drafter) -> "SpeculationPlan":
    """The plan with k = 'auto' resolved to `default_policy(target, drafter)`."""
    if not self.auto:
      return self
    return _checked_policy(default_policy(LM.of(target), drafter))


def of(k: int | str | None = None, tree: TreeSpec | DynamicTree | None = None,
       policy: adaptive.AdaptivePolicy | None = None,
       plan: SpeculationPlan | None = None) -> SpeculationPlan:
  """The speculation plan of the host API's keywords: exactly one of k (an int >= 1: a chain;
  'auto': the default policy), tree (a `trees.TreeSpec` or `trees.DynamicTree`), policy (an
  `adaptive.AdaptivePolicy`; with k = 'auto' or alone), or a built `plan`, which is returned as
  it is. ValueError naming the argument otherwise."""
  if plan is not None:
    if not isinstance(plan, SpeculationPlan):
      raise ValueError(f"plan must be a plan.SpeculationPlan (built by plan.of), got {plan!r}")
    if any(x is not None for x in (k, tree, policy)):
      raise ValueError(f"plan= is the whole speculation plan: pass no k={k!r}, tree={tree!r} "
                       f"or policy={policy!r} with it")
    return plan
  auto = isinstance(k, str) and k == "auto"
  if auto or policy is not None:
    if tree is not None or (k is not None and not auto):
      raise ValueError(f"adaptive speculation (k='auto' or policy=) takes its shapes from the "
                       f"policy's menu: pass neither k={k!r} nor tree={tree!r} with it")
    return SpeculationPlan(auto=True) if policy is None else _checked_policy(policy)
  if isinstance(k, str):
    raise ValueError(f"k must be an int >= 1 or 'auto', got {k!r}")
  return SpeculationPlan(tree=resolve_tree(k, tree))


def _checked_policy(policy) -> SpeculationPlan:
  if not isinstance(policy, adaptive.AdaptivePolicy):
    raise ValueError(f"policy must be an adaptive.AdaptivePolicy, got {policy!r}")
  adaptive.menu(policy.menu)  # empty, dynamic or duplicate shapes: ValueError
  adaptive.check_threshold(float(policy.threshold))
  return SpeculationPlan(policy=policy)


def resolve_tree(k: int | None, tree: TreeSpec | DynamicTree | None) -> TreeSpec | DynamicTree:
  """The tree of a fixed shape: exactly one of k (a chain, `trees.chain(k)`, which checks k)
  or tree."""
  if (k is None) == (tree is None):
    got = "neither" if k is None else f"both k={k!r} and tree={tree!r}"
    raise ValueError(f"speculative decoding needs exactly one of k (chain length) or tree "
                     f"(a trees.TreeSpec or trees.DynamicTree), got {got}")
  if tree is None:
    return trees.chain(k)
  if not isinstance(tree, (TreeSpec, DynamicTree)):
    raise ValueError(f"tree must be a trees.TreeSpec or trees.DynamicTree, got {tree!r}")
  return tree


# ----------------------------------------------------------------------------- drafters


def as_drafter(draft) -> Drafter:
  """A drafter from a drafter (a `drafters.base.Drafter`) or a bare draft model (wrapped as
  a separate-model drafter, `ModelDrafter`)."""
  if isinstance(draft, Drafter):
    return draft
  return ModelDrafter.of(draft)


def fit_vocab(drafter: Drafter, vocab_size: int) -> Drafter:
  """The drafter for a target of `vocab_size` ids: as it is when its model's vocabulary has
  as many ids (or it has no model), padded when it has fewer (a target with extra padded
  or reserved rows: `ModelDrafter.padded_to`, docs/exactness.md "Padded vocabularies");
  ValueError naming both sizes when it has more, or cannot be padded."""
  cfg = drafter.config
  if cfg is None or cfg.vocab_size == vocab_size:
    return drafter
  if isinstance(drafter, ModelDrafter):
    return drafter.padded_to(vocab_size)
  raise ValueError(f"draft vocabulary ({cfg.vocab_size}) must match the target's "
                   f"({vocab_size}): {type(drafter).__name__} cannot pad its vocabulary")


def lazy_slots_of(drafter) -> int:
  """The adaptive loop's lazy catch-up bound for this drafter: `loop.LAZY_SLOTS` if it
  declares `lazy_catch_up`, else 0 (eager). Price k = 0 with it (`AdaptivePolicy.from_costs`
  / `from_model`, `lazy_slots=`)."""
  return loop.LAZY_SLOTS if as_drafter(drafter).lazy_catch_up else 0


def default_policy(target, drafter, entries=adaptive.DEFAULT_CHAINS,
                   **kwargs) -> adaptive.AdaptivePolicy:
  """The policy of `k="auto"` without calibrated costs: the menu `entries` (default
  `adaptive.DEFAULT_CHAINS`) priced by `AdaptivePolicy.from_model` with c = the draft's share
  of the target's per-token matmul weights (1 for a drafter without a model of its own or
  the target itself), a k = 0 step's catch-up share 1 / `loop.LAZY_SLOTS` for a drafter that
  catches up lazily. kwargs: the policy's runtime values (threshold, decay, ...). Calibrate
  for real costs (`adaptive.AdaptivePolicy.from_costs`)."""

  drafter = as_drafter(drafter)
  if entries is adaptive.DEFAULT_CHAINS:  # a menu the caller chose is taken as given
    entries = drafter_menu(drafter, entries)
  cfg = drafter.config
  c = 1.0
  if cfg is not None and cfg != target.config:
    c = roofline.param_counts(cfg)["matmul"] / roofline.param_counts(target.config)["matmul"]
  return adaptive.AdaptivePolicy.from_model(entries, c=min(c, 1.0),
                                            lazy_slots=lazy_slots_of(drafter), **kwargs)


def drafter_menu(drafter, entries=adaptive.DEFAULT_CHAINS) -> tuple:
  """The menu's entries (k, a chain's length, or a TreeSpec) this drafter can draft (e.g.
  chains no deeper than its Medusa heads), in order: k = 0 is always kept; none left but
  k = 0 is refused (ValueError)."""
  drafter = as_drafter(drafter)
  kept = []
  for e in entries:
    tree = None if e == 0 else (e if isinstance(e, TreeSpec) else trees.chain(int(e)))
    try:
      if tree is not None:
        drafter.validate(tree, 1)
    except ValueError:
      continue
    kept.append(e)
  if all(e == 0 for e in kept):
    raise ValueError(f"the drafter can draft none of the default menu's shapes {entries!r}: "
                     f"pass policy= with shapes it takes")
  return tuple(kept)


def draft_cache_bytes(drafter: Drafter, batch: int, cache_len: int) -> int:
  """The drafter's own KV cache: none without a model or when it shares the target's."""
  if drafter.config is None or drafter.shares_target_cache:
    return 0
  return kv.cache_bytes(drafter.config, batch, cache_len)


# ----------------------------------------------------------------------------- prepare


@dataclasses.dataclass(frozen=True, eq=False)
class Prepared:
  """A checked speculative run (`prepare`): the target and the fitted drafter, the plan
  (k = 'auto' resolved), the padded batch, the sampler, the EOS ids and the PRNG key."""

  target: LM
  drafter: Drafter
  plan: SpeculationPlan
  batch: Batch
  sampler: Any
  eos: Array
  key: Array

  def loop_args(self) -> tuple:
    """The positional arguments of the plan's loop: `loop.speculative_loop(*args,
    **loop_kwargs())` for a fixed shape, `adaptive_loop.adaptive_loop` (the policy after
    the drafter) for an adaptive plan."""
    b = self.batch
    models = (self.target, self.drafter) + ((self.plan.policy,) if self.plan.adaptive else ())
    return models + (b.prompt_BP, b.prompt_len_B, b.budget_B, self.eos, self.sampler, self.key)

  def loop_kwargs(self) -> dict:
    """The loop's static keywords: the tree (fixed shapes) and the cache length."""
    tree = {} if self.plan.adaptive else {"tree": self.plan.tree}
    return {**tree, "cache_len": self.batch.cache_len}


def prepare(target, draft, prompts, plan: SpeculationPlan, *, max_new_tokens, sampler=None,
            seed=0, eos_id=None, cache_len: int | None = None,
            allow_beyond_max_len: bool = False, row_multiple: int = 1) -> Prepared:
  """Every check a speculative run passes before anything compiles (module doc), once.

  target: a `Transformer` or `LM`; draft: a draft model or any `drafters.Drafter`; plan: a
  `SpeculationPlan` (`of`). The other arguments are `decoding.speculative_generate`'s
  (sampler None: greedy); row_multiple: the batch is padded to a multiple of it
  (`batching.pad_rows`; a mesh's `data` axis), and memory is checked for the padded rows.
  Raises ValueError naming the argument; returns a `Prepared` run."""
  if not isinstance(plan, SpeculationPlan):
    raise ValueError(f"plan must be a plan.SpeculationPlan (built by plan.of), got {plan!r}")
  target = LM.of(target)
  cfg = target.config
  drafter = fit_vocab(as_drafter(draft), cfg.vocab_size)
  plan = plan.for_pair(target, drafter)
  shapes = plan.shapes()
  width = max(e.max_width for e in shapes)
  if width > cfg.vocab_size:
    what = "policy menu" if plan.adaptive else "tree"
    raise ValueError(f"{what} has a node with {width} candidates (width {width}) but the "
                     f"vocabulary has only {cfg.vocab_size} tokens: width must be <= "
                     f"{cfg.vocab_size}")
  slots = max(max(e.n_nodes, drafter.slots_needed(e)) for e in shapes)
  batch = sized_batch([cfg] if drafter.config is None else [cfg, drafter.config], prompts,
                      slots=slots, max_new_tokens=max_new_tokens, cache_len=cache_len,
                      allow_beyond_max_len=allow_beyond_max_len)
  batch = pad_rows(batch, row_multiple)
  rows = len(batch.budget_B)
  for e in shapes:
    drafter.validate(e, rows)
  kv.check_fits(cfg, rows, batch.cache_len,
                extra_bytes=draft_cache_bytes(drafter, rows, batch.cache_len),
                what="target + draft KV caches")
  return Prepared(target=target, drafter=drafter, plan=plan, batch=batch,
                  sampler=sampler if sampler is not None else sampling.make_sampler(0.0),
                  eos=eos_ids(eos_id, cfg.vocab_size), key=key_of(seed))
