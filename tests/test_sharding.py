"""Decoding over a device mesh (`specjax.sharding`, `mesh=`): tokens identical to one device,
the partition rules, the compiled loop's collectives (HLO) and the bytes each device holds.

The mesh tests need 8 devices, and XLA's device count is fixed when JAX starts. The suite
runs with one CPU device (`device_map` sweeps split work over every local device, so eight
would change what other tests measure), so without 8 devices `test_mesh_cases_in_8_devices`
(slow) re-runs this file in a subprocess with `--xla_force_host_platform_device_count=8`
and the 8-device tests skip here; in that subprocess they all run and the driver skips.
Run them directly with `SPECJAX_TEST_MESH_CHILD=1
XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/test_sharding.py`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from specjax.engine import decoding, loop
from specjax.verify import sampling, trees
from specjax import sharding
from specjax.models.lm import LM
from specjax.drafters.eagle import EagleDrafter
from specjax.drafters.layer_skip import LayerSkipDrafter
from specjax.drafters.lookup import LookupDrafter
from specjax.drafters.medusa import MedusaDrafter
from specjax.drafters.model import ModelDrafter
from specjax.drafters.oracle import OracleDrafter
from specjax.models import transformer
from specjax.models.transformer import ModelConfig
from specjax_testing import byte_target, data  # noqa: F401 (shared fixtures)
from specjax_testing import model, perturbed

EIGHT = len(jax.devices()) >= 8
needs_8 = pytest.mark.skipif(not EIGHT, reason="run by test_mesh_cases_in_8_devices")
CHILD = "SPECJAX_TEST_MESH_CHILD"

# Llama-shaped: 8 heads, 4 KV heads (split at model=4, replicated at model=8), vocabulary
# divisible by 8. GPT-2-shaped: a vocabulary (100) model=8 does not divide (the embedding
# splits over d_model), learned positions, biases, tied head.
LLAMA = ModelConfig.llama(vocab_size=128, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4,
                          d_ff=128, max_len=256, rope_theta=500.0)
GPT2 = ModelConfig.gpt2(vocab_size=100, d_model=64, n_layers=2, n_heads=8, n_kv_heads=8,
                        d_ff=128, max_len=128)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12], [7], [3, 3, 3, 3, 3, 3, 5, 3, 3, 3, 3]]
NEW = 12


# ----------------------------------------------------------------------------- no devices needed


@pytest.mark.parametrize("text, sizes", [("data=2,model=4", (2, 4)), ("model=8", (1, 8)),
                                         (" data = 3 ", (3, 1)), ("model=1,data=1", (1, 1))])
def test_parse_mesh(text, sizes):
  assert sharding.parse_mesh(text) == sizes


@pytest.mark.parametrize("text", ["", "data=2,model", "tensor=2", "data=0", "data=2,data=2",
                                  "model=-1", "model=x"])
def test_parse_mesh_refuses(text):
  with pytest.raises(ValueError, match="--mesh must be 'data=D,model=M'"):
    sharding.parse_mesh(text)


def test_rules():
  spec = lambda path, shape, **kw: sharding.param_spec(path.split("/"), shape, 4, **kw)
  assert spec("blocks/0/attn/q/kernel", (64, 64)) == P(None, "model")
  assert spec("blocks/0/attn/k/bias", (32,)) == P("model")
  assert spec("blocks/0/attn/o/kernel", (64, 64)) == P("model", None)
  assert spec("blocks/0/attn/o/bias", (64,)) == P()
  assert spec("blocks/0/mlp/gate/kernel", (64, 128)) == P(None, "model")
  assert spec("blocks/0/mlp/down/kernel", (128, 64)) == P("model", None)
  assert spec("embed", (128, 64)) == P("model", None)
  assert spec("embed", (101, 64)) == P(None, "model")  # vocabulary does not divide
  assert spec("embed", (101, 63)) == P()
  assert spec("lm_head/kernel", (64, 128)) == P(None, "model")
  assert spec("blocks/0/attn_norm/scale", (64,)) == P()
  assert spec("pos_embed", (128, 64)) == P()
  assert spec("blocks/0/attn/k/kernel", (64, 32), heads=8, kv_heads=2) == P()  # replicated
  assert spec("blocks/0/attn/q/kernel", (64, 64), heads=8, kv_heads=2) == P(None, "model")
  assert spec("block/attn/q/kernel", (64, 64), heads=2, kv_heads=2) == P()
  assert spec("params/w", (3, 64, 64)) == P(None, None, "model")  # Medusa heads
  assert spec("lm", (32, 128)) == P(None, "model")  # EAGLE's folded LM head


def test_check_mesh_refuses():
  with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh with axes"):
    sharding.check_mesh("data=2")
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("x", "y"))
  with pytest.raises(ValueError, match=r"axes \('data', 'model'\)"):
    sharding.check_mesh(mesh)
  with pytest.raises(ValueError, match="needs 9 devices"):
    sharding.make_mesh(3, 3, devices=jax.devices()[:1] * 8)


@pytest.mark.slow
def test_mesh_cases_in_8_devices():
  """Runs this file's 8-device tests (all of them, slow or not: compiling for 8 devices
  takes this driver past the fast tier's budget) in a subprocess with 8 CPU devices."""
  if EIGHT or os.environ.get(CHILD):
    pytest.skip("8 devices here: the tests run directly")
  env = dict(os.environ, **{CHILD: "1"})
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      " --xla_force_host_platform_device_count=8").strip()
  cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
         "-k", "not test_mesh_cases_in_8_devices and not test_two_processes_match_one"]
  done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800,
                        cwd=os.path.dirname(os.path.dirname(__file__)))
  assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
  assert " passed" in done.stdout and " skipped" not in done.stdout.splitlines()[-1], \
      done.stdout[-2000:]


