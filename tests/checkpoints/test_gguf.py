"""GGUF import parity, with transformers' GGUF loader as the reference.

Small random GGUF files (`gguf_files.write_model`, gguf's GGUFWriter) in several tensor types
and architectures: specjax's logits equal transformers' on the same file (float32, 1e-4 of
the largest logit),
the tokenizer's ids equal AutoTokenizer's (BPE and SentencePiece vocabularies, text with
code, Unicode, special tokens and whitespace runs), the chat template's ids equal
`apply_chat_template`'s; two planted bugs (q/k permutation left in, a wrong block scale)
make the parity check fail. Transformers dequantizes with its own code
(transformers.integrations.gguf), so the quantized cases also cross-check `gguf.quants`.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf_pkg = pytest.importorskip("gguf")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from gguf_files import CHAT_TEMPLATE, TEXTS, llama_cpp_permute, write_model  # noqa: E402
from specjax.checkpoints import gguf  # noqa: E402
from specjax.checkpoints.gguf import config as gguf_config  # noqa: E402
from specjax.checkpoints.gguf import read as gguf_read  # noqa: E402
from specjax.models.lm import LM  # noqa: E402

TOL = 1e-4
TOKENS = np.random.default_rng(1).integers(0, 300, (2, 12))


@jax.jit
def _forward(lm, tokens_BT, positions_BT):
  return lm(tokens_BT, positions_BT)[0]


def _specjax_logits(path, tokens=TOKENS) -> np.ndarray:
  model = gguf.import_gguf(path).model()
  b, t = tokens.shape
  positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
  return np.asarray(_forward(LM.of(model), jnp.asarray(tokens), jnp.asarray(positions)))


def _reference_logits(path, tokens=TOKENS, **config) -> np.ndarray:
  import pathlib
  p = pathlib.Path(path)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(p.parent), gguf_file=p.name, dtype=torch.float32, **config)
  with torch.no_grad():
    return model.eval()(torch.as_tensor(tokens)).logits.float().numpy()


def _parity_error(path, **config) -> float:
  """max |ours - theirs| over the logits, relative to the largest reference logit (at least
  1): float32 sums of different order differ by ~1e-5 of the scale, and random Q6_K weights
  give logits near 100."""
  ours, theirs = _specjax_logits(path), _reference_logits(path, **config)
  return float(np.abs(ours - theirs).max() / max(1.0, np.abs(theirs).max()))


CASES = {  # name: write_model keywords
    "llama-f32-tied-gqa": dict(arch="llama", qtype="F32"),
    "llama-f16-untied-spm": dict(arch="llama", qtype="F16", tied=False, tokenizer="llama"),
    "qwen2-bf16-bias": dict(arch="qwen2", qtype="BF16", theta=1e6),
    "qwen3-q8_0-qknorm": dict(arch="qwen3", qtype="Q8_0", d=256, heads=2, kv_heads=1,
                              ff=256),
    "llama-q4_0": dict(arch="llama", qtype="Q4_0"),
    "llama-q4_1": dict(arch="llama", qtype="Q4_1", tied=False),
    "llama-q4_k": dict(arch="llama", qtype="Q4_K", d=256, ff=256),
    "llama-q5_k": dict(arch="llama", qtype="Q5_K", d=256, ff=256),
    "llama-q6_k": dict(arch="llama", qtype="Q6_K", d=256, ff=256, tied=False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path, case):
  path = write_model(tmp_path / f"{case}.gguf", **CASES[case])
  assert _parity_error(path) <= TOL


def test_mistral_sliding_window_matches_transformers(tmp_path):
  """A llama file stating its sliding window is Mistral, windowed: equal to transformers'
  Mistral with that window (its GGUF loader reads neither the key nor a mistral file with
  this gguf version: the weights it loads as Llama are put into a MistralForCausalLM), and
  unequal to the unwindowed model on 12 tokens with a window of 4."""
  import pathlib
  path = pathlib.Path(write_model(tmp_path / "m.gguf", sliding_window=4))
  imported = gguf.import_gguf(path)
  assert imported.family == "mistral" and imported.config.sliding_window == 4
  llama = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path), gguf_file=path.name, dtype=torch.float32)
  fields = {k: v for k, v in llama.config.to_dict().items()
            if k not in ("model_type", "architectures", "transformers_version")}
  mistral = transformers.MistralForCausalLM(transformers.MistralConfig(
      **{**fields, "sliding_window": 4}))
  mistral.load_state_dict(llama.state_dict())
  with torch.no_grad():
    theirs = mistral.eval()(torch.as_tensor(TOKENS)).logits.float().numpy()
  ours = _specjax_logits(path)
  assert np.abs(ours - theirs).max() <= TOL
  with torch.no_grad():
    unwindowed = llama.eval()(torch.as_tensor(TOKENS)).logits.float().numpy()
  assert np.abs(ours - unwindowed).max() > 1e-2


def test_planted_qk_permutation_is_caught(tmp_path, monkeypatch):
  """Control: with llama.cpp's q/k permutation left in, the parity check fails."""
  path = write_model(tmp_path / "a.gguf")
  monkeypatch.setattr(gguf_config, "unpermute", lambda w, heads: w)
  assert _parity_error(path) > 1e-2


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_planted_block_scale_is_caught(tmp_path, monkeypatch, qtype):
  """Control: a dequantization that reads each row's first block scale 1.5x too large
  fails the parity check (the f16 scale: the first two bytes of a Q8_0 and a Q4_K block)."""
  kw = dict(d=256, ff=256) if qtype == "Q4_K" else {}
  path = write_model(tmp_path / "a.gguf", qtype=qtype, **kw)
  real = gguf_read.dequantize

  def wrong_scale(data, qtype_):
    if qtype_.name == qtype:
      data = np.array(data)
      d = data[:, 0:2].copy().view(np.float16) * np.float16(1.5)
      data[:, 0:2] = d.view(np.uint8)
    return real(data, qtype_)
  monkeypatch.setattr(gguf_read, "dequantize", wrong_scale)
  assert _parity_error(path) > 1e-3


