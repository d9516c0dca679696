"""specjax.load / specjax.resolve: every drafter kind by reference, one call, exact."""

import pytest

import specjax
from specjax.engine import decoding
from specjax import resolve
from specjax.verify import trees
from specjax.drafters.eagle import EagleDrafter
from specjax.drafters.layer_skip import LayerSkipDrafter
from specjax.drafters.lookup import LookupDrafter
from specjax.drafters.medusa import MedusaDrafter
from specjax.drafters.model import ModelDrafter

PROMPT = [[5, 6, 7, 8, 9, 10]]


@pytest.mark.slow
@pytest.mark.parametrize("draft, cls, shape", [
    ("default", ModelDrafter, {"k": 3}),
    ("eagle:default", EagleDrafter, {"k": 3}),
    ("layer-skip:2", LayerSkipDrafter, {"k": 3}),
    ("lookup", LookupDrafter, {"k": 3}),
    ("self", ModelDrafter, {"k": 3}),
])
def test_every_default_drafter_by_reference_is_greedy_exact(draft, cls, shape):
  run = specjax.load("default", draft, k=3)
  assert isinstance(run.drafter, cls) and run.shape == shape
  assert run.tokenizer.vocab_size == run.target.config.vocab_size == 4096
  plain = decoding.generate(run.target, PROMPT, max_new_tokens=12)
  spec = decoding.speculative_generate(run.target, run.drafter, PROMPT, max_new_tokens=12,
                                       **run.shape)
  assert spec.tokens == plain.tokens


def test_medusa_heads_take_k_as_a_node_budget_and_a_tree_as_given():
  run = resolve.load("default", "medusa:default", k=6)
  assert isinstance(run.drafter, MedusaDrafter) and run.shape["tree"].size <= 6
  tree = trees.chain(2)
  assert resolve.load("default", "medusa:default", tree=tree).shape == {"tree": tree}


def test_a_served_dtype_keeps_the_heads_binding():
  run = resolve.load("default", "eagle:default", target_dtype="bfloat16", k=2)
  assert run.target.config.dtype == "bfloat16"
  out = decoding.speculative_generate(run.target, run.drafter, PROMPT, max_new_tokens=6,
                                      **run.shape)
  assert len(out.tokens[0]) == 6


def test_random_models_by_spec():
  run = resolve.load("random:tiny-llama", "random:tiny-llama:n_layers=1", k=2)
  assert run.target.config.n_layers == 2 and run.draft.config.n_layers == 1
  assert run.draft.config.vocab_size == run.target.config.vocab_size


def test_a_random_target_keeps_a_vocabulary_its_spec_names():
  """vocab_size=N in a random target's spec is kept (a padded vocabulary behind byte
  prompts, e.g. an 8B shape's LM head), the draft follows it, and the studies' planning
  reads the same config; without it the byte tokenizer's vocabulary is used."""
  from specjax.experiments import references
  run = resolve.load("random:tiny-llama:vocab_size=1000", "random:tiny-llama:n_layers=1", k=2)
  assert run.target.config.vocab_size == run.draft.config.vocab_size == 1000
  assert references.target_config("random:tiny-llama:vocab_size=1000").vocab_size == 1000
  assert resolve.load("random:tiny-llama", "self", k=2).target.config.vocab_size == 259
  out = decoding.speculative_generate(run.target, run.drafter, PROMPT, max_new_tokens=6,
                                      **run.shape)
  assert len(out.tokens[0]) == 6
  with pytest.raises(ValueError, match=r"target 'tiny-llama:vocab_size=100': vocab_size "
                                       r"must be >= 259 \(the byte tokenizer's ids\), got 100"):
    resolve.load("random:tiny-llama:vocab_size=100", "self")


@pytest.mark.parametrize("target, draft, message", [
    ("default", "layer-skip:x", "draft 'layer-skip:x': write layer-skip:M"),
    ("default", "eagle:", "draft 'eagle:': write eagle:DIR or eagle:default"),
    ("random:tiny-llama", "eagle:default", "holds heads for the default target"),
    ("random:nope", "self", "target 'nope': unknown model config 'nope'"),
    ("default", "", "draft must name a drafter"),
    ("/nonexistent/model/dir", "self", "target /nonexistent/model/dir"),
])
def test_bad_references_name_the_argument(target, draft, message):
  with pytest.raises((ValueError, OSError), match=message):
    resolve.load(target, draft)