# ----------------------------------------------------------------------------- 8 devices


@pytest.fixture(scope="module")
def llama():
  return LM.of(model(LLAMA, seed=0, logit_scale=3.0))


@pytest.fixture(scope="module")
def draft():
  return LM.of(perturbed(model(LLAMA, seed=0, logit_scale=3.0), seed=1, noise=0.15))


def _same(target, drafter, mesh_shape, temperature=0.0, **plan):
  """Tokens of one device and of the mesh agree; returns the mesh run."""
  sampler = sampling.make_sampler(temperature)
  kw = dict(max_new_tokens=[NEW, 5, NEW, 9], sampler=sampler, seed=7)
  call = (decoding.generate if drafter is None else
          lambda *a, **k: decoding.speculative_generate(a[0], drafter, *a[1:], **k, **plan))
  one = call(target, PROMPTS, **kw)
  mesh = sharding.make_mesh(*mesh_shape)
  run = call(target, PROMPTS, mesh=mesh, **kw)
  assert run.tokens == one.tokens
  if drafter is not None:
    assert np.array_equal(run.stats["accepted"], one.stats["accepted"])
  return run


@needs_8
@pytest.mark.parametrize("mesh_shape", [(2, 4), (1, 8)])
def test_chain_tokens_match_one_device(llama, draft, mesh_shape):
  run = _same(llama, ModelDrafter.of(draft), mesh_shape, k=3)
  assert 0 < run.summary().alpha < 1


@needs_8
@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("mesh_shape", [(2, 4), (1, 8)])
def test_plain_tokens_match_one_device(llama, mesh_shape, temperature):
  _same(llama, None, mesh_shape, temperature)


@needs_8
@pytest.mark.slow
@pytest.mark.parametrize("case, mesh_shape", [
    ("chain-T1", (2, 4)), ("static-tree", (2, 4)), ("static-tree-T1", (2, 4)),
    ("dynamic-tree", (2, 4)), ("adaptive", (2, 4)), ("adaptive-T1", (2, 4)),
    ("dynamic-tree", (1, 8)), ("adaptive-T1", (1, 8))])
def test_modes_match_one_device(llama, draft, case, mesh_shape):
  temperature = 1.0 if case.endswith("T1") else 0.0
  top_k = ModelDrafter.of(draft, deterministic=True)
  plan = {"chain-T1": (ModelDrafter.of(draft), dict(k=4)),
          "static-tree": (top_k, dict(tree=trees.branching((3, 2, 1)))),
          "static-tree-T1": (ModelDrafter.of(draft), dict(tree=trees.branching((2, 2)))),
          "dynamic-tree": (top_k, dict(tree=trees.DynamicTree(budget=8, depth=3, width=2))),
          "adaptive": (ModelDrafter.of(draft), dict(k="auto")),
          "adaptive-T1": (ModelDrafter.of(draft), dict(k="auto"))}[case]
  _same(llama, plan[0], mesh_shape, temperature, **plan[1])


