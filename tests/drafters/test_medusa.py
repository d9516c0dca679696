"""Medusa heads: greedy identity (chain, static tree, ragged batch with EOS and budgets), the
kept hidden state, the joint law at T > 0 (χ², false-alarm rate 1e-3, planted-bug control),
head training (loss down, acceptance up, round trip, resume, binding to the target), bad
trees, the CLI, the default-heads cache.

Tiny models only; the training tests share one kind and schedule, so one compile of the
train step serves the file.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.verify import acceptance, sampling, trees
from specjax import cli
from specjax.engine import decoding, loop
from specjax.data.corpus import load_corpus
from specjax.models.lm import LM
from specjax.drafters.medusa import MedusaDrafter, head_logits
from specjax.models.transformer import ModelConfig
from specjax.training import defaults
from specjax.training.heads import HeadTrainer, TargetBinding, load_head, train_head
from specjax.training.medusa import MedusaHeads
from specjax.training.trainer import params_fingerprint
from specjax_testing import (FALSE_ALARM, PROMPT, RAGGED, TC, TCFG, TINY, TOK,
                             assert_greedy_identity, exact_joint, first_three, joint_pvalue,
                             joint_target, model)
from specjax_testing import byte_target, data  # noqa: F401 (shared fixtures)


def random_heads(cfg: ModelConfig, heads: int, seed: int, scale: float) -> dict:
  kw, kb = jax.random.split(jax.random.key(seed))
  d = cfg.d_model
  return {"w": scale * jax.random.normal(kw, (heads, d, d)) / np.sqrt(d),
          "b": scale * jax.random.normal(kb, (heads, d))}


@pytest.fixture(scope="module")
def target():
  return model(TINY["llama"], seed=0, logit_scale=4.0)


@pytest.fixture(scope="module")
def drafter(target):
  return MedusaDrafter.of(target, random_heads(target.config, 3, seed=1, scale=0.5))


# ----------------------------------------------------------------------------- decoding


@pytest.mark.slow
@pytest.mark.parametrize("tree", [trees.chain(3), trees.from_paths(
    [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])], ids=["chain", "tree"])
def test_greedy_identity_with_plain_decoding_on_a_ragged_batch(target, drafter, tree):
  """Same tokens as plain greedy decoding, with per-row budgets and an EOS cutting cycles
  short (the drafter then takes the hidden state of path node m - 1, m < n + 1)."""
  assert_greedy_identity(target, drafter, tree, new_tokens=24)


def test_drafter_keeps_the_final_hidden_state_at_L_minus_1(target, drafter):
  """After a run, the kept state is a cache-free forward's final-norm output at L - 1, and
  the next proposal is the heads' top choices there."""
  batch = decoding.prepare_batch(RAGGED[:4], vocab_size=61, max_len=128, max_new_tokens=11,
                                 slots=7)
  tree = trees.branching((2, 1, 1))
  state = loop.speculative_jit(LM.of(target), drafter, batch.prompt_BP, batch.prompt_len_B,
                               batch.budget_B, jnp.asarray(-1), sampling.make_sampler(0.0),
                               jax.random.key(0), tree=tree, cache_len=batch.cache_len)
  # one causal, cache-free forward of every row: position L - 1 sees only tokens [0, L)
  width = int(state.length.max())
  tokens = state.tokens[:, :width]
  _, hidden, _ = jax.jit(lambda lm, t: lm(t, jnp.broadcast_to(
      jnp.arange(width, dtype=jnp.int32), t.shape)))(LM.of(target), tokens)
  expected = np.asarray(hidden)[np.arange(4), np.asarray(state.length) - 1]
  np.testing.assert_allclose(state.draft.hidden, expected, rtol=1e-4, atol=1e-4)
  proposal, _ = drafter.propose(state.draft, state.context(), tree, None, None)
  top = np.argsort(-np.asarray(head_logits(drafter.params, drafter.target,
                                           state.draft.hidden)), axis=-1)
  # nodes 1, 2: head 0's ranks 0, 1; nodes 3, 4 (one under each): head 1's rank 0; 5, 6:
  # head 2's rank 0 (Medusa's candidates at a depth do not depend on the parent)
  np.testing.assert_array_equal(proposal.tokens, np.stack(
      [top[:, 0, 0], top[:, 0, 1], top[:, 1, 0], top[:, 1, 0], top[:, 2, 0], top[:, 2, 0]],
      axis=1))


