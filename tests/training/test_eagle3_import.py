"""Published EAGLE-3 heads (issue 32): import, parity with a reference written in torch from
the format's description, exactness through the real loop, export and round trip.

The target is a small Hugging Face Llama with random weights written by transformers (8
layers, so the format's three layers 2, 4, 5 are distinct), imported by specjax. A head with
random weights is written in the published layout (fc, midlayer.*, norm, lm_head over a
reduced draft vocabulary, d2t, t2d). The reference (`RefHead`) runs the target in
transformers and the head in plain torch with its own KV cache, one drafting step at a time:
step 1 reads fc(concat of hidden_states[2], [4], [5]) and the embedding of the next token;
later steps read the previous step's output h (before `norm`). Controls: a dropped
hidden_norm, an off-by-one in d2t and the wrong three layers each break parity; a drafter
that reports mass off the draft vocabulary fails the χ² joint-law test.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from specjax.engine import decoding, loop  # noqa: E402
from specjax import resolve
from specjax.verify import sampling, trees
from specjax.checkpoints import hf  # noqa: E402
from specjax.training.published import eagle3 as pub  # noqa: E402
from specjax.models.lm import LM  # noqa: E402
from specjax.drafters.eagle import EagleDrafter  # noqa: E402
from specjax.drafters.eagle3 import DraftIds, Eagle3Head  # noqa: E402
from specjax_testing import (FALSE_ALARM, PROMPT, RAGGED, VOCAB,  # noqa: E402
                             assert_greedy_identity, exact_joint, first_three, joint_pvalue,
                             joint_target)

V, D, N_LAYERS, HEADS, KV, FF = 64, 64, 8, 4, 2, 128
HD = D // HEADS
HF_LAYERS = (2, 4, 5)  # the format's default for 8 layers: 2, N // 2, N - 3
DRAFT_IDS = np.sort(np.random.default_rng(0).choice(V - 1, 40, replace=False))  # not V - 1


def _published(d, *, vocab, d_model, draft_ids, seed, fmt="safetensors", aux=None,
               heads=HEADS, kv=KV, ff=FF, like=None):
  """A random EAGLE-3 head in the published layout in directory d; returns its tensors.
  like: the target's torch model: a head that starts as a copy of the target's prediction
  (fc picks the last aux layer, the final norm's output; tiny attention and MLP; lm_head =
  the target's rows), so that it drafts well."""
  d.mkdir(parents=True, exist_ok=True)
  g = torch.Generator().manual_seed(seed)
  hd = d_model // heads
  n_aux = 3

  def w(*shape, scale=0.15):
    return torch.randn(*shape, generator=g) * scale

  ids = np.asarray(draft_ids)
  t = {"fc.weight": w(d_model, n_aux * d_model),
       "midlayer.input_layernorm.weight": 1 + w(d_model),
       "midlayer.hidden_norm.weight": 1 + w(d_model),
       "midlayer.self_attn.q_proj.weight": w(heads * hd, 2 * d_model),
       "midlayer.self_attn.k_proj.weight": w(kv * hd, 2 * d_model),
       "midlayer.self_attn.v_proj.weight": w(kv * hd, 2 * d_model),
       "midlayer.self_attn.o_proj.weight": w(d_model, heads * hd),
       "midlayer.post_attention_layernorm.weight": 1 + w(d_model),
       "midlayer.mlp.gate_proj.weight": w(ff, d_model),
       "midlayer.mlp.up_proj.weight": w(ff, d_model),
       "midlayer.mlp.down_proj.weight": w(d_model, ff),
       "norm.weight": 1 + w(d_model),
       "lm_head.weight": w(len(ids), d_model, scale=0.5),
       "d2t": torch.tensor(ids - np.arange(len(ids)), dtype=torch.int64),
       "t2d": torch.tensor(np.isin(np.arange(vocab), ids))}
  if like is not None:
    model = like
    t["fc.weight"] = torch.cat([torch.zeros(d_model, 2 * d_model), torch.eye(d_model)], 1)
    t["midlayer.self_attn.o_proj.weight"] *= 0.01
    t["midlayer.mlp.down_proj.weight"] *= 0.01
    t["norm.weight"] = torch.ones(d_model)
    t["lm_head.weight"] = model.lm_head.weight.detach()[torch.as_tensor(ids)].clone()
  config = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": d_model,
            "intermediate_size": ff, "num_attention_heads": heads, "num_key_value_heads": kv,
            "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "vocab_size": vocab, "draft_vocab_size": len(ids), "hidden_act": "silu"}
  if aux is not None:
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux)}
  (d / "config.json").write_text(json.dumps(config))
  if fmt == "bin":
    torch.save(t, d / "pytorch_model.bin")
  else:
    safetensors_torch.save_file({k: v.contiguous() for k, v in t.items()},
                                d / "model.safetensors")
  return t