def _medusa_params(cfg, heads=2):
  kw, kb = jax.random.split(jax.random.key(5))
  d = cfg.d_model
  return {"w": 0.5 * jax.random.normal(kw, (heads, d, d)) / np.sqrt(d),
          "b": 0.5 * jax.random.normal(kb, (heads, d))}


@needs_8
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle", "medusa", "layer-skip", "layer-skip-own-cache",
                                  "lookup", "oracle", "gpt2-model"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafters_match_one_device(llama, kind, temperature):
  target = llama
  if kind == "gpt2-model":
    target = LM.of(model(GPT2, seed=2, logit_scale=3.0))
    drafter = ModelDrafter.of(perturbed(model(GPT2, seed=2, logit_scale=3.0), 3, 0.15))
  else:
    drafter = {
        "eagle": lambda: EagleDrafter.of(target, seed=3),
        "medusa": lambda: MedusaDrafter.of(target, _medusa_params(LLAMA)),
        "layer-skip": lambda: LayerSkipDrafter.of(target, 1),
        "layer-skip-own-cache": lambda: LayerSkipDrafter.of(target, 1, share_cache=False),
        "lookup": lambda: LookupDrafter(max_ngram=2),
        "oracle": lambda: OracleDrafter.of(target, 0.7),
    }[kind]()
  plan = dict(tree=trees.branching((2, 1))) if kind == "medusa" else dict(k=2)
  _same(target, drafter, (2, 4), temperature, **plan)


@needs_8
def test_compiles_once_and_refuses(llama):
  mesh = sharding.make_mesh(2, 4)
  jax.clear_caches()  # earlier tests may have compiled this loop already
  before = loop.TRACE_COUNTS["generate"]
  for seed in (0, 1):
    decoding.generate(llama, PROMPTS, max_new_tokens=4, seed=seed, mesh=mesh)
  assert loop.TRACE_COUNTS["generate"] - before == 1
  with pytest.raises(ValueError, match="mesh data=2 must divide the batch"):
    sharding.place_batch(mesh, *(np.zeros((3, 8), np.int32), np.ones(3), np.ones(3)))
  odd = LM.of(model(LLAMA.replace(n_heads=4, n_kv_heads=4), seed=0))
  with pytest.raises(ValueError, match=r"mesh model=8 must divide the target's n_heads \(4\)"):
    decoding.generate(odd, PROMPTS, max_new_tokens=4, mesh=sharding.make_mesh(1, 8))


@needs_8
@pytest.mark.slow
@pytest.mark.parametrize("case", ["plain", "plain-T1", "chain-T1", "static-tree-T1",
                                  "adaptive-T1"])
def test_batch_that_data_does_not_divide_is_padded(llama, draft, case):
  """3 prompts on data=2 (and 5 on data=4): padded with one-token rows that the result
  drops; the kept rows' tokens and statistics are the one-device run's, at T = 1 too."""
  temperature = 1.0 if case.endswith("T1") else 0.0
  plan = {"chain-T1": dict(k=3), "static-tree-T1": dict(tree=trees.branching((2, 2))),
          "adaptive-T1": dict(k="auto")}.get(case)
  sampler = sampling.make_sampler(temperature)
  configurations = ((PROMPTS[:3], (2, 4)), (PROMPTS + [[9, 9]], (4, 2)))
  for prompts, mesh_shape in configurations[:1 if case.startswith("adaptive") else 2]:
    kw = dict(max_new_tokens=NEW, sampler=sampler, seed=11)
    if plan is None:
      one = decoding.generate(llama, prompts, **kw)
      run = decoding.generate(llama, prompts, mesh=sharding.make_mesh(*mesh_shape), **kw)
    else:
      drafter = ModelDrafter.of(draft)
      one = decoding.speculative_generate(llama, drafter, prompts, **kw, **plan)
      run = decoding.speculative_generate(llama, drafter, prompts,
                                          mesh=sharding.make_mesh(*mesh_shape), **kw, **plan)
      for name, x in run.stats.items():
        assert np.array_equal(x, one.stats[name]), name
    assert len(run.tokens) == len(prompts) and run.tokens == one.tokens
    assert run.prompt_lengths == [len(p) for p in prompts]


