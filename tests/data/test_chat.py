"""Chat templates (specjax.data.chat, HFTokenizer.chat_template / apply_chat_template / eos_ids).

A tiny byte-level BPE with Llama-3-like and ChatML-like special tokens is trained in the
test and saved as a Hugging Face tokenizer directory; our token ids are compared with
`transformers.AutoTokenizer.from_pretrained(dir).apply_chat_template(messages,
add_generation_prompt=True)` (skipped without transformers) for templates in
tokenizer_config.json (string and named-list forms), in chat_template.jinja, with BOS
written by the template, with loop controls, tojson, namespace and `{% generation %}`, and
with the legacy special_tokens_map.json.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from specjax.data import chat
from specjax.checkpoints.hf.tokenizer import (HFTokenizer, copy_tokenizer_files,
                                              load_tokenizer_for)
from specjax.data.tokenizer import ByteTokenizer

tokenizers = pytest.importorskip("tokenizers")

from hf_testing import CHATML, LLAMA3, _backend_json, theirs, write_tokenizer_dir  # noqa: E402

# Non-dash tags (trim_blocks / lstrip_blocks decide its whitespace), loop controls, tojson
# (no HTML escaping, non-ASCII kept), namespace, dict, {% generation %}, None-dropping,
# the reasoning aliases, tools / documents passed as None, eos_token as a variable.
FANCY = """{% set ns = namespace(n=0) %}
{% for m in messages %}
    {% if m.role == 'system' %}
{{ m | tojson }}
        {% continue %}
    {% endif %}
    {% set ns.n = ns.n + 1 %}
<|im_start|>{{ m.role }}{% if m.name is defined %} name={{ m.name }}{% endif %}

    {% if m.role == 'assistant' %}
{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}
{% generation %}{{ m.content }}{% endgeneration %}{{ eos_token }}
    {% else %}
{{ m.content | tojson(indent=1) }} {{ dict(k=ns.n) | tojson(sort_keys=true) }}
    {% endif %}
<|im_end|>
    {% if ns.n >= 4 %}{% break %}{% endif %}
{% endfor %}
{% if tools is not none or documents is not none %}{{ raise_exception('no tools') }}{% endif %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

SYSTEM_USER = [{"role": "system", "content": "You are a helpful assistant."},
               {"role": "user", "content": "Hello, how are you?"}]
USER = [{"role": "user", "content": "  write a poem about the sea  "}]
MULTI = [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "Hello"},
         {"role": "assistant", "content": "I am fine, thank you."},
         {"role": "user", "content": 'héllo wörld ✓ <b>&amp;</b> "quoted"'}]
LONG = [{"role": "user", "content": f"turn {i}"} if i % 2 == 0 else
        {"role": "assistant", "content": f"answer {i}", "reasoning": "because"}
        for i in range(9)]
ODD = [{"role": "user", "content": "the cat", "name": None},
       {"role": "assistant", "content": "sat", "thinking": "hmm", "name": "bot"},
       {"role": "user", "content": "on the mat", "name": "me"}]
CONVERSATIONS = [SYSTEM_USER, USER, MULTI]


def ours(d: pathlib.Path, messages) -> list[int]:
  return HFTokenizer.from_dir(d).apply_chat_template(messages)


def assert_same(d: pathlib.Path, messages) -> list[int]:
  tok = HFTokenizer.from_dir(d)
  assert tok.chat_template.render(messages) == theirs(d, messages, tokenize=False)
  ids = tok.apply_chat_template(messages)
  assert ids == theirs(d, messages)
  return ids


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("template", [LLAMA3, CHATML, FANCY], ids=["llama3", "chatml", "fancy"])
@pytest.mark.parametrize("where", ["config", "jinja"])
def test_ids_match_transformers(tmp_path, template, where):
  d = write_tokenizer_dir(tmp_path, config={"chat_template": template} if where == "config"
                          else None, jinja=template if where == "jinja" else None)
  for messages in CONVERSATIONS + [LONG, ODD]:
    assert_same(d, messages)
  t = HFTokenizer.from_dir(d).chat_template
  assert t.source == ("tokenizer_config.json chat_template" if where == "config"
                      else "chat_template.jinja")


