"""Generation loops: greedy identity, end-to-end exactness, composition, compile counts, input
validation.

Statistical tests here use a per-test false-alarm rate of 1e-3 (p-value threshold), fixed seeds
(so the suite is deterministic), and each has a negative control showing it can fail.
"""

import dataclasses
import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax.verify import acceptance, sampling, trees
from specjax.engine import decoding, loop
from specjax.analysis import metrics
from specjax.exactness import planted_bugs
from specjax.models.lm import LM
from specjax.drafters.model import ModelDrafter
from specjax_testing import (FALSE_ALARM, PROMPT, RAGGED, TINY, VOCAB, FeatureProbe,
                             exact_joint, first_three, joint_pvalue, joint_target, model,
                             perturbed)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def family_models(request):
  cfg = TINY[request.param]
  target = model(cfg, seed=0, logit_scale=4.0)
  return target, perturbed(target, seed=1, noise=0.25)


@pytest.mark.slow
@pytest.mark.parametrize("k, prompts", [(1, RAGGED), (3, RAGGED), (6, RAGGED), (3, RAGGED[1:2])],
                         ids=["k1-ragged6", "k3-ragged6", "k6-ragged6", "k3-batch1"])
def test_greedy_speculative_equals_plain_greedy(family_models, k, prompts):
  target, weak = family_models
  plain = decoding.generate(target, prompts, max_new_tokens=24)
  weak_run = decoding.speculative_generate(target, weak, prompts, k=k, max_new_tokens=24)
  self_run = decoding.speculative_generate(target, target, prompts, k=k, max_new_tokens=24)
  assert weak_run.tokens == plain.tokens
  assert self_run.tokens == plain.tokens
  assert all(len(t) == 24 for t in plain.tokens)
  weak_alpha = weak_run.summary().alpha
  assert 0.0 < weak_alpha < 1.0, "the weak draft should be neither useless nor perfect"
  assert self_run.summary().alpha == 1.0  # self-speculation at T=0 accepts every draft


@pytest.mark.slow
def test_greedy_identity_with_random_separate_draft_and_deterministic_drafter():
  cfg = TINY["llama"]
  target = model(cfg, logit_scale=4.0)
  draft = model(cfg.replace(n_layers=1, d_model=16, d_ff=32, n_heads=2, n_kv_heads=1), seed=7)
  plain = decoding.generate(target, RAGGED, max_new_tokens=20)
  for drafter in (ModelDrafter.of(draft), ModelDrafter.of(draft, deterministic=True)):
    run = decoding.speculative_generate(target, drafter, RAGGED, k=3, max_new_tokens=20)
    assert run.tokens == plain.tokens


@pytest.mark.slow
def test_self_speculation_at_temperature_one_accepts_nearly_everything():
  target = model(TINY["gpt2"], logit_scale=4.0)
  run = decoding.speculative_generate(target, target, RAGGED, k=4, max_new_tokens=40,
                                      sampler=sampling.make_sampler(1.0), seed=3)
  s = run.summary()
  assert s.alpha >= 0.99, s.alpha
  assert s.tau > 4.0


@pytest.mark.slow  # compile-bound (5-18 s): the fast tier's 3 minutes
def test_eos_and_per_row_budgets(family_models):
  target, weak = family_models
  plain = decoding.generate(target, RAGGED, max_new_tokens=30)
  eos = plain.tokens[0][5]  # a token that row 0 emits
  budgets = [30, 2, 7, 30, 1, 13]
  g = decoding.generate(target, RAGGED, max_new_tokens=budgets, eos_id=eos)
  s = decoding.speculative_generate(target, weak, RAGGED, k=3, max_new_tokens=budgets, eos_id=eos)
  for row, (full, budget) in enumerate(zip(plain.tokens, budgets)):
    cut = full[:budget]
    if eos in cut:
      cut = cut[:cut.index(eos) + 1]
    assert g.tokens[row] == cut, row
    assert s.tokens[row] == cut, row
  assert s.tokens[0][-1] == eos


# ----------------------------------------------------------------------------- exactness


@pytest.fixture(scope="module")
def joint_setup():
  target = joint_target()
  draft = perturbed(target, seed=4, noise=0.7)
  return target, draft


