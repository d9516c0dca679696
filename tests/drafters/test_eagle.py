"""EAGLE head: drafting bookkeeping against a cache-free reference (chain, static tree,
dynamic tree), greedy identity with plain decoding on a ragged batch, the joint law of the
first three tokens at T > 0 (χ², false-alarm rate 1e-3 per test, fixed seeds, planted-bug
negative control), training with training-time test (loss down, acceptance up), save /
restore round trip, a head for another target refused naming the fields, bad input.

Tiny models only; the training tests share one kind and schedule (one train-step compile).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, struct

from specjax.engine import decoding, loop
from specjax.verify import sampling, trees
from specjax.data.corpus import load_corpus
from specjax.models.lm import LM
from specjax.drafters.eagle import EagleDrafter, default_layers, embed, head_logits, init_head
from specjax.training.eagle import EagleHeads
from specjax.training.heads import HeadTrainer, load_head, train_head
from specjax_testing import (FALSE_ALARM, PROMPT, RAGGED, TC, TCFG, TOK, assert_greedy_identity,
                             exact_joint, first_three, joint_pvalue, model)
from specjax_testing import byte_target, data  # noqa: F401 (shared fixtures)
from specjax_testing import joint_target as _joint_target

TREES = [trees.chain(3), trees.branching((2, 2, 1)), trees.DynamicTree(6, 3, 2)]
TREE_IDS = ["chain", "static", "dynamic"]

KIND = EagleHeads(steps=3)


@pytest.fixture(scope="module")
def trained(data, byte_target):
  """(trainer before training: loss, acceptance; the result) of the shared schedule."""
  trainer = HeadTrainer(KIND, TCFG, byte_target[1], TC, data, TOK, progress=False)
  before = trainer.validation_loss(), trainer.evaluate()
  return before, trainer.run(), trainer


@pytest.fixture(scope="module")
def drafter(byte_target, trained):
  return EagleDrafter.of(byte_target[0], trained[1].params, KIND.feature_layers(TCFG),
                         deterministic=True)


# ----------------------------------------------------------------------------- bookkeeping


def _reference_logits(drafter, tokens, path):
  """Cache-free: the head over positions 0..L-1 with the target's features, then one step
  per token of `path` fed with the previous step's h; logits after the last one."""
  head, tgt = drafter.head.module(), drafter.target.module()
  n = len(tokens) - 1  # L
  toks = jnp.asarray([tokens[:n]], jnp.int32)
  _, _, _, feats = tgt(toks, jnp.arange(n, dtype=jnp.int32)[None], capture=drafter.layers)
  u = head.fused(feats)[0]  # [L, D]
  ins, emb = [u[i] for i in range(n)], list(tokens[1:n + 1])
  h = None
  for step in range(len(path) + 1):
    if step:
      ins.append(h)
      emb.append(path[step - 1])
    pos = jnp.arange(len(ins), dtype=jnp.int32)[None]
    hs, _ = head(jnp.stack(ins)[None], embed(tgt, jnp.asarray([emb], jnp.int32)), pos)
    h = hs[0, -1]
  return np.asarray(head_logits(head, tgt, h[None, None])[0, 0])


@pytest.mark.slow
@pytest.mark.parametrize("tree", TREES, ids=TREE_IDS)
def test_proposals_equal_a_cache_free_reference_after_some_cycles(byte_target, drafter, tree):
  """After a few cycles (ragged rows, some finished), every drafted node is its parent's
  rank-r top choice under a cache-free run of the head along the node's path: the cache
  catch-up, the features of the accepted path and the carried h are all right."""
  target = byte_target[0]
  batch = decoding.prepare_batch(RAGGED[:3], vocab_size=TCFG.vocab_size, max_len=128,
                                 max_new_tokens=[9, 3, 12],
                                 slots=drafter.slots_needed(tree))
  state = loop.speculative_jit(LM.of(target), drafter, batch.prompt_BP, batch.prompt_len_B,
                               batch.budget_B, jnp.asarray(-1), sampling.make_sampler(0.0),
                               jax.random.key(0), tree=tree, cache_len=batch.cache_len)
  proposal, _ = jax.jit(lambda s, c: drafter.propose(s, c, tree, sampling.make_sampler(0.0),
                                                     jax.random.key(1)))(state.draft,
                                                                         state.context())
  for b in range(3):
    L = int(state.length[b])
    ctx = [int(x) for x in state.tokens[b, :L + 1]]
    parents = (np.asarray(tree.parents) if proposal.parents is None
               else np.asarray(proposal.parents[b]))
    nodes = [None] + [int(x) for x in proposal.tokens[b]]
    for i in range(1, len(nodes)):
      path, j = [], parents[i]
      while j > 0:
        path.insert(0, nodes[j])
        j = parents[j]
      rank = sum(1 for s in range(1, i) if parents[s] == parents[i])
      ref = _reference_logits(drafter, ctx, path)
      np.testing.assert_allclose(ref[nodes[i]], np.sort(ref)[::-1][rank], rtol=1e-4,
                                 atol=1e-4, err_msg=f"row {b} node {i}")


