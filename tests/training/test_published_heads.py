"""Published draft heads (EAGLE-1/2, Medusa-1): import, parity with a reference forward
written here in torch from each format's description, exactness through the loop, export
and the round trip (`specjax.training.published`, `specjax import-head` / `export-head`).

The target is a small Llama with random weights written by transformers; the heads have
random weights in the published layouts. The references share nothing with specjax but
the weights: the target's hidden states come from transformers, the head's forward is
written below (RMSNorm, half-split rotary embedding, grouped-query attention over the
head's own growing cache, SwiGLU)."""

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402

import specjax  # noqa: E402
from specjax import cli, resolve  # noqa: E402
from specjax.engine import decoding, loop
from specjax.exactness import planted_bugs
from specjax.verify import sampling, trees
from specjax.checkpoints import hf  # noqa: E402
from specjax.training import published
from specjax.training.published import eagle as eagle_format  # noqa: E402
from specjax.drafters import medusa as medusa_drafter  # noqa: E402
from specjax.models.lm import LM  # noqa: E402
from specjax.drafters.base import Context
from specjax.training.heads import load_head, save_head  # noqa: E402
from specjax.training.medusa import MedusaHeads  # noqa: E402
from specjax_testing import (FALSE_ALARM, PROMPT, TC, TOK, assert_greedy_identity,  # noqa: E402
                             byte_target, data, exact_joint, first_three, joint_pvalue,
                             joint_target)

V, D, H, KV, F, N_LAYERS, THETA, EPS = 96, 32, 4, 2, 64, 3, 1000.0, 1e-5
HD = D // H
PROMPT_IDS = [3, 17, 5, 42, 8, 11, 29]
STEPS = 4  # drafting steps compared (the head's cache grows by one entry per step)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
  """(HF directory, the transformers model, the specjax import of it)."""
  d = tmp_path_factory.mktemp("target")
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=F,
                                 num_hidden_layers=N_LAYERS, num_attention_heads=H,
                                 num_key_value_heads=KV, max_position_embeddings=128,
                                 initializer_range=0.2, rope_theta=THETA, rms_norm_eps=EPS,
                                 tie_word_embeddings=False, bos_token_id=None,
                                 eos_token_id=None, pad_token_id=None)
  model = transformers.LlamaForCausalLM(cfg).eval()
  model.save_pretrained(d)
  return d, model, hf.import_hf(d, dtype="float32").model()


def _randn(g, *shape, scale=0.17):
  return torch.randn(*shape, generator=g) * scale


def eagle_tensors(seed: int, *, d=D, h=H, kv=KV, f=F, vocab=V, bias=True, embed=False) -> dict:
  """A random EAGLE-1/2 head in the published layout (with a random copy of an embedding
  when `embed`: another model's)."""
  g = torch.Generator().manual_seed(seed)
  hd = d // h
  w = {"fc.weight": _randn(g, d, 2 * d),
       "layers.0.self_attn.q_proj.weight": _randn(g, h * hd, d),
       "layers.0.self_attn.k_proj.weight": _randn(g, kv * hd, d),
       "layers.0.self_attn.v_proj.weight": _randn(g, kv * hd, d),
       "layers.0.self_attn.o_proj.weight": _randn(g, d, h * hd),
       "layers.0.post_attention_layernorm.weight": 1 + _randn(g, d, scale=0.1),
       "layers.0.mlp.gate_proj.weight": _randn(g, f, d),
       "layers.0.mlp.up_proj.weight": _randn(g, f, d),
       "layers.0.mlp.down_proj.weight": _randn(g, d, f)}
  if embed:
    w["embed_tokens.weight"] = _randn(g, vocab, d)
  if bias:
    w["fc.bias"] = _randn(g, d)
  return w


def eagle_config(**extra) -> dict:
  return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": D,
          "intermediate_size": F, "num_attention_heads": H, "num_key_value_heads": KV,
          "num_hidden_layers": 1, "rms_norm_eps": EPS, "rope_theta": THETA, "vocab_size": V,
          "bias": True, **extra}


def write_head(d, tensors: dict, config: dict, name: str):
  d.mkdir(parents=True, exist_ok=True)
  (d / "config.json").write_text(json.dumps(config))
  if name.endswith(".safetensors"):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / name))
  else:
    torch.save(tensors, d / name)
  return d