def _speculative_first_three(target, draft, sampler, seed, run=None):
  return first_three(target, ModelDrafter.of(draft), trees.chain(2), sampler, seed, slots=3,
                     run=run)


@pytest.mark.slow
@pytest.mark.parametrize("sampler_args", [(1.0, 0, 1.0), (0.8, 5, 0.9)],
                         ids=["T1", "T0.8-topk5-topp0.9"])
def test_joint_distribution_of_first_three_tokens_matches_target(joint_setup, sampler_args):
  """χ² goodness of fit of 40,000 independent rows against the enumerated target joint over
  8³ outcomes (sparse cells pooled); false-alarm rate 1e-3. Rows are independent: the first
  tokens of paired rows pass a χ² independence test at the same rate."""
  target, draft = joint_setup
  sampler = sampling.make_sampler(*sampler_args)
  tokens = _speculative_first_three(target, draft, sampler, seed=11)
  exact = exact_joint(target, PROMPT, sampler)
  assert joint_pvalue(tokens, exact) > FALSE_ALARM
  table = np.zeros((VOCAB, VOCAB))
  np.add.at(table, (tokens[0::2, 1], tokens[1::2, 1]), 1)
  table = table[table.sum(1) > 0][:, table.sum(0) > 0]
  assert stats.chi2_contingency(table).pvalue > FALSE_ALARM


@pytest.mark.slow
def test_joint_distribution_test_catches_an_always_accept_sampler(joint_setup):
  """Negative control: the same χ² test must reject a planted 'always accept' bug
  (`planted_bugs.planted`, traced in a jitted loop of its own)."""
  target, draft = joint_setup

  @functools.partial(jax.jit, static_argnames=("tree", "cache_len"))
  def planted_loop(*args, **kwargs):
    with planted_bugs.planted("always_accept"):
      return loop.speculative_loop(*args, **kwargs)

  sampler = sampling.make_sampler(1.0)
  tokens = _speculative_first_three(target, draft, sampler, seed=11, run=planted_loop)
  assert joint_pvalue(tokens, exact_joint(target, PROMPT, sampler)) < FALSE_ALARM


# ----------------------------------------------------------------------------- composition


def _loop_inputs(target, prompts, budget):
  batch = decoding.prepare_batch(prompts, vocab_size=target.config.vocab_size,
                                 max_len=target.config.max_len, max_new_tokens=budget, slots=4)
  return batch


@pytest.mark.slow
def test_speculative_loop_composes_with_vmap():
  target = model(TINY["llama"], logit_scale=4.0)
  draft = perturbed(target, seed=1, noise=0.25)
  batch = _loop_inputs(target, RAGGED[:3], 12)
  sampler = sampling.make_sampler(1.0)
  lm, drafter = LM.of(target), ModelDrafter.of(draft)

  def run(key):
    return loop.speculative_loop(lm, drafter, batch.prompt_BP, batch.prompt_len_B,
                                 batch.budget_B, jnp.asarray(-1), sampler, key,
                                 tree=trees.chain(3), cache_len=batch.cache_len).tokens

  keys = jax.random.split(jax.random.key(0), 3)
  mapped = jax.jit(jax.vmap(run))(keys)
  for i in range(3):
    np.testing.assert_array_equal(mapped[i], jax.jit(run)(keys[i]))


@pytest.mark.parametrize("tree", [trees.chain(3), pytest.param(trees.branching((2, 2)),
                                                                 marks=pytest.mark.slow)],
                         ids=["chain", "tree"])
