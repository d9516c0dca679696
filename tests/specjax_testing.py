"""What several test files share (imported by test modules; pytest puts tests/ on sys.path):
tiny models; the joint-law (χ²) exactness helpers; a drafter that reads the target's
features; the byte-vocabulary target and data of the head-training tests (Medusa, EAGLE).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, struct
from scipy import stats

from specjax.engine import decoding, loop
from specjax.verify import sampling
from specjax.data.batches import TokenData
from specjax.data.corpus import load_corpus
from specjax.data.tokenizer import ByteTokenizer
from specjax.models.lm import LM
from specjax.drafters.model import ModelDrafter
from specjax.models.transformer import ModelConfig, Transformer
from specjax.training.config import TrainConfig

TINY = {
    "gpt2": ModelConfig.gpt2(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4,
                             d_ff=64, max_len=128),
    "llama": ModelConfig.llama(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                               d_ff=64, max_len=128, rope_theta=500.0),
}


def model(config: ModelConfig, seed: int = 0, logit_scale: float = 1.0,
          mix: float = 20.0) -> Transformer:
  """A random model with non-trivial behaviour.

  At the usual init the blocks barely touch the residual stream, so a tied-embedding model
  just repeats its last token; `mix` scales the blocks' output projections so that the
  context matters. logit_scale > 1 sharpens next-token distributions (near-uniform p and q
  would make speculative acceptance trivially high).
  """
  m = Transformer(config, rngs=nnx.Rngs(seed))
  for block in m.blocks:
    block.attn.o.kernel[...] = block.attn.o.kernel[...] * mix
    block.mlp.down.kernel[...] = block.mlp.down.kernel[...] * mix
  if logit_scale != 1.0:
    if m.lm_head is not None:
      m.lm_head.kernel[...] = m.lm_head.kernel[...] * logit_scale
    else:
      m.final_norm.scale[...] = m.final_norm.scale[...] * logit_scale
  return m


def perturbed(m: Transformer, seed: int, noise: float) -> Transformer:
  """A copy of `m` with Gaussian noise (relative scale `noise`) on every weight: a draft of
  tunable quality, from α ≈ 1 (noise 0) down towards α ≈ 0."""
  graphdef, state = nnx.split(m)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  noisy = [x + noise * jnp.std(x) * jax.random.normal(kk, x.shape, x.dtype)
           for x, kk in zip(leaves, keys)]
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, noisy))


RAGGED = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12], [7], [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3], [9, 8],
          [11, 13, 17, 19]]  # a ragged batch of prompts


def assert_greedy_identity(target, drafter, tree, new_tokens: int, *, policy=None,
                           mixed_alpha: bool = True):
  """Speculative decoding of RAGGED with `drafter` and `tree` (or an adaptive `policy`, tree
  None) at T = 0 emits plain greedy decoding's tokens: with per-row budgets and an EOS (a
  token row 0 emits) cutting cycles short, and uncut over `new_tokens`; with `mixed_alpha`
  the drafter is neither always right nor always wrong (0 < α < 1). Returns the (cut, uncut)
  Generations."""
  plan = {"policy": policy} if policy is not None else {"tree": tree}
  plain = decoding.generate(target, RAGGED, max_new_tokens=new_tokens)
  eos = plain.tokens[0][5]
  budgets = [new_tokens, 2, 7, new_tokens, 1, 13]
  ref = decoding.generate(target, RAGGED, max_new_tokens=budgets, eos_id=eos)
  run = decoding.speculative_generate(target, drafter, RAGGED, max_new_tokens=budgets,
                                      eos_id=eos, **plan)
  assert run.tokens == ref.tokens
  full = decoding.speculative_generate(target, drafter, RAGGED, max_new_tokens=new_tokens,
                                       **plan)
  assert full.tokens == plain.tokens
  if mixed_alpha:
    assert 0.0 < full.summary().alpha < 1.0
  return run, full


# ----------------------------------------------------------------------------- joint law (χ²)
#
# The law of the first three emitted tokens of JOINT_ROWS independent rows against the
# target's own, enumerated exactly over VOCAB³ outcomes; every statistical test rejects at
# p < FALSE_ALARM (its false-alarm rate) and has a planted-bug negative control.

FALSE_ALARM = 1e-3
VOCAB = 8
JOINT_ROWS = 40_000
PROMPT = [1, 5, 2]


def joint_target() -> Transformer:
  """The target of the joint-law tests: VOCAB ids, sharpened logits."""
  cfg = ModelConfig.llama(vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1,
                          d_ff=32, max_len=32)
  return model(cfg, seed=2, logit_scale=6.0)


def exact_joint(target, prompt, sampler):
  """P(t1, t2, t3 | prompt) of the warped target, by enumerating all VOCAB² prefixes."""
  lm = LM.of(target)
  p = np.asarray(prompt)
  seqs = np.array([np.concatenate([p, [a, b]]) for a in range(VOCAB) for b in range(VOCAB)])
  pos = np.broadcast_to(np.arange(seqs.shape[1]), seqs.shape)
  logits, _, _ = jax.jit(lambda lm, t, q: lm(t, q))(lm, jnp.asarray(seqs), jnp.asarray(pos))
  probs = np.asarray(sampling.warp(logits, sampler), np.float64)  # [V², T, V]
  n = len(p)
  p1 = probs[0, n - 1]  # [V]
  p2 = probs[::VOCAB, n].reshape(VOCAB, VOCAB)  # [t1, t2]
  p3 = probs[:, n + 1].reshape(VOCAB, VOCAB, VOCAB)  # [t1, t2, t3]
  return p1[:, None, None] * p2[:, :, None] * p3


def joint_pvalue(tokens, exact):
  """χ² goodness-of-fit p-value of the rows' first three tokens [N, 3] against `exact`
  (sparse cells, expected < 5, pooled); 0 when an impossible outcome was emitted."""
  counts = np.zeros(exact.size)
  idx = (tokens[:, 0] * VOCAB + tokens[:, 1]) * VOCAB + tokens[:, 2]
  np.add.at(counts, idx, 1)
  expected = exact.ravel() * len(tokens)
  impossible = exact.ravel() == 0  # cut by top-k / top-p: must never be emitted
  if counts[impossible].sum() > 0:
    return 0.0
  counts, expected = counts[~impossible], expected[~impossible]
  small = expected < 5  # pool sparse cells so the χ² approximation holds
  obs, exp = counts[~small], expected[~small]
  if small.any():
    obs, exp = np.append(obs, counts[small].sum()), np.append(exp, expected[small].sum())
  return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def first_three(target, drafter, tree, sampler, seed: int, *, prompt=PROMPT,
                slots: int | None = None, run=None) -> np.ndarray:
  """The first three tokens after `prompt` of JOINT_ROWS independent rows of the speculative
  loop `run` (default loop.speculative_jit): int [JOINT_ROWS, 3]. slots: cache slots a cycle
  needs (default drafter.slots_needed(tree))."""
  batch = decoding.prepare_batch([prompt] * JOINT_ROWS, vocab_size=VOCAB, max_len=32,
                                 max_new_tokens=3,
                                 slots=drafter.slots_needed(tree) if slots is None else slots)
  run = run or loop.speculative_jit
  state = run(LM.of(target), drafter, batch.prompt_BP, batch.prompt_len_B, batch.budget_B,
              jnp.asarray(-1), sampler, jax.random.key(seed), tree=tree,
              cache_len=batch.cache_len)
  n = len(prompt)
  return np.asarray(state.tokens)[:, n:n + 3]


# ----------------------------------------------------------------------------- features


@struct.dataclass
class FeatureProbe(ModelDrafter):
  """A model drafter that also keeps, per row, the target's final hidden state at position
  L - 1 (what Medusa-style heads read), to test the loop's features path. A cycle emits
  m = L' - L tokens (m < n + 1 when EOS or the budget cut in, 0 for a finished row); the
  hidden state at L' - 1 is that of path node m - 1. The extra static field keeps its
  compiled program (another state structure) apart from ModelDrafter's (docs/xla_notes.md,
  trap 9)."""

  probe: bool = struct.field(pytree_node=False, default=True)

  feature_layers = property(lambda self: (self.lm.config.n_layers,))

  def init(self, prompt_BP, prompt_len_B, cache_len, tree=None, features=None):
    inner = super().init(prompt_BP, prompt_len_B, cache_len, tree)
    last = jnp.take_along_axis(features[:, :, 0], (prompt_len_B - 1)[:, None, None], axis=1)
    return (inner, last[:, 0], prompt_len_B)

  def propose(self, state, ctx, tree, sampler, key):
    proposal, inner = super().propose(state[0], ctx, tree, sampler, key)
    return proposal, (inner,) + tuple(state[1:])

  def commit(self, state, ctx, tree, path_BP, n_accepted_B, features=None):
    inner = super().commit(state[0], ctx, tree, path_BP, n_accepted_B)
    m = ctx.length - state[2]
    node = jnp.take_along_axis(path_BP, jnp.maximum(m - 1, 0)[:, None], axis=1)
    last = jnp.take_along_axis(features[:, :, 0], node[:, :, None], axis=1)[:, 0]
    return (inner, jnp.where((m > 0)[:, None], last, state[1]), ctx.length)


# ----------------------------------------------------------------------------- head training
#
# The Medusa and EAGLE training tests: a tiny Llama target on the byte vocabulary, the code
# corpus, one schedule. Test modules import the fixtures (`from specjax_testing import data,
# byte_target`); module scope, so each module builds its own.

TOK = ByteTokenizer()
TCFG = TINY["llama"].replace(vocab_size=TOK.vocab_size)
TC = TrainConfig(steps=40, batch_size=8, seq_len=32, lr=1e-2, warmup_steps=2, eval_every=0,
                 ckpt_every=0, eval_windows=16)


@pytest.fixture(scope="module")
def data():
  return TokenData.from_corpus(load_corpus("code", max_bytes=60_000), TOK)


@pytest.fixture(scope="module")
def byte_target():
  """(the target Transformer, its nnx.Param state)."""
  m = model(TCFG, seed=0, logit_scale=4.0)
  return m, nnx.state(m, nnx.Param)
