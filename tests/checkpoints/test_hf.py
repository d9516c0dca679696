"""Hugging Face parity: specjax loads `transformers` checkpoints exactly and hands its own back.

Tiny random models of unusual shapes are built from configs and saved with
`save_pretrained`; no download: GPT-2; Llama with GQA and a non-default rope_theta; Llama 3.1
rope scaling (tied head, GQA 3:1, θ and the original context chosen so that the high,
smoothed and low frequency bands are all present); Mistral with a sliding window far shorter
than the sequences; Qwen2 with q/k/v biases and a tied head; Qwen3 with per-head q/k norms,
a head_dim that is not hidden_size / heads, and a sliding window on its last layer only.
For each family: logits, greedy generation against `generate`, speculative (chain and tree)
against plain, export -> `from_pretrained`, and the Flax msgpack layout. Needs the [hf]
extra (torch, transformers); skipped cleanly without it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from specjax.engine import decoding  # noqa: E402
from specjax.checkpoints import hf, load_model  # noqa: E402
from specjax.models.lm import LM  # noqa: E402

V = 300
TOL = 1e-4


def _hf_config(family: str, **kw):
  """A tiny config; initializer_range 0.1 keeps logits peaked enough that greedy decoding has
  no near-ties (top-2 gaps here are >= 1e-4, the parity error ~2e-6)."""
  common = dict(vocab_size=V, initializer_range=0.1, bos_token_id=None, eos_token_id=None,
                pad_token_id=None)
  if family == "gpt2":
    return transformers.GPT2Config(**{**common, "n_embd": 64, "n_layer": 2, "n_head": 4,
                                      "n_positions": 128, **kw})
  llama_like = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
  cls = {"llama": transformers.LlamaConfig, "llama3": transformers.LlamaConfig,
         "mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config,
         "qwen3": transformers.Qwen3Config}[family]
  return cls(**{**common, **llama_like, **kw})


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 20000.0, "factor": 4.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 128}
FAMILY_KW = {
    "gpt2": {},
    "llama": {"rope_theta": 50000.0},  # GQA (4 heads, 2 KV heads), non-default θ, untied head
    # head_dim 8: wavelengths 6.3 (kept), 75 (smoothed), 888 and 10560 (divided by factor)
    "llama3": {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 2,
               "tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE},
    "mistral": {"num_key_value_heads": 1, "sliding_window": 5},  # window << sequences
    "qwen2": {"tie_word_embeddings": True},  # q/k/v biases, tied head
    "qwen3": {"head_dim": 24, "num_key_value_heads": 1, "rope_theta": 30000.0,
              "use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
}
FAMILY = {"llama3": "llama"}  # test model name -> specjax family when they differ
MODEL_CLASS = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
               "llama3": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _build(family: str, seed: int, **kw):
  torch.manual_seed(seed)
  model = getattr(transformers, MODEL_CLASS[family])(_hf_config(family, **{**FAMILY_KW[family],
                                                                            **kw}))
  with torch.no_grad():  # random norms and biases (HF initialises them to 1 / 0)
    for name, p in model.named_parameters():
      if name.endswith("bias") or "norm" in name or ".ln_" in name:
        p.add_(0.1 * torch.randn_like(p))
  return model.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  """{family: (hf model, directory it was saved to)}."""
  out = {}
  for family in FAMILY_KW:
    d = tmp_path_factory.mktemp(family)
    model = _build(family, seed=0)
    model.save_pretrained(d)
    out[family] = (model, d)
  return out


def _hf_logits(model, tokens_BT: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.as_tensor(tokens_BT)).logits.float().numpy()


@jax.jit
def _forward(lm, tokens_BT, positions_BT):
  return lm(tokens_BT, positions_BT)[0]


def _sj_logits(model, tokens_BT: np.ndarray) -> np.ndarray:
  """Cache-free logits, jitted (op-by-op NNX dispatch is slower than compiling tiny graphs)."""
  b, t = tokens_BT.shape
  positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
  return np.asarray(_forward(LM.of(model), jnp.asarray(tokens_BT), jnp.asarray(positions)))


TOKENS = np.random.default_rng(0).integers(0, V, (3, 16))
PROMPTS = [list(range(1, 6)), [7, 250, 3, 99, 42, 42, 8, 1, 0], [int(x) for x in TOKENS[1, :12]]]


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILY_KW))
def test_logits_match_transformers(models, family):
  model, d = models[family]
  imported = hf.import_hf(d)
  assert imported.family == FAMILY.get(family, family)
  c = imported.config
  if family == "llama":
    assert (c.n_heads, c.n_kv_heads, c.rope_theta, c.tie_embeddings) == (4, 2, 50000.0, False)
  if family == "llama3":
    assert (c.rope_scaling, c.rope_factor, c.rope_original_max_len, c.tie_embeddings) == (
        "llama3", 4.0, 128, True)
  if family == "mistral":
    assert (c.sliding_window, c.window_first_layer) == (5, 0) and TOKENS.shape[1] > 5
  if family == "qwen2":
    assert c.qkv_bias and c.tie_embeddings
  if family == "qwen3":
    assert c.qk_norm and c.head_dim == 24 and [c.window_of(i) for i in range(2)] == [None, 6]
  theirs = _hf_logits(model, TOKENS)
  err = np.abs(_sj_logits(imported.model(), TOKENS) - theirs).max()
  assert err <= TOL, f"{family}: max |Δlogit| = {err:.3g}"
  if c.sliding_window is not None:  # control: without the window the logits diverge
    unwindowed = hf.build_model(c.replace(sliding_window=None), imported.params)
    assert np.abs(_sj_logits(unwindowed, TOKENS) - theirs).max() > 100 * TOL


def test_qwen2_sliding_window_on_the_last_layers(tmp_path):
  """Qwen2 (biases) with use_sliding_window and max_window_layers=1: layer 0 full, layer 1
  windowed to 4 positions, on 16-token sequences; logits equal transformers', and differ
  without the window (the control)."""
  model = _build("qwen2", seed=3, use_sliding_window=True, sliding_window=4, max_window_layers=1)
  model.save_pretrained(tmp_path)
  imported = hf.import_hf(tmp_path)
  c = imported.config
  assert [c.window_of(i) for i in range(2)] == [None, 4] and c.qkv_bias
  theirs = _hf_logits(model, TOKENS)
  assert np.abs(_sj_logits(imported.model(), TOKENS) - theirs).max() <= TOL
  unwindowed = hf.build_model(c.replace(sliding_window=None), imported.params)
  assert np.abs(_sj_logits(unwindowed, TOKENS) - theirs).max() > 100 * TOL


def _hf_greedy(model, prompt, n, assistant=None, k=None):
  if assistant is not None:  # pin the draft length: constant k, no confidence early stop
    assistant.generation_config.num_assistant_tokens = k
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0
  ids = torch.tensor([prompt])
  with torch.no_grad():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, num_beams=1, pad_token_id=0,
                         assistant_model=assistant)
  return out[0, len(prompt):].tolist()


def test_llama3_frequencies_equal_transformers():
  """The scaled inverse frequencies against transformers' own function (to float32 rounding:
  torch's and numpy's float32 pow differ by an ulp at some exponents)."""
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  from specjax.models.transformer import rope_frequencies
  config = _hf_config("llama3", **FAMILY_KW["llama3"])
  theirs, scale = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
  ours = rope_frequencies(hf.config_from_hf(config.to_dict())[1])
  assert scale == 1.0
  np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6, atol=0)
  plain = 1.0 / 20000.0 ** (np.arange(0, 8, 2) / 8)
  ratio = ours / plain  # one band each: kept, smoothed, divided by the factor
  assert ratio[0] == pytest.approx(1.0) and 0.25 < ratio[1] < 1 and ratio[2:] == pytest.approx(0.25)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "qwen2", "llama3", "mistral", "qwen3"])
def test_greedy_generation_matches_transformers(models, family):
  model, d = models[family]
  target, _ = load_model(d)
  ours = decoding.generate(target, PROMPTS, max_new_tokens=32).tokens
  theirs = [_hf_greedy(model, p, 32) for p in PROMPTS]
  assert ours == theirs


@pytest.mark.slow
def test_speculative_matches_assisted_generation(models, tmp_path):
  """Llama target (GQA, rope) and a draft made from its weights plus noise (so drafts are
  both accepted and rejected), k = 3 on both sides."""
  model, d = models["llama"]
  draft_hf = _build("llama", seed=0)
  with torch.no_grad():
    torch.manual_seed(1)
    for p in draft_hf.parameters():
      p.add_(0.3 * p.std() * torch.randn_like(p))
  draft_hf.save_pretrained(tmp_path / "draft")
  target, _ = load_model(d)
  draft, _ = load_model(tmp_path / "draft")
  k = 3
  spec = decoding.speculative_generate(target, draft, PROMPTS, k=k, max_new_tokens=32)
  accepted, drafted = spec.stats["accepted"].sum(), spec.stats["drafted"].sum()
  assert 0 < accepted < drafted, (accepted, drafted)
  theirs = [_hf_greedy(model, p, 32, assistant=draft_hf, k=k) for p in PROMPTS]
  assert spec.tokens == theirs
  assert spec.tokens == [_hf_greedy(model, p, 32) for p in PROMPTS]


def _perturbed(model, scale: float, seed: int):
  """The same specjax model with relative Gaussian noise on every weight (a draft that is
  accepted often but not always)."""
  rng = np.random.default_rng(seed)
  params = {k: v + scale * v.std() * rng.standard_normal(v.shape).astype(v.dtype)
            for k, v in hf.model_params(model).items()}
  return hf.build_model(model.config, params)


@pytest.mark.slow
@pytest.mark.parametrize("family,tree", [("llama3", None), ("qwen2", None),
                                         ("mistral", (2, 2, 1)), ("qwen3", "dynamic")])
def test_speculative_matches_plain(models, family, tree):
  """Greedy speculative decoding (chain k = 3, a static token tree, or an EAGLE-2 dynamic
  tree with per-row masks, verified through the sliding window) emits exactly the plain
  greedy tokens."""
  from specjax.verify import trees
  _, d = models[family]
  target, _ = load_model(d)
  draft = _perturbed(target, 0.3, seed=1)
  plain = decoding.generate(target, PROMPTS, max_new_tokens=32).tokens
  kw = ({"k": 3} if tree is None else
        {"tree": trees.DynamicTree(budget=6, depth=3, width=2)} if tree == "dynamic" else
        {"tree": trees.branching(tree)})
  spec = decoding.speculative_generate(target, draft, PROMPTS, max_new_tokens=32, **kw)
  accepted, drafted = spec.stats["accepted"].sum(), spec.stats["drafted"].sum()
  assert 0 < accepted < drafted, (accepted, drafted)
  assert spec.tokens == plain


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILY_KW))
def test_export_loads_in_transformers_with_equal_logits(models, tmp_path, family):
  model, d = models[family]
  ours, _ = load_model(d)
  hf.export_hf(ours, tmp_path / "out")
  config = json.loads((tmp_path / "out" / "config.json").read_text())
  assert config["architectures"] == [MODEL_CLASS[family]]
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  assert type(back).__name__ == MODEL_CLASS[family]
  np.testing.assert_array_equal(_hf_logits(back, TOKENS), _hf_logits(model, TOKENS))


def test_bf16_checkpoint_stays_bf16(tmp_path):
  model = _build("llama", seed=2).to(torch.bfloat16)
  model.save_pretrained(tmp_path / "bf16")
  imported = hf.import_hf(tmp_path / "bf16")
  assert imported.config.dtype == "bfloat16"
  state = {k: v.float().numpy() for k, v in model.state_dict().items()}
  np.testing.assert_array_equal(
      imported.params["blocks.0.attn.k.kernel"].astype(np.float32),
      state["model.layers.0.self_attn.k_proj.weight"].T)
  assert hf.import_hf(tmp_path / "bf16", dtype="float32").config.dtype == "float32"


def _flax_tree(family: str, state: dict) -> dict:
  """The Flax msgpack tree of a torch state dict, converted the way transformers'
  PyTorch -> Flax conversion did: GPT-2's Conv1D [in, out] -> FlaxConv1D kernel [out, in],
  LayerNorm weight -> scale; nn.Linear weight [out, in] -> Dense kernel [in, out]; Embedding
  weight -> embedding; RMSNorm weight kept. Buffers and a tied head are not parameters."""
  tree: dict = {}
  for name, p in state.items():
    if name.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")):
      continue
    x = p.numpy()
    parts = name.split(".")
    leaf = parts[-1]
    if leaf == "weight":
      if parts[-2] in ("wte", "wpe", "embed_tokens"):
        leaf = "embedding"
      elif ".ln_" in name or name.startswith("transformer.ln_f"):
        leaf = "scale"
      elif "norm" in parts[-2]:
        pass
      else:  # GPT-2 Conv1D stores [in, out], torch Linear [out, in]: both flip
        leaf, x = "kernel", x.T
    node = tree
    for part in parts[:-1]:
      node = node.setdefault(part, {})
    node[leaf] = x
  return tree


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILY_KW))
def test_flax_msgpack_import_and_export(models, tmp_path, family):
  """flax_model.msgpack from the torch weights imports with the torch logits; export back
  to Flax and re-import is bit-exact."""
  from flax import serialization
  model, d = models[family]
  state = dict(model.state_dict())
  if model.config.tie_word_embeddings:
    state.pop("lm_head.weight", None)
  flax_dir = tmp_path / "flax"
  flax_dir.mkdir()
  (flax_dir / "config.json").write_text((d / "config.json").read_text())
  (flax_dir / hf.FLAX_MSGPACK).write_bytes(serialization.msgpack_serialize(
      _flax_tree(family, state)))
  imported = hf.import_hf(flax_dir)
  assert imported.layout == "flax"
  assert np.abs(_sj_logits(imported.model(), TOKENS) - _hf_logits(model, TOKENS)).max() <= TOL
  hf.export_hf(imported.model(), tmp_path / "back", layout="flax")
  assert (tmp_path / "back" / hf.FLAX_MSGPACK).is_file()
  assert not (tmp_path / "back" / hf.SAFETENSORS).exists()
  again = hf.import_hf(tmp_path / "back")
  assert again.config == imported.config and sorted(again.params) == sorted(imported.params)
  for k, v in imported.params.items():
    np.testing.assert_array_equal(again.params[k], v, err_msg=k)


# ----------------------------------------------------------------------------- config values
# Issue 29: config.json values are checked (type, finiteness, range) before they become
# ModelConfig fields, the error naming the key; nothing is rounded or read as truthy.

GPT2_JSON = {"model_type": "gpt2", "vocab_size": 300, "n_embd": 64, "n_layer": 2, "n_head": 4,
             "n_positions": 128}
QWEN2_JSON = {"model_type": "qwen2", "vocab_size": 300, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 256}


@pytest.mark.parametrize("base, key, value", [
    (GPT2_JSON, "layer_norm_epsilon", -1.0), (GPT2_JSON, "layer_norm_epsilon", float("nan")),
    (GPT2_JSON, "n_layer", 2.5), (GPT2_JSON, "n_layer", "2"), (GPT2_JSON, "n_embd", True),
    (GPT2_JSON, "tie_word_embeddings", "no"), (GPT2_JSON, "tie_word_embeddings", 1),
    (GPT2_JSON, "n_inner", 256.5), (GPT2_JSON, "vocab_size", 0),
    (GPT2_JSON, "scale_attn_weights", 1),
    (QWEN2_JSON, "rms_norm_eps", float("inf")), (QWEN2_JSON, "num_key_value_heads", 1.5),
    (QWEN2_JSON, "rope_theta", "1e6"), (QWEN2_JSON, "rope_theta", float("nan")),
    (QWEN2_JSON, "use_sliding_window", "false"), (QWEN2_JSON, "head_dim", 16.0),
    (QWEN2_JSON, "tie_word_embeddings", "false"), (QWEN2_JSON, "max_window_layers", -1),
])
def test_config_values_are_checked_naming_the_key(base, key, value):
  config = {**base, key: value, **({"use_sliding_window": True}
                                   if key == "max_window_layers" else {})}
  with pytest.raises(ValueError, match=f"config.json: {key}"):
    hf.config_from_hf(config)


def test_config_values_that_are_fine_still_read():
  _, c = hf.config_from_hf({**GPT2_JSON, "layer_norm_epsilon": 1e-6, "tie_word_embeddings":
                            False, "n_inner": 200})
  assert (c.norm_eps, c.tie_embeddings, c.d_ff, c.n_layers) == (1e-6, False, 200, 2)
  _, c = hf.config_from_hf({**QWEN2_JSON, "rope_theta": 1000000, "use_sliding_window": True,
                            "sliding_window": 8, "max_window_layers": 1})
  assert (c.rope_theta, c.sliding_window, c.window_first_layer) == (1e6, 8, 1)
  llama3 = {**QWEN2_JSON, "model_type": "llama", "rope_scaling": {
      "rope_type": "llama3", "factor": float("nan"), "low_freq_factor": 1.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 128}}
  with pytest.raises(ValueError, match="config.json: rope_scaling.factor"):
    hf.config_from_hf(llama3)


def test_a_config_claiming_a_billion_layers_is_read_at_once_and_refused_at_import(tmp_path):
  """Nothing in the reader is sized by n_layers (Qwen2's windowed layers are not listed);
  import refuses the parameters against memory before reading a tensor."""
  import time

  from specjax.models.transformer import ModelConfig
  start = time.perf_counter()
  _, c = hf.config_from_hf({**QWEN2_JSON, "num_hidden_layers": 10**9,
                            "use_sliding_window": True, "max_window_layers": 5})
  assert (c.n_layers, c.window_first_layer) == (10**9, 5)
  small = ModelConfig.gpt2(vocab_size=300, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2,
                           d_ff=32, max_len=32)
  params = {k: np.zeros(s, np.float32) for k, s in hf.param_shapes(small).items()}
  d = hf.export_hf((small, params), tmp_path / "m")
  config = json.loads((d / "config.json").read_text())
  (d / "config.json").write_text(json.dumps({**config, "n_layer": 10**9}))
  with pytest.raises(ValueError, match=r"Hugging Face model .*n_layers=1000000000.*more than "
                     "this machine's"):
    hf.import_hf(d)
  assert time.perf_counter() - start < 10


def test_a_hf_target_by_reference_is_imported_once_and_cached_by_its_files(models, tmp_path,
                                                                         monkeypatch):
  """`specjax.load` / `resolve.load_target` of a Hugging Face directory: imported on first
  use into $SPECJAX_CACHE_DIR/hf (keyed by the files' sha256), loaded from there after, and
  imported again when a file changes; the cached model's logits equal the direct import's."""
  import shutil

  from specjax import resolve
  from specjax.checkpoints import hf
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
  src = tmp_path / "llama_dir"
  shutil.copytree(models["llama"][1], src)
  calls = []
  real = hf.import_hf
  monkeypatch.setattr(hf, "import_hf", lambda *a, **k: calls.append(a) or real(*a, **k))
  first, _ = resolve.load_target(str(src))
  assert len(calls) == 1 and len(list((tmp_path / "cache" / "hf").iterdir())) == 1
  again, _ = resolve.load_target(str(src))
  assert len(calls) == 1  # from the cache, not imported again
  tokens = np.arange(12, dtype=np.int32)[None] % first.config.vocab_size
  np.testing.assert_array_equal(_sj_logits(first, tokens), _sj_logits(again, tokens))
  np.testing.assert_allclose(_sj_logits(again, tokens), _hf_logits(models["llama"][0], tokens),
                             atol=1e-4, rtol=1e-4)
  cfg = src / "config.json"
  cfg.write_text(cfg.read_text() + "\n")  # another file: another key
  resolve.load_target(str(src))
  assert len(calls) == 2 and len(list((tmp_path / "cache" / "hf").iterdir())) == 2


def test_generate_target_dir_uses_the_cached_import(models, tmp_path, monkeypatch):
  """`generate --target DIR` (commands.models.target_from_flags) reads a Hugging Face
  directory's cached import as `bench` and `resolve.load_target` do, not a fresh import on
  every call (issue 40, item 10)."""
  import argparse
  import shutil

  from specjax.checkpoints import hf
  from specjax.commands.models import target_from_flags
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
  src = tmp_path / "llama_dir"
  shutil.copytree(models["llama"][1], src)
  calls = []
  real = hf.import_hf
  monkeypatch.setattr(hf, "import_hf", lambda *a, **k: calls.append(a) or real(*a, **k))
  args = argparse.Namespace(target=str(src), target_config=None)
  target_from_flags(args)
  target_from_flags(args)
  assert len(calls) == 1 and len(list((tmp_path / "cache" / "hf").iterdir())) == 1
