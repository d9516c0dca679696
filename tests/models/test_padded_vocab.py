"""Vocabularies that differ only by padding (issue 31, item 5): a draft with V_d < V_t ids (a
target with extra padded or reserved rows) drafts over the target's vocabulary with q = 0
beyond V_d, never proposes those ids, and the output keeps the target's law (greedy
identity, χ² joint law with a negative control); a larger draft vocabulary and a different
tokenizer are refused in one line."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, struct

from specjax.engine import decoding
from specjax import resolve
from specjax.verify import sampling, trees
from specjax.data.tokenizer import ByteTokenizer, vocab_mismatch
from specjax.drafters.base import Context
from specjax.drafters.model import ModelDrafter
from specjax.models.transformer import Transformer
from specjax_testing import (FALSE_ALARM, PROMPT, RAGGED, TINY, VOCAB, assert_greedy_identity,
                             exact_joint, first_three, joint_pvalue, joint_target, model,
                             perturbed)

V_T, V_D = 300, 264


def truncated(m: Transformer, vocab_size: int) -> Transformer:
  """`m` with only its first `vocab_size` embedding / LM-head rows: the same model on a
  vocabulary without the padded rows."""
  small = Transformer(m.config.replace(vocab_size=vocab_size), rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(small)
  leaves, treedef = jax.tree.flatten(state)
  big = jax.tree.leaves(nnx.split(m)[1])
  cut = [b[tuple(slice(0, n) for n in s.shape)] for b, s in zip(big, leaves)]
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, cut))


@pytest.fixture(scope="module")
def padded_pair():
  target = model(TINY["llama"].replace(vocab_size=V_T), seed=3, logit_scale=2.0)
  draft = truncated(perturbed(target, seed=5, noise=0.3), V_D)
  return target, draft


@pytest.mark.parametrize("tree", [trees.chain(3), trees.branching((2, 2))],
                         ids=["chain", "tree"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled", "top-k"])
def test_greedy_identity_with_a_padded_draft_vocabulary(padded_pair, tree, deterministic):
  """At T = 0 the padded draft's speculative output is plain greedy decoding's, also where
  the target emits ids the draft lacks (fed to the draft as V_d - 1)."""
  target, draft = padded_pair
  drafter = ModelDrafter.of(draft, deterministic=deterministic)
  _, full = assert_greedy_identity(target, drafter, tree, 24)
  assert max(max(row) for row in full.tokens) >= V_D  # the target does emit padded ids


def _propose(drafter, tree, temperature, rows=64, seed=0):
  prompts = [[int(i) for i in np.random.default_rng(seed + r).integers(0, V_T, 5)]
             for r in range(rows)]
  batch = decoding.prepare_batch(prompts, vocab_size=V_T, max_len=128, max_new_tokens=8,
                                 slots=drafter.slots_needed(tree) + 1)
  drafter = decoding.fit_vocab(drafter, V_T)
  state = drafter.init(batch.prompt_BP, batch.prompt_len_B, batch.cache_len, tree)
  ctx = Context(tokens=jnp.pad(batch.prompt_BP, ((0, 0), (0, 16))),
                length=batch.prompt_len_B - 1)
  return jax.jit(lambda d, s: d.propose(s, ctx, tree, sampling.make_sampler(temperature),
                                        jax.random.key(seed))[0])(drafter, state)


@pytest.mark.parametrize("kind", ["sampled", "top-k", "dynamic", "stopping"])
def test_the_draft_never_proposes_an_id_beyond_its_vocabulary(padded_pair, kind):
  """Proposals (sampled at T = 2, top-k, a dynamic tree, a stopped chain's fillers) stay
  below V_d, and the reported law q has no mass beyond it; prompts hold ids >= V_d."""
  _, draft = padded_pair
  drafter = ModelDrafter.of(draft, deterministic=kind in ("top-k", "dynamic"))
  tree = {"dynamic": trees.DynamicTree(budget=6, depth=3, width=3),
          "stopping": trees.chain(4)}.get(kind, trees.branching((3, 2)))
  if kind == "stopping":
    drafter = drafter.with_stopping(1.0)  # every level after the first is a filler
  proposal = _propose(drafter, tree, 2.0)
  tokens = np.asarray(proposal.tokens)
  assert tokens.min() >= 0 and tokens.max() < V_D
  if proposal.q is not None:
    q = np.asarray(proposal.q)
    assert q.shape[-1] == V_T and np.all(q[..., V_D:] == 0)
    np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-5)


# ----------------------------------------------------------------------------- joint law (χ²)

DRAFT_VOCAB = 5  # of the joint test's VOCAB = 8: ids 5..7 exist for the target only


@pytest.fixture(scope="module")
def joint_padded():
  target = joint_target()
  draft = truncated(perturbed(target, seed=4, noise=0.7), DRAFT_VOCAB)
  return target, draft


@struct.dataclass
class ResidualOverDraftVocab(ModelDrafter):
  """Planted bug: the reported law q is 1 on every id the draft lacks, so the residual
  max(p - q, 0) has no mass there: the rule is computed over the draft's V_d ids only, and
  the target's own mass beyond V_d is lost (proposals and acceptance are unchanged)."""

  planted: bool = struct.field(pytree_node=False, default=True)

  def propose(self, state, ctx, tree, sampler, key):
    proposal, state = super().propose(state, ctx, tree, sampler, key)
    v = self.lm.config.vocab_size
    return proposal.replace(q=proposal.q.at[..., v:].set(1.0)), state


@pytest.mark.slow
@pytest.mark.parametrize("tree", [trees.chain(2), trees.branching((2, 1))],
                         ids=["chain", "tree"])
def test_joint_law_of_a_padded_draft_is_the_targets(joint_padded, tree):
  """χ² goodness of fit of the first three tokens of 40,000 rows (T = 1) against the
  enumerated target joint (false-alarm rate 1e-3), with a draft lacking 3 of the 8 ids
  (the target puts real mass on them: they are emitted through the residual)."""
  target, draft = joint_padded
  sampler = sampling.make_sampler(1.0)
  exact = exact_joint(target, PROMPT, sampler)
  assert exact.reshape(VOCAB, -1).sum(1)[DRAFT_VOCAB:].sum() > 0.05
  drafter = decoding.fit_vocab(ModelDrafter.of(draft), VOCAB)
  tokens = first_three(target, drafter, tree, sampler, seed=13)
  assert (tokens >= DRAFT_VOCAB).any()
  assert joint_pvalue(tokens, exact) > FALSE_ALARM


@pytest.mark.slow
def test_joint_law_test_catches_a_residual_over_the_draft_vocabulary(joint_padded):
  """Negative control: the same χ² test rejects the planted residual-over-V_d bug."""
  target, draft = joint_padded
  sampler = sampling.make_sampler(1.0)
  drafter = ResidualOverDraftVocab.of(draft).padded_to(VOCAB)
  tokens = first_three(target, drafter, trees.chain(2), sampler, seed=13)
  assert joint_pvalue(tokens, exact_joint(target, PROMPT, sampler)) < FALSE_ALARM


# ----------------------------------------------------------------------------- refusals


def test_a_draft_vocabulary_larger_than_the_targets_is_refused_in_one_line(padded_pair):
  target, _ = padded_pair
  big = model(TINY["llama"].replace(vocab_size=V_T + 8))
  for call in (lambda: decoding.speculative_generate(target, big, [[1]], k=2,
                                                     max_new_tokens=3),
               lambda: decoding.speculative_generate(target, big, [[1]], k="auto",
                                                     max_new_tokens=3)):
    with pytest.raises(ValueError) as e:
      call()
    msg = str(e.value)
    assert f"({V_T + 8})" in msg and f"({V_T})" in msg and "\n" not in msg


def test_top_k_candidates_must_fit_the_draft_vocabulary():
  target = model(TINY["llama"].replace(vocab_size=12))
  draft = truncated(target, 3)
  with pytest.raises(ValueError, match="only 3 tokens"):
    decoding.speculative_generate(target, ModelDrafter.of(draft, deterministic=True), [[1]],
                                  tree=trees.branching((4,)), max_new_tokens=3)


class ShiftedBytes:
  """A tokenizer that spells id i as byte i + 1: the byte tokenizer's size, other tokens."""

  vocab_size = ByteTokenizer.vocab_size

  def decode(self, ids):
    return bytes((int(i) + 1) % 256 for i in ids if 0 <= int(i) < 256).decode("latin-1")


def test_vocab_mismatch_names_the_first_differing_id():
  assert vocab_mismatch(ByteTokenizer(), ByteTokenizer()) is None
  assert vocab_mismatch(None, ShiftedBytes()) is None  # unknown: judged on sizes only
  why = vocab_mismatch(ByteTokenizer(), ShiftedBytes())
  assert why.startswith("id 0 is '\\x00' in the target's tokenizer but '\\x01'")


def test_bpe_tokenizers_that_differ_are_told_apart_and_a_padded_one_is_not():
  pytest.importorskip("tokenizers")
  from specjax.data.tokenizer import BPETokenizer
  a = BPETokenizer.train(["the cat sat on the mat " * 50], 300)
  b = BPETokenizer.train(["lorem ipsum dolor sit amet " * 50], 300)
  shorter = BPETokenizer.train(["the cat sat on the mat " * 50], 280)
  assert vocab_mismatch(a, b) is not None
  assert vocab_mismatch(a, shorter) is None


def test_a_draft_directory_with_another_tokenizer_is_refused_in_one_line(tmp_path):
  from specjax.checkpoints import save_model
  target = model(TINY["llama"].replace(vocab_size=259))
  path = save_model(tmp_path / "draft", truncated(target, 256))  # no tokenizer.json: bytes
  assert resolve.draft_model(str(path), target, tokenizer=ByteTokenizer()).config.vocab_size \
      == 256
  with pytest.raises(ValueError) as e:
    resolve.draft_model(str(path), target, tokenizer=ShiftedBytes())
  msg = str(e.value)
  assert "tokenizer is not the target's" in msg and "id 0" in msg and "\n" not in msg