@pytest.fixture(scope="module")
def hf_target(tmp_path_factory):
  """(directory, transformers model, specjax Transformer) of the random Llama target."""
  d = tmp_path_factory.mktemp("eagle3") / "target"
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=FF,
                                 num_hidden_layers=N_LAYERS, num_attention_heads=HEADS,
                                 num_key_value_heads=KV, max_position_embeddings=256,
                                 initializer_range=0.1, rms_norm_eps=1e-6, bos_token_id=None,
                                 eos_token_id=None, pad_token_id=None)
  model = transformers.LlamaForCausalLM(cfg).eval()
  model.save_pretrained(d)
  return d, model, hf.import_hf(d).model()


@pytest.fixture(scope="module")
def random_head(hf_target, tmp_path_factory):
  """(published tensors, imported head directory) of a random head read from a .bin."""
  root = tmp_path_factory.mktemp("eagle3_head")
  tensors = _published(root / "pub", vocab=V, d_model=D, draft_ids=DRAFT_IDS, seed=1, fmt="bin")
  pub.import_head(root / "pub", hf_target[2], root / "head")
  return tensors, root / "head"


# ----------------------------------------------------------------------------- the reference


def _rms(x, w, eps=1e-6):
  return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta=10000.0):
  """x [T, H, hd] rotated as Llama does (rotate_half over the two halves)."""
  hd = x.shape[-1]
  inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
  ang = pos.float()[:, None] * inv[None]
  cos, sin = torch.cat([ang, ang], -1)[:, None], torch.cat([ang, ang], -1)[:, None]
  cos, sin = cos.cos(), sin.sin()
  x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
  return x * cos + torch.cat([-x2, x1], -1) * sin


class RefHead:
  """The published EAGLE-3 head in torch, with its own KV cache (module doc)."""

  def __init__(self, t, vocab, embed, heads=HEADS, kv=KV):
    self.t, self.vocab, self.embed, self.heads, self.kv = t, vocab, embed, heads, kv
    self.keys, self.values, self.key_pos = [], [], []
    self.ids = torch.as_tensor(np.arange(len(t["d2t"]))) + t["d2t"]

  def step(self, hidden, tokens, pos):
    """h [T, D] of hidden [T, D] (fused features or the last h) and next tokens [T]."""
    t, m = self.t, "midlayer."
    emb = self.embed[torch.as_tensor(tokens)]
    a = torch.cat([_rms(emb, t[m + "input_layernorm.weight"]),
                   _rms(hidden, t[m + "hidden_norm.weight"])], -1)
    n, hd = len(tokens), t[m + "self_attn.o_proj.weight"].shape[1] // self.heads
    pos = torch.as_tensor(pos)
    q = _rope((a @ t[m + "self_attn.q_proj.weight"].T).view(n, self.heads, hd), pos)
    self.keys.append(_rope((a @ t[m + "self_attn.k_proj.weight"].T).view(n, self.kv, hd), pos))
    self.values.append((a @ t[m + "self_attn.v_proj.weight"].T).view(n, self.kv, hd))
    self.key_pos.append(pos)
    rep = self.heads // self.kv
    k = torch.cat(self.keys).repeat_interleave(rep, 1)
    v = torch.cat(self.values).repeat_interleave(rep, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / hd ** 0.5
    scores = scores.masked_fill(~(torch.cat(self.key_pos)[None, None] <= pos[None, :, None]),
                                float("-inf"))
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(n, -1)
    x = hidden + out @ t[m + "self_attn.o_proj.weight"].T
    y = _rms(x, t[m + "post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(y @ t[m + "mlp.gate_proj.weight"].T)
           * (y @ t[m + "mlp.up_proj.weight"].T)) @ t[m + "mlp.down_proj.weight"].T
    return x + mlp

  def log_probs(self, h):
    """log q over the target vocabulary of h [D] (-inf outside the mapped ids)."""
    sub = _rms(h, self.t["norm.weight"]) @ self.t["lm_head.weight"].T
    full = torch.full((self.vocab,), float("-inf"))
    full[self.ids] = sub
    return full.log_softmax(-1)


def reference_chain(model, t, ctx, drafted, layers=HF_LAYERS):
  """log q [k, V] of the chain: step 1 over the context's positions, then one per drafted
  token (the head's cache carried), as the published code drafts."""
  n = len(ctx) - 1  # L: ctx[n] is the root
  with torch.no_grad():
    out = model(torch.as_tensor([ctx[:n]]), output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i][0] for i in layers], -1)
    head = RefHead(t, model.config.vocab_size, model.model.embed_tokens.weight)
    h = head.step(feats @ t["fc.weight"].T, ctx[1:n + 1], list(range(n)))[-1]
    rows = [head.log_probs(h)]
    for j, tok in enumerate(drafted[:-1]):
      h = head.step(h[None], [tok], [n + j])[-1]
      rows.append(head.log_probs(h))
  return torch.stack(rows).numpy()


