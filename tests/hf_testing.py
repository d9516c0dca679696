"""Hugging Face test directories shared by the chat, prompt, bench and study tests: a tiny
byte-level BPE tokenizer with Llama-3-like and ChatML-like special tokens (trained here), its
chat templates, transformers' own rendering (`theirs`) and a random Llama pair."""

from __future__ import annotations

import functools
import json
import pathlib
from typing import Mapping

import pytest

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|im_start|>", "<|im_end|>", "<|eom_id|>"]
CORPUS = ["You are a helpful assistant. Hello, how are you? I am fine, thank you.",
          "the cat sat on the mat; write a poem about the sea. Sure: waves and sand.",
          '{"role": "user", "content": "<b>&amp;</b>"} héllo wörld ✓'] * 20

LLAMA3 = (
    "{{- bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = \"\" %}\n"
    "{%- endif %}\n"
    "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n"
    "{{- system_message }}\n"
    "{{- \"<|eot_id|>\" }}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n")

CHATML = (
    "{%- for message in messages %}\n"
    "    {%- if loop.first and message['role'] != 'system' %}\n"
    "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n")

@functools.lru_cache(maxsize=1)
def _backend_json() -> str:
  # optional dependency: the tests that write a directory skip without it
  tokenizers = pytest.importorskip("tokenizers")
  from tokenizers import decoders, models, pre_tokenizers, trainers
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(CORPUS, trainer=trainer)
  return tok.to_str()


def write_tokenizer_dir(d: pathlib.Path, *, config: Mapping | None = None,
                        jinja: str | None = None, generation: Mapping | None = None,
                        special_map: Mapping | None = None) -> pathlib.Path:
  """A Hugging Face tokenizer directory: tokenizer.json, tokenizer_config.json (`config`
  over Llama-3-like bos/eos), optional chat_template.jinja, generation_config.json and
  special_tokens_map.json."""
  d.mkdir(parents=True, exist_ok=True)
  (d / "tokenizer.json").write_text(_backend_json())
  base = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
          "eos_token": "<|eot_id|>"}
  (d / "tokenizer_config.json").write_text(json.dumps({**base, **(config or {})}))
  if jinja is not None:
    (d / "chat_template.jinja").write_text(jinja, encoding="utf-8")
  if generation is not None:
    (d / "generation_config.json").write_text(json.dumps(generation))
  if special_map is not None:
    (d / "special_tokens_map.json").write_text(json.dumps(special_map))
  return d


@functools.lru_cache(maxsize=None)
def _auto(d: str):
  transformers = pytest.importorskip("transformers")
  return transformers.AutoTokenizer.from_pretrained(d)


def theirs(d: pathlib.Path, messages, tokenize: bool = True):
  out = _auto(str(d)).apply_chat_template(messages, add_generation_prompt=True,
                                          tokenize=tokenize)
  if isinstance(out, Mapping):
    out = out["input_ids"]
  return out if isinstance(out, str) else [int(i) for i in out]


V = 448  # the test tokenizer's 428 ids (420 BPE + 8 specials), padded as checkpoints are


def llama_dir(d, layers: int, seed: int):
  """A random Llama written by transformers, with the test tokenizer and the Llama-3
  template."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(seed)
  cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=layers, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=256,
                                 initializer_range=0.1, bos_token_id=None, eos_token_id=None,
                                 pad_token_id=None)
  transformers.LlamaForCausalLM(cfg).eval().save_pretrained(d)
  write_tokenizer_dir(d, config={"chat_template": LLAMA3})
  return d
