"""Non-finite draft logits are surfaced in every drafter, temperature and loop (issue 40,
item 5): a draft whose logits hold a NaN proposes argmaxes of NaNs, which look like ordinary
rejected drafts (α = 0.000, exit 0) unless the loop counts them. Each drafter that has
logits reports them per row (`Proposal.finite`), the loops count the passes
(`LoopState.draft_nonfinite`) and the host API raises NonFiniteLogitsError naming the draft.

Layer-skip is exempt from "names the draft": its weights are the target's own, so a NaN in
them is a NaN target, reported as the target's (its draft pass is counted too, checked
below). Lookup has no logits; the oracle drafts from the target itself.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.drafters.eagle import EagleDrafter, init_head
from specjax.drafters.eagle3 import Eagle3Head
from specjax.drafters.layer_skip import LayerSkipDrafter
from specjax.drafters.medusa import MedusaDrafter
from specjax.drafters.model import ModelDrafter
from specjax.engine import decoding
from specjax.engine.adaptive import policy as adaptive
from specjax.verify import sampling, trees
from specjax.models.lm import LM
from specjax_testing import TINY, FeatureProbe, model

CFG = TINY["gpt2"]
PROMPTS = [[1, 2, 3], [4, 5]]
LAYERS = (0, 1, 2)  # the captured target layers of the EAGLE heads (2 blocks + final norm)


def _poison(x):
  """x with its first entry NaN."""
  return x.at[(0,) * x.ndim].set(jnp.nan)


def _draft_model(nan: bool):
  m = model(CFG.replace(n_layers=1), seed=1)
  if nan:  # the final norm: every logit it produces is NaN
    m.final_norm.scale[...] = _poison(m.final_norm.scale[...])
  return m


def _medusa(target, nan: bool):
  d = CFG.d_model
  b = jnp.zeros((2, d))
  return MedusaDrafter.of(target, {"w": jnp.zeros((2, d, d)), "b": _poison(b) if nan else b})


def _eagle(target, nan: bool):
  head = init_head(CFG, LAYERS, seed=2)
  if nan:
    head.norm.scale[...] = _poison(head.norm.scale[...])
  return EagleDrafter.of(target, head, LAYERS)


def _eagle3(target, nan: bool):
  head = Eagle3Head(CFG, len(LAYERS), np.arange(40), rngs=nnx.Rngs(3))
  if nan:
    head.norm.scale[...] = _poison(head.norm.scale[...])
  return EagleDrafter.of(target, head, LAYERS)


DRAFTERS = {  # name -> (target, nan) -> the draft speculative_generate is given
    "model": lambda target, nan: _draft_model(nan),  # sampled candidates (q)
    "model-top-k": lambda target, nan: ModelDrafter.of(_draft_model(nan), deterministic=True),
    "medusa": _medusa,
    "eagle": _eagle,
    "eagle3": _eagle3,
}
SHAPES = {"chain": {"k": 2}, "tree": {"tree": trees.branching((2, 1))}}


@pytest.fixture(scope="module")
def target():
  return model(CFG)


def _run(target, draft, temperature=0.0, **shape):
  return decoding.speculative_generate(target, draft, PROMPTS, max_new_tokens=5,
                                       sampler=sampling.make_sampler(temperature), **shape)


def _assert_refused_naming_the_draft(call):
  with pytest.raises(decoding.NonFiniteLogitsError, match="^the draft's logits were NaN or "
                     "infinite in [1-9]") as e:
    call()
  assert e.value.target_passes == 0 and e.value.draft_passes >= 1
  assert len(e.value.generation.tokens) == len(PROMPTS)  # the run is attached


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", DRAFTERS)
def test_a_nan_draft_is_refused_at_every_temperature_and_a_finite_one_runs(target, name, shape):
  """Before the fix: Medusa (any T) and the draft model at T = 0 returned α = 0, no error."""
  for temperature in (0.0, 1.0):
    run = _run(target, DRAFTERS[name](target, False), temperature, **SHAPES[shape])
    assert [len(t) for t in run.tokens] == [5, 5]
    _assert_refused_naming_the_draft(
        lambda: _run(target, DRAFTERS[name](target, True), temperature, **SHAPES[shape]))


@pytest.mark.slow
def test_dynamic_trees_and_the_adaptive_loop_count_nan_drafts(target):
  """EAGLE-2 dynamic trees (top-k candidates, q = None), the adaptive loop's speculative
  cycles (forced: a tiny target's policy would decode plainly, never drafting), its eager
  plain steps (a feature-reading model drafter without a catch-up drafts a chain(1) each
  step) and its lazy catch-up passes (a plain-only policy over 40 tokens: P = 32 plain
  steps, then one catch-up) of a draft model, Medusa heads and an EAGLE head (whose
  catch-ups read the features the plain steps kept)."""
  plain_only = adaptive.AdaptivePolicy.create((0, 1), [1.0, 1.2], forced=[0])
  spec_only = adaptive.AdaptivePolicy.create((0, 2), [1.0, 1.2], forced=[1])
  dynamic = trees.DynamicTree(width=2, depth=2, budget=4)
  top_k = DRAFTERS["model-top-k"]
  calls = {  # name -> nan -> run
      "dynamic-model": lambda nan: _run(target, top_k(target, nan), tree=dynamic),
      "dynamic-eagle": lambda nan: _run(target, _eagle(target, nan), tree=dynamic),
      "auto-spec": lambda nan: _run(target, top_k(target, nan), policy=spec_only),
      "auto-plain-eager": lambda nan: _run(
          target, FeatureProbe(lm=LM.of(_draft_model(nan)), deterministic=True),
          policy=plain_only),
  }
  for name, drafter in (("model", top_k), ("medusa", _medusa), ("eagle", _eagle)):
    calls[f"auto-plain-lazy-{name}"] = lambda nan, d=drafter: decoding.speculative_generate(
        target, d(target, nan), PROMPTS, max_new_tokens=40, policy=plain_only)
  for name, call in calls.items():
    assert len(call(False).tokens) == len(PROMPTS), name
    _assert_refused_naming_the_draft(lambda: call(True))


def test_layer_skip_counts_its_draft_passes_under_the_targets_error():
  """Layer-skip's draft is the target's first layers and final norm: a NaN there is the
  target's error, whose message adds the draft's count."""
  bad = model(CFG)
  bad.final_norm.scale[...] = _poison(bad.final_norm.scale[...])
  with pytest.raises(decoding.NonFiniteLogitsError, match=r"^the target's logits were NaN .* \("
                     "the draft's logits too") as e:
    _run(bad, LayerSkipDrafter.of(bad, 1, deterministic=True), k=2)
  assert e.value.target_passes >= 1 and e.value.draft_passes >= 1
  assert e.value.passes == e.value.target_passes + e.value.draft_passes


def test_finite_rows_passes_minus_inf_masks_and_flags_nan_and_plus_inf():
  """-inf is a vocabulary mask (padded or reduced draft vocabularies), not a fault."""
  from specjax.drafters.base import finite_rows
  x = jnp.zeros((4, 2, 3)).at[1, 0, 0].set(-jnp.inf).at[2, 1, 2].set(jnp.nan)
  x = x.at[3, 0, 1].set(jnp.inf)
  assert finite_rows(x).tolist() == [True, True, False, False]


@pytest.mark.slow
def test_generate_command_reports_a_nan_draft_directory_as_one_line_exit_2(tmp_path, capsys):
  """`specjax generate --draft DIR` with NaN draft weights: exit 2, one line naming the draft
  (was: "α = 0.000", "greedy outputs identical to plain decoding: True", exit 0)."""
  from specjax import cli
  from specjax.checkpoints import save_model
  from specjax.models.presets import PRESETS
  from specjax.models.transformer import Transformer
  for nan in (False, True):
    net = Transformer(PRESETS["tiny-llama"].replace(n_layers=1, vocab_size=259),  # bytes
                      rngs=nnx.Rngs(0))
    if nan:
      net.final_norm.scale[...] = _poison(net.final_norm.scale[...])
    draft = save_model(tmp_path / f"draft-{nan}", net)
    code = cli.main(["generate", "--target-config", "tiny-llama", "--draft", str(draft),
                     "--max-new-tokens", "4", "--repeats", "1"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    if not nan:
      assert code == 0, err
      continue
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("specjax: error: the draft's logits were NaN or infinite"), err