CHAIN = trees.chain(4)


def parity_error(target, drafter, model, tensors, layers=HF_LAYERS) -> float:
  """max |log q_specjax - log q_reference| over the mapped ids, of the 4-token chain drafted
  after a few cycles of the real loop (ragged rows), and whether q is 0 off the map."""
  batch = decoding.prepare_batch(RAGGED[:3], vocab_size=V, max_len=256,
                                 max_new_tokens=[9, 3, 12], slots=drafter.slots_needed(CHAIN))
  state = loop.speculative_jit(LM.of(target), drafter, batch.prompt_BP, batch.prompt_len_B,
                               batch.budget_B, jnp.asarray(-1), sampling.make_sampler(0.0),
                               jax.random.key(0), tree=CHAIN, cache_len=batch.cache_len)
  proposal, _ = jax.jit(lambda s, c: drafter.propose(s, c, CHAIN, sampling.make_sampler(1.0),
                                                     jax.random.key(1)))(state.draft,
                                                                         state.context())
  q = np.asarray(proposal.q)
  ids = np.arange(len(tensors["d2t"])) + tensors["d2t"].numpy()
  off = np.setdiff1d(np.arange(V), ids)
  worst = 0.0 if (q[:, :, off] == 0).all() else np.inf
  for b in range(3):
    L = int(state.length[b])
    ctx = [int(x) for x in state.tokens[b, :L + 1]]
    drafted = [int(x) for x in proposal.tokens[b]]
    ref = reference_chain(model, tensors, ctx, drafted, layers)
    ours = np.log(np.maximum(q[b, :4], 1e-38))
    worst = max(worst, float(np.max(np.abs(ours[:, ids] - ref[:, ids]))))
  return worst


def _drafter(target, head_dir, **kw):
  return resolve.head_drafter(f"eagle:{head_dir}", target, "eagle", str(head_dir), k=4,
                              **kw)[0]


# ----------------------------------------------------------------------------- tests


@pytest.mark.slow
def test_draft_logits_match_the_torch_reference_and_planted_bugs_break_it(hf_target,
                                                                          random_head):
  """Draft log-probabilities over 4 drafting steps (the head's cache carried across cycles
  of the real loop) agree with the reference within 1e-4 in float32; zero mass off the
  mapped ids. Controls: a dropped hidden_norm, d2t off by one, the wrong three layers."""
  _, model, target = hf_target
  tensors, head_dir = random_head
  good = _drafter(target, head_dir)
  assert good.layers == (1, 3, 4)  # HF hidden_states 2, 4, 5: the residual entering them
  assert parity_error(target, good, model, tensors) < 1e-4

  class NoHiddenNorm(Eagle3Head):
    def _attn_input(self, u, emb):
      return jnp.concatenate([self.input_layernorm(emb), u.astype(jnp.float32)], axis=-1)

  module = good.head.module()
  module.__class__ = NoHiddenNorm
  assert parity_error(target, EagleDrafter.of(target, module, good.layers), model,
                      tensors) > 1e-2
  module = good.head.module()
  ids = np.asarray(module.draft_ids[...])
  module.draft_ids = DraftIds(jnp.asarray(ids + 1))
  assert parity_error(target, EagleDrafter.of(target, module, good.layers), model,
                      tensors) > 1e-2
  wrong = EagleDrafter.of(target, good.head, HF_LAYERS)  # HF indices taken as capture ones
  assert parity_error(target, wrong, model, tensors) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("tree", [trees.chain(3), trees.DynamicTree(6, 3, 2)],
                         ids=["chain", "dynamic"])