def test_bos_written_by_the_template_once(tmp_path):
  d = write_tokenizer_dir(tmp_path, config={"chat_template": LLAMA3})
  tok = HFTokenizer.from_dir(d)
  ids = assert_same(d, SYSTEM_USER)
  bos = tok.bos_id
  assert bos == tok._tok.token_to_id("<|begin_of_text|>")
  assert ids[0] == bos and ids.count(bos) == 1
  assert ids[1] == tok._tok.token_to_id("<|start_header_id|>")
  assert tok.decode(ids).endswith("assistant\n\n")  # the generation prompt (specials dropped)
  # a template without bos_token: no BOS anywhere (none is added, as in transformers)
  d2 = write_tokenizer_dir(tmp_path / "chatml", config={"chat_template": CHATML})
  assert bos not in assert_same(d2, SYSTEM_USER)


def test_jinja_file_wins_over_the_config(tmp_path):
  d = write_tokenizer_dir(tmp_path, config={"chat_template": CHATML}, jinja=LLAMA3)
  ids = assert_same(d, MULTI)
  assert ids[0] == HFTokenizer.from_dir(d).bos_id  # the Llama template ran
  assert HFTokenizer.from_dir(d).chat_template.source == "chat_template.jinja"


def test_named_list_form_uses_default(tmp_path):
  config = {"chat_template": [{"name": "tool_use", "template": LLAMA3},
                              {"name": "default", "template": CHATML}]}
  d = write_tokenizer_dir(tmp_path, config=config)
  assert_same(d, SYSTEM_USER)
  t = chat.load_chat_template(d)
  assert t.text == CHATML and "'default'" in t.source


def test_legacy_special_tokens_map(tmp_path):
  tmpl = "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
  d = tmp_path / "legacy"
  write_tokenizer_dir(d, special_map={"bos_token": {"content": "<|im_start|>", "lstrip": False},
                                      "eos_token": "<|im_end|>"})
  cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": tmpl,
         "eos_token": "<|eot_id|>"}
  (d / "tokenizer_config.json").write_text(json.dumps(cfg))
  assert chat.special_tokens(d) == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
  assert_same(d, MULTI)
  # with added_tokens_decoder in the config, special_tokens_map.json is not read
  cfg["added_tokens_decoder"] = {}
  (d / "tokenizer_config.json").write_text(json.dumps(cfg))
  assert chat.special_tokens(d) == {"eos_token": "<|eot_id|>"}


def test_special_tokens_forms(tmp_path):
  d = write_tokenizer_dir(tmp_path, config={
      "bos_token": {"__type": "AddedToken", "content": "<|begin_of_text|>"},
      "pad_token": None, "unk_token": "<|eom_id|>", "additional_special_tokens": ["<x>"]})
  assert chat.special_tokens(d) == {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                                    "unk_token": "<|eom_id|>"}
  (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": 3}))
  with pytest.raises(ValueError, match=r"tokenizer_config.json'?: bos_token must be a string"):
    chat.special_tokens(d)


# ----------------------------------------------------------------------------- eos ids


@pytest.mark.parametrize("generation,expected", [
    ({"eos_token_id": [11, 2, 7]}, None),  # None: (11, 2, 7) + the tokenizer's eos if new
    ({"eos_token_id": 5}, None),
    ({"bos_token_id": 1}, None),
    ({"eos_token_id": None}, None),
])
def test_eos_ids(tmp_path, generation, expected):
  d = write_tokenizer_dir(tmp_path, generation=generation)
  tok = HFTokenizer.from_dir(d)
  eot = tok._tok.token_to_id("<|eot_id|>")
  assert tok.eos_id == eot
  listed = generation.get("eos_token_id")
  listed = [] if listed is None else listed if isinstance(listed, list) else [listed]
  want = tuple(listed) + ((eot,) if eot not in listed else ())
  assert tok.eos_ids == want and chat.stop_ids(tok) == want
  assert isinstance(tok.eos_ids, tuple)


def test_eos_ids_tokenizer_eos_already_listed_and_from_generation_only(tmp_path):
  d = write_tokenizer_dir(tmp_path, generation={"eos_token_id": [9, 12]})
  eot = HFTokenizer.from_dir(d)._tok.token_to_id("<|eot_id|>")
  assert eot not in (9, 12) and HFTokenizer.from_dir(d).eos_ids == (9, 12, eot)
  (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, eot, 12, 9]}))
  assert HFTokenizer.from_dir(d).eos_ids == (9, eot, 12)
  # no eos_token in the config: the tokenizer's eos is generation_config's first id
  (d / "tokenizer_config.json").write_text(json.dumps({}))
  tok = HFTokenizer.from_dir(d)
  assert tok.eos_id == 9 and tok.eos_ids == (9, eot, 12)


