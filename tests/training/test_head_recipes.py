"""Recipes for a real target (`training.presets.RECIPES`, `specjax train KIND
--recipe NAME`) and head training on a Hugging Face target, whose tokenizer the checkpoint
keeps (issue 44)."""

import argparse

import pytest

from specjax.commands import train as train_cmd
from specjax.training.presets import RECIPES, get_recipe


def _args(kind: str, *argv: str) -> argparse.Namespace:
  parser = argparse.ArgumentParser()
  sub = parser.add_subparsers(dest="what")
  train_cmd.add_parser(sub)
  model = ["--teacher", "t"] if kind == "draft" else ["--target", "t"]
  return parser.parse_args(["train", kind, *model, "--out", "o", *argv])


def test_a_draft_recipe_gives_a_model_on_the_targets_vocabulary_and_a_distill_schedule():
  drafts = [r for r in RECIPES.values() if r.kind == "draft"]
  assert drafts
  for recipe in drafts:
    args = _args("draft", "--recipe", recipe.name)
    assert train_cmd._apply_recipe(args, "draft") == recipe
    assert recipe.model is not None and recipe.schedule.objective == "distill"
  smol = RECIPES["smollm2-draft"].model
  assert (smol.vocab_size, smol.max_len, smol.rope_theta) == (49152, 2048, 100000.0)


def test_every_head_recipe_names_a_head_command_and_builds_its_kind():
  for name, recipe in RECIPES.items():
    if recipe.kind == "draft":
      continue
    assert recipe.kind in train_cmd.HEAD_KINDS, name
    args = _args(recipe.kind, "--recipe", name)
    schedule = train_cmd._apply_recipe(args, recipe.kind).schedule
    kind = train_cmd.HEAD_KINDS[recipe.kind][2](args)
    for dest, value in recipe.flags:
      assert getattr(args, dest) == value
    assert schedule == recipe.schedule
    assert kind.name == recipe.kind


def test_a_flag_given_wins_over_the_recipe_and_schedule_flags_apply_over_it():
  args = _args("eagle3", "--recipe", "smollm2-eagle3", "--draft-vocab", "512", "--steps", "7")
  base = train_cmd._apply_recipe(args, "eagle3").schedule
  assert args.draft_vocab == 512 and args.ttt_steps == 3
  tc = train_cmd._train_config(base, args, "lm")
  assert tc.steps == 7 and tc.seq_len == RECIPES["smollm2-eagle3"].schedule.seq_len


def test_without_a_recipe_the_kind_flags_keep_their_documented_defaults():
  kind = train_cmd.HEAD_KINDS["medusa"][2](_args("medusa"))
  assert (kind.heads, kind.decay) == (4, 0.8)
  kind = train_cmd.HEAD_KINDS["eagle3"][2](_args("eagle3"))
  assert (kind.steps, kind.decay) == (3, 0.8)


@pytest.mark.parametrize("name,kind", [("smollm2-medusa", "eagle3"), ("nope", "medusa"),
                                       ("smollm2-eagle3", "draft")])
def test_a_recipe_of_another_kind_or_unknown_is_refused_naming_the_allowed(name, kind):
  with pytest.raises(ValueError, match=r"--recipe must be one of \[.*\] for `train " + kind):
    get_recipe(name, kind)


@pytest.mark.slow  # trains two steps of an EAGLE-3 head
def test_an_eagle3_head_trains_on_a_hugging_face_target_and_keeps_its_tokenizer(tmp_path):
  """The head trainer saved the target's tokenizer with ByteTokenizer/BPE's `save`, which a
  Hugging Face tokenizer lacked: training a head for a real target failed at its first
  checkpoint."""
  pytest.importorskip("transformers")
  from hf_testing import llama_dir
  from specjax.checkpoints.hf.tokenizer import HFTokenizer, load_tokenizer_for
  from specjax.cli import main
  target = llama_dir(tmp_path / "llama", layers=4, seed=0)
  corpus = tmp_path / "text"
  corpus.mkdir()
  (corpus / "a.txt").write_text("def add(a, b):\n    return a + b\n" * 300)
  out = tmp_path / "head"
  assert main(["train", "eagle3", "--target", str(target), "--corpus", str(corpus),
               "--out", str(out), "--steps", "2", "--batch-size", "2", "--seq-len", "32",
               "--draft-vocab", "64", "--no-progress"]) == 0
  saved = load_tokenizer_for(out)
  theirs = load_tokenizer_for(target)
  assert isinstance(saved, HFTokenizer)
  assert saved.to_spec() == theirs.to_spec() and saved.eos_ids == theirs.eos_ids
  msgs = [{"role": "user", "content": "hi"}]
  assert saved.apply_chat_template(msgs) == theirs.apply_chat_template(msgs)