def test_unpermute_inverts_llama_cpp():
  w = np.arange(8 * 6 * 3, dtype=np.float32).reshape(8 * 6, 3)
  assert np.array_equal(gguf_config.unpermute(llama_cpp_permute(w, 6), 6), w)
  assert not np.array_equal(llama_cpp_permute(w, 6), w)


# ----------------------------------------------------------------------------- tokenizer


def _tokenizers(tmp_path, kind):
  from specjax.checkpoints.hf import load_tokenizer_for
  path = write_model(tmp_path / f"{kind}.gguf", tokenizer=kind)
  ours_dir = tmp_path / "ours"
  ours_dir.mkdir()
  gguf.write_tokenizer_files(path, ours_dir)
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=f"{kind}.gguf")
  return load_tokenizer_for(ours_dir), theirs


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_tokenizer_ids_match_transformers(tmp_path, kind):
  ours, theirs = _tokenizers(tmp_path, kind)
  assert ours.vocab_size == len(theirs)
  texts = TEXTS + ["<|im_start|>assistant\n  def f():\n\treturn 1<|im_end|>\n"]
  for text in texts:
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
  special = ours.encode("<|im_end|>")
  assert len(special) == 1 and special[0] in ours.eos_ids or kind == "llama"
  assert ours.decode(ours.encode("naïve café 🙂")) == theirs.decode(
      theirs.encode("naïve café 🙂", add_special_tokens=False), skip_special_tokens=True)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_chat_template_ids_match_transformers(tmp_path, kind):
  ours, theirs = _tokenizers(tmp_path, kind)
  assert ours.chat_template.text == CHAT_TEMPLATE
  messages = [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "def f(x):\n    return x  # 🙂 naïve?"}]
  want = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                    return_dict=False)
  assert ours.apply_chat_template(messages) == list(want)