@pytest.mark.slow
@pytest.mark.parametrize("tree", TREES, ids=TREE_IDS)
def test_greedy_identity_with_plain_decoding_on_a_ragged_batch(byte_target, drafter, tree):
  """Same tokens as plain greedy decoding, also with per-row budgets and an EOS that cuts
  cycles short (the features of path node m - 1 then start the next cycle)."""
  assert_greedy_identity(byte_target[0], drafter, tree, new_tokens=20)


@pytest.mark.slow
def test_lazy_catch_up_in_the_adaptive_loop_keeps_greedy_identity_and_acceptance(byte_target,
                                                                                 drafter):
  """The adaptive loop forced through runs of k = 0 (lazy bound P = 3: each run skips the
  head for 3 tokens, a catch-up from the kept features before the next draft) between k = 1,
  2 and tree cycles: plain greedy tokens, catch-ups run, and the caught-up head's drafts are
  accepted exactly where they are with eager catch-up (P = 0: a chain(1) proposal and
  commit every plain step), the schedules arranged so both run their speculative cycles
  after the same plain steps. The states' agreement, draft by draft, is
  `tests/engine/test_adaptive_lazy.py`'s."""
  import jax.numpy as jnp
  from specjax.engine.adaptive import loop as adaptive_loop, policy as adaptive
  target = byte_target[0]
  menu = (0, 1, 2, trees.branching((2, 1)))
  slots = max(max(e.n_nodes, drafter.slots_needed(e)) for e in adaptive.menu(menu)[1:])
  batch = decoding.prepare_batch(RAGGED, vocab_size=TCFG.vocab_size, max_len=128,
                                 max_new_tokens=24, slots=slots)

  def run(lazy_slots, forced):
    policy = adaptive.AdaptivePolicy.create(menu, [1.0, 1.1, 1.2, 1.4], forced=forced)
    return adaptive_loop.adaptive_jit(LM.of(target), drafter, policy, batch.prompt_BP,
                                      batch.prompt_len_B, batch.budget_B, jnp.asarray(-1),
                                      sampling.make_sampler(0.0), jax.random.key(0),
                                      cache_len=batch.cache_len, lazy_slots=lazy_slots)
  lazy = run(3, [0, 2, 1, 3, 2])  # a lazy k = 0 iteration is a run of 3 plain steps
  eager = run(0, [0, 0, 0, 2, 1, 3, 2])
  plain = decoding.generate(target, RAGGED, max_new_tokens=24).tokens
  lens = np.asarray(batch.prompt_len_B)
  for state in (lazy, eager):
    toks = np.asarray(state.tokens)
    assert [toks[b, lens[b]:lens[b] + 24].tolist() for b in range(len(RAGGED))] == plain
  assert int(lazy.adapt.catch_ups) > 0 and int(eager.adapt.catch_ups) == 0
  assert int(lazy.stats.accepted.sum()) > 0  # 7 of 73 drafts
  np.testing.assert_array_equal(lazy.stats.drafted, eager.stats.drafted)
  np.testing.assert_array_equal(lazy.stats.depth_accepted, eager.stats.depth_accepted)
  np.testing.assert_array_equal(lazy.stats.rank_accepted, eager.stats.rank_accepted)


