"""A Hugging Face directory without tokenizer.json is read as transformers reads it (GPT-2's
vocab.json + merges.txt; a SentencePiece tokenizer.model through transformers), never with the
byte tokenizer (issue 40, item 3). Ids are compared with transformers' on the same files."""

import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from specjax.checkpoints.hf.tokenizer import HFTokenizer, load_tokenizer_for  # noqa: E402
from specjax.data.tokenizer import ByteTokenizer  # noqa: E402

TEXTS = ["def main():\n    return 42  # héllo", "The quick brown fox jumps over the lazy dog.",
         "  spaces   and\ttabs<|endoftext|>after"]


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("gpt2tok")
  bpe = tokenizers.ByteLevelBPETokenizer()
  bpe.train_from_iterator(TEXTS * 20 + ["import numpy as np\nprint(x)\n"] * 20,
                          vocab_size=400, special_tokens=["<|endoftext|>"])
  bpe.save_model(str(d))  # vocab.json + merges.txt, no tokenizer.json
  (d / "tokenizer_config.json").write_text(
      '{"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>", '
      '"eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}')
  assert not (d / "tokenizer.json").exists()
  return d


def test_vocab_and_merges_give_transformers_ids(gpt2_dir):
  ours = load_tokenizer_for(gpt2_dir, {"vocab_size": 400})
  assert isinstance(ours, HFTokenizer) and not isinstance(ours, ByteTokenizer)
  theirs = transformers.AutoTokenizer.from_pretrained(str(gpt2_dir))
  for text in TEXTS:
    ids = theirs(text, add_special_tokens=False)["input_ids"]
    assert list(ours.encode(text)) == ids, text
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
  assert ours.eos_id == theirs.eos_token_id


@pytest.mark.parametrize("files", [["vocab.json"], ["merges.txt"]])
def test_half_a_bpe_is_refused_not_bytes(tmp_path, gpt2_dir, files):
  for name in files:
    (tmp_path / name).write_bytes((gpt2_dir / name).read_bytes())
  with pytest.raises(ValueError, match="needs both vocab.json and merges.txt"):
    load_tokenizer_for(tmp_path, {"vocab_size": 400})


def test_a_sentencepiece_model_is_converted_or_refused_naming_the_file(tmp_path):
  (tmp_path / "tokenizer.model").write_bytes(b"not a sentencepiece model")
  with pytest.raises(ValueError, match="tokenizer.model"):
    load_tokenizer_for(tmp_path, {"vocab_size": 32000})


def test_a_saved_hugging_face_tokenizer_reads_back_equal(tmp_path):
  """`HFTokenizer.save` (what a head trained on a real target keeps beside its checkpoint):
  the same ids, specials, EOS ids and chat template after a round trip."""
  from hf_testing import LLAMA3, write_tokenizer_dir
  src = write_tokenizer_dir(tmp_path / "src", config={"chat_template": LLAMA3},
                            generation={"eos_token_id": [3, 5]})
  ours = load_tokenizer_for(src)
  ours.save(tmp_path / "dst")
  back = load_tokenizer_for(tmp_path / "dst")
  assert isinstance(back, HFTokenizer)
  assert back.to_spec() == ours.to_spec()
  assert (back.bos_id, back.eos_id, back.eos_ids) == (ours.bos_id, ours.eos_id, ours.eos_ids)
  msgs = [{"role": "user", "content": TEXTS[0]}]
  assert back.apply_chat_template(msgs) == ours.apply_chat_template(msgs)
  for text in TEXTS:
    assert back.encode(text) == ours.encode(text)
  ours.save(tmp_path / "src")  # saving where it was read from rewrites nothing it needs
  assert load_tokenizer_for(src).to_spec() == ours.to_spec()