# ----------------------------------------------------------------------------- exactness


@pytest.fixture(scope="module")
def joint_setup():
  target = joint_target()
  return target, MedusaDrafter.of(target, random_heads(target.config, 2, seed=5, scale=1.0))


def _first_three(target, drafter, sampler, run=None):
  return first_three(target, drafter, trees.branching((2, 1)), sampler, 11, slots=4, run=run)


SAMPLER = (0.8, 5, 0.9)  # temperature, top-k, top-p


@pytest.mark.slow
def test_joint_law_of_first_three_tokens_matches_target(joint_setup):
  """χ² goodness of fit of 40,000 rows (first token from prefill, then one Medusa tree
  cycle) against the enumerated warped target joint over 8³ outcomes; false-alarm 1e-3."""
  target, drafter = joint_setup
  sampler = sampling.make_sampler(*SAMPLER)
  tokens = _first_three(target, drafter, sampler)
  assert joint_pvalue(tokens, exact_joint(target, PROMPT, sampler)) > FALSE_ALARM


@pytest.mark.slow
def test_joint_law_test_catches_a_point_mass_bug(joint_setup, monkeypatch):
  """Negative control: a rejected candidate left in the residual must be detected."""
  target, drafter = joint_setup
  monkeypatch.setattr(acceptance, "EXACT_TREE",
                      acceptance.TreeRule(update_point=lambda r, x, last: r))
  fresh = jax.jit(lambda *a, **kw: loop.speculative_loop(*a, **kw),
                  static_argnames=("tree", "cache_len"))
  sampler = sampling.make_sampler(*SAMPLER)
  tokens = _first_three(target, drafter, sampler, run=fresh)
  assert joint_pvalue(tokens, exact_joint(target, PROMPT, sampler)) < FALSE_ALARM


# ----------------------------------------------------------------------------- bad trees


def test_too_deep_too_wide_or_dynamic_trees_are_refused(target, drafter):
  with pytest.raises(ValueError, match="tree depth 4 exceeds the 3 Medusa heads"):
    decoding.speculative_generate(target, drafter, RAGGED[:1], k=4, max_new_tokens=4)
  with pytest.raises(ValueError, match="62 children but a Medusa head ranks only 61"):
    drafter.validate(trees.branching((62,)), 1)
  with pytest.raises(ValueError, match="static trees"):
    decoding.speculative_generate(target, drafter, RAGGED[:1], max_new_tokens=4,
                                  tree=trees.DynamicTree(4, 2, 2))
  with pytest.raises(ValueError, match="w \\[K, 32, 32\\]"):
    MedusaDrafter.of(target, {"w": np.zeros((2, 16, 16)), "b": np.zeros((2, 16))})


# ----------------------------------------------------------------------------- training

KIND = MedusaHeads(heads=3)


@pytest.fixture(scope="module")
def six_steps(data, byte_target):
  return train_head(KIND, TCFG, byte_target[1], TC.replace(steps=6), data, TOK, progress=False)


def _same(a, b) -> bool:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y))
                                    for x, y in zip(la, lb))