# ----------------------------------------------------------------------------- the compiled loop


def _gathers(hlo: str) -> list[tuple[int, ...]]:
  """The result shapes of every all-gather in an HLO module's text."""
  found = re.findall(r"=\s*\(?\w+\[([\d,]*)\][^=]*?\ball-gather(?:-start)?\(", hlo)
  return [tuple(int(n) for n in s.split(",") if n) for s in found]


def _loop_hlo(target, drafter, mesh, tree) -> str:
  batch = decoding.prepare_batch(PROMPTS, vocab_size=LLAMA.vocab_size, max_len=LLAMA.max_len,
                                 max_new_tokens=NEW, slots=tree.n_nodes)
  args = sharding.place_args(mesh, (target, drafter, batch.prompt_BP, batch.prompt_len_B,
                                    batch.budget_B, jnp.asarray([-1], jnp.int32),
                                    sampling.make_sampler(0.0), jax.random.key(0)), models=2)
  with sharding.on(mesh):
    lowered = loop.speculative_jit.lower(*args, tree=tree, cache_len=batch.cache_len)
    return lowered.compile().as_text()


def _weight_shapes(*lms) -> set[tuple[int, ...]]:
  return {tuple(x.shape) for lm in lms for x in jax.tree.leaves(lm.params) if x.ndim >= 2}


@needs_8
def test_loop_gathers_no_whole_weight(llama, draft, monkeypatch):
  """The compiled speculative loop (prefill, drafting, verification) all-gathers no whole
  weight matrix; the negative control replicates every gathered kernel before its product
  and the same check finds the gathers."""
  mesh = sharding.make_mesh(2, 4)
  drafter = ModelDrafter.of(draft)
  weights = _weight_shapes(llama, draft)
  for tree in (trees.chain(3), trees.branching((2, 2))):  # a tree also compacts its cache
    hlo = _loop_hlo(llama, drafter, mesh, tree)
    assert "all-reduce" in hlo  # the row-split products' reductions: the model is split
    assert not [s for s in _gathers(hlo) if s in weights]

  def replicated(self, x):  # the planted bug: every kernel gathered whole before its product
    w = jax.lax.with_sharding_constraint(self.kernel[...], P())
    y = jnp.einsum("...i,io->...o", x.astype(w.dtype), w, preferred_element_type=jnp.float32)
    return y if self.bias is None else y + self.bias[...].reshape((1,) * (y.ndim - 1) + (-1,))

  monkeypatch.setattr(transformer.Dense, "__call__", replicated)
  jax.clear_caches()
  bad = _loop_hlo(llama, drafter, mesh, trees.chain(3))
  assert [s for s in _gathers(bad) if s in weights]


@needs_8
def test_bytes_per_device(llama):
  """Placed weights: each device holds about 1/M of the matrices (norms are replicated)."""
  mesh = sharding.make_mesh(2, 4)
  placed, _ = sharding.place(mesh, llama)
  total = sum(x.nbytes for x in jax.tree.leaves(llama.params))
  replicated = sum(x.nbytes for x in jax.tree.leaves(llama.params) if x.ndim == 1)
  per_device = sharding.bytes_per_device(placed)
  assert len(per_device) == 8
  for n in per_device.values():
    assert n <= (total - replicated) / 4 * 1.01 + replicated
    assert n >= (total - replicated) / 4 * 0.99


# ----------------------------------------------------------------------------- restored into place


