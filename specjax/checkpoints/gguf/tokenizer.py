"""The tokenizer a GGUF file describes (`tokenizer.ggml.*`), as Hugging Face tokenizer files.

GGUF stores no tokenizer.json: it stores the vocabulary (`tokens`, `token_type`, `scores`),
the BPE `merges`, the special token ids and the chat template (`tokenizer.chat_template`).
`tokenizer_files` builds a `tokenizers.Tokenizer` from them and returns the three files a
Hugging Face directory holds (tokenizer.json, tokenizer_config.json with the special tokens
and the chat template, generation_config.json with the ids to stop on), so that an imported
GGUF model carries the same tokenizer files, read by the same `HFTokenizer`, as an imported
Hugging Face directory.

Two tokenizer models (`tokenizer.ggml.model`):
  gpt2   byte-level BPE with merges; the pre-tokenizer split from `tokenizer.ggml.pre` (GPT-2's,
         Llama 3's or Qwen2's regex; other splits are refused naming the value).
  llama  SentencePiece-style BPE: '▁' for a space, a '▁' prefixed to the text unless
         `tokenizer.ggml.add_space_prefix` is false, byte fallback through the <0xNN>
         tokens; the merges are the file's, or, when it lists none, every split of a token
         into two tokens ranked by the merged token's score.
Tokens of type CONTROL become special tokens (matched whole in text, skipped on decoding),
USER_DEFINED ones plain added tokens (matched whole). The ids to stop on are
`eos_token_id`, then `eot_token_id` and `eom_token_id` where the file names them.
"""

from __future__ import annotations

import json
from typing import Any

from specjax.checkpoints.gguf.read import GGUFFile

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The pre-tokenizer splits of byte-level vocabularies, by `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {"default": None, "gpt2": None, "smollm": None, "starcoder": None,
          "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
          "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


def _byte_alphabet() -> dict[int, str]:
  """GPT-2's byte -> printable character map (the spelling of byte-level vocabularies)."""
  printable = [b for b in range(256) if (33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255)]
  mapping = {b: chr(b) for b in printable}
  n = 0
  for b in range(256):
    if b not in mapping:
      mapping[b] = chr(256 + n)
      n += 1
  return mapping


def _byte_level(f: GGUFFile, tokens: list[str]):
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
  pre = f.meta("tokenizer.ggml.pre", "default")
  if pre not in SPLITS:
    raise ValueError(f"GGUF file {str(f.path)!r}: tokenizer.ggml.pre={pre!r} is not supported "
                     f"(supported pre-tokenizers: {', '.join(SPLITS)})")
  spelling = _byte_alphabet()
  alphabet = set(spelling.values())
  vocab = {}
  for i, t in enumerate(tokens):  # tokens outside the byte alphabet: spell their bytes
    vocab.setdefault(t if set(t) <= alphabet else
                     "".join(spelling[b] for b in t.encode("utf-8")), i)
  merges = [tuple(m.split(" ", 1)) for m in f.meta("tokenizer.ggml.merges")]
  tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="",
                             end_of_word_suffix="", fuse_unk=False))
  if SPLITS[pre] is None:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  else:
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  return tok, alphabet


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
  """Merges of a SentencePiece vocabulary that lists none: every split of a token into two
  vocabulary tokens, the highest-scoring merged token first (ties: shorter left part)."""
  index = {t: i for i, t in enumerate(tokens)}
  found = []
  for t, score in zip(tokens, scores):
    pairs = [(t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in index and t[k:] in index]
    pairs.sort(key=lambda p: (index[p[0]], index[p[1]]))
    found += [(score, len(a), len(b), a, b) for a, b in pairs]
  found.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)
  return [(a, b) for _, _, _, a, b in found]


def _sentencepiece(f: GGUFFile, tokens: list[str], types: list[int]):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  vocab = {}
  for i, t in enumerate(tokens):
    vocab.setdefault(t, i)
  if f.has("tokenizer.ggml.merges"):
    merges = [tuple(m.split(" ", 1)) for m in f.meta("tokenizer.ggml.merges")]
  else:
    scores = f.meta("tokenizer.ggml.scores", None)
    if scores is None or len(scores) != len(tokens):
      raise ValueError(f"GGUF file {str(f.path)!r}: a 'llama' tokenizer needs "
                       f"tokenizer.ggml.merges or one tokenizer.ggml.scores entry per token")
    merges = spm_merges(tokens, scores)
  unk = next((tokens[i] for i, k in enumerate(types) if k == UNKNOWN), None)
  if f.has("tokenizer.ggml.unknown_token_id"):
    unk = tokens[f.meta("tokenizer.ggml.unknown_token_id")]
  tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                             byte_fallback=True))
  prefix = bool(f.meta("tokenizer.ggml.add_space_prefix", True))
  tok.pre_tokenizer = pre_tokenizers.Metaspace(
      replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False)
  steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
  tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)]
                                           if prefix else []))
  return tok


def build_tokenizer(f: GGUFFile):
  """The file's `tokenizers.Tokenizer` (module doc); ValueError naming the key for a
  tokenizer model or pre-tokenizer that is not covered."""
  from tokenizers import AddedToken
  kind = f.meta("tokenizer.ggml.model")
  tokens = list(f.meta("tokenizer.ggml.tokens"))
  types = list(f.meta("tokenizer.ggml.token_type", [NORMAL] * len(tokens)))
  if len(types) != len(tokens):
    raise ValueError(f"GGUF file {str(f.path)!r}: tokenizer.ggml.token_type has {len(types)} "
                     f"entries for {len(tokens)} tokens")
  if kind == "gpt2":
    tok, alphabet = _byte_level(f, tokens)
  elif kind == "llama":
    tok, alphabet = _sentencepiece(f, tokens, types), None
  else:
    raise ValueError(f"GGUF file {str(f.path)!r}: tokenizer.ggml.model={kind!r} is not "
                     f"supported (supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)")
  control = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
             if k == CONTROL and (alphabet is None or set(t) <= alphabet)]
  tok.add_special_tokens(control)
  user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types)
          if k == USER_DEFINED]
  tok.add_tokens(user)
  return tok


def _token(f: GGUFFile, tokens: list[str], key: str) -> str | None:
  i = f.meta(f"tokenizer.ggml.{key}", None)
  return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None


def tokenizer_files(f: GGUFFile) -> dict[str, str]:
  """{file name: text} of the Hugging Face tokenizer files for the file's tokenizer."""
  tok = build_tokenizer(f)
  tokens = list(f.meta("tokenizer.ggml.tokens"))
  config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
  for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                    ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
    config[name] = _token(f, tokens, key)
  for name in ("add_bos_token", "add_eos_token"):
    if f.has(f"tokenizer.ggml.{name}"):
      config[name] = bool(f.meta(f"tokenizer.ggml.{name}"))
  template = f.meta("tokenizer.chat_template", None)
  if template is not None:
    config["chat_template"] = template
  eos = []
  for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
    i = f.meta(f"tokenizer.ggml.{key}", None)
    if isinstance(i, int) and i not in eos:
      eos.append(i)
  generation = {"eos_token_id": eos} if eos else {}
  for name, key in (("bos_token_id", "bos_token_id"), ("pad_token_id", "padding_token_id")):
    if f.has(f"tokenizer.ggml.{key}"):
      generation[name] = f.meta(f"tokenizer.ggml.{key}")
  return {"tokenizer.json": tok.to_str(),
          "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False),
          "generation_config.json": json.dumps(generation, indent=2)}