def test_greedy_identity_through_the_loop(hf_target, tmp_path_factory, tree):
  """At T = 0 speculative decoding with an imported head (a good one: it starts from the
  target's own last-layer prediction, read through config's aux layer ids) emits plain
  greedy decoding's tokens, on a ragged batch with EOS and budgets, acceptance mixed."""
  d, model, target = hf_target
  root = tmp_path_factory.mktemp("eagle3_good")
  _published(root / "pub", vocab=V, d_model=D, draft_ids=DRAFT_IDS, seed=2,
             aux=(2, 4, N_LAYERS), like=model)
  pub.import_head(root / "pub", target, root / "head")
  drafter = _drafter(target, root / "head")
  assert drafter.layers == (1, 3, N_LAYERS)  # hidden state N: the final norm's output
  assert_greedy_identity(target, drafter, tree, new_tokens=16)


@pytest.mark.slow
@pytest.mark.parametrize("tree,sampler_args",
                         [(trees.chain(2), dict(temperature=0.8, top_k=6)),
                          (trees.DynamicTree(4, 2, 2), dict(temperature=1.0, top_p=0.9))],
                         ids=["chain", "dynamic"])
def test_joint_law_with_the_reduced_vocabulary(tmp_path, tree, sampler_args):
  """χ² of 40,000 rows' first three tokens against the enumerated target law over 8³
  outcomes, with an imported head that drafts 5 of the 8 ids (false-alarm rate 1e-3)."""
  target = joint_target()
  ids = np.array([0, 2, 3, 5, 6])
  _published(tmp_path / "pub", vocab=VOCAB, d_model=target.config.d_model, draft_ids=ids,
             seed=5, aux=(1, 2, 2), heads=2, kv=1, ff=32)
  pub.import_head(tmp_path / "pub", target, tmp_path / "head")
  drafter = _drafter(target, tmp_path / "head")
  assert np.array_equal(np.asarray(drafter.vocab), ids)
  sampler = sampling.make_sampler(**sampler_args)
  tokens = first_three(target, drafter, tree, sampler, seed=7)
  assert joint_pvalue(tokens, exact_joint(target, PROMPT, sampler)) > FALSE_ALARM


@struct.dataclass
class _ReportsMassOffTheMap(EagleDrafter):
  """Planted bug: the q reported to the acceptance rule leaks 30% of its mass onto the target
  ids outside the draft vocabulary (which are never sampled). The extra static field keeps
  its compiled program apart from its parent's."""

  planted: bool = struct.field(pytree_node=False, default=True)

  def propose(self, state, ctx, tree, sampler, key):
    proposal, state = super().propose(state, ctx, tree, sampler, key)
    off = jnp.ones(proposal.q.shape[-1], bool).at[self.vocab].set(False)
    leak = (off / off.sum())[None, None]
    return proposal.replace(q=0.7 * proposal.q + 0.3 * leak), state


@pytest.mark.slow
def test_the_joint_law_test_catches_mass_reported_off_the_map(tmp_path):
  """Negative control of the test above: the same χ² rejects the planted leak."""
  target = joint_target()
  _published(tmp_path / "pub", vocab=VOCAB, d_model=target.config.d_model,
             draft_ids=[0, 2, 3, 5, 6], seed=5, aux=(1, 2, 2), heads=2, kv=1, ff=32)
  pub.import_head(tmp_path / "pub", target, tmp_path / "head")
  good = _drafter(target, tmp_path / "head")
  bad = _ReportsMassOffTheMap(head=good.head, target=good.target, layers=good.layers,
                              vocab=good.vocab, lm=good.lm)
  sampler = sampling.make_sampler(1.0)
  tokens = first_three(target, bad, trees.chain(2), sampler, seed=7)
  assert joint_pvalue(tokens, exact_joint(target, PROMPT, sampler)) < FALSE_ALARM