@pytest.mark.slow
def test_reduced_vocabulary_greedy_identity_and_drafts_inside_it(byte_target, drafter):
  """FR-Spec: only the most frequent tokens are drafted; the output stays plain greedy's."""
  from specjax.drafters.eagle import frequent_vocab
  target = byte_target[0]
  vocab = frequent_vocab(np.concatenate(RAGGED + [list(range(40, 120))]), 48)
  small = EagleDrafter.of(target, drafter.head, drafter.layers, deterministic=True,
                          vocab=vocab)
  plain = decoding.generate(target, RAGGED, max_new_tokens=16)
  for tree in TREES:
    assert decoding.speculative_generate(target, small, RAGGED, tree=tree,
                                         max_new_tokens=16).tokens == plain.tokens
  tree = TREES[2]
  batch = decoding.prepare_batch(RAGGED, vocab_size=TCFG.vocab_size, max_len=128,
                                 max_new_tokens=6, slots=small.slots_needed(tree))
  state = loop.speculative_jit(LM.of(target), small, batch.prompt_BP, batch.prompt_len_B,
                               batch.budget_B, jnp.asarray(-1), sampling.make_sampler(0.0),
                               jax.random.key(0), tree=tree, cache_len=batch.cache_len)
  proposal, _ = jax.jit(lambda s, c: small.propose(s, c, tree, sampling.make_sampler(0.0),
                                                   jax.random.key(1)))(state.draft,
                                                                       state.context())
  assert np.isin(np.asarray(proposal.tokens), vocab).all()
  with pytest.raises(ValueError, match="distinct token ids"):
    EagleDrafter.of(target, drafter.head, drafter.layers, vocab=[1, 1])
  with pytest.raises(ValueError, match="only 2 tokens"):
    decoding.speculative_generate(target, EagleDrafter.of(target, drafter.head,
                                                          drafter.layers, vocab=[1, 2]),
                                  RAGGED[:1], tree=trees.branching((3,)), max_new_tokens=4)


# ----------------------------------------------------------------------------- the joint law


@pytest.fixture(scope="module")
def joint_target():
  return _joint_target()


@struct.dataclass
class _ReportsTheWrongLaw(EagleDrafter):
  """Planted bug: children are sampled from the head's law sharpened (q²), while the
  proposal reports q itself to the acceptance rule. The extra static field keeps its
  compiled program apart from its parent's (docs/xla_notes.md, trap 9)."""

  planted: bool = struct.field(pytree_node=False, default=True)

  def _children(self, logits_BRV, q_BRV, parent_row, rank, width, key):
    sharp = None if q_BRV is None else q_BRV ** 2
    return super()._children(logits_BRV, sharp, parent_row, rank, width, key)


@pytest.mark.slow
@pytest.mark.parametrize("tree, sampler_args, vocab", [
    (trees.chain(2), (0.8, 5, 0.9), None), (trees.branching((2, 1)), (0.8, 5, 0.9), None),
    (trees.chain(2), (1.0, 0, 1.0), (0, 2, 3, 6))],
    ids=["chain-T0.8-topk5-topp0.9", "tree-T0.8-topk5-topp0.9", "chain-T1-reduced-vocab"])
def test_joint_law_of_first_three_tokens_matches_target(joint_target, tree, sampler_args,
                                                        vocab):
  """χ² of 40,000 rows against the enumerated target joint over 8³ outcomes (sparse cells
  pooled); false-alarm rate 1e-3. Sampled candidates from the head's warped law (q
  reported), an untrained head: exactness does not depend on the head's quality; with a
  reduced draft vocabulary (FR-Spec) half the tokens are never drafted."""
  drafter = EagleDrafter.of(joint_target, seed=3, vocab=vocab)
  sampler = sampling.make_sampler(*sampler_args)
  tokens = first_three(joint_target, drafter, tree, sampler, seed=11)
  assert joint_pvalue(tokens, exact_joint(joint_target, PROMPT, sampler)) > FALSE_ALARM


@pytest.mark.slow
def test_joint_law_test_catches_a_drafter_reporting_the_wrong_law(joint_target):
  """Negative control: the same χ² test rejects a planted q mismatch."""
  good = EagleDrafter.of(joint_target, seed=3)
  bad = _ReportsTheWrongLaw(head=good.head, target=good.target, layers=good.layers)
  sampler = sampling.make_sampler(1.0)
  tokens = first_three(joint_target, bad, trees.chain(2), sampler, seed=11)
  assert joint_pvalue(tokens, exact_joint(joint_target, PROMPT, sampler)) < FALSE_ALARM


# ----------------------------------------------------------------------------- training


def test_training_lowers_the_loss_and_raises_acceptance(byte_target, trained):
  """Training-time test over 3 steps for 40 steps: the held-out loss drops and the
  teacher-forced acceptance rises at every drafting step; decoding with the trained head
  accepts more than with the untrained one."""
  (loss0, acc0), result, trainer = trained
  assert result.completed and result.step == TC.steps
  assert trainer.validation_loss() < 0.8 * loss0
  acc = result.acceptance
  assert len(acc.top1) == 3
  assert all(a > b + 0.02 for a, b in zip(acc.top1, acc0.top1)), (acc0, acc)
  target = byte_target[0]
  prompts = [[ord(c) for c in "def f(x):\n    return"], [ord(c) for c in "import numpy"]]
  layers = KIND.feature_layers(TCFG)
  runs = [decoding.speculative_generate(
      target, EagleDrafter.of(target, head, layers, deterministic=True), prompts, k=3,
      max_new_tokens=24).summary().alpha for head in (trainer.kind.init(TCFG, jax.random.key(
          TC.seed)), result.params)]
  assert runs[1] > runs[0] + 0.05, runs


