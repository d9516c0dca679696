"""The matmul-precision policy: validated, applied to every product of both loops, and part
of the compile key (a new policy compiles once, the same policy reuses the loop)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.engine import decoding, loop
from specjax.verify import sampling, trees
from specjax.models import row_kernel
from specjax.models.lm import LM
from specjax.drafters.model import ModelDrafter
from specjax.models.precision import PRECISIONS, check_precision, matmul_precision
from specjax_testing import TINY, model, perturbed


def _dot_precisions(fn, *args) -> set[str]:
  text = jax.jit(fn).lower(*args).as_text()
  found = set()
  for line in text.splitlines():
    if "dot_general" in line and "precision = [" in line:
      found.add(line.split("precision = [")[1].split(",")[0])
  return found


@pytest.mark.slow
@pytest.mark.parametrize("name, hlo", [("highest", "HIGHEST"), ("high", "HIGH"),
                                       ("default", "DEFAULT")])
def test_every_product_of_the_speculative_loop_runs_under_the_policy(name, hlo):
  """The loop's own `precision` decides, also inside a caller's different context. XLA's
  products are the ones a policy governs: on XLA:CPU the loops' few-row products and cache
  attention take specjax's kernels (always full float32; `row_kernel`), so they are
  suspended here, and with them on the loop holds no XLA product at all."""
  target = model(TINY["llama"], seed=0)
  drafter = ModelDrafter.of(perturbed(target, seed=1, noise=0.2))
  batch = decoding.prepare_batch([[1, 2, 3]], vocab_size=target.config.vocab_size,
                                 max_len=target.config.max_len, max_new_tokens=4, slots=4)

  def run(key):
    return loop.speculative_loop(LM.of(target), drafter, batch.prompt_BP, batch.prompt_len_B,
                                 batch.budget_B, jnp.asarray(-1), sampling.make_sampler(1.0),
                                 key, tree=trees.chain(3), cache_len=batch.cache_len,
                                 precision=name).tokens

  with matmul_precision("highest" if name != "highest" else "default"):
    if row_kernel.enabled():
      assert _dot_precisions(run, jax.random.key(0)) == set()
    with row_kernel.suspended():
      assert _dot_precisions(lambda key: run(key), jax.random.key(0)) == {hlo}


@pytest.mark.slow
def test_host_api_takes_the_policy_and_compiles_once_per_policy():
  target = model(TINY["gpt2"], seed=0, logit_scale=4.0)
  draft = perturbed(target, seed=1, noise=0.2)
  prompts = [[1, 2, 3], [4, 5]]
  kw = dict(max_new_tokens=6, sampler=sampling.make_sampler(0.0))
  ref = decoding.generate(target, prompts, **kw).tokens
  for name in PRECISIONS:  # CPU float32 products are exact under every policy
    np.testing.assert_array_equal(decoding.generate(target, prompts, precision=name, **kw).tokens,
                                  ref)
    spec = decoding.speculative_generate(target, draft, prompts, k=2, precision=name, **kw)
    np.testing.assert_array_equal(spec.tokens, ref)
  before = loop.TRACE_COUNTS.copy()
  decoding.speculative_generate(target, draft, prompts, k=2, precision="high", **kw)
  assert loop.TRACE_COUNTS["speculative"] == before["speculative"]


@pytest.mark.parametrize("bad", ["HIGHEST", "tf32", None, 3])
def test_bad_precision_is_refused_naming_the_argument(bad):
  with pytest.raises(ValueError, match="precision must be one of"):
    check_precision(bad)
  target = model(TINY["gpt2"], seed=0)
  with pytest.raises(ValueError, match="precision must be one of"):
    decoding.generate(target, [[1, 2]], max_new_tokens=2, precision=bad)


@pytest.mark.slow  # compile-bound (5-18 s): the fast tier's 3 minutes
def test_host_api_runs_both_loops_under_the_requested_policy(monkeypatch):
  seen = []

  def spy(real):
    def call(*args, **kwargs):
      seen.append(kwargs.get("precision", "highest"))
      return real(*args, **kwargs)
    return call

  monkeypatch.setattr(loop, "generate_jit", spy(loop.generate_jit))
  monkeypatch.setattr(loop, "speculative_jit", spy(loop.speculative_jit))
  target = model(TINY["gpt2"], seed=0)
  decoding.generate(target, [[1, 2]], max_new_tokens=2, precision="default")
  decoding.speculative_generate(target, target, [[1, 2]], k=2, max_new_tokens=2)
  assert seen == ["default", "highest"]


@pytest.mark.slow
def test_with_dtype_serves_the_same_model_in_bf16_with_greedy_identity():
  from specjax.models.transformer import with_dtype
  target = model(TINY["llama"], seed=0, logit_scale=4.0)
  served = with_dtype(target, "bfloat16")
  assert served.config.dtype == "bfloat16" and served.embed[...].dtype == jnp.bfloat16
  assert with_dtype(served, "bfloat16") is served
  toks, pos = jnp.asarray([[1, 2, 3, 4]]), jnp.arange(4)[None]
  np.testing.assert_allclose(served(toks, pos)[0], target(toks, pos)[0], atol=0.05)
  draft = perturbed(target, seed=1, noise=0.25)
  prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
  kw = dict(max_new_tokens=10, sampler=sampling.make_sampler(0.0))
  plain = decoding.generate(served, prompts, **kw).tokens
  for tree in (trees.chain(3), trees.branching((2, 1))):
    spec = decoding.speculative_generate(served, draft, prompts, tree=tree, **kw).tokens
    np.testing.assert_array_equal(spec, plain)
  with pytest.raises(ValueError, match="dtype must be one of"):
    with_dtype(target, "float16")