@pytest.mark.slow
def test_export_then_import_gives_bit_identical_draft_logits(hf_target, random_head,
                                                             tmp_path):
  """import -> export -> import: the same tensors, and the same draft law bit for bit."""
  _, _, target = hf_target
  tensors, head_dir = random_head
  pub.export_head(head_dir, target, tmp_path / "exported")
  config = json.loads((tmp_path / "exported" / "config.json").read_text())
  assert config["draft_vocab_size"] == len(DRAFT_IDS)
  assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(HF_LAYERS)
  again = safetensors_torch.load_file(tmp_path / "exported" / "model.safetensors")
  assert sorted(again) == sorted(tensors)
  for name, value in tensors.items():
    assert torch.equal(again[name], value.to(again[name].dtype)), name
  pub.import_head(tmp_path / "exported", target, tmp_path / "head2")
  prompts = RAGGED[:2]
  runs = [decoding.speculative_generate(target, _drafter(target, d), prompts, k=4,
                                        max_new_tokens=6, sampler=sampling.make_sampler(1.0),
                                        seed=3)
          for d in (head_dir, tmp_path / "head2")]
  assert runs[0].tokens == runs[1].tokens
  first, second = (_drafter(target, d) for d in (head_dir, tmp_path / "head2"))
  for a, b in zip(jax.tree.leaves(first.head.params), jax.tree.leaves(second.head.params)):
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_a_head_that_does_not_fit_is_refused_naming_the_tensor(hf_target, tmp_path):
  """A head for a wider model, a d2t out of range, or not an EAGLE-3 head: one line each."""
  _, _, target = hf_target
  _published(tmp_path / "wide", vocab=V, d_model=2 * D, draft_ids=DRAFT_IDS, seed=3)
  with pytest.raises(ValueError, match=r"fc\.weight.*\(128, 384\).*\(64, 192\)"):
    pub.import_head(tmp_path / "wide", target, tmp_path / "out")
  _published(tmp_path / "far", vocab=2 * V, d_model=D, draft_ids=[1, 2, V + 5], seed=3)
  with pytest.raises(ValueError, match=f"d2t maps a draft id to target id {V + 5}"):
    pub.import_head(tmp_path / "far", target, tmp_path / "out")
  assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_load_by_reference_and_what_export_refuses(hf_target, random_head, tmp_path,
                                                   monkeypatch):
  """specjax.load(target=HF_DIR, draft="eagle3:DIR") drafts with the imported head; export
  refuses a head of another structure and one reading the last block's un-normed output."""
  import specjax
  from flax import nnx

  from specjax.training.eagle import EagleHeads
  from specjax.training.eagle3 import Eagle3Heads
  from specjax.training.heads import save_head
  d, _, target = hf_target
  _, head_dir = random_head
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
  run = specjax.load(target=str(d), draft=f"eagle3:{head_dir}", k=3)
  assert isinstance(run.drafter.head.module(), Eagle3Head) and run.shape == {"k": 3}
  bound = (target.config, nnx.state(target, nnx.Param))
  ours = EagleHeads(steps=1)
  save_head(tmp_path / "ours", ours, ours.init(target.config, jax.random.key(0)), bound)
  with pytest.raises(ValueError, match="'eagle' head; only an eagle3 head"):
    pub.export_head(tmp_path / "ours", target, tmp_path / "out")
  last = Eagle3Heads(layers=(1, 3, N_LAYERS - 1))
  save_head(tmp_path / "last", last, last.init(target.config, jax.random.key(0)), bound)
  with pytest.raises(ValueError, match="cannot name"):
    pub.export_head(tmp_path / "last", target, tmp_path / "out")
  assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- our EAGLE-3