def test_appended_rows_leave_the_kept_rows_unchanged(tree):
  """What a mesh's padding (`batching.pad_rows`) relies on: rows appended to a batch do not
  change the other rows' tokens or statistics at T = 1 (a draw of shape [B', ...] begins
  with the draw of shape [B, ...]). Negative control: rows put in front do change them."""
  target = model(TINY["llama"], logit_scale=4.0)
  lm, drafter = LM.of(target), ModelDrafter.of(perturbed(target, seed=1, noise=0.25))
  sampler = sampling.make_sampler(1.0)

  def run(batch):
    state = loop.speculative_jit(lm, drafter, batch.prompt_BP, batch.prompt_len_B,
                                 batch.budget_B, decoding.eos_ids(None, VOCAB), sampler,
                                 jax.random.key(5), tree=tree, cache_len=batch.cache_len)
    return np.asarray(state.tokens), np.asarray(state.stats.cycle_log)

  batch = _loop_inputs(target, RAGGED[:3], 16)
  padded = decoding.pad_rows(batch, 4)
  assert padded.prompt_BP.shape[0] == 4 and padded.budget_B.tolist()[3] == 1 and padded.padded == 1
  assert np.array_equal(padded.prompt_BP[3], batch.prompt_BP[2])
  assert decoding.pad_rows(batch, 3) is batch
  (tokens, log), (tokens_p, log_p) = run(batch), run(padded)
  assert np.array_equal(tokens_p[:3], tokens) and np.array_equal(log_p[:3], log)
  front = dataclasses.replace(padded, **{f: np.roll(getattr(padded, f), 1, axis=0) for f in
                                         ("prompt_BP", "prompt_len_B", "budget_B")})
  assert not np.array_equal(run(front)[0][1:], tokens)


MULTI_DEVICE_SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=4 "
                               "--xla_backend_optimization_level=0")
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from specjax import decoding, loop, sampling, trees
    from specjax.models.lm import LM
    from specjax.drafters.model import ModelDrafter
    sys_path_tests = os.environ["SPECJAX_TESTS_DIR"]
    import sys; sys.path.insert(0, sys_path_tests)
    from specjax_testing import TINY, model, perturbed
    assert jax.device_count() == 4, jax.devices()
    target = model(TINY["gpt2"], logit_scale=4.0)
    lm, drafter = LM.of(target), ModelDrafter.of(perturbed(target, seed=1, noise=0.25))
    batch = decoding.prepare_batch([[1, 2, 3], [4, 5]], vocab_size=61, max_len=128,
                                   max_new_tokens=10, slots=3)
    sampler = sampling.make_sampler(1.0)
    def run(key):
      return loop.speculative_loop(lm, drafter, batch.prompt_BP, batch.prompt_len_B,
                                   batch.budget_B, jnp.asarray(-1), sampler, key,
                                   tree=trees.chain(2), cache_len=batch.cache_len).tokens
    keys = jax.random.split(jax.random.key(0), 4)
    serial = np.stack([np.asarray(jax.jit(run)(k)) for k in keys])
    mesh = Mesh(np.array(jax.devices()), ("d",))
    # check_vma=False: the loop carries (caches, buffers) start as device-invariant zeros
    # and become per-device values; the loop is plain data parallelism, no collectives.
    sharded = jax.jit(jax.shard_map(jax.vmap(run), mesh=mesh, in_specs=P("d"),
                                    out_specs=P("d"), check_vma=False))(keys)
    np.testing.assert_array_equal(np.asarray(sharded), serial)
    pmapped = jax.pmap(run)(keys)
    np.testing.assert_array_equal(np.asarray(pmapped), serial)
    print("MULTI_DEVICE_OK")