# ----------------------------------------------------------------------------- references


def _rms(x, w):
  return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rotary(x, pos):  # x [T, heads, HD]; the half-split layout
  inv = 1.0 / (THETA ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD))
  ang = pos[:, None].double() * inv[None]
  cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None].float()
  sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None].float()
  x1, x2 = x.chunk(2, -1)
  return x * cos + torch.cat([-x2, x1], -1) * sin


class RefEagle:
  """The EAGLE-1/2 head from its description: fc([e; f]), one Llama layer without an input
  norm, its own KV cache; the target's LM head reads the layer's output directly."""

  def __init__(self, w: dict):
    self.w, self.keys, self.values, self.pos = w, [], [], []

  def __call__(self, feature, emb, pos):  # [T, D], [T, D], [T] -> [T, D]
    w = self.w
    x = torch.cat([emb, feature], -1) @ w["fc.weight"].T + w.get("fc.bias", 0.0)
    lin = lambda n, a: a @ w[f"layers.0.{n}.weight"].T + w.get(f"layers.0.{n}.bias", 0.0)  # noqa: E731,E501
    t = x.shape[0]
    q = _rotary(lin("self_attn.q_proj", x).view(t, H, HD), pos)
    k = _rotary(lin("self_attn.k_proj", x).view(t, KV, HD), pos)
    self.keys.append(k)
    self.values.append(lin("self_attn.v_proj", x).view(t, KV, HD))
    self.pos.append(pos)
    keys = torch.cat(self.keys).repeat_interleave(H // KV, dim=1)
    values = torch.cat(self.values).repeat_interleave(H // KV, dim=1)
    kpos = torch.cat(self.pos)
    scores = torch.einsum("thd,shd->hts", q, keys) / math.sqrt(HD)
    scores = scores.masked_fill(kpos[None, None, :] > pos[None, :, None], -math.inf)
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), values).reshape(t, D)
    x = x + lin("self_attn.o_proj", attn)
    m = _rms(x, w["layers.0.post_attention_layernorm.weight"])
    return x + lin("mlp.down_proj", torch.nn.functional.silu(lin("mlp.gate_proj", m))
                   * lin("mlp.up_proj", m))


def ref_eagle_logprobs(model, w, ids, root, drafted) -> np.ndarray:
  """log-softmax of the reference head's logits at drafting steps 1..len(drafted)+1, the
  chain root -> drafted[0] -> ... (the target's hidden states after its final norm)."""
  with torch.no_grad():
    feats = model.model(torch.tensor([ids])).last_hidden_state[0]
    emb, head = model.model.embed_tokens, model.lm_head
    ref = RefEagle(w)
    n = len(ids)
    out = ref(feats, emb(torch.tensor(ids[1:] + [root])), torch.arange(n))[-1:]
    rows = [head(out)[0]]
    for j, tok in enumerate(drafted):
      out = ref(out, emb(torch.tensor([tok])), torch.tensor([n + j]))
      rows.append(head(out)[0])
    return torch.log_softmax(torch.stack(rows), -1).numpy()


@jax.jit  # jitted once: op-by-op dispatch of the head is slower than compiling it
def _draft_chain(lm, drafter, prompt_1P, buf_1S, key):
  """The proposal of a sampled chain of STEPS at temperature 1 after the prompt."""
  tree, n = trees.chain(STEPS), prompt_1P.shape[1]
  features = lm(prompt_1P, jnp.arange(n, dtype=jnp.int32)[None],
                capture=drafter.feature_layers)[3]
  state = drafter.init(prompt_1P, jnp.asarray([n]), 64, tree, features)
  ctx = Context(tokens=buf_1S, length=jnp.asarray([n]))
  return drafter.propose(state, ctx, tree, sampling.make_sampler(1.0), key)[0]