@pytest.mark.slow
def test_training_the_eagle3_structure_then_export_and_import(tmp_path):
  """Our trainer learns the EAGLE-3 structure (training-time test over 2 steps, a draft
  vocabulary of the 96 most frequent bytes): held-out loss and acceptance improve, decoding
  stays greedy-exact (this random target's favourite byte lies outside the vocabulary, so
  α is near 0 there: exactness does not depend on it), and the trained head exports to
  the published format and imports back to the same parameters."""
  from flax import nnx

  from specjax.data.batches import TokenData
  from specjax.data.corpus import load_corpus
  from specjax.training.eagle3 import Eagle3Heads
  from specjax.training.heads import HeadTrainer
  from specjax_testing import TC, TCFG, TOK, model
  target = model(TCFG, seed=0, logit_scale=4.0)
  data = TokenData.from_corpus(load_corpus("code", max_bytes=60_000), TOK)
  kind = Eagle3Heads(steps=2, layers=(0, 0, TCFG.n_layers)).with_frequent_vocab(
      data.train, 96, TCFG.vocab_size)
  assert len(kind.draft_ids) == 96 and ord(" ") in kind.draft_ids
  trainer = HeadTrainer(kind, TCFG, nnx.state(target, nnx.Param), TC, data, TOK,
                        out_dir=tmp_path / "head", progress=False)
  loss0, acc0 = trainer.validation_loss(), trainer.evaluate()
  result = trainer.run()
  assert trainer.validation_loss() < 0.8 * loss0
  assert all(a > b + 0.02 for a, b in zip(result.acceptance.top1, acc0.top1))
  drafter = _drafter(target, tmp_path / "head")
  prompts = [[ord(c) for c in "def f(x):\n    return"], [ord(c) for c in "import numpy"]]
  run = decoding.speculative_generate(target, drafter, prompts, k=3, max_new_tokens=24)
  assert run.tokens == decoding.generate(target, prompts, max_new_tokens=24).tokens
  pub.export_head(tmp_path / "head", target, tmp_path / "published")
  pub.import_head(tmp_path / "published", target, tmp_path / "again")
  again = _drafter(target, tmp_path / "again")
  for a, b in zip(jax.tree.leaves(drafter.head.params), jax.tree.leaves(again.head.params)):
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_the_formats_layers_for_small_targets():
  """hidden_states (2, N // 2, N - 3) as capture indices (-1: the embedding output); N = 4..6
  read a state twice, as the format does; N < 3 has no such states (issue 40, item 11)."""
  from specjax.drafters.eagle3 import eagle3_layers
  assert eagle3_layers(3) == (1, 0, -1)
  assert [eagle3_layers(n) for n in (4, 5, 6, 7, 8)] == [(1, 1, 0), (1, 1, 1), (1, 2, 2),
                                                          (1, 2, 3), (1, 3, 4)]
  for n in (1, 2):
    with pytest.raises(ValueError, match="needs 3 layers or more"):
      eagle3_layers(n)


@pytest.mark.slow
def test_a_three_layer_target_reads_the_embedding_output(tmp_path):
  """For N = 3 the format reads hidden_states 2, 1 and 0 (0: the embedding output): parity
  with the reference; control: the old clamp to block 0 read twice breaks it."""
  torch.manual_seed(3)
  cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=FF,
                                 num_hidden_layers=3, num_attention_heads=HEADS,
                                 num_key_value_heads=KV, max_position_embeddings=256,
                                 initializer_range=0.1, rms_norm_eps=1e-6, bos_token_id=None,
                                 eos_token_id=None, pad_token_id=None)
  model = transformers.LlamaForCausalLM(cfg).eval()
  model.save_pretrained(tmp_path / "target")
  target = hf.import_hf(tmp_path / "target").model()
  tensors = _published(tmp_path / "pub", vocab=V, d_model=D, draft_ids=DRAFT_IDS, seed=5)
  pub.import_head(tmp_path / "pub", target, tmp_path / "head")
  good = _drafter(target, tmp_path / "head")
  assert good.layers == (1, 0, -1)
  assert parity_error(target, good, model, tensors, layers=(2, 1, 0)) < 1e-4
  clamped = EagleDrafter.of(target, good.head, (1, 0, 0))
  assert parity_error(target, clamped, model, tensors, layers=(2, 1, 0)) > 1e-2