@pytest.mark.parametrize("bad", ["3", [1, "2"], [True], -1, {"a": 1}, 2.0])
def test_eos_ids_bad_generation_config(tmp_path, bad):
  d = write_tokenizer_dir(tmp_path, generation={"eos_token_id": bad})
  with pytest.raises(ValueError, match=r"generation_config.json'?: eos_token_id must be"):
    HFTokenizer.from_dir(d)


def test_stop_ids_of_other_tokenizers():
  assert chat.stop_ids(ByteTokenizer()) == (257,)

  class NoEos:
    eos_id = None
  assert chat.stop_ids(NoEos()) == ()


def test_eos_ids_direct_construction_merges():
  backend = tokenizers.Tokenizer.from_str(_backend_json())
  tok = HFTokenizer(backend, bos_id=None, eos_id=4, pad_id=None, eos_ids=(4, 6))
  assert tok.eos_ids == (4, 6) and tok.chat_template is None
  assert HFTokenizer(backend, bos_id=None, eos_id=None, pad_id=None).eos_ids == ()


# ----------------------------------------------------------------------------- library calls


def test_encode_messages_and_opt_out(tmp_path):
  d = write_tokenizer_dir(tmp_path, config={"chat_template": CHATML})
  tok = load_tokenizer_for(d)
  assert isinstance(tok, HFTokenizer) and tok.chat_template is not None
  assert chat.encode_messages(tok, SYSTEM_USER) == tok.apply_chat_template(SYSTEM_USER)
  plain = chat.encode_messages(tok, SYSTEM_USER, use_chat_template=False)
  assert plain == tok.encode("You are a helpful assistant.\nHello, how are you?")
  assert chat.template_of(tok, use_chat_template=False) is None
  # single user message, no template: the content as is
  assert chat.encode_messages(tok, USER, use_chat_template=False) == tok.encode(USER[0]["content"])
  # tokenizers without a template
  byte = ByteTokenizer()
  assert chat.encode_messages(byte, USER) == byte.encode(USER[0]["content"])
  with pytest.raises(ValueError, match="use_chat_template must be a bool"):
    chat.encode_messages(tok, USER, use_chat_template="no")


def test_no_template(tmp_path):
  d = write_tokenizer_dir(tmp_path)
  tok = HFTokenizer.from_dir(d)
  assert chat.load_chat_template(d) is None and tok.chat_template is None
  with pytest.raises(ValueError, match="has no chat template"):
    tok.apply_chat_template(USER)
  assert chat.encode_messages(tok, USER) == tok.encode(USER[0]["content"])


def test_render_without_generation_prompt(tmp_path):
  d = write_tokenizer_dir(tmp_path, config={"chat_template": CHATML})
  t = chat.load_chat_template(d)
  assert t.render(USER).endswith("<|im_start|>assistant\n")
  assert t.render(USER, add_generation_prompt=False).endswith("<|im_end|>\n")


def test_messages_are_not_modified(tmp_path):
  d = write_tokenizer_dir(tmp_path, config={"chat_template": FANCY})
  messages = [dict(m) for m in ODD]
  before = json.dumps(messages)
  HFTokenizer.from_dir(d).apply_chat_template(messages)
  assert json.dumps(messages) == before


def test_copy_tokenizer_files_takes_the_jinja_template(tmp_path):
  src = write_tokenizer_dir(tmp_path / "src", jinja=CHATML)
  (tmp_path / "dst").mkdir()
  assert "chat_template.jinja" in copy_tokenizer_files(src, tmp_path / "dst")
  assert chat.load_chat_template(tmp_path / "dst").text == CHATML


# ----------------------------------------------------------------------------- errors


def _one_line_error(fn, match: str, directory) -> str:
  with pytest.raises(ValueError, match=match) as e:
    fn()
  msg = str(e.value)
  assert "\n" not in msg and str(directory) in msg
  return msg


def test_template_that_raises(tmp_path):
  raising = "{{ raise_exception('roles must alternate\\nuser/assistant') }}"
  d = write_tokenizer_dir(tmp_path, config={"chat_template": raising})
  _one_line_error(lambda: HFTokenizer.from_dir(d).apply_chat_template(USER),
                  "failed: roles must alternate user/assistant", d)


def test_template_with_a_runtime_error(tmp_path):
  d = write_tokenizer_dir(tmp_path, config={"chat_template": "{{ messages[0]['content'] + 1 }}"})
  _one_line_error(lambda: HFTokenizer.from_dir(d).apply_chat_template(USER), "failed", d)