def ours_eagle(target_module, head_dir, ids, root, key=0):
  """(drafted tokens [STEPS - 1], log q [STEPS, V]) of a sampled chain of STEPS from the
  imported head (`eagle:DIR` through the resolver), at temperature 1: q's rows are the laws
  of the root's child and of drafted nodes 1..STEPS - 1's (the last node's is not drafted)."""
  drafter, _ = resolve.make_drafter(f"eagle:{head_dir}", target_module, k=STEPS)
  prompt = jnp.asarray([ids], jnp.int32)
  buf = jnp.zeros((1, 64), jnp.int32).at[0, :len(ids) + 1].set(jnp.asarray(ids + [root]))
  prop = _draft_chain(LM.of(target_module), drafter, prompt, buf, jax.random.key(key))
  return [int(t) for t in prop.tokens[0, :STEPS - 1]], np.log(np.asarray(prop.q[0, :STEPS]))


def eagle_error(target, head_dir, w, key=0) -> float:
  """Largest |log q - log p_ref| over STEPS drafting steps."""
  _, model, ours = target
  root = 7
  drafted, logq = ours_eagle(ours, head_dir, PROMPT_IDS, root, key)
  ref = ref_eagle_logprobs(model, w, PROMPT_IDS, root, drafted)
  return float(np.max(np.abs(logq - ref)))


# ----------------------------------------------------------------------------- EAGLE-1/2


@pytest.fixture(scope="module")
def eagle_src(tmp_path_factory):
  w = eagle_tensors(1)
  return write_head(tmp_path_factory.mktemp("eagle") / "src", w, eagle_config(),
                    "pytorch_model.bin"), w


@pytest.fixture(scope="module")
def eagle_head(target, eagle_src, tmp_path_factory):
  out = tmp_path_factory.mktemp("eagle-imported") / "head"
  published.import_head(eagle_src[0], target[2], out)  # kind read from the files
  return out


def test_eagle_draft_logits_match_the_reference(target, eagle_src, eagle_head):
  assert published.detect_kind(eagle_src[0]) == "eagle"
  assert load_head(eagle_head).kind.structure == "eagle"
  for key in (0, 1):
    assert eagle_error(target, eagle_head, eagle_src[1], key) < 1e-4


def test_a_transposed_fc_fails_parity(target, eagle_src, tmp_path, monkeypatch):
  """Planted bug: fc.weight reshaped instead of transposed on import."""
  monkeypatch.setattr(eagle_format, "fc_kernel", lambda w: np.reshape(w, w.shape[::-1]))
  published.import_head(eagle_src[0], target[2], tmp_path / "bad")
  assert eagle_error(target, tmp_path / "bad", eagle_src[1]) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("tree", [trees.chain(3), trees.branching((2, 1)),
                                  trees.DynamicTree(6, 3, 2)], ids=["chain", "tree", "dynamic"])
def test_eagle_speculative_equals_plain_at_t0(target, eagle_head, tree):
  drafter, _ = resolve.make_drafter(f"eagle:{eagle_head}", target[2], tree=tree)
  assert_greedy_identity(target[2], drafter, tree, 12, mixed_alpha=False)


@pytest.mark.slow
def test_a_qwen2_head_carries_its_qkv_biases(tmp_path):
  """A Qwen2 target's EAGLE head has q/k/v biases, as its layers: mapped by the family's own
  key map (parity with the reference, which adds them); without them it is refused."""
  torch.manual_seed(1)
  cfg = transformers.Qwen2Config(vocab_size=V, hidden_size=D, intermediate_size=F,
                                 num_hidden_layers=2, num_attention_heads=H,
                                 num_key_value_heads=KV, max_position_embeddings=128,
                                 rope_theta=THETA, rms_norm_eps=EPS, tie_word_embeddings=False,
                                 initializer_range=0.2, bos_token_id=None, eos_token_id=None,
                                 pad_token_id=None)
  model = transformers.Qwen2ForCausalLM(cfg).eval()
  model.save_pretrained(tmp_path / "qwen2")
  qwen = (tmp_path / "qwen2", model, hf.import_hf(tmp_path / "qwen2", dtype="float32").model())
  w = eagle_tensors(7)
  g = torch.Generator().manual_seed(8)
  for n, width in (("q", H * HD), ("k", KV * HD), ("v", KV * HD)):
    w[f"layers.0.self_attn.{n}_proj.bias"] = _randn(g, width)
  published.import_head(write_head(tmp_path / "src", w, eagle_config(), "model.safetensors"),
                        qwen[2], tmp_path / "head")
  assert eagle_error(qwen, tmp_path / "head", w) < 1e-4
  del w["layers.0.self_attn.k_proj.bias"]
  with pytest.raises(ValueError, match=r"missing tensor 'layers\.0\.self_attn\.k_proj\.bias'"):
    published.import_head(write_head(tmp_path / "src2", w, eagle_config(), "model.safetensors"),
                          qwen[2], tmp_path / "head2")


