"""`specjax generate --chat` and every EOS id of a Hugging Face target: the prompt is the
chat template's rendering (transformers' apply_chat_template ids), decoding stops on any id
generation_config.json (else config.json) lists, not only the first, and the ids survive
the cached import."""

from __future__ import annotations

import argparse
import json

import pytest

pytestmark = pytest.mark.slow  # a Hugging Face directory per test, imported and compiled

pytest.importorskip("torch")
pytest.importorskip("transformers")

from specjax.data import chat  # noqa: E402
from specjax import cli, resolve
from specjax.engine import decoding
from specjax.commands import generate  # noqa: E402
from hf_testing import llama_dir as _llama_dir, theirs  # noqa: E402

MESSAGE = "Hello, how are you?"


@pytest.fixture()
def target(tmp_path, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
  return _llama_dir(tmp_path / "target", 2, 0)


def _set_eos(directory, where: str, ids) -> None:
  path = directory / where
  data = json.loads(path.read_text()) if path.is_file() else {}
  path.write_text(json.dumps({**data, "eos_token_id": ids}))


def _cli(directory, capsys, *extra) -> dict:
  assert cli.main(["generate", "--target", str(directory), "--draft", "self", "--chat",
                   "--prompt", MESSAGE, "--max-new-tokens", "6", "--k", "2", "--repeats", "1",
                   "--json", *extra]) == 0
  return json.loads(capsys.readouterr().out)


def test_chat_prompt_is_the_templates_rendering(target):
  tok = resolve.load_target(str(target))[1]
  args = argparse.Namespace(chat=True, target=str(target))
  ids = generate._encode(args, tok, MESSAGE)
  assert ids == theirs(target, [{"role": "user", "content": MESSAGE}])
  plain = generate._encode(argparse.Namespace(chat=False, target=str(target)), tok, MESSAGE)
  assert plain != ids  # a negative control: without --chat, the text itself


def test_every_listed_eos_id_stops_decoding(target, capsys):
  tok = resolve.load_target(str(target))[1]
  ids = generate._encode(argparse.Namespace(chat=True, target=str(target)), tok, MESSAGE)
  first = decoding.generate(resolve.load_target(str(target))[0], [ids],
                            max_new_tokens=3).tokens[0][0]  # the greedy first token
  other = (first + 1) % 400
  # the first token is the SECOND id listed: decoding that stopped on the first id alone
  # would run on to --max-new-tokens
  _set_eos(target, "generation_config.json", [other, first])
  report = _cli(target, capsys)
  assert report["chat"] is True and report["eos_ids"][:2] == [other, first]
  assert report["plain"]["tokens"] == 1 and report["speculative"]["tokens"] == 1
  assert report["identical_to_plain"] is True
  _set_eos(target, "generation_config.json", [other])  # control: not listed, decoding runs on
  assert _cli(target, capsys)["plain"]["tokens"] == 6


def test_config_json_eos_ids_when_generation_config_has_none(target):
  (target / "generation_config.json").unlink(missing_ok=True)
  _set_eos(target, "config.json", [5, 7])
  tok = resolve.load_target(str(target))[1]  # through the cached import
  assert chat.stop_ids(tok)[:2] == (5, 7)


def test_chat_without_a_template_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
  d = _llama_dir(tmp_path / "plain", 1, 0)
  config = json.loads((d / "tokenizer_config.json").read_text())
  config.pop("chat_template")
  (d / "tokenizer_config.json").write_text(json.dumps(config))
  assert cli.main(["generate", "--target", str(d), "--draft", "self", "--chat", "--prompt",
                   "hi", "--max-new-tokens", "2", "--repeats", "1"]) != 0
  err = capsys.readouterr().err
  assert "--chat: the target's tokenizer has no chat template" in err
