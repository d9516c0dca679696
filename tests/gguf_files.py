"""Small random GGUF files for the tests, written with gguf's GGUFWriter.

`write_model(path, arch=..., qtype=...)` writes a tiny model in llama.cpp's conventions
(tensor names, the q/k row permutation of llama files, F32 norms, tied embeddings without
output.weight) and a tokenizer: a byte-level BPE ('gpt2') trained here on a small text, or a
SentencePiece-style vocabulary ('llama') with scores and no merges.
"""

from __future__ import annotations

import numpy as np

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                 "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n\tprint(i * i)\n",
          "The quick brown fox jumps over the lazy dog. " * 3,
          "Héllo wörld, naïve café — 日本語のテキスト 🙂 ünïcödé", "x = {'key': [1, 2, 3]}  # comment",
          "    indented    with    spaces\n\n\n  and newlines", "speculative decoding is exact"]
TEXTS = ["def add(a, b):\n    return a + b", "Héllo wörld 🙂 日本語", "  lots   of    spaces  \n\n\t",
         "<|im_start|>user\nhi<|im_end|>", "naïve café, the lazy fox!!", "x = [1, 22, 333, 4444]",
         "unseen words: zyxw qqq ÆØÅ", ""]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's converter's q/k permutation (half-split rows -> interleaved pairs)."""
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


def bpe_vocab(size: int = 400):
  """(tokens, types, merges) of a byte-level BPE trained on CORPUS, the specials first."""
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=SPECIALS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(CORPUS * 4, trainer)
  import json
  model = json.loads(tok.to_str())["model"]
  tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
  merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
  types = [3 if t in SPECIALS else 1 for t in tokens]
  return tokens, types, merges


def spm_vocab(size: int = 420):
  """(tokens, types, scores) of a SentencePiece-style vocabulary: <unk>, <s>, </s>, the 256
  byte tokens, the specials, then pieces (a '▁' for a space) scored by their merge rank."""
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first",
                                               split=True)
  trainer = trainers.BpeTrainer(vocab_size=size - 262, special_tokens=[])
  tok.train_from_iterator(CORPUS * 4, trainer)
  pieces = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
  tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPECIALS[1:]
  types = [2, 3, 3] + [6] * 256 + [3, 3]
  scores = [0.0] * len(tokens)
  tokens += pieces
  types += [1] * len(pieces)
  scores += [-float(i) for i in range(len(pieces))]
  return tokens, types, scores


def _k_blocks(rows: int, cols: int, qtype: str, rng) -> np.ndarray:
  """Random K-quant blocks (gguf cannot quantize to these) with small finite f16 scales."""
  size, scale_at = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}[qtype]
  blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
  for at in scale_at:
    d = (rng.uniform(0.5, 1.5, (rows, cols // 256)) * (2e-4 if qtype != "Q6_K" else 1e-3))
    blocks[:, :, at:at + 2] = d.astype(np.float16)[..., None].view(np.uint8).reshape(
        rows, cols // 256, 2)
  return blocks.reshape(rows, -1)


def _add(w, name: str, x: np.ndarray, qtype: str, rng) -> None:
  import gguf
  t = gguf.GGMLQuantizationType
  if x.ndim == 1 or qtype == "F32":
    w.add_tensor(name, x.astype(np.float32))
  elif qtype == "F16":
    w.add_tensor(name, x.astype(np.float16))
  elif qtype in ("Q4_K", "Q5_K", "Q6_K"):
    w.add_tensor(name, _k_blocks(*x.shape, qtype, rng), raw_dtype=t[qtype])
  else:
    w.add_tensor(name, gguf.quants.quantize(x.astype(np.float32), t[qtype]), raw_dtype=t[qtype])


def write_model(path, *, arch: str = "llama", qtype: str = "F32", tokenizer: str = "gpt2",
                d: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, ff: int = 128,
                tied: bool = True, theta: float = 10000.0, sliding_window: int | None = None,
                name: str = "tiny", seed: int = 0, rope_freqs: np.ndarray | None = None,
                extra=None) -> str:
  """A tiny random model as a GGUF file (module doc); returns the path as a str."""
  import gguf
  rng = np.random.default_rng(seed)
  if tokenizer == "gpt2":
    tokens, types, merges = bpe_vocab()
  else:
    tokens, types, scores = spm_vocab()
  vocab, hd = len(tokens), d // heads
  w = gguf.GGUFWriter(str(path), arch)
  w.add_name(name)
  w.add_block_count(layers)
  w.add_context_length(256)
  w.add_embedding_length(d)
  w.add_feed_forward_length(ff)
  w.add_head_count(heads)
  w.add_head_count_kv(kv_heads)
  w.add_rope_freq_base(theta)
  w.add_layer_norm_rms_eps(1e-5)
  if arch == "llama":
    w.add_rope_dimension_count(hd)
  if arch == "qwen3":
    w.add_key_length(hd)
    w.add_value_length(hd)
  if sliding_window is not None:
    w.add_sliding_window(sliding_window)
  w.add_tokenizer_model(tokenizer)
  w.add_token_list(tokens)
  w.add_token_types(types)
  if tokenizer == "gpt2":
    w.add_tokenizer_pre("default")
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
  else:
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_space_prefix(True)
  w.add_chat_template(CHAT_TEMPLATE)
  if extra is not None:
    extra(w)

  def normal(*shape, scale=0.1):
    return (rng.standard_normal(shape) * scale).astype(np.float32)

  _add(w, "token_embd.weight", normal(vocab, d, scale=0.5), qtype, rng)
  for i in range(layers):
    b = f"blk.{i}."
    _add(w, b + "attn_norm.weight", 1 + normal(d), qtype, rng)
    q, k = normal(heads * hd, d), normal(kv_heads * hd, d)
    if arch == "llama":
      q, k = llama_cpp_permute(q, heads), llama_cpp_permute(k, kv_heads)
    _add(w, b + "attn_q.weight", q, qtype, rng)
    _add(w, b + "attn_k.weight", k, qtype, rng)
    _add(w, b + "attn_v.weight", normal(kv_heads * hd, d), qtype, rng)
    if arch == "qwen2":
      for n, rows in (("q", heads * hd), ("k", kv_heads * hd), ("v", kv_heads * hd)):
        _add(w, b + f"attn_{n}.bias", normal(rows), qtype, rng)
    if arch == "qwen3":
      _add(w, b + "attn_q_norm.weight", 1 + normal(hd), qtype, rng)
      _add(w, b + "attn_k_norm.weight", 1 + normal(hd), qtype, rng)
    _add(w, b + "attn_output.weight", normal(d, heads * hd), qtype, rng)
    _add(w, b + "ffn_norm.weight", 1 + normal(d), qtype, rng)
    _add(w, b + "ffn_gate.weight", normal(ff, d), qtype, rng)
    _add(w, b + "ffn_up.weight", normal(ff, d), qtype, rng)
    _add(w, b + "ffn_down.weight", normal(d, ff), qtype, rng)
  _add(w, "output_norm.weight", 1 + normal(d), qtype, rng)
  if not tied:
    _add(w, "output.weight", normal(vocab, d, scale=0.5), qtype, rng)
  if rope_freqs is not None:
    w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)