@pytest.mark.slow
def test_save_restore_round_trip(data, byte_target, tmp_path):
  result = train_head(KIND, TCFG, byte_target[1], TC.replace(steps=3), data, TOK,
                      out_dir=tmp_path / "h", progress=False)
  head = load_head(tmp_path / "h", target=(TCFG, byte_target[1]), kind="eagle")
  assert head.kind == KIND and head.step == 3
  for x, y in zip(jax.tree.leaves(head.params), jax.tree.leaves(result.params)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  target = byte_target[0]
  d = EagleDrafter.of(target, head.params, head.kind.feature_layers(TCFG))
  prompts = [[1, 40, 50], [60, 61]]
  run = decoding.speculative_generate(target, d, prompts, k=3, max_new_tokens=8)
  assert run.tokens == decoding.generate(target, prompts, max_new_tokens=8).tokens


def test_a_head_for_another_target_is_refused_naming_the_fields(data, byte_target, tmp_path):
  train_head(KIND, TCFG, byte_target[1], TC.replace(steps=1), data, TOK,
             out_dir=tmp_path / "h", progress=False)
  other = TCFG.replace(d_model=48, n_layers=3, n_heads=4, n_kv_heads=2)
  with pytest.raises(ValueError, match="another target") as e:
    load_head(tmp_path / "h", target=(other, nnx.state(model(other, seed=3), nnx.Param)))
  assert "d_model: head=32, target=48" in str(e.value)
  assert "n_layers: head=2, target=3" in str(e.value)
  with pytest.raises(ValueError, match="parameter fingerprint: head="):
    load_head(tmp_path / "h", target=(TCFG, nnx.state(model(TCFG, seed=9), nnx.Param)))


# ----------------------------------------------------------------------------- bad input


def test_bad_input_is_refused_before_any_work(byte_target):
  target = byte_target[0]
  assert default_layers(2) == (0, 1, 2)
  with pytest.raises(ValueError, match=r"layers must be .* in \[-1, 2\]"):
    EagleDrafter.of(target, layers=(0, 3))
  with pytest.raises(ValueError, match="the head fuses 3 target layers but layers has 2"):
    EagleDrafter.of(target, EagleDrafter.of(target).head, layers=(0, 2))
  wide = model(TCFG.replace(d_model=48, n_heads=4, n_kv_heads=2), seed=1)
  with pytest.raises(ValueError, match="does not fit this target: d_model: head 48"):
    EagleDrafter.of(target, EagleDrafter.of(wide).head)
  for kwargs, match in [(dict(steps=0), "steps must be an int >= 1"),
                        (dict(decay=0.0), r"decay must be in \(0, 1\]"),
                        (dict(layers=()), "layers must be a non-empty")]:
    with pytest.raises(ValueError, match=match):
      EagleHeads(**kwargs)


# ----------------------------------------------------------------------------- CLI


@pytest.mark.slow
def test_cli_trains_an_eagle_head_and_generates_with_it(byte_target, tmp_path, capsys):
  import json

  from specjax import cli
  from specjax.checkpoints import save_model
  save_model(tmp_path / "target", byte_target[0])
  argv = ["train", "eagle", "--target", str(tmp_path / "target"), "--ttt-steps", "2",
          "--max-bytes", "60000", "--steps", "3", "--batch-size", "8", "--seq-len", "32",
          "--ckpt-every", "0", "--out", str(tmp_path / "head"), "--no-progress"]
  assert cli.main(argv) == 0
  assert "eagle head" in capsys.readouterr().out
  assert cli.main(["generate", "--target", str(tmp_path / "target"), "--draft",
                   f"eagle:{tmp_path / 'head'}", "--k", "3", "--max-new-tokens", "6",
                   "--repeats", "1", "--json"]) == 0
  assert json.loads(capsys.readouterr().out)["identical_to_plain"]
  assert cli.main(argv[:4] + ["--layers", "0,9"] + argv[4:]) == 2
  assert "layers must be" in capsys.readouterr().err


@pytest.mark.slow  # compile-bound (5-18 s): the fast tier's 3 minutes
def test_default_eagle_head_is_built_on_first_use_then_cached(monkeypatch, tmp_path, capfd,
                                                             byte_target):
  """`load_default_heads("eagle")` trains once into the cache, then loads; the head drafts
  for the target it was built for (a stand-in default target: the tiny byte target)."""
  from specjax.training import defaults
  default = defaults.DefaultTarget(TCFG, byte_target[1], TOK)
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
  monkeypatch.setattr(defaults, "load_default_target", lambda *a, **kw: default)
  monkeypatch.setattr(defaults, "load_corpus", lambda spec: load_corpus(spec, max_bytes=60_000))
  monkeypatch.setitem(defaults.DEFAULT_HEADS, "eagle",
                      (KIND.spec(), TC.replace(steps=2, ckpt_every=1)))
  head = defaults.load_default_heads("eagle", "base", progress=False)
  assert "training the default eagle heads" in capfd.readouterr().err
  again = defaults.load_default_heads("eagle", "base", progress=False)
  assert "training" not in capfd.readouterr().err
  for x, y in zip(jax.tree.leaves(again.params), jax.tree.leaves(head.params)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  target = byte_target[0]
  d = EagleDrafter.of(target, again.params, again.kind.feature_layers(TCFG))
  assert decoding.speculative_generate(target, d, [[5, 6, 7]], k=2, max_new_tokens=6).tokens \
      == decoding.generate(target, [[5, 6, 7]], max_new_tokens=6).tokens


@pytest.mark.slow
def test_a_narrow_head_drafts_exactly_and_round_trips(data, byte_target, tmp_path):
  """width < d_model: the head's layer is narrower and its output is mapped back to d_model
  for the target's LM head (folded once into one W x V product when drafting). Greedy
  identity on a ragged batch for every tree kind, the folded drafting logits equal the
  unfolded `head_logits`, and the width survives a save / restore."""
  target = byte_target[0]
  kind = EagleHeads(steps=2, width=16)
  head = train_head(kind, TCFG, byte_target[1], TC, data, TOK,
                    out_dir=tmp_path / "h", progress=False)
  d = EagleDrafter.of(target, head.params, kind.feature_layers(TCFG), deterministic=True)
  assert d.config.d_model == 16 and d.head.module().out is not None
  assert d.lm.shape == (16, TCFG.vocab_size)
  h = jax.random.normal(jax.random.key(0), (2, 3, 16))
  np.testing.assert_allclose(d._logits(d.head.module(), h),
                             head_logits(d.head.module(), target, h), rtol=1e-5, atol=1e-5)
  for tree in TREES + [trees.DynamicTree(6, 3, 2, confidence=0.3)]:
    assert_greedy_identity(target, d, tree, new_tokens=12)
  loaded = load_head(tmp_path / "h", target=(TCFG, byte_target[1]))
  assert loaded.kind == kind
  again = EagleDrafter.of(target, loaded.params, kind.feature_layers(TCFG))
  assert again.config.d_model == 16


def test_a_bad_width_is_refused_naming_what_is_allowed(byte_target):
  target = byte_target[0]
  hd = TCFG.head_dim
  for width in (hd + 1, 0, TCFG.d_model + hd):
    with pytest.raises(ValueError, match=rf"width must be a multiple of the target's head_dim "
                                         rf"\({hd}\) up to its d_model \({TCFG.d_model}\)"):
      EagleDrafter.of(target, init_head(TCFG, default_layers(TCFG.n_layers), width=width))
  with pytest.raises(ValueError, match="width must be None .* or an int >= 1, got 'x'"):
    EagleHeads(width="x")


def test_the_default_heads_width_falls_back_to_full_width_where_the_target_cannot_take_it():
  from specjax.training.defaults import DEFAULT_HEADS, default_head_spec
  from specjax.training.presets import get_preset
  width = DEFAULT_HEADS["eagle"][0]["width"]
  base = get_preset("base").target
  assert base.d_model > width and default_head_spec("eagle", base, "base")["width"] == width
  assert "width" not in default_head_spec("eagle", get_preset("tiny").target, "base")  # d 96
  assert "width" not in default_head_spec("eagle", base.replace(d_model=width, n_heads=2,
                                                                n_kv_heads=2),
                                          "base")  # = d_model
  shipped = get_preset("shipped")  # a preset with its own heads table: its own width
  assert default_head_spec("eagle", shipped.target, "shipped")["width"] == \
      shipped.heads["eagle"][0]["width"] < shipped.target.d_model