def test_an_eagle_head_for_gpt2_is_refused(tmp_path):
  from specjax_testing import TINY, model
  src = write_head(tmp_path / "src", eagle_tensors(2), eagle_config(), "model.safetensors")
  with pytest.raises(ValueError, match="RoPE-family model .* not gpt2"):
    published.import_head(src, model(TINY["gpt2"]), tmp_path / "out", kind="eagle")


def test_shapes_that_do_not_fit_are_refused_naming_the_tensor(target, tmp_path):
  src = write_head(tmp_path / "wide", eagle_tensors(2, f=2 * F), eagle_config(),
                   "model.safetensors")
  with pytest.raises(ValueError, match=r"'layers\.0\.mlp\.gate_proj\.weight' has shape "
                     r"\(128, 32\) but the target needs \(64, 32\)"):
    published.import_head(src, target[2], tmp_path / "out")
  assert not (tmp_path / "out").exists()
  src = write_head(tmp_path / "narrow", eagle_tensors(2, d=16, h=2, kv=1), eagle_config(),
                   "model.safetensors")
  with pytest.raises(ValueError, match=r"'fc\.weight' has shape \(16, 32\) but the target "
                     r"needs \(32, 64\)"):
    published.import_head(src, target[2], tmp_path / "out")


def test_eagle_round_trip_is_bit_identical(target, eagle_head, tmp_path):
  published.export_head(eagle_head, target[2], tmp_path / "hf", format="eagle")
  cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert cfg["num_hidden_layers"] == 1 and cfg["hidden_size"] == D and cfg["bias"] is True
  published.import_head(tmp_path / "hf", target[2], tmp_path / "again", kind="eagle")
  a = ours_eagle(target[2], eagle_head, PROMPT_IDS, 7)
  b = ours_eagle(target[2], tmp_path / "again", PROMPT_IDS, 7)
  assert a[0] == b[0] and np.array_equal(a[1], b[1])


@pytest.mark.slow
def test_a_head_we_train_in_the_eagle_structure_round_trips(tmp_path, data, byte_target):
  """Our trainer with the published structure (EagleHeads(structure="eagle")): its head
  exports to the format and comes back with the same parameters and draft law, bit for bit."""
  import dataclasses

  from flax import nnx

  from specjax.training.eagle import EagleHeads
  from specjax.training.heads import train_head
  target_module, params = byte_target
  kind = EagleHeads(steps=2, structure="eagle", bias=True)
  train_head(kind, target_module.config, params, dataclasses.replace(TC, steps=4), data, TOK,
             out_dir=tmp_path / "trained", progress=False)
  published.export_head(tmp_path / "trained", target_module, tmp_path / "hf", format="eagle")
  published.import_head(tmp_path / "hf", target_module, tmp_path / "again")
  a, b = load_head(tmp_path / "trained"), load_head(tmp_path / "again")
  assert b.kind.structure == "eagle" and b.kind.bias
  for x, y in zip(jax.tree.leaves(nnx.to_pure_dict(a.params)),
                  jax.tree.leaves(nnx.to_pure_dict(b.params))):
    assert np.array_equal(np.asarray(x), np.asarray(y))
  first = ours_eagle(target_module, tmp_path / "trained", PROMPT_IDS, 7)
  again = ours_eagle(target_module, tmp_path / "again", PROMPT_IDS, 7)
  assert first[0] == again[0] and np.array_equal(first[1], again[1])


def test_specjax_train_eagle_takes_the_structure():
  from specjax.commands import train
  from specjax.training.eagle import EagleHeads
  args = cli.build_parser().parse_args(["train", "eagle", "--target", "default", "--structure",
                                        "eagle", "--out", "x"])
  assert train._eagle_kind(args) == EagleHeads(structure="eagle", bias=True)