def test_training_lowers_the_loss_and_raises_acceptance(data, byte_target):
  trainer = HeadTrainer(KIND, TCFG, byte_target[1], TC, data, TOK, progress=False)
  loss0, acc0 = trainer.validation_loss(), trainer.evaluate()
  result = trainer.run()
  assert result.completed and result.step == TC.steps
  assert trainer.validation_loss() < 0.9 * loss0
  acc = result.acceptance
  assert np.mean(acc.top1) > np.mean(acc0.top1) + 0.02, (acc0, acc)
  assert all(a >= b for a, b in zip(acc.top1, acc0.top1)), (acc0, acc)
  assert len(acc.rank_probs) == 3 and all(sum(r) <= 1.0 + 1e-9 for r in acc.rank_probs)
  assert acc.tree(8).max_depth <= 3


@pytest.mark.slow
def test_save_restore_round_trip(data, byte_target, six_steps, tmp_path):
  result = train_head(KIND, TCFG, byte_target[1], TC.replace(steps=6), data, TOK,
                      out_dir=tmp_path / "h", progress=False)
  assert _same(result.params, six_steps.params)
  head = load_head(tmp_path / "h", target=(TCFG, byte_target[1]))
  assert head.kind == KIND and head.step == 6 and head.tokenizer == TOK
  assert _same(head.params, result.params)
  assert head.acceptance == result.acceptance
  assert head.target == TargetBinding(TCFG, params_fingerprint(byte_target[1]))
  # a Transformer or an LM identifies the same target
  load_head(tmp_path / "h", target=byte_target[0])
  load_head(tmp_path / "h", target=LM.of(byte_target[0]))
  prompts = [[1, 40, 50], [60, 61]]
  a = decoding.speculative_generate(byte_target[0], MedusaDrafter.of(byte_target[0],
                                                                      head.params),
                                    prompts, k=3, max_new_tokens=8)
  assert a.tokens == decoding.generate(byte_target[0], prompts, max_new_tokens=8).tokens


def test_interrupted_then_resumed_matches_uninterrupted(data, byte_target, six_steps, tmp_path):
  out = tmp_path / "run"
  tc = TC.replace(steps=6, ckpt_every=2)
  first = HeadTrainer(KIND, TCFG, byte_target[1], tc, data, TOK, out_dir=out,
                      progress=False).run(stop_after=3)
  assert first.step == 3 and not first.completed
  resumed = HeadTrainer(KIND, TCFG, byte_target[1], tc, data, TOK, out_dir=out,
                        progress=False).run()
  assert resumed.resumed_from == 3 and resumed.step == 6
  assert _same(resumed.params, six_steps.params)
  with pytest.raises(ValueError, match="train_config.lr"):
    HeadTrainer(KIND, TCFG, byte_target[1], tc.replace(lr=1e-3), data, TOK,
                out_dir=out, progress=False).run()


def test_a_head_for_another_target_is_refused_naming_the_fields(data, byte_target, tmp_path):
  train_head(KIND, TCFG, byte_target[1], TC.replace(steps=1), data, TOK,
             out_dir=tmp_path / "h", progress=False, stop_after=1)
  other = TCFG.replace(d_model=48, n_layers=3, n_heads=4, n_kv_heads=2)
  other_params = nnx.state(model(other, seed=3), nnx.Param)
  with pytest.raises(ValueError, match="another target") as e:
    load_head(tmp_path / "h", target=(other, other_params))
  msg = str(e.value)
  assert "d_model: head=32, target=48" in msg and "n_layers: head=2, target=3" in msg
  assert "parameter fingerprint" in msg and "vocab_size" not in msg
  same_shape = nnx.state(model(TCFG, seed=9), nnx.Param)
  with pytest.raises(ValueError, match="parameter fingerprint: head=") as e:
    load_head(tmp_path / "h", target=(TCFG, same_shape))
  assert "d_model" not in str(e.value)
  with pytest.raises(ValueError, match="not a 'eagle' head"):
    load_head(tmp_path / "h", kind="eagle")


# ----------------------------------------------------------------------------- CLI, cache


