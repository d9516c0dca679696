"""LM training, distillation, resume, the default-pair cache, acceptance estimates, bad input.

All models here are tiny (d_model 32, 1-2 layers, 32-token windows) and share configs, so the
jitted steps compile once per config for the whole file (trainer.compiled_steps memoises).
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from specjax.checkpoints import orbax_io
from specjax.data.batches import TokenData
from specjax.data.corpus import load_corpus
from specjax.data.tokenizer import ByteTokenizer
from specjax.models.transformer import ModelConfig
from specjax.training import defaults, evaluate as ev, presets
from specjax.training.config import TrainConfig
from specjax.checkpoints.trained import load_trained
from specjax.training.trainer import (Teacher, Trainer, check_memory, params_fingerprint,
                                      train, validation_metrics)

TOK = ByteTokenizer()
STUDENT = ModelConfig.llama(vocab_size=259, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2,
                            d_ff=64, max_len=64, tie_embeddings=True)
TEACHER = STUDENT  # same shape, trained longer: shares every compilation with the student
TC = TrainConfig(steps=40, batch_size=8, seq_len=32, lr=1e-2, warmup_steps=2, eval_every=0,
                 ckpt_every=0, eval_windows=16)
MAX_BYTES = 60_000


@pytest.fixture(scope="module")
def data():
  return TokenData.from_corpus(load_corpus("code", max_bytes=MAX_BYTES), TOK)


@pytest.fixture(scope="module")
def teacher(data):
  result = train(TEACHER, TC.replace(steps=60, seed=1), data, TOK, progress=False)
  return Teacher(TEACHER, result.params)


@pytest.fixture(scope="module")
def six_steps(data):
  """An uninterrupted 6-step run, the reference for the resume tests."""
  return train(STUDENT, TC.replace(steps=6), data, TOK, progress=False)


def _same(a, b) -> bool:
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(leaves_a) == len(leaves_b) and all(
      np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(leaves_a, leaves_b))


def test_training_lowers_validation_loss(data):
  trainer = Trainer(STUDENT, TC, data, TOK, progress=False)
  before = trainer.evaluate()
  assert before["bpb"] > 7.5  # about log2(259) bits per byte at initialisation
  result = trainer.run()
  assert result.completed and result.step == TC.steps
  assert result.val["bpb"] < before["bpb"] - 2.0
  assert all(np.asarray(x).dtype == np.float32 for x in jax.tree.leaves(result.params))


def test_distillation_lowers_kl_faster_than_plain(data, teacher):
  steps = 30
  distilled = train(STUDENT, TC.replace(steps=steps, objective="distill"), data, TOK,
                    teacher=teacher, progress=False)
  plain = train(STUDENT, TC.replace(steps=steps), data, TOK, progress=False)
  kl_distilled = validation_metrics(STUDENT, distilled.params, data, TOK, TC, teacher)["kl"]
  kl_plain = validation_metrics(STUDENT, plain.params, data, TOK, TC, teacher)["kl"]
  kl_init = validation_metrics(STUDENT, Trainer(STUDENT, TC, data, TOK).params, data, TOK, TC,
                               teacher)["kl"]
  assert kl_distilled < kl_plain < kl_init
  assert kl_distilled < 0.8 * kl_plain


def test_interrupted_then_resumed_matches_uninterrupted(data, six_steps, tmp_path):
  tc = TC.replace(steps=6)
  # stop after 3 steps (a checkpoint is written on the way out), then a new trainer resumes
  first = train(STUDENT, tc, data, TOK, out_dir=tmp_path, stop_after=3, progress=False)
  assert first.step == 3 and not first.completed
  assert orbax_io.latest_step(tmp_path) == 3
  resumed = train(STUDENT, tc, data, TOK, out_dir=tmp_path, progress=False)
  assert resumed.resumed_from == 3 and resumed.step == 6
  assert _same(resumed.params, six_steps.params)
  # negative control: a different seed is a different run and is refused, not mixed in
  with pytest.raises(ValueError, match="holds a different run"):
    train(STUDENT, tc.replace(seed=1), data, TOK, out_dir=tmp_path, progress=False)
  # the saved model loads for inference with its config and tokenizer
  loaded = load_trained(tmp_path)
  assert loaded.config == STUDENT and loaded.step == 6 and loaded.tokenizer == TOK
  assert _same(loaded.params, six_steps.params)
  assert loaded.metadata["data"] == {"seed": 0, "step": 6, "corpus": "code",
                                     "fingerprint": data.fingerprint}
  with pytest.raises(ValueError, match="n_layers: checkpoint=1, expected=2"):
    load_trained(tmp_path, config=STUDENT.replace(n_layers=2))


class _SignalAtStep(TokenData):
  """Data whose batch for step 3 arrives together with a SIGTERM (an external kill)."""

  def train_batch(self, seed, step, *args):
    if step == 3:
      os.kill(os.getpid(), signal.SIGTERM)
    return super().train_batch(seed, step, *args)


def test_sigterm_saves_a_checkpoint_and_resumes(data, six_steps, tmp_path):
  tc = TC.replace(steps=6)
  full = six_steps
  signalling = _SignalAtStep(data.train, data.validation, data.corpus_name, data.fingerprint)
  with pytest.raises(KeyboardInterrupt):
    train(STUDENT, tc, signalling, TOK, out_dir=tmp_path, progress=False)
  assert orbax_io.latest_step(tmp_path) == 4  # the step in flight finished, then it saved
  resumed = train(STUDENT, tc, data, TOK, out_dir=tmp_path, progress=False)
  assert resumed.resumed_from == 4 and _same(resumed.params, full.params)


@pytest.mark.slow  # compile-bound (5-18 s): the fast tier's 3 minutes
def test_killed_process_resumes_from_last_checkpoint(data, tmp_path):
  """SIGKILL a real training process mid-run; resuming here reaches the uninterrupted result."""
  tc = TC.replace(steps=400, ckpt_every=2, keep=2)
  script = textwrap.dedent(f"""
      import jax
      jax.config.update("jax_numpy_rank_promotion", "raise")
      jax.config.update("jax_default_matmul_precision", "float32")
      from specjax.data.batches import TokenData
      from specjax.data.corpus import load_corpus
      from specjax.data.tokenizer import ByteTokenizer
      from specjax.models.transformer import ModelConfig
      from specjax.training.config import TrainConfig
      from specjax.training.trainer import train
      tok = ByteTokenizer()
      data = TokenData.from_corpus(load_corpus("code", max_bytes={MAX_BYTES}), tok)
      train(ModelConfig(**{STUDENT.to_dict()!r}), TrainConfig(**{tc.__dict__!r}), data, tok,
            out_dir={str(tmp_path)!r}, progress=False)
      """)
  env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).parents[2])}
  proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  try:
    deadline = time.time() + 120
    while (orbax_io.latest_step(tmp_path) or 0) < 4:
      assert proc.poll() is None and time.time() < deadline, "trainer did not checkpoint"
      time.sleep(0.2)
  finally:
    proc.kill()
    proc.wait()
  killed_at = orbax_io.latest_step(tmp_path)
  assert killed_at is not None and 4 <= killed_at < tc.steps
  stop = killed_at + 3  # resume a few steps and compare with an uninterrupted run to there
  short = tc.replace(steps=tc.steps)
  resumed = Trainer(STUDENT, short, data, TOK, out_dir=tmp_path, progress=False).run(
      stop_after=3)
  assert resumed.resumed_from == killed_at and resumed.step == stop
  reference = Trainer(STUDENT, short, data, TOK, progress=False).run(stop_after=stop)
  assert _same(resumed.params, reference.params)


def test_gradient_accumulation_matches_one_big_batch(data):
  tc = TC.replace(steps=2)
  one = train(STUDENT, tc, data, TOK, progress=False)
  accumulated = train(STUDENT, tc.replace(grad_accum=2), data, TOK, progress=False)
  for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(accumulated.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_bfloat16_compute_keeps_float32_master_weights(data, six_steps):
  trainer = Trainer(STUDENT, TC.replace(steps=6, dtype="bfloat16"), data, TOK, progress=False)
  trainer.run(stop_after=2, final_eval=False)
  assert all(np.asarray(x).dtype == np.float32 for x in jax.tree.leaves(trainer.params))
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(trainer.params))
  assert not _same(trainer.params, Trainer(STUDENT, TC, data, TOK).params)  # it trained


def test_greedy_acceptance_estimates(data, teacher):
  # cycles start at 0 (accepts 4, bonus at 4), 5 (rejects at once, correction at 5) and 6
  # (accepts 2, rejects at 8); the next would start at 9 and does not fit in 10 tokens
  assert ev.chain_counts(np.array([1, 1, 1, 1, 1, 0, 1, 1, 0, 0], bool), 4) == (3, 12, 6, 8)
  assert ev.chain_counts(np.array([0, 0, 0, 0, 0], bool), 4) == (2, 8, 0, 2)
  windows = data.validation_windows(32, 8)[:, :-1]
  pair = (TEACHER, teacher.params)
  assert ev.teacher_forced_agreement(pair, pair, windows).value == 1.0
  # negative control: an untrained draft rarely agrees with the target on real text
  untrained = (STUDENT, Trainer(STUDENT, TC, data, TOK).params)
  low = ev.teacher_forced_agreement(pair, untrained, windows)
  assert low.value < 0.5 and low.wilson[0] <= low.value <= low.wilson[1]
  prompts = data.validation_windows(16, 4)[:, :16]
  same = ev.greedy_chain(pair, pair, prompts, new_tokens=24, k=4)
  assert same["alpha"].value == 1.0 and same["tau"] == 5.0  # self-speculation accepts all
  assert same["drafted"] == 4 * same["cycles"]


_REAL_LOAD_CORPUS = defaults.load_corpus


def _use_preset(monkeypatch, cache_dir, name: str, preset) -> None:
  """Preset `name` = `preset`, the pair cache in `cache_dir`, a small corpus."""
  monkeypatch.setitem(presets.PRESETS, name, preset)
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(cache_dir))
  monkeypatch.setattr(defaults, "load_corpus",
                      lambda spec: _REAL_LOAD_CORPUS(spec, max_bytes=MAX_BYTES))


@pytest.mark.slow
def test_default_pair_cache_builds_loads_and_rebuilds(monkeypatch, tmp_path, capfd):
  micro = presets.Preset("tiny", TEACHER, STUDENT, TC.replace(steps=3, ckpt_every=2),
                         TC.replace(steps=3, objective="distill"), "test preset")
  _use_preset(monkeypatch, tmp_path, "tiny", micro)

  # the target alone: its draft is not trained until a pair is asked for
  target = defaults.load_default_target("tiny", "code", progress=False)
  entry = defaults.entry_dir("tiny", "code")
  assert entry.parent.parent == tmp_path and entry.is_dir()
  err = capfd.readouterr().err
  assert "training the default 'tiny' target" in err and "draft" not in err
  assert [p.name for p in (tmp_path / "models").iterdir() if p.is_dir()] == [entry.name]
  pair = defaults.load_default_pair("tiny", "code", progress=False)
  err = capfd.readouterr().err
  assert "distilling the default 'tiny' draft" in err and "training the default" not in err
  target_cfg, target_params, draft_cfg, draft_params, tokenizer = pair
  assert target_cfg == TEACHER and draft_cfg == STUDENT and tokenizer == TOK
  assert _same(target.target_params, target_params) and target.tokenizer == TOK
  manifest = json.loads((entry / "manifest.json").read_text())
  assert manifest["target"]["fingerprint"] == params_fingerprint(target_params)
  draft_entry = defaults.draft_entry_dir("tiny", "code", params_fingerprint(target_params))
  manifest = json.loads((draft_entry / "manifest.json").read_text())
  assert manifest["draft"]["fingerprint"] == params_fingerprint(draft_params)
  assert manifest["recipe"]["target_entry"] == entry.name
  assert pair.draft_module()(np.zeros((1, 4), np.int32), np.arange(4)[None])[0].shape == (1, 4, 259)

  def no_training(*args, **kwargs):
    raise AssertionError("a valid cache entry must not be retrained")

  monkeypatch.setattr(defaults, "train", no_training)
  again = defaults.load_default_pair("tiny", "code", progress=False)
  assert _same(again.target_params, target_params) and _same(again.draft_params, draft_params)
  monkeypatch.undo()
  _use_preset(monkeypatch, tmp_path, "tiny", micro)

  # corrupt one stored file of each entry: detected by checksum, reported, rebuilt
  for where in (draft_entry / "draft", entry / "target"):
    victim = next(p for p in sorted(where.rglob("*")) if p.is_file()
                  and p.stat().st_size > 0 and "params" in p.parts)
    victim.write_bytes(victim.read_bytes()[:-1] + bytes([victim.read_bytes()[-1] ^ 0xFF]))
    capfd.readouterr()
    rebuilt = defaults.load_default_pair("tiny", "code", progress=False)
    assert f"cached {where.name} at" in capfd.readouterr().err
    assert _same(rebuilt.target_params, target_params)  # training is deterministic
    assert _same(rebuilt.draft_params, draft_params)
  # a partial entry (no manifest) is never used either
  (entry / "manifest.json").unlink()
  defaults.load_default_pair("tiny", "code", progress=False)
  assert "no manifest" in capfd.readouterr().err
  assert (entry / "manifest.json").is_file()
  with pytest.raises(ValueError, match="corpus must be one of"):
    defaults.load_default_pair("tiny", "/some/dir")
  # `specjax train defaults` loads the pair and shows both entries
  from specjax import cli
  capfd.readouterr()
  assert cli.main(["train", "defaults", "--preset", "tiny", "--no-progress"]) == 0
  out = capfd.readouterr().out
  assert f"target: d_model={TEACHER.d_model}" in out and str(entry) in out
  assert f"draft: d_model={STUDENT.d_model}" in out and str(draft_entry) in out


@pytest.mark.slow
def test_bpe_preset_pair_is_built_cached_and_resumed_with_its_tokenizer(monkeypatch, tmp_path,
                                                                         capfd):
  """The default preset's shape of build: a BPE trained on the corpus, saved before training,
  restored with the pair, and reused (not retrained) when an interrupted build resumes."""
  pytest.importorskip("tokenizers")
  cfg = STUDENT.replace(vocab_size=300)
  micro = presets.Preset("micro-bpe", cfg, cfg, TC.replace(steps=3, ckpt_every=2),
                         TC.replace(steps=3, objective="distill"), "test preset",
                         tokenizer="bpe:300")
  _use_preset(monkeypatch, tmp_path, "micro-bpe", micro)
  pair = defaults.load_default_pair("micro-bpe", "code", progress=False)
  assert pair.tokenizer.kind == "bpe" and pair.tokenizer.vocab_size == 300
  text = "def f(x):\n    return x + 1\n"
  assert pair.tokenizer.decode(pair.tokenizer.encode(text)) == text
  entry = defaults.entry_dir("micro-bpe", "code")
  assert (entry / "tokenizer.json").is_file()

  # an interrupted build resumes with the tokenizer it saved first (a different BPE would
  # make the saved target checkpoint unusable): count BPE trainings during the resume.
  partial = entry.with_name(entry.name + ".partial")
  entry.rename(partial)
  (partial / "manifest.json").unlink()
  trained = []
  real_train = defaults.BPETokenizer.train
  monkeypatch.setattr(defaults.BPETokenizer, "train",
                      classmethod(lambda cls, *a, **k: trained.append(1) or real_train(*a, **k)))
  again = defaults.load_default_pair("micro-bpe", "code", progress=False)
  assert "resuming an interrupted build" in capfd.readouterr().err
  assert not trained and again.tokenizer.to_spec() == pair.tokenizer.to_spec()
  assert _same(again.target_params, pair.target_params)

  with pytest.raises(ValueError, match="vocab_size 259 != 300 ids of tokenizer 'bpe:300'"):
    presets.Preset("bad", STUDENT, cfg, TC, TC, "x", tokenizer="bpe:300")
  with pytest.raises(ValueError, match="tokenizer must be 'byte' or 'bpe:N'"):
    presets.Preset("bad", STUDENT, STUDENT, TC, TC, "x", tokenizer="wordpiece")


def test_bad_input_is_a_clear_error(data, tmp_path):
  with pytest.raises(ValueError, match="preset must be one of"):
    presets.get_preset("huge")
  with pytest.raises(ValueError, match=r"batch_size=1048576 .* needs about .* GiB"):
    Trainer(STUDENT, TC.replace(batch_size=2**20), data, TOK)
  with pytest.raises(ValueError, match="seq_len=2048"):
    check_memory(STUDENT.replace(max_len=4096), TC.replace(seq_len=2048),
                 available=64 * 2**20)
  with pytest.raises(ValueError, match="exceeds the model's max_len"):
    Trainer(STUDENT, TC.replace(seq_len=128), data, TOK)
  with pytest.raises(ValueError, match="needs a teacher"):
    Trainer(STUDENT, TC.replace(objective="distill"), data, TOK)
  for bad, match in [({"batch_size": 0}, "batch_size"), ({"grad_accum": 3}, "divisible"),
                     ({"dtype": "float16"}, "dtype"), ({"objective": "rl"}, "objective"),
                     ({"lr": 0.0}, "lr")]:
    with pytest.raises(ValueError, match=match):
      TC.replace(**bad)


def test_cli_reports_bad_input(tmp_path, capsys):
  import argparse

  from specjax.commands import train as train_cmd

  parser = argparse.ArgumentParser(prog="specjax")
  train_cmd.add_parser(parser.add_subparsers(dest="command"))

  def run(*argv):
    args = parser.parse_args(list(argv))
    try:
      return args.func(args)
    except ValueError as e:
      return str(e)

  assert "preset must be one of" in run("train", "target", "--preset", "x", "--out",
                                        str(tmp_path / "o"))
  empty = tmp_path / "empty"
  empty.mkdir()
  assert "no non-empty text files" in run("train", "target", "--corpus", str(empty), "--out",
                                          str(tmp_path / "o"))
  assert "--teacher is required" in run("train", "draft", "--corpus", str(empty), "--out",
                                        str(tmp_path / "o"))


def test_a_run_never_queues_more_than_run_ahead_unfinished_steps(monkeypatch):
  """Each dispatched step waits for the step RUN_AHEAD before it: an interrupt acts within
  RUN_AHEAD + 1 steps (an unbounded queue let Ctrl-C take 10 steps of a minute each)."""
  from specjax.training import checkpointed
  waited = []
  monkeypatch.setattr(checkpointed.jax, "block_until_ready", waited.append)
  run = checkpointed.CheckpointedRun.__new__(checkpointed.CheckpointedRun)
  steps = [{"loss": np.float32(i)} for i in range(6)]
  for i, metrics in enumerate(steps):
    run._bound_run_ahead(metrics)
    assert waited == steps[:max(0, i + 1 - run.RUN_AHEAD)]
  assert run.RUN_AHEAD <= 2