def test_our_structure_is_refused_by_the_eagle_format(target, tmp_path):
  from flax import nnx

  from specjax.drafters.eagle import init_head
  from specjax.training.eagle import EagleHeads
  ours = target[2]
  kind = EagleHeads()
  head = init_head(ours.config.replace(dtype="float32"), kind.feature_layers(ours.config))
  save_head(tmp_path / "ours", kind, nnx.state(head, nnx.Param),
            (ours.config, nnx.state(ours, nnx.Param)))
  with pytest.raises(ValueError, match="'specjax' structure .* cannot express"):
    published.export_head(tmp_path / "ours", ours, tmp_path / "hf", format="eagle")


# ----------------------------------------------------------------------------- Medusa-1

K, R = 3, 2


def medusa_tensors(seed: int, *, heads=K, blocks=R, d=D, vocab=V, prefix="") -> dict:
  g = torch.Generator().manual_seed(seed)
  w = {}
  for i in range(heads):
    for j in range(blocks):
      w[f"{prefix}{i}.{j}.linear.weight"] = _randn(g, d, d)
      w[f"{prefix}{i}.{j}.linear.bias"] = _randn(g, d)
    w[f"{prefix}{i}.{blocks}.weight"] = _randn(g, vocab, d)
  return w


def ref_medusa_logits(model, w, ids) -> np.ndarray:
  """[K, V]: residual SiLU blocks, then each head's own projection, on the target's last
  hidden state (after its final norm)."""
  with torch.no_grad():
    h = model.model(torch.tensor([ids])).last_hidden_state[0, -1]
    out = []
    for i in range(K):
      x = h
      for j in range(R):
        x = x + torch.nn.functional.silu(x @ w[f"{i}.{j}.linear.weight"].T
                                         + w[f"{i}.{j}.linear.bias"])
      out.append(x @ w[f"{i}.{R}.weight"].T)
    return torch.stack(out).numpy()


def ours_medusa_logits(target_module, head_dir, ids) -> np.ndarray:
  drafter, _ = resolve.make_drafter(f"medusa:{head_dir}", target_module, k=4,
                                    tree=trees.chain(K))
  lm = LM.of(target_module)
  prompt = jnp.asarray([ids], jnp.int32)
  feats = lm(prompt, jnp.arange(len(ids), dtype=jnp.int32)[None], capture=(N_LAYERS,))[3]
  state = drafter.init(prompt, jnp.asarray([len(ids)]), 64, None, feats)
  return np.asarray(medusa_drafter.head_logits(drafter.params, lm, state.hidden)[0])


@pytest.fixture(scope="module")
def medusa_src(tmp_path_factory):
  w = medusa_tensors(3)
  cfg = {"medusa_num_heads": K, "medusa_num_layers": R, "base_model_name_or_path": "target"}
  return write_head(tmp_path_factory.mktemp("medusa") / "src", w, cfg,
                    "medusa_lm_head.safetensors"), w


@pytest.fixture(scope="module")
def medusa_head(target, medusa_src, tmp_path_factory):
  out = tmp_path_factory.mktemp("medusa-imported") / "head"
  published.import_head(medusa_src[0], target[2], out)
  return out


def test_medusa_logits_match_the_reference(target, medusa_src, medusa_head):
  assert published.detect_kind(medusa_src[0]) == "medusa"
  kind = load_head(medusa_head).kind
  assert (kind.heads, kind.blocks, kind.own_lm) == (K, R, True)
  ours = ours_medusa_logits(target[2], medusa_head, PROMPT_IDS)
  ref = ref_medusa_logits(target[1], medusa_src[1], PROMPT_IDS)
  assert np.max(np.abs(ours - ref)) < 1e-4


def test_a_missing_residual_fails_medusa_parity(target, medusa_src, medusa_head, monkeypatch):
  """Planted bug: the residual blocks without their skip connection."""
  def no_residual(params, hidden):
    x = jnp.broadcast_to(hidden[..., None, :], hidden.shape[:-1] + (K, D))
    for r in range(R):
      b = params["b"][:, r].reshape((1,) * (x.ndim - 2) + (K, D))
      x = jax.nn.silu(jnp.einsum("...kd,kde->...ke", x, params["w"][:, r]) + b)
    return x
  monkeypatch.setattr(medusa_drafter, "head_states", no_residual)
  ours = ours_medusa_logits(target[2], medusa_head, PROMPT_IDS)
  ref = ref_medusa_logits(target[1], medusa_src[1], PROMPT_IDS)
  assert np.max(np.abs(ours - ref)) > 1e-2