""")


@pytest.mark.slow
def test_speculative_loop_over_four_fake_devices_matches_serial():
  env = dict(os.environ, SPECJAX_TESTS_DIR=os.path.dirname(os.path.dirname(__file__)))
  out = subprocess.run([sys.executable, "-c", MULTI_DEVICE_SCRIPT], env=env,
                       capture_output=True, text=True, timeout=600)
  assert "MULTI_DEVICE_OK" in out.stdout, out.stderr[-3000:]


def test_no_recompilation_when_runtime_values_change():
  target = model(TINY["gpt2"], logit_scale=4.0)
  draft = perturbed(target, seed=1, noise=0.25)
  before = loop.TRACE_COUNTS.copy()
  settings = [(0.0, 0, 1.0, 10, None, 0), (1.0, 5, 0.9, 17, 3, 1), (0.5, 0, 0.5, 3, 7, 2)]
  for t, top_k, top_p, budget, eos, seed in settings:
    sampler = sampling.make_sampler(t, top_k, top_p)
    decoding.speculative_generate(target, draft, RAGGED[:2], k=2, max_new_tokens=budget,
                                  sampler=sampler, eos_id=eos, seed=seed, cache_len=64)
    decoding.generate(target, RAGGED[:2], max_new_tokens=budget, sampler=sampler, eos_id=eos,
                      seed=seed, cache_len=64)
  assert loop.TRACE_COUNTS["speculative"] - before["speculative"] == 1
  assert loop.TRACE_COUNTS["generate"] - before["generate"] == 1


# ----------------------------------------------------------------------------- statistics


def test_stats_record_logs_cycles_that_accept_128_or_more_nodes():
  """cycle_log keeps accepted path lengths beyond int8 (a chain or tree deeper than 127)."""
  b, depth = 2, 300
  result = acceptance.TreeResult(
      n_accepted=jnp.asarray([130, 300], jnp.int32), next_token=jnp.zeros((b,), jnp.int32),
      path=jnp.zeros((b, depth + 1), jnp.int32), depth_tried=jnp.ones((b, depth), bool),
      rank_tried=jnp.ones((b, 1), jnp.int32), rank_accepted=jnp.ones((b, 1), jnp.int32))
  stats = loop.Stats.zeros(b, depth, max_cycles=4)
  stats = jax.jit(lambda s, r: s.record(jnp.asarray([True, True]), r, depth))(stats, result)
  np.testing.assert_array_equal(stats.cycle_log, [[130, -1, -1, -1], [300, -1, -1, -1]])
  np.testing.assert_array_equal(stats.hist[:, 130], [1, 0])
  s = metrics.summarize(cycles=stats.cycles, drafted=stats.drafted, accepted=stats.accepted,
                        emitted=stats.accepted + 1, cycle_log=stats.cycle_log, k=depth)
  assert s.log_complete and s.histogram[130] == 1 and s.histogram[300] == 1


@pytest.mark.slow
def test_self_speculation_logs_a_cycle_of_130_accepted_drafts():
  """End to end: the target drafting for itself at T = 0 with k = 130 accepts whole chains;
  the log and the summary see 130, not an int8 wrap-around."""
  target = model(TINY["llama"], logit_scale=4.0)  # RoPE: may run past max_len on opt-in
  plain = decoding.generate(target, [[1, 2, 3]], max_new_tokens=140, allow_beyond_max_len=True)
  run = decoding.speculative_generate(target, target, [[1, 2, 3]], k=130, max_new_tokens=140,
                                      allow_beyond_max_len=True)
  assert run.tokens == plain.tokens
  log = run.stats["cycle_log"][0]
  assert log[0] == 130, log[:4]
  summary = run.summary()
  assert summary.log_complete and summary.histogram[130] >= 1 and summary.alpha == 1.0


# ----------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def tiny_pair():
  target = model(TINY["gpt2"])
  return target, perturbed(target, seed=1, noise=0.25)


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts=[[1, 2]], max_new_tokens=500), "exceeds the cache/context length 128"),
    (dict(prompts=[[1, 2]], max_new_tokens=14, cache_len=16), "exceeds .* cache_len 16"),
    (dict(prompts=[[1, 2]], max_new_tokens=5, k=10_000), "exceeds .* max_len 128"),
    (dict(prompts=[[1, 2]], max_new_tokens=5, allow_beyond_max_len=1), "allow_beyond_max_len"),
    (dict(prompts=[[1, 2]], max_new_tokens=5, k=0), "k must be an int >= 1"),
    (dict(prompts=[[]], max_new_tokens=5), r"prompts\[0\] must be a non-empty"),
    (dict(prompts=[[1, 61]], max_new_tokens=5), "token id 61 out of range"),
    (dict(prompts=[[1, -1]], max_new_tokens=5), "token id -1 out of range"),
    (dict(prompts=[], max_new_tokens=5), "batch must be >= 1"),
    (dict(prompts=[[1]], max_new_tokens=0), "max_new_tokens must be an int >= 1"),
    (dict(prompts=[[1]], max_new_tokens=[3, 4]), "2 entries for 1 prompts"),
    (dict(prompts=[[1]], max_new_tokens=3, eos_id=99), "eos_id must be in"),
])
def test_bad_input_raises_value_error_naming_the_argument(tiny_pair, kwargs, match):
  target, draft = tiny_pair
  kwargs.setdefault("k", 2)
  with pytest.raises(ValueError, match=match):
    decoding.speculative_generate(target, draft, **kwargs)


def test_bad_sampler_settings_and_vocab_mismatch(tiny_pair):
  target, _ = tiny_pair
  for kwargs, match in [(dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"),
                        (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k")]:
    with pytest.raises(ValueError, match=match):
      sampling.make_sampler(**kwargs)
  other = model(TINY["gpt2"].replace(vocab_size=62))  # smaller is padding (test_padded_vocab)
  with pytest.raises(ValueError, match=r"draft vocabulary \(62\) must match the target's \(61\)"):
    decoding.speculative_generate(target, other, [[1]], k=2, max_new_tokens=3)


@pytest.mark.slow
def test_generation_concat_is_the_rows_of_its_parts_in_order(tiny_pair):
  """Two one-prompt calls concatenated read like one call over both prompts: tokens,
  prompt lengths and per-row counters in order (greedy, so equal to the batched call's),
  per-cycle logs padded with -1, seconds summed; mixed kinds and adaptive runs refused."""
  target, draft = tiny_pair
  prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
  kw = dict(k=3, max_new_tokens=12, cache_len=64)
  parts = [decoding.speculative_generate(target, draft, [p], **kw) for p in prompts]
  both = decoding.Generation.concat(parts)
  batched = decoding.speculative_generate(target, draft, prompts, **kw)
  assert both.tokens == batched.tokens and both.prompt_lengths == [3, 5]
  assert both.seconds == pytest.approx(parts[0].seconds + parts[1].seconds)
  for name in ("cycles", "drafted", "accepted", "hist", "depth_tried", "depth_accepted"):
    assert np.array_equal(both.stats[name], batched.stats[name]), name
  assert both.summary().tau == pytest.approx(batched.summary().tau)
  short = dataclasses.replace(parts[1], stats={**parts[1].stats, "cycle_log":
                                               parts[1].stats["cycle_log"][:, :2]})
  padded = decoding.Generation.concat([parts[0], short]).stats["cycle_log"]
  assert padded.shape[1] == parts[0].stats["cycle_log"].shape[1] and (padded[1, 2:] == -1).all()
  plain = decoding.generate(target, [prompts[0]], max_new_tokens=12, cache_len=64)
  assert decoding.Generation.concat([plain, plain]).stats is None
  with pytest.raises(ValueError, match="all be plain, all speculative with one shape"):
    decoding.Generation.concat([plain, parts[0]])
  with pytest.raises(ValueError, match="non-empty list of Generations"):
    decoding.Generation.concat([])
  adaptive_run = dataclasses.replace(parts[0], choices=np.zeros(2, int), menu=["k=0", "k=3"],
                                     plain_steps=np.array([1]))
  with pytest.raises(ValueError, match="all adaptive over one menu"):
    decoding.Generation.concat([adaptive_run, parts[1]])
  joined = decoding.Generation.concat([adaptive_run, dataclasses.replace(
      adaptive_run, choices=np.ones(3, int), plain_steps=np.array([4]))])
  assert joined.choices.tolist() == [0, 0, 1, 1, 1] and joined.plain_steps.tolist() == [1, 4]
  assert joined.menu == ["k=0", "k=3"]


# ----------------------------------------------------------------------------- context limits


def test_prompt_bucket_is_capped_at_what_the_model_allows():
  """A 300-token prompt + 16 new tokens needs 317 of a learned-position model's 512
  positions: the power-of-two bucket (512) is capped, never a reason to refuse."""
  batch = decoding.prepare_batch([[1] * 300], vocab_size=61, max_len=512, max_new_tokens=16)
  assert batch.prompt_BP.shape == (1, 512) and batch.cache_len == 512
  assert decoding.cache_len_for(300, 16, 1, limit=512) == 512
  assert decoding.cache_len_for(300, 16, 1) == 1024  # the uncapped rule
  with pytest.raises(ValueError, match="318 exceeds the cache/context length 317"):
    decoding.prepare_batch([[1] * 300], vocab_size=61, max_len=512, max_new_tokens=17,
                           cache_len=317)


@pytest.mark.slow  # compile-bound (5-18 s): the fast tier's 3 minutes
def test_300_token_prompt_generates_on_a_512_position_learned_model():
  target = model(TINY["gpt2"].replace(max_len=512), logit_scale=4.0)
  prompt = [(7 * i) % 61 for i in range(300)]
  plain = decoding.generate(target, [prompt], max_new_tokens=16)
  assert len(plain.tokens[0]) == 16
  spec = decoding.speculative_generate(target, target, [prompt], k=1, max_new_tokens=16)
  assert spec.tokens == plain.tokens


def test_rope_model_past_max_len_is_refused_unless_opted_in():
  target = model(TINY["llama"])  # RoPE, max_len 128
  for call in (lambda **kw: decoding.generate(target, [[1, 2, 3]], **kw),
               lambda **kw: decoding.speculative_generate(target, target, [[1, 2, 3]], k=2,
                                                          **kw)):
    with pytest.raises(ValueError, match=r"max_len 128 \(the length this RoPE model was "
                       r"trained for; pass allow_beyond_max_len=True"):
      call(max_new_tokens=130)
  run = decoding.generate(target, [[1, 2, 3]], max_new_tokens=130, allow_beyond_max_len=True)
  assert len(run.tokens[0]) == 130
  learned = model(TINY["gpt2"])  # the opt-in cannot lift learned position embeddings
  with pytest.raises(ValueError, match="learned position embeddings end there"):
    decoding.generate(learned, [[1, 2, 3]], max_new_tokens=130, allow_beyond_max_len=True)


def test_transformer_capture_returns_the_residual_stream_and_final_hidden():
  cfg = TINY["llama"]
  m = model(cfg, seed=3)
  toks = jnp.asarray([[1, 2, 3, 4, 5]], jnp.int32)
  pos = jnp.arange(5, dtype=jnp.int32)[None]
  logits, hidden, _ = m(toks, pos)
  logits2, hidden2, _, feats = m(toks, pos, capture=(cfg.n_layers, 0))
  np.testing.assert_array_equal(logits, logits2)
  assert feats.shape == (1, 5, 2, cfg.d_model)
  np.testing.assert_allclose(feats[:, :, 0], hidden, rtol=1e-6, atol=1e-6)
  # layer 0's output: one block over the embeddings (rope model: no position table)
  x = jnp.take(m.embed[...], toks, axis=0)
  x1, _ = m.blocks[0](x, pos, None, 0, None)
  np.testing.assert_allclose(feats[:, :, 1], x1, rtol=1e-5, atol=1e-5)
  *_, emb = m(toks, pos, capture=(-1,))  # -1: the embedding output (hidden_states[0])
  np.testing.assert_array_equal(emb[:, :, 0], x)
  for bad in ((cfg.n_layers + 1,), (-2,), [0], (True,)):
    with pytest.raises(ValueError, match="capture"):
      m(toks, pos, capture=bad)


@pytest.mark.slow
@pytest.mark.parametrize("tree", [trees.chain(3), trees.branching((2, 1))], ids=["chain", "tree"])
def test_loop_passes_verify_features_of_the_accepted_path_to_the_drafter(tree):
  """A drafter declaring `feature_layers` gets the prompt's and each verify pass's features;
  at the end its copy of the final hidden state at L - 1 equals a cache-free forward's."""
  cfg = TINY["llama"]
  target = model(cfg, seed=0, logit_scale=4.0)
  draft = perturbed(target, seed=1, noise=0.25)
  prompts = RAGGED[:4]
  batch = _loop_inputs(target, prompts, 9)
  drafter = FeatureProbe(lm=LM.of(draft), deterministic=True)
  state = loop.speculative_jit(LM.of(target), drafter, batch.prompt_BP, batch.prompt_len_B,
                               batch.budget_B, jnp.asarray(-1), sampling.make_sampler(0.0),
                               jax.random.key(0), tree=tree, cache_len=batch.cache_len)
  kept = np.asarray(state.draft[1])
  for b in range(len(prompts)):
    n = int(state.length[b])
    toks = state.tokens[b:b + 1, :n]
    _, hidden, _ = target(toks, jnp.arange(n, dtype=jnp.int32)[None])
    np.testing.assert_allclose(kept[b], hidden[0, n - 1], rtol=1e-4, atol=1e-4)
  # and the plain drafter path (no features) still yields the same tokens
  plain = loop.speculative_jit(LM.of(target), ModelDrafter.of(draft, deterministic=True),
                               batch.prompt_BP, batch.prompt_len_B, batch.budget_B,
                               jnp.asarray(-1), sampling.make_sampler(0.0), jax.random.key(0),
                               tree=tree, cache_len=batch.cache_len)
  np.testing.assert_array_equal(state.tokens, plain.tokens)
