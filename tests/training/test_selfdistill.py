"""Self-distillation data: the prompt recipe, the evaluation-set overlap check, the data
command (resume, refusals) and the trainers reading the shards."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.data import instructions, selfdistill
from specjax.data.instructions import Recipe
from specjax.training import selfdistill as make

ROOT = pathlib.Path(__file__).resolve().parents[2]
SPECBENCH = ROOT / "benchmarks" / "specbench_questions.jsonl"
TARGET = "random:tiny-llama:max_len=1024"
SMALL = Recipe(seed=3, max_chars=200)  # short prompts: byte-level prompts stay small


# ----------------------------------------------------------------------------- recipe


@pytest.mark.slow  # compile-bound (5-18 s): the fast tier's 3 minutes
def test_recipe_is_a_pure_function_of_seed_and_index():
  a = [Recipe(seed=1).item(i) for i in range(40)]
  assert a == [Recipe(seed=1).item(i) for i in range(40)]
  assert [x["text"] for x in a] != [Recipe(seed=2).item(i)["text"] for i in range(40)]
  assert Recipe.from_spec(json.loads(json.dumps(Recipe(seed=1).spec()))) == Recipe(seed=1)
  kinds = {(x["source"], x["task"]) for x in (Recipe(seed=1).item(i) for i in range(200))}
  assert {s for s, _ in kinds} == {"code", "prose"} and len(kinds) >= 9  # every kind of task
  temps = {Recipe(seed=1).batch_temperature(k) for k in range(40)}
  assert temps == {0.0, 1.0}  # both temperatures mixed
  with pytest.raises(ValueError, match="sample_fraction must be in"):
    Recipe(sample_fraction=1.5)


def test_no_prompt_shares_an_8gram_with_specbench():
  reference = instructions.reference_ngrams(instructions.evaluation_texts(SPECBENCH))
  assert len(reference) > 10_000  # the file was read: every turn of 480 questions
  texts = [Recipe().item(i)["text"] for i in range(400)]
  templates = [t.format(name="x", kind="function", passage="", head="")
               for tasks in (instructions.CODE_TASKS, instructions.PROSE_TASKS)
               for phrasings in tasks.values() for t in phrasings]
  assert instructions.shared_ngrams(texts + templates, reference) == {}
  # negative control: a prompt with one Spec-Bench turn planted in it is caught, alone
  turn = json.loads(SPECBENCH.read_text().splitlines()[5])["turns"][0]
  planted = texts[:7] + [texts[7] + "\n\n" + turn] + texts[8:20]
  found = instructions.shared_ngrams(planted, reference)
  assert list(found) == [7] and " ".join(found[7]) in " ".join(instructions.words(turn))


def test_select_prompts_skips_the_excluded_ones():
  texts = [SMALL.item(i)["text"] for i in range(6)]
  reference = instructions.reference_ngrams([texts[2], texts[4]])
  kept, skipped = make.select_prompts(SMALL, 4, reference)
  assert skipped == [2, 4] and kept == [0, 1, 3, 5]
  assert make.select_prompts(SMALL, 4) == ([0, 1, 2, 3], [])


# ----------------------------------------------------------------------------- data command


@pytest.fixture(scope="module")
def target():
  from specjax.resolve import load_target
  return load_target(TARGET)


def _make(target, out, **kw):
  args = dict(prompts=8, max_new_tokens=6, batch=4, recipe=SMALL, loaded=target,
              log=lambda _: None)
  return make.make_data(TARGET, out, **{**args, **kw})


def _shards(directory: pathlib.Path) -> dict[str, bytes]:
  return {p.name: p.read_bytes() for p in sorted(directory.glob("shard-*.npz"))}


def test_interrupted_run_resumes_to_the_same_shards(tmp_path, target):
  whole = _make(target, tmp_path / "whole")
  assert whole["complete"] and whole["totals"]["rows"] == 8
  part = _make(target, tmp_path / "part", stop_after=1)  # killed after its first shard
  assert not part["complete"] and len(part["shards"]) == 1
  (tmp_path / "part" / ".shard-000001.npz.tmp-1-ab").write_bytes(b"half")  # a torn write
  resumed = _make(target, tmp_path / "part")
  assert resumed["complete"]
  assert _shards(tmp_path / "part") == _shards(tmp_path / "whole")
  assert not list((tmp_path / "part").glob(".shard-*"))
  assert [s["sha256"] for s in resumed["shards"]] == [s["sha256"] for s in whole["shards"]]
  for key in ("answer_tokens", "rows", "prompt_tokens"):
    assert resumed["totals"][key] == whole["totals"][key]
  assert whole["totals"]["seconds"] > 0 and whole["run"]["recipe"] == SMALL.spec()
  # names, no paths of the machine (the directory can be committed)
  excluded = _make(target, tmp_path / "excl", stop_after=1, exclude=[SPECBENCH])
  assert excluded["exclude_files"] == [SPECBENCH.name]
  assert "/" not in json.dumps(excluded["target_ref"]) and str(tmp_path) not in json.dumps(
      selfdistill.read_manifest(tmp_path / "excl"))
  # the rows: the chat (here plain) prompt, then the answer, masked to the answer
  rows = selfdistill.read_rows(tmp_path / "whole")
  tok = target[1]
  from specjax.data.chat import encode_messages
  first = encode_messages(tok, SMALL.messages(int(rows.prompt_index[0])))
  np.testing.assert_array_equal(rows.tokens[0][:len(first)], first)
  assert rows.masks[0][:len(first)].sum() == 0
  assert rows.masks[0][len(first):].all() and 1 <= len(rows.tokens[0]) - len(first) <= 6
  # a larger --prompts extends the data with the same first shards
  more = _make(target, tmp_path / "part", prompts=12)
  assert [s["sha256"] for s in more["shards"][:2]] == [s["sha256"] for s in whole["shards"]]
  assert len(more["shards"]) == 3 and more["complete"]


def test_another_run_is_refused_in_one_line(tmp_path, target):
  _make(target, tmp_path / "d", stop_after=1)
  with pytest.raises(ValueError, match=r"another run \(differs in recipe\)"):
    _make(target, tmp_path / "d", recipe=Recipe(seed=4, max_chars=200))
  from specjax.resolve import load_target
  other = load_target(TARGET, seed=1)
  with pytest.raises(ValueError, match=r"differs in target\)"):
    _make(other, tmp_path / "d")
  with pytest.raises(ValueError, match="multiple of batch"):
    _make(target, tmp_path / "e", prompts=6)
  (tmp_path / "f").mkdir()
  (tmp_path / "f" / "x").write_text("x")
  with pytest.raises(ValueError, match="not empty"):
    _make(target, tmp_path / "f")


def test_cli_one_line_errors(tmp_path, capsys):
  from specjax.cli import main
  rc = main(["train", "selfdistill-data", "--target", TARGET, "--out", str(tmp_path / "o"),
             "--prompts", "5", "--batch", "4"])
  assert rc == 2
  assert capsys.readouterr().err.strip().splitlines() == [
      "specjax: error: --prompts must be a multiple of batch (4), got 5"]
  rc = main(["train", "selfdistill-data", "--target", TARGET, "--out", str(tmp_path / "o"),
             "--prompts", "4", "--sample-fraction", "2"])
  assert rc == 2 and "--sample-fraction must be in [0, 1]" in capsys.readouterr().err
  for flag, value, message in (("--target", str(tmp_path / "none"), "is not a directory"),
                               ("--exclude", str(tmp_path / "q.jsonl"), "does not exist")):
    argv = ["train", "selfdistill-data", "--target", TARGET, "--out", str(tmp_path / "o"),
            "--prompts", "16", flag, value]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"specjax: error: {flag} ") and message in err[0]


# ----------------------------------------------------------------------------- trainers


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, target):
  out = tmp_path_factory.mktemp("sd") / "data"
  _make(target, out, prompts=16, max_new_tokens=24)
  return out


def test_token_data_aligns_masks_and_splits_by_prompt(data_dir, target):
  rows = selfdistill.read_rows(data_dir)
  data = selfdistill.token_data(data_dir, target[1], val_fraction=0.25)
  assert len(data.train) == len(data.train_mask) and len(data.validation_mask) > 0
  assert len(data.train) + len(data.validation) == sum(len(t) for t in rows.tokens)
  assert data.train_mask.sum() + data.validation_mask.sum() == sum(m.sum() for m in rows.masks)
  batch = data.train_batch(0, 3, 4, 16)
  mask = data.train_batch_mask(0, 3, 4, 16)
  assert mask.shape == batch.shape and set(np.unique(mask)) <= {0, 1}
  assert data.learned_tokens().size == data.train_mask.sum()
  from specjax.data.tokenizer import BPETokenizer
  other = BPETokenizer.train(["some text to train a tiny tokenizer on"] * 4, 300)
  with pytest.raises(ValueError, match="made with tokenizer"):
    selfdistill.token_data(data_dir, other)


def test_masked_loss_counts_only_answer_positions(target):
  from flax import nnx

  from specjax.training.heads import frozen_target, target_pass
  from specjax.training.medusa import MedusaHeads
  model, _ = target
  lm = frozen_target(model.config, nnx.state(model, nnx.Param))
  kind = MedusaHeads(heads=2)
  params = kind.init(lm.config, jax.random.key(0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 250, (2, 20)), jnp.int32)
  plain = kind.loss(params, target_pass(kind, lm, tokens))[0]
  ones = kind.loss(params, target_pass(kind, lm, tokens, jnp.ones_like(tokens)))[0]
  np.testing.assert_allclose(ones, plain, rtol=1e-6)  # an all-ones mask is no mask
  half = jnp.zeros_like(tokens).at[:, 10:].set(1)
  masked = kind.loss(params, target_pass(kind, lm, tokens, half))[0]
  assert abs(float(masked) - float(plain)) > 1e-4  # the mask reaches the loss
  # held-out acceptance counts only guesses of tokens the mask keeps
  from specjax.training.heads import head_acceptance
  windows = np.asarray(tokens)
  every = head_acceptance(kind, params, lm, windows, batch=2)
  some = head_acceptance(kind, params, lm, windows, batch=2, masks_NT=np.asarray(half))
  # head 0 at t (0..18) guesses token t + 2: kept from t = 8 on (the last repeats its own)
  assert every.positions == 2 * 19 and some.positions == 2 * 11


@pytest.mark.slow  # trains (two steps of each trainer)
def test_head_and_draft_trainers_read_the_shards(data_dir, tmp_path, capsys):
  from specjax.cli import main
  common = ["--corpus", f"selfdistill:{data_dir}", "--steps", "2", "--batch-size", "2",
            "--seq-len", "32", "--no-progress"]
  assert main(["train", "medusa", "--target", TARGET, "--heads", "2",
               "--out", str(tmp_path / "m"), *common]) == 0
  out = capsys.readouterr()
  assert "answer tokens" in out.err and "held-out acceptance" in out.out
  assert main(["train", "draft", "--preset", "tiny", "--teacher", TARGET,
               "--out", str(tmp_path / "d"), *common]) == 0
  assert "KL to teacher" in capsys.readouterr().out


COMMITTED = ROOT / "benchmarks" / "smollm2_selfdistill"


@pytest.mark.slow  # reads 3.4 MB and selects 1,536 prompts against Spec-Bench: ~10 s
@pytest.mark.skipif(not (COMMITTED / selfdistill.MANIFEST).is_file(),
                    reason="no committed SmolLM2 self-distillation data")
def test_the_committed_smollm2_data_is_intact_and_excludes_specbench():
  """The SmolLM2 data kept in the repository (benchmarks/smollm2_drafters.sh data): every
  shard matches its digest, nothing else lies there, the totals add up, no path of a machine
  is recorded, and it was made excluding today's Spec-Bench file from the seed-0 recipe's
  prompts that share no 8-gram with it."""
  from specjax.files import file_sha256
  rows = selfdistill.read_rows(COMMITTED)  # each shard against its sha256
  m = rows.manifest
  assert sorted(p.name for p in COMMITTED.iterdir()) == sorted(
      [selfdistill.MANIFEST] + [s["file"] for s in m["shards"]])
  assert m["run"]["exclude"] == [file_sha256(SPECBENCH)]
  assert m["exclude_files"] == [SPECBENCH.name] and "/" not in m["target_ref"]
  assert m["run"]["target"]["config"]["vocab_size"] == 49152
  assert m["totals"]["rows"] == len(rows.tokens) == 32 * len(m["shards"])
  answers = sum(int(k.sum()) for k in rows.masks)
  assert answers == m["totals"]["answer_tokens"] == sum(s["answer_tokens"] for s in m["shards"])
  assert max(int(t.max()) for t in rows.tokens) < 49152
  recipe = Recipe.from_spec(m["run"]["recipe"])
  assert recipe == Recipe(seed=0)
  reference = instructions.reference_ngrams(instructions.evaluation_texts(SPECBENCH))
  kept, _ = make.select_prompts(recipe, len(rows.tokens), reference)
  assert sorted(rows.prompt_index.tolist()) == sorted(kept)