@pytest.mark.parametrize("template", ["", "   \n", "{% if false %}x{% endif %}"])
def test_template_that_renders_nothing(tmp_path, template):
  d = write_tokenizer_dir(tmp_path, jinja=template)
  _one_line_error(lambda: HFTokenizer.from_dir(d).apply_chat_template(USER), "rendered nothing", d)


def test_template_with_a_syntax_error(tmp_path):
  d = write_tokenizer_dir(tmp_path, config={"chat_template": "{% for m in messages %}\n{{ m }"})
  _one_line_error(lambda: chat.load_chat_template(d).render(USER), "is invalid: line", d)


def test_sandbox_refuses_unsafe_access(tmp_path):
  d = write_tokenizer_dir(tmp_path, config={"chat_template":
                                            "{{ messages.__class__.__mro__ }}"})
  with pytest.raises(ValueError):
    chat.load_chat_template(d).render(USER)
  d2 = write_tokenizer_dir(tmp_path / "ns", config={"chat_template":
                                                    "{% set ns = namespace(_x=1) %}{{ ns }}"})
  _one_line_error(lambda: chat.load_chat_template(d2).render(USER), "underscore", d2)
  d3 = write_tokenizer_dir(tmp_path / "mut", config={"chat_template":
                                                     "{{ messages.append(1) }}x"})
  _one_line_error(lambda: chat.load_chat_template(d3).render(USER), "failed", d3)


def test_bad_template_entries(tmp_path):
  d = write_tokenizer_dir(tmp_path, config={"chat_template": [{"name": "tool_use",
                                                               "template": CHATML}]})
  with pytest.raises(ValueError, match="none named 'default'"):
    chat.load_chat_template(d)
  write_tokenizer_dir(d, config={"chat_template": [{"name": "default"}]})
  with pytest.raises(ValueError, match=r"chat_template\[0\] must be an object"):
    chat.load_chat_template(d)
  write_tokenizer_dir(d, config={"chat_template": 7})
  with pytest.raises(ValueError, match="chat_template must be a string or a list"):
    chat.load_chat_template(d)
  (d / "tokenizer_config.json").write_text("{not json")
  with pytest.raises(ValueError, match="tokenizer_config.json.*invalid JSON at line 1"):
    chat.load_chat_template(d)
  (d / "tokenizer_config.json").write_text("[]")
  with pytest.raises(ValueError, match="must hold a JSON object"):
    chat.load_chat_template(d)
  (d / "tokenizer_config.json").write_text("{}")
  (d / "chat_template.jinja").write_bytes(b"\xff{{ x }}")
  with pytest.raises(ValueError, match="chat_template.jinja.*invalid UTF-8"):
    chat.load_chat_template(d)
  with pytest.raises(ValueError, match="not a directory"):
    chat.load_chat_template(tmp_path / "missing")


def test_extra_templates_without_default(tmp_path):
  d = write_tokenizer_dir(tmp_path, config={"chat_template": CHATML})
  (d / "additional_chat_templates").mkdir()
  (d / "additional_chat_templates" / "rag.jinja").write_text(LLAMA3)
  with pytest.raises(ValueError, match="none named 'default'"):
    chat.load_chat_template(d)
  (d / "chat_template.jinja").write_text(CHATML)
  t = chat.load_chat_template(d)
  assert t.text == CHATML and t.source == "chat_template.jinja"


@pytest.mark.parametrize("messages,match", [
    ([], "must not be empty"),
    ("hello", "must be a list"),
    ([{"content": "x"}], r"messages\[0\]\['role'\] must be a string"),
    (["x"], r"messages\[0\] must be a mapping"),
    ([{"role": "user", "content": object()}], "must be plain data"),
])
def test_bad_messages(tmp_path, messages, match):
  d = write_tokenizer_dir(tmp_path, config={"chat_template": CHATML})
  with pytest.raises(ValueError, match=match):
    chat.load_chat_template(d).render(messages)


def test_normalize_messages():
  import numpy as np
  out = chat.normalize_messages([{"role": "user", "content": "a", "x": None,
                                  "n": np.int64(3), "r": "why", "t": (1, [2])}])
  assert out == [{"role": "user", "content": "a", "n": 3, "r": "why", "t": (1, [2])}]
  assert type(out[0]["n"]) is int
  out = chat.normalize_messages([{"role": "assistant", "content": "a", "reasoning": "r"}])
  assert list(out[0]) == ["thinking", "role", "content", "reasoning", "reasoning_content"]
  assert out[0]["thinking"] == out[0]["reasoning_content"] == "r"
