"""Hugging Face parity: specjax loads `transformers` checkpoints exactly and hands its own back.

Tiny random models (GPT-2, Llama with GQA and a non-default rope_theta, Mistral, Qwen2 with
q/k/v biases) are built from configs and saved with `save_pretrained`; no download. Needs the
[hf] extra (torch, transformers); skipped cleanly without it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from specjax import decoding  # noqa: E402
from specjax.checkpoints import hf, load_model  # noqa: E402

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
  cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
         "qwen2": transformers.Qwen2Config}[family]
  return cls(**{**common, **llama_like, **kw})


FAMILY_KW = {
    "gpt2": {},
    "llama": {"rope_theta": 50000.0},  # GQA (4 heads, 2 KV heads), non-default θ, untied head
    "mistral": {"num_key_value_heads": 1, "sliding_window": 128},
    "qwen2": {"tie_word_embeddings": True},  # q/k/v biases, tied head
}
MODEL_CLASS = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
               "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


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


def _sj_logits(model, tokens_BT: np.ndarray) -> np.ndarray:
  b, t = tokens_BT.shape
  positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
  logits, _, _ = model(jnp.asarray(tokens_BT), jnp.asarray(positions))
  return np.asarray(logits)


TOKENS = np.random.default_rng(0).integers(0, V, (3, 16))
PROMPTS = [list(range(1, 6)), [7, 250, 3, 99, 42, 42, 8, 1, 0], [int(x) for x in TOKENS[1, :12]]]


@pytest.mark.parametrize("family", list(FAMILY_KW))
def test_logits_match_transformers(models, family):
  model, d = models[family]
  imported = hf.import_hf(d)
  assert imported.family == family
  c = imported.config
  if family == "llama":
    assert (c.n_heads, c.n_kv_heads, c.rope_theta, c.tie_embeddings) == (4, 2, 50000.0, False)
  if family == "qwen2":
    assert c.qkv_bias and c.tie_embeddings
  err = np.abs(_sj_logits(imported.model(), TOKENS) - _hf_logits(model, TOKENS)).max()
  assert err <= TOL, f"{family}: max |Δlogit| = {err:.3g}"


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


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_greedy_generation_matches_transformers(models, family):
  model, d = models[family]
  target, _ = load_model(d)
  ours = decoding.generate(target, PROMPTS, max_new_tokens=32).tokens
  theirs = [_hf_greedy(model, p, 32) for p in PROMPTS]
  assert ours == theirs


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


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_export_loads_in_transformers_with_equal_logits(models, tmp_path, family):
  model, d = models[family]
  ours, _ = load_model(d)
  hf.export_hf(ours, tmp_path / "out")
  config = json.loads((tmp_path / "out" / "config.json").read_text())
  assert config["architectures"] == [MODEL_CLASS[family]]
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  assert type(back).__name__ == MODEL_CLASS[family]
  np.testing.assert_array_equal(_hf_logits(back, TOKENS), _hf_logits(model, TOKENS))


def test_mistral_exports_as_llama(models, tmp_path):
  model, d = models["mistral"]
  ours, _ = load_model(d)
  hf.export_hf(ours, tmp_path / "out")
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  assert type(back).__name__ == "LlamaForCausalLM"
  assert np.abs(_hf_logits(back, TOKENS) - _hf_logits(model, TOKENS)).max() <= TOL


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


def test_flax_msgpack_layout_matches_torch_gpt2(models, tmp_path):
  """Build flax_model.msgpack from the torch weights the way transformers' PyTorch->Flax
  conversion did (Conv1D [in, out] -> FlaxConv1D kernel [out, in]; LayerNorm weight -> scale;
  Embedding weight -> embedding) and check the import against the torch logits."""
  from flax import serialization
  model, d = models["gpt2"]
  tree: dict = {}
  for name, p in model.state_dict().items():
    if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
      continue  # buffers and the tied head are not Flax parameters
    x = p.numpy()
    parts = name.split(".")
    leaf = parts[-1]
    if leaf == "weight":
      if ".ln_" in name:
        leaf = "scale"
      elif parts[-2] in ("wte", "wpe"):
        leaf = "embedding"
      else:
        leaf, x = "kernel", x.T
    node = tree
    for part in parts[:-1]:
      node = node.setdefault(part, {})
    node[leaf] = x
  flax_dir = tmp_path / "flax"
  flax_dir.mkdir()
  (flax_dir / "config.json").write_text((d / "config.json").read_text())
  (flax_dir / hf.FLAX_MSGPACK).write_bytes(serialization.msgpack_serialize(tree))
  imported = hf.import_hf(flax_dir)
  assert imported.layout == "flax"
  assert np.abs(_sj_logits(imported.model(), TOKENS) - _hf_logits(model, TOKENS)).max() <= TOL