def test_cli_trains_medusa_heads_and_generates_with_them(byte_target, tmp_path, capsys):
  from specjax.checkpoints import save_model
  save_model(tmp_path / "target", byte_target[0])
  argv = ["train", "medusa", "--target", str(tmp_path / "target"), "--heads", "3",
          "--max-bytes", "60000", "--steps", "3", "--batch-size", "8", "--seq-len", "32",
          "--ckpt-every", "0", "--out", str(tmp_path / "heads"), "--no-progress",
          "--tree-budget", "4"]
  assert cli.main(argv) == 0
  assert "best static tree of <= 4 nodes" in capsys.readouterr().out
  assert cli.main(["generate", "--target", str(tmp_path / "target"), "--draft",
                   f"medusa:{tmp_path / 'heads'}", "--k", "3", "--max-new-tokens", "6",
                   "--repeats", "1", "--json"]) == 0
  report = json.loads(capsys.readouterr().out)
  assert report["identical_to_plain"]
  assert cli.main(argv[:4] + ["--heads", "0"] + argv[6:]) == 2
  assert "heads must be an int >= 1" in capsys.readouterr().err


def test_cli_trains_heads_data_parallel_on_the_mesh_it_names(byte_target, tmp_path,
                                                             monkeypatch):
  """--data-parallel D hands the trainer a (D, 1) mesh (the training over it is checked
  against one device in tests/test_sharding.py)."""
  from specjax.checkpoints import save_model
  from specjax.training import heads
  seen = []
  init = heads.HeadTrainer.__init__

  def spy(self, *args, mesh=None, **kwargs):
    seen.append(mesh)
    init(self, *args, mesh=mesh, **kwargs)

  monkeypatch.setattr(heads.HeadTrainer, "__init__", spy)
  save_model(tmp_path / "target", byte_target[0])
  assert cli.main(["train", "medusa", "--target", str(tmp_path / "target"), "--heads", "2",
                   "--max-bytes", "60000", "--steps", "2", "--batch-size", "8", "--seq-len",
                   "32", "--ckpt-every", "0", "--out", str(tmp_path / "heads"),
                   "--no-progress", "--data-parallel", "1"]) == 0
  assert len(seen) == 1 and dict(seen[0].shape) == {"data": 1, "model": 1}


def test_default_heads_are_built_cached_verified_and_rebuilt(monkeypatch, tmp_path, capfd,
                                                             byte_target, data):
  default = defaults.DefaultTarget(TCFG, byte_target[1], TOK)
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
  monkeypatch.setattr(defaults, "load_default_target", lambda *a, **kw: default)
  monkeypatch.setattr(defaults, "load_corpus",
                      lambda spec: load_corpus(spec, max_bytes=60_000))
  monkeypatch.setitem(defaults.DEFAULT_HEADS, "medusa",
                      (KIND.spec(), TC.replace(steps=2, ckpt_every=1)))
  head = defaults.load_default_heads("medusa", "base", progress=False)
  assert "training the default medusa heads" in capfd.readouterr().err
  entry = next(p for p in (tmp_path / "heads").iterdir() if p.is_dir())
  manifest = json.loads((entry / "manifest.json").read_text())
  assert manifest["fingerprint"] == params_fingerprint(head.params)
  again = defaults.load_default_heads("medusa", "base", progress=False)
  assert "training" not in capfd.readouterr().err and _same(again.params, head.params)
  victim = next(p for p in sorted((entry / "head").rglob("*")) if p.is_file()
                and p.stat().st_size > 0 and "params" in p.parts)
  victim.write_bytes(victim.read_bytes()[:-1] + bytes([victim.read_bytes()[-1] ^ 0xFF]))
  rebuilt = defaults.load_default_heads("medusa", "base", progress=False)
  assert "unusable" in capfd.readouterr().err and _same(rebuilt.params, head.params)
  with pytest.raises(ValueError, match="kind must be one of"):
    defaults.load_default_heads("nope")