def test_a_tokenizer_larger_than_the_targets_vocabulary_is_refused():
  """A padded embedding (more rows than the tokenizer has ids, as real checkpoints ship) is
  fine; a tokenizer with ids the target cannot embed is refused in one line."""
  from flax import nnx

  from specjax.data.batches import TokenData
  from specjax.data.corpus import load_corpus
  from specjax.data.tokenizer import ByteTokenizer
  from specjax.training.heads import HeadTrainer
  from specjax.training.medusa import MedusaHeads
  from specjax_testing import TC, TCFG, model
  small = TCFG.replace(vocab_size=200)
  data = TokenData.from_corpus(load_corpus("code", max_bytes=20_000), ByteTokenizer())
  with pytest.raises(ValueError, match="tokenizer vocab_size 259 exceeds the target's "
                                       "vocab_size 200"):
    HeadTrainer(MedusaHeads(heads=1), small, nnx.state(model(small, seed=0), nnx.Param), TC,
                data, ByteTokenizer(), progress=False)


@pytest.mark.slow  # distils two steps of a draft model from a Hugging Face teacher
def test_a_draft_distilled_from_a_hugging_face_teacher_exports_and_reloads_bit_identically(
    tmp_path):
  """A trained checkpoint records a Hugging Face tokenizer as kind "hf": loading it, and so
  `export-hf` (the directory transformers' assisted generation takes), refused that kind
  until the checkpoint layer read the saved tokenizer files back (`recorded_tokenizer`). A
  teacher whose embedding has more rows than its tokenizer has ids gives the student its
  row count (distillation was refused: "teacher vocab_size 448 != student vocab_size")."""
  pytest.importorskip("transformers")
  import jax
  import numpy as np
  from flax import nnx
  from hf_testing import llama_dir
  from specjax.checkpoints import load_model
  from specjax.checkpoints.hf.tokenizer import HFTokenizer, recorded_tokenizer
  from specjax.cli import main
  teacher = llama_dir(tmp_path / "llama", layers=2, seed=0)
  corpus = tmp_path / "text"
  corpus.mkdir()
  (corpus / "a.txt").write_text("def add(a, b):\n    return a + b\n" * 300)
  out, hf_out = tmp_path / "draft", tmp_path / "draft-hf"
  # the recipe's Llama shape, on the teacher's vocabulary (448 rows for a 374-id tokenizer)
  assert main(["train", "draft", "--recipe", "smollm2-draft", "--teacher", str(teacher),
               "--corpus", str(corpus), "--out", str(out), "--steps", "2", "--batch-size", "2",
               "--seq-len", "32", "--no-progress"]) == 0
  assert main(["export-hf", str(out), "--out", str(hf_out)]) == 0
  (ours, tok), (theirs, hf_tok) = load_model(out), load_model(hf_out)
  assert ours.config.vocab_size == 448 and tok.vocab_size < 448
  assert isinstance(tok, HFTokenizer) and tok.to_spec() == hf_tok.to_spec()

  def params(m):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(nnx.state(m, nnx.Param))]
  assert all(a.dtype == b.dtype and np.array_equal(a, b)
             for a, b in zip(params(ours), params(theirs), strict=True))
  # tokenizer files that no longer match the recorded digest are refused, not trusted
  spec = dict(tok.to_spec(), sha256="0" * 64)
  with pytest.raises(ValueError, match="do not match the recorded tokenizer"):
    recorded_tokenizer(spec, out)
