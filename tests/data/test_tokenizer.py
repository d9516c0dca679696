"""Byte tokenizer, the optional BPE, and load_tokenizer."""

import json
import sys

import numpy as np
import pytest

from specjax.data import tokenizer as tk
from specjax.data.tokenizer import ByteTokenizer, load_tokenizer, tokenizer_from_spec


def test_byte_ids_and_specials():
  tok = ByteTokenizer()
  assert tok.vocab_size == 259
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (256, 257, 258)
  assert tok.encode("Az") == [65, 122]
  assert tok.encode("a", bos=True, eos=True) == [256, 97, 257]


@pytest.mark.parametrize("text", ["", "def f(x):\n    return x\n", "héllo wörld ∑ 🙂", "\t\0\x7f"])
def test_byte_roundtrip(text):
  tok = ByteTokenizer()
  ids = tok.encode(text)
  assert all(0 <= i < 256 for i in ids)
  assert tok.decode(ids) == text
  np.testing.assert_array_equal(tok.encode_array(text), np.asarray(ids, np.uint16))


def test_byte_decode_drops_specials_and_replaces_bad_utf8():
  tok = ByteTokenizer()
  assert tok.decode([256, 104, 105, 257, 258, 999, -1]) == "hi"
  assert tok.decode([0xC3]) == "\ufffd"  # a truncated 2-byte sequence


def test_byte_lengths():
  lengths = ByteTokenizer().token_byte_lengths()
  assert lengths.shape == (259,)
  assert lengths[:256].tolist() == [1] * 256 and lengths[256:].tolist() == [0, 0, 0]


def test_load_tokenizer_byte_forms(tmp_path):
  assert isinstance(load_tokenizer(None), ByteTokenizer)
  assert isinstance(load_tokenizer("byte"), ByteTokenizer)
  ByteTokenizer().save(tmp_path)
  assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
  assert isinstance(load_tokenizer(tmp_path / "tokenizer.json"), ByteTokenizer)
  assert isinstance(tokenizer_from_spec({"kind": "byte"}), ByteTokenizer)


def test_load_tokenizer_bad_paths(tmp_path):
  with pytest.raises(ValueError, match="not a tokenizer.json"):
    load_tokenizer(tmp_path / "missing")
  (tmp_path / "tokenizer.json").write_text("{not json")
  with pytest.raises(ValueError, match="cannot read tokenizer file"):
    load_tokenizer(tmp_path)
  with pytest.raises(ValueError, match="kind must be"):
    tokenizer_from_spec({"kind": "sentencepiece"})


def test_bpe_without_tokenizers_names_the_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
  with pytest.raises(ImportError, match=r"specjax\[hf\]"):
    tk.BPETokenizer.train(["abc"], 300)


def test_bpe_train_roundtrip(tmp_path):
  pytest.importorskip("tokenizers")
  texts = ["def add(a, b):\n    return a + b\n"] * 20 + ["class Foo:\n    pass\n"] * 20
  tok = tk.BPETokenizer.train(texts, 300)
  assert tok.vocab_size <= 300 and (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
  text = "def sub(a, b):\n    return a - b  # ünïcode\n"
  ids = tok.encode(text, eos=True)
  assert ids[-1] == tok.eos_id and len(ids) < len(text.encode())  # merges were learned
  assert tok.decode(ids) == text
  lengths = tok.token_byte_lengths()
  assert lengths[list(ids[:-1])].sum() == len(text.encode())
  tok.save(tmp_path)
  again = load_tokenizer(tmp_path)
  assert again.encode(text) == tok.encode(text)
  assert tokenizer_from_spec(tok.to_spec(), tmp_path).to_spec() == tok.to_spec()
  assert json.loads((tmp_path / "tokenizer.json").read_text())["model"]["type"] == "BPE"


def test_bpe_too_small_vocab():
  with pytest.raises(ValueError, match="vocab_size must be >= 259"):
    tk.BPETokenizer.train(["abc"], 100)