def test_medusa_from_a_pickle_with_the_model_prefix(target, medusa_src, tmp_path):
  w = {f"medusa_head.{k}": v for k, v in medusa_src[1].items()}
  src = write_head(tmp_path / "pt", w, {}, "medusa_lm_head.pt")  # sizes from the names
  published.import_head(src, target[2], tmp_path / "head", kind="medusa")
  ours = ours_medusa_logits(target[2], tmp_path / "head", PROMPT_IDS)
  assert np.max(np.abs(ours - ref_medusa_logits(target[1], medusa_src[1], PROMPT_IDS))) < 1e-4


def test_medusa_shapes_that_do_not_fit_are_refused(target, tmp_path):
  src = write_head(tmp_path / "src", medusa_tensors(4, vocab=V + 4), {}, "model.safetensors")
  with pytest.raises(ValueError, match=r"'0\.2\.weight' has shape \(100, 32\) but the target "
                     r"needs \(96, 32\)"):
    published.import_head(src, target[2], tmp_path / "out", kind="medusa")


@pytest.mark.slow
def test_medusa_speculative_equals_plain_at_t0(target, medusa_head):
  drafter, _ = resolve.make_drafter(f"medusa:{medusa_head}", target[2], k=4,
                                    tree=trees.chain(K))
  assert_greedy_identity(target[2], drafter, trees.chain(K), 12, mixed_alpha=False)


def test_our_medusa_heads_round_trip_bit_identically(target, tmp_path):
  """Our heads (one block, the target's LM head shared) -> the format (the LM head copied
  into each head) -> back: the same parameters, the same logits, bit for bit."""
  from flax import nnx
  ours = target[2]
  rng = np.random.default_rng(5)
  params = {"w": jnp.asarray(rng.normal(0, 0.3, (K, D, D)), jnp.float32),
            "b": jnp.asarray(rng.normal(0, 0.3, (K, D)), jnp.float32)}
  save_head(tmp_path / "ours", MedusaHeads(heads=K), params,
            (ours.config, nnx.state(ours, nnx.Param)))
  published.export_head(tmp_path / "ours", ours, tmp_path / "hf", format="medusa")
  assert json.loads((tmp_path / "hf" / "config.json").read_text())["medusa_num_heads"] == K
  published.import_head(tmp_path / "hf", ours, tmp_path / "again")
  again = load_head(tmp_path / "again")
  assert again.kind == MedusaHeads(heads=K)
  for name in params:
    assert np.array_equal(np.asarray(again.params[name]), np.asarray(params[name]))
  assert np.array_equal(ours_medusa_logits(ours, tmp_path / "ours", PROMPT_IDS),
                        ours_medusa_logits(ours, tmp_path / "again", PROMPT_IDS))


# ----------------------------------------------------------------------------- exactness