def test_spm_merges_rank_by_score():
  tokens, scores = ["a", "b", "c", "ab", "bc", "abc"], [0, 0, 0, -2.0, -1.0, -3.0]
  assert gguf.tokenizer_files  # the module under test
  from specjax.checkpoints.gguf.tokenizer import spm_merges
  assert spm_merges(tokens, scores) == [("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]


# ----------------------------------------------------------------------------- config, errors


def test_llama3_rope_freqs_read_as_llama3_scaling(tmp_path):
  freqs = gguf_config.llama3_rope_factors(16, 500000.0, factor=8.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0,
                                          original_max_position_embeddings=8192)
  assert freqs.min() == 1.0 and freqs.max() == 8.0
  path = write_model(tmp_path / "l3.gguf", theta=500000.0, rope_freqs=freqs)
  c = gguf.import_gguf(path).config
  assert (c.rope_scaling, c.rope_factor, c.rope_original_max_len) == ("llama3", 8.0, 8192)
  bad = write_model(tmp_path / "bad.gguf", theta=500000.0, rope_freqs=freqs * 1.1)
  with pytest.raises(ValueError, match="rope_freqs.weight is not Llama 3.1"):
    gguf.import_gguf(bad)


def test_refusals_name_the_file_and_what(tmp_path):
  good = write_model(tmp_path / "a.gguf")
  data = open(good, "rb").read()
  (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04" + data[4:100])
  with pytest.raises(ValueError, match="is not a GGUF file"):
    gguf.import_gguf(tmp_path / "not.gguf")
  for cut in (200, len(data) - 1000):
    (tmp_path / "cut.gguf").write_bytes(data[:cut])
    with pytest.raises(ValueError, match="truncated"):
      gguf.import_gguf(tmp_path / "cut.gguf")
  q5 = write_model(tmp_path / "q5.gguf", qtype="Q5_0")
  with pytest.raises(ValueError, match=r"tensor 'token_embd.weight' has type Q5_0, not "
                                       r"supported"):
    gguf.import_gguf(q5)
  gpt = write_model(tmp_path / "g.gguf", arch="gptneox")
  with pytest.raises(ValueError, match="general.architecture='gptneox' is not supported"):
    gguf.import_gguf(gpt)


def test_cli_import_and_errors(tmp_path, capsys):
  from specjax.cli import main
  path = write_model(tmp_path / "a.gguf", tokenizer="llama")
  assert main(["import-gguf", path, "--out", str(tmp_path / "ckpt")]) == 0
  from specjax.checkpoints import load_model
  model, tok = load_model(tmp_path / "ckpt")
  assert model.config == gguf.import_gguf(path).config
  assert tok.chat_template is not None and tok.eos_ids == (2,)
  capsys.readouterr()
  (tmp_path / "x.gguf").write_bytes(b"hello")
  assert main(["import-gguf", str(tmp_path / "x.gguf"), "--out", str(tmp_path / "o")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "is not a GGUF file" in err and "Traceback" not in err


def test_gguf_target_resolves_and_is_cached(tmp_path, monkeypatch):
  """`specjax.load(target=FILE.gguf)`: imported once under $SPECJAX_CACHE_DIR/gguf, keyed by
  the file's sha256 (a second load does not import again; an edited file does)."""
  import specjax
  from specjax import resolve
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
  path = write_model(tmp_path / "a.gguf")
  run = specjax.load(target=path, draft="lookup")
  entries = list((tmp_path / "cache" / "gguf").iterdir())
  assert len(entries) == 1 and entries[0].name.startswith("a-")
  assert run.tokenizer.chat_template is not None
  monkeypatch.setattr("specjax.resolve.save_gguf",
                      lambda *a, **k: pytest.fail("imported twice"))
  assert resolve.imported_gguf(path) == entries[0]
  write_model(tmp_path / "a.gguf", seed=1)
  with pytest.raises(BaseException, match="imported twice"):
    resolve.imported_gguf(path)