def _check_in_place(loaded, reference, mesh):
  """Every weight sits in its shards (each device ≈ 1/M of the matrices) and equals the
  reference model's."""
  lm = LM.of(loaded)
  m = mesh.shape["model"]
  leaves = jax.tree.leaves(lm.params)
  total = sum(x.nbytes for x in leaves)
  replicated = sum(x.nbytes for x in leaves if x.ndim == 1 or not x.sharding.spec)
  per_device = sharding.bytes_per_device(lm.params)
  assert len(per_device) == mesh.size
  assert replicated < 0.05 * total
  for n in per_device.values():
    assert (total - replicated) / m * 0.99 <= n <= (total - replicated) / m * 1.01 + replicated
  for x in leaves:
    assert isinstance(x.sharding, jax.sharding.NamedSharding)
  for a, b in zip(leaves, jax.tree.leaves(LM.of(reference).params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@needs_8
@pytest.mark.parametrize("kind", ["orbax", "hf"])
def test_load_into_place(tmp_path, kind):
  """orbax restore and a Hugging Face import read each weight straight into its shards."""
  from specjax import checkpoints
  from specjax.checkpoints import hf
  reference = model(LLAMA.replace(tie_embeddings=False), seed=4)
  where = tmp_path / kind
  if kind == "orbax":
    checkpoints.save_model(where, reference)
  else:
    hf.export_hf(reference, where)
  mesh = sharding.make_mesh(2, 4)
  loaded, _ = checkpoints.load_model(where, mesh=mesh)
  _check_in_place(loaded, reference, mesh)
  run = decoding.generate(loaded, PROMPTS, max_new_tokens=4, mesh=mesh)
  assert run.tokens == decoding.generate(reference, PROMPTS, max_new_tokens=4).tokens


@needs_8
def test_too_big_for_one_device_loads_onto_the_mesh(tmp_path, monkeypatch):
  """A model larger than one accelerator's memory is refused on one device and loads onto a
  mesh whose model axis splits it small enough (the memory check counts the mesh)."""
  from specjax import checkpoints
  reference = model(LLAMA, seed=4)
  checkpoints.save_model(tmp_path / "m", reference)
  need = transformer.param_bytes(LLAMA)
  monkeypatch.setattr(transformer, "machine_memory", lambda: (need // 3, "fake HBM memory"))
  with pytest.raises(ValueError, match="more than this machine's"):
    checkpoints.load_model(tmp_path / "m")
  mesh = sharding.make_mesh(2, 4)
  loaded, _ = checkpoints.load_model(tmp_path / "m", mesh=mesh)
  _check_in_place(loaded, reference, mesh)


@needs_8
def test_cache_checked_per_device(monkeypatch):
  """On an accelerator mesh the KV cache's memory check counts each device's share (KV-head
  groups x data shards); without a mesh the whole cache must fit one device."""
  from specjax.models import cache as kv
  monkeypatch.setattr(kv, "_device_stats", lambda: {"bytes_limit": 1})
  need = kv.cache_bytes(LLAMA, 4, 1024)
  with pytest.raises(ValueError, match="lower batch or max_len"):
    kv.check_fits(LLAMA, 4, 1024, available=need // 4)
  with sharding.on(sharding.make_mesh(2, 4)):  # 4 KV heads over model=4, 4 rows over data=2
    kv.check_fits(LLAMA, 4, 1024, available=need // 4)
    with pytest.raises(ValueError, match="lower batch or max_len"):
      kv.check_fits(LLAMA, 4, 1024, available=need // 8)


# ----------------------------------------------------------------------------- training


@needs_8
@pytest.mark.slow
def test_training_data_parallel(data, byte_target, tmp_path):  # noqa: F811 (fixtures)
  """A language model and a Medusa head trained data-parallel over 4 devices (rows split,
  weights replicated) follow the one-device run to rounding (the gradient's sums are
  reduced in another order)."""
  from specjax.training.heads import HeadTrainer
  from specjax.training.medusa import MedusaHeads
  from specjax.training.trainer import Trainer
  from specjax_testing import TC, TCFG, TOK
  tc = TC.replace(steps=3)
  mesh = sharding.make_mesh(4, 2)
  one = Trainer(TCFG, tc, data, TOK, progress=False).run()
  dp = Trainer(TCFG, tc, data, TOK, progress=False, mesh=mesh, out_dir=tmp_path / "lm").run()
  np.testing.assert_allclose(dp.val["nll"], one.val["nll"], rtol=1e-4)
  for a, b in zip(jax.tree.leaves(dp.params), jax.tree.leaves(one.params)):
    assert a.sharding.spec == P() and len(a.sharding.device_set) == 8
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-5)
  with pytest.raises(ValueError, match="mesh data=8 must divide the micro-batch"):
    Trainer(TCFG, tc.replace(batch_size=4), data, TOK, progress=False,
            mesh=sharding.make_mesh(8, 1))
  kind = MedusaHeads(heads=2)
  heads = [HeadTrainer(kind, TCFG, byte_target[1], tc, data, TOK, progress=False, **kw).run()
           for kw in ({}, {"mesh": mesh})]
  for a, b in zip(jax.tree.leaves(heads[1].params), jax.tree.leaves(heads[0].params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-5)


# ----------------------------------------------------------------------------- two processes


def two_process_case(mesh=None) -> list:
  """The tokens of the two-process test's run (chain of 3, model drafter, ragged batch)."""
  target = LM.of(model(LLAMA, seed=0, logit_scale=3.0))
  drafter = ModelDrafter.of(perturbed(model(LLAMA, seed=0, logit_scale=3.0), 1, 0.15))
  run = decoding.speculative_generate(target, drafter, PROMPTS, k=3, max_new_tokens=[8, 5, 8, 6],
                                      mesh=mesh)
  return run.tokens


@pytest.mark.slow
def test_two_processes_match_one():
  """Two local processes (`jax.distributed`, coordinator on localhost, 4 CPU devices each)
  decode over one (2, 4) mesh spanning both: each gets the one-process tokens."""
  if os.environ.get(CHILD):
    pytest.skip("run by the parent process")
  import socket
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = str(s.getsockname()[1])
  script = os.path.join(os.path.dirname(__file__), "multihost_decode.py")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  procs = [subprocess.Popen([sys.executable, script, str(i), port], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in (0, 1)]
  outs = []
  for p in procs:
    try:
      outs.append(p.communicate(timeout=900)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
  want = two_process_case()
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-4000:]
    line = [x for x in out.splitlines() if x.startswith("TOKENS ")]
    assert line and json.loads(line[-1][len("TOKENS "):]) == want, out[-2000:]


# ----------------------------------------------------------------------------- the CLI


def test_cli_mesh_refusals(capsys):
  from specjax import cli
  assert cli.main(["generate", "--max-new-tokens", "2", "--mesh", "data=64,model=64"]) == 2
  assert "mesh data=64, model=64 needs 4096 devices" in capsys.readouterr().err
  assert sharding.check_mesh(None) is None  # the command's default mesh is gone after it


@needs_8
@pytest.mark.slow
def test_cli_generate_on_a_mesh(monkeypatch, capsys):
  """`specjax generate --mesh` decodes on the mesh (every loop call placed on it) and its
  speculative tokens equal its plain ones."""
  from specjax import cli
  meshes = []
  place = sharding.place_args
  monkeypatch.setattr(sharding, "place_args",
                      lambda mesh, *a, **k: meshes.append(mesh) or place(mesh, *a, **k))
  assert cli.main(["generate", "--target-config", "tiny-llama", "--max-new-tokens", "6",
                   "--repeats", "1", "--mesh", "data=1,model=2", "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["identical_to_plain"]
  assert meshes and all(m is not None and dict(m.shape) == {"data": 1, "model": 2}
                        for m in meshes)


@needs_8
def test_forward_agrees_to_rounding(llama):
  """The target's logits on a (2, 4) mesh equal one device's to float32 rounding, not bit for
  bit: o and down are summed per device, then across devices (another order)."""
  tokens = jnp.asarray(np.arange(32).reshape(4, 8) % LLAMA.vocab_size, jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (4, 8))
  forward = jax.jit(lambda lm, t, p: lm(t, p)[0])
  one = np.asarray(forward(llama, tokens, positions))
  mesh = sharding.make_mesh(2, 4)
  placed, _ = sharding.place(mesh, llama)
  with sharding.on(mesh):
    split = np.asarray(forward(placed, *sharding.place_batch(mesh, tokens, positions)))
  np.testing.assert_allclose(split, one, rtol=1e-5, atol=1e-5)
  assert np.array_equal(split.argmax(-1), one.argmax(-1))