@functools.partial(jax.jit, static_argnames=("tree", "cache_len"))
def always_accept_loop(*args, **kwargs):
  """The speculative loop with a planted 'always accept' rule (the χ² tests' control)."""
  with planted_bugs.planted("always_accept"):
    return loop.speculative_loop(*args, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_joint_law_with_an_imported_head(kind, tmp_path):
  """χ² over the first three tokens at T > 0 (top-k active) with an imported head drafting
  chains of 2: EAGLE's sampled candidates (its q in the stochastic rule), Medusa's top
  candidates (point masses). Negative control: a planted 'always accept' rule fails it."""
  t = joint_target()
  c = t.config
  if kind == "eagle":
    w = eagle_tensors(6, d=c.d_model, h=c.n_heads, kv=c.n_kv_heads, f=c.d_ff,
                      vocab=c.vocab_size)
  else:
    w = medusa_tensors(6, heads=2, d=c.d_model, vocab=c.vocab_size)
  published.import_head(write_head(tmp_path / "src", w, {}, "model.safetensors"), t,
                        tmp_path / "head", kind=kind)
  drafter, _ = resolve.make_drafter(f"{kind}:{tmp_path / 'head'}", t, k=2, tree=trees.chain(2))
  sampler = sampling.make_sampler(0.9, top_k=6)
  exact = exact_joint(t, PROMPT, sampler)
  assert joint_pvalue(first_three(t, drafter, trees.chain(2), sampler, seed=13), exact) \
      > FALSE_ALARM
  bad = first_three(t, drafter, trees.chain(2), sampler, seed=13, run=always_accept_loop)
  assert joint_pvalue(bad, exact) < FALSE_ALARM


# ----------------------------------------------------------------------------- commands


@pytest.mark.slow
def test_cli_import_and_export(target, eagle_src, medusa_src, tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
  tdir = str(target[0])
  out = tmp_path / "eagle"
  assert cli.main(["import-head", str(eagle_src[0]), "--target", tdir, "--out", str(out)]) == 0
  assert f"--draft eagle:{out}" in capsys.readouterr().out
  run = specjax.load(target=tdir, draft=f"eagle:{out}", k=3)  # the Python face
  plain = decoding.generate(run.target, [PROMPT_IDS], max_new_tokens=6)
  spec = decoding.speculative_generate(run.target, run.drafter, [PROMPT_IDS], max_new_tokens=6,
                                       **run.shape)
  assert spec.tokens == plain.tokens
  assert cli.main(["export-head", str(out), "--format", "eagle", "--target", tdir, "--out",
                   str(tmp_path / "hf")]) == 0
  assert (tmp_path / "hf" / "model.safetensors").is_file()
  assert cli.main(["import-head", str(medusa_src[0]), "--kind", "eagle", "--target", tdir,
                   "--out", str(tmp_path / "bad")]) == 2
  err = capsys.readouterr().err
  assert err.startswith("specjax: error:") and len(err.strip().splitlines()) == 1
  assert cli.main(["export-head", str(out), "--format", "medusa", "--target", tdir, "--out",
                   str(tmp_path / "bad")]) == 2
  assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.slow
def test_check_exact_takes_every_drafter(target, eagle_head, medusa_head, capsys):
  """`check-exact --draft` with imported heads, lookup and layer-skip (greedy identity)."""
  for draft in (f"eagle:{eagle_head}", f"medusa:{medusa_head}", "lookup", "layer-skip:1"):
    assert cli.main(["check-exact", "--target", str(target[0]), "--draft", draft, "--k", "2",
                     "--temperature", "0", "--tokens", "6", "--samples", "100"]) == 0, draft
    assert "PASS" in capsys.readouterr().out


def test_a_long_draft_vocabulary_prints_as_its_length():
  from specjax.training.heads import spec_text
  text = spec_text({"draft_ids": list(range(32000)), "layers": [2, 5, 8], "width": 64})
  assert "<32000 ids>" in text and "31999" not in text
  assert "[2, 5, 8]" in text and "64" in text  # short lists and numbers as they are


@pytest.mark.slow
def test_a_mistral_targets_eagle_head_matches_its_reference(tmp_path):
  """The Mistral family (a Llama layer, no biases) through the same import: parity with the
  reference over the drafting steps."""
  torch.manual_seed(2)
  cfg = transformers.MistralConfig(vocab_size=V, hidden_size=D, intermediate_size=F,
                                   num_hidden_layers=2, num_attention_heads=H,
                                   num_key_value_heads=KV, max_position_embeddings=128,
                                   rope_theta=THETA, rms_norm_eps=EPS, sliding_window=None,
                                   tie_word_embeddings=False, initializer_range=0.2,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
  model = transformers.MistralForCausalLM(cfg).eval()
  model.save_pretrained(tmp_path / "mistral")
  mistral = (tmp_path / "mistral", model,
             hf.import_hf(tmp_path / "mistral", dtype="float32").model())
  w = eagle_tensors(9)
  published.import_head(write_head(tmp_path / "src", w, eagle_config(), "model.safetensors"),
                        mistral[2], tmp_path / "head")
  assert eagle_error(mistral, tmp_path / "head", w) < 1e-4
