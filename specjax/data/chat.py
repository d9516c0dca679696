"""Chat templates: a Hugging Face tokenizer directory's Jinja template, rendered and tokenized
exactly as `transformers`' `tokenizer.apply_chat_template(messages, add_generation_prompt=True)`
renders and tokenizes it, without importing transformers.

Where the template lives (transformers' rule, docs/prompts.md):

- `chat_template.jinja` beside tokenizer_config.json (and named extra templates in
  `additional_chat_templates/*.jinja`); files take priority over the config;
- else tokenizer_config.json's `chat_template`: a string, or a list of {"name", "template"};
- several templates: the one named "default" (no tools are passed, so never "tool_use").

The environment the template runs in: jinja2's `ImmutableSandboxedEnvironment` with
`trim_blocks`, `lstrip_blocks`, the loop controls (`break`, `continue`) and the
`{% generation %}` block (rendered as its body); the `tojson` filter without HTML escaping
(`ensure_ascii=False`, and `indent`, `separators`, `sort_keys` options); the globals
`raise_exception(message)` and `strftime_now(format)`, and `dict` / `namespace` that refuse
underscore names. Variables: `messages`, `tools` = None, `documents` = None,
`add_generation_prompt`, and the named special tokens of the tokenizer files (`bos_token`,
`eos_token`, `unk_token`, `sep_token`, `pad_token`, `cls_token`, `mask_token`; only those
set). Messages are copied as plain data, keys whose value is None are dropped, and a
message's reasoning (`reasoning_content`, `thinking` or `reasoning`) is offered under
`reasoning_content` and `thinking` too.

Token ids: the rendered text is encoded with the tokenizer's plain `encode` (no special
tokens added, transformers' `add_special_tokens=False`), so a BOS appears exactly when the
template writes `{{ bos_token }}`; callers must not prepend another.

Nothing here imports transformers or the checkpoint machinery; jinja2 is imported when a
template is compiled.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import pathlib
from typing import Any, Iterable, Mapping, Sequence

CHAT_TEMPLATE_FILE = "chat_template.jinja"
EXTRA_TEMPLATES_DIR = "additional_chat_templates"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


# ----------------------------------------------------------------------------- template


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  """One chat template of a tokenizer directory.

  `text` is the Jinja source, `source` the file it came from (with the template's name when
  the file holds several), `special_tokens` the named special tokens offered to the template
  as variables. `render` and `encode` raise ValueError naming `directory` when the template
  is invalid, raises, or renders nothing.
  """
  text: str
  directory: str
  source: str
  special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)

  def render(self, messages: Sequence[Mapping[str, Any]], *,
             add_generation_prompt: bool = True) -> str:
    """The conversation as the template writes it (transformers' `apply_chat_template(...,
    tokenize=False)`): non-empty text, else ValueError."""
    chat = normalize_messages(messages)
    if not isinstance(add_generation_prompt, bool):
      raise ValueError(f"add_generation_prompt must be a bool, got {add_generation_prompt!r}")
    variables = {**self.special_tokens, "messages": chat, "tools": None, "documents": None,
                 "add_generation_prompt": add_generation_prompt}
    try:
      text = self._compiled.render(**variables)
    except Exception as e:  # noqa: BLE001 - a template may raise anything; one line for all
      raise ValueError(f"the chat template of {self.directory} ({self.source}) failed: "
                       f"{_one_line(e)}") from e
    if not text.strip():
      raise ValueError(f"the chat template of {self.directory} ({self.source}) rendered "
                       f"nothing for {len(chat)} message(s)")
    return text

  def encode(self, tokenizer, messages: Sequence[Mapping[str, Any]], *,
             add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `render(messages)` by `tokenizer.encode(text)` (no BOS/EOS added): what
    transformers' `apply_chat_template(messages, add_generation_prompt=True)` returns when
    `tokenizer` encodes like the directory's tokenizer.json (HFTokenizer does)."""
    return list(tokenizer.encode(self.render(messages,
                                             add_generation_prompt=add_generation_prompt)))

  @functools.cached_property
  def _compiled(self):
    import jinja2
    try:
      return _environment().from_string(self.text)
    except jinja2.TemplateSyntaxError as e:
      raise ValueError(f"the chat template of {self.directory} ({self.source}) is invalid: "
                       f"line {e.lineno}: {_one_line(e.message or e)}") from e


def load_chat_template(directory: str | os.PathLike) -> ChatTemplate | None:
  """The chat template of a tokenizer directory (transformers' rule, module docstring), or
  None when it has none. ValueError naming the file for an unreadable file, a malformed
  `chat_template` entry, or several templates without one named "default"."""
  d = pathlib.Path(directory)
  if not d.is_dir():
    raise ValueError(f"tokenizer directory {str(d)!r} is not a directory")
  config = _read_json(d / TOKENIZER_CONFIG)
  templates: dict[str, tuple[str, str]] = {}  # name -> (text, source)
  if (d / CHAT_TEMPLATE_FILE).is_file():
    templates["default"] = (_read_text(d / CHAT_TEMPLATE_FILE), CHAT_TEMPLATE_FILE)
  extra = d / EXTRA_TEMPLATES_DIR
  if extra.is_dir():
    for path in sorted(extra.glob("*.jinja")):
      templates[path.name.removesuffix(".jinja")] = (_read_text(path),
                                                      f"{EXTRA_TEMPLATES_DIR}/{path.name}")
  named = bool(templates) and list(templates) != ["default"]  # several, by name
  if not templates:
    templates, named = _config_templates(config, d / TOKENIZER_CONFIG)
    if not templates and not named:
      return None
  if named and "default" not in templates:
    raise ValueError(f"{str(d)!r} has named chat templates {sorted(templates)} and none "
                     f"named 'default'")
  text, source = templates["default"]
  return ChatTemplate(text=text, directory=str(d), source=source,
                      special_tokens=special_tokens(d, config))


def special_tokens(directory: str | os.PathLike, config: Mapping | None = None
                   ) -> dict[str, str]:
  """The named special tokens a template sees (bos_token, eos_token, ...: only those set):
  tokenizer_config.json's values (strings, or {"content": ...} objects), overridden by the
  legacy special_tokens_map.json when the config has no `added_tokens_decoder` (transformers'
  rule). `config` is tokenizer_config.json's contents when already read."""
  d = pathlib.Path(directory)
  config = _read_json(d / TOKENIZER_CONFIG) if config is None else config
  given = {name: (config[name], d / TOKENIZER_CONFIG) for name in SPECIAL_TOKEN_NAMES
           if name in config}
  if "added_tokens_decoder" not in config:
    legacy = _read_json(d / SPECIAL_TOKENS_MAP)
    given.update({name: (legacy[name], d / SPECIAL_TOKENS_MAP) for name in SPECIAL_TOKEN_NAMES
                  if name in legacy})
  found = {}
  for name, (value, path) in given.items():
    if value is None:
      continue
    content = value.get("content") if isinstance(value, Mapping) else value
    if not isinstance(content, str):
      raise ValueError(f"{str(path)!r}: {name} must be a string or an object with a string "
                       f"'content', got {_short(value)}")
    found[name] = content
  return found


# ----------------------------------------------------------------------------- messages


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """The conversation as the template sees it: a fresh list of plain dicts (JSON types), keys
  whose value is None dropped, reasoning offered under `reasoning_content` and `thinking`.
  ValueError for an empty conversation, a message that is not a mapping with a string
  'role', or a value that is not plain data."""
  if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
    raise ValueError(f"messages must be a list of {{'role', 'content'}} mappings, "
                     f"got {type(messages).__name__}")
  if not messages:
    raise ValueError("messages must not be empty")
  chat = []
  for i, message in enumerate(messages):
    if not isinstance(message, Mapping):
      raise ValueError(f"messages[{i}] must be a mapping with 'role' and 'content', "
                       f"got {message!r}")
    if not isinstance(message.get("role"), str):
      raise ValueError(f"messages[{i}]['role'] must be a string, got {message.get('role')!r}")
    plain = {_plain(k, f"messages[{i}]"): _plain(v, f"messages[{i}][{k!r}]")
             for k, v in message.items() if v is not None}
    reasoning = next((plain[k] for k in REASONING_FIELDS if k in plain), None)
    if reasoning is not None:
      plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    chat.append(plain)
  return chat


def _plain(value: Any, where: str) -> Any:
  """A copy of `value` in exact JSON types: subclasses (enums, numpy scalars) are stripped to
  their base type, so a sandboxed template sees no methods beyond those of plain data."""
  import numpy as np
  if value is None or type(value) in (str, int, float, bool):
    return value
  if isinstance(value, np.generic):
    return _plain(value.item(), where)
  if isinstance(value, str):
    return str.__str__(value)
  if isinstance(value, int):
    return int.__int__(value)
  if isinstance(value, float):
    return float.__float__(value)
  if isinstance(value, Mapping):
    return {_plain(k, where): _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
  if isinstance(value, list):
    return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
  if isinstance(value, tuple):
    return tuple(_plain(v, f"{where}[{i}]") for i, v in enumerate(value))
  raise ValueError(f"{where} must be plain data (str, number, bool, None, list, dict), "
                   f"got {type(value).__name__}")


def plain_text(messages: Sequence[Mapping[str, Any]]) -> str:
  """The prompt text without a chat template: the messages' contents in order, joined by a
  newline (a single user message is its content, unchanged)."""
  chat = normalize_messages(messages)
  parts = []
  for i, message in enumerate(chat):
    content = message.get("content", "")
    if not isinstance(content, str):
      raise ValueError(f"messages[{i}]['content'] must be a string without a chat template, "
                       f"got {type(content).__name__}")
    parts.append(content)
  return "\n".join(parts)


# ----------------------------------------------------------------------------- tokenizers


def template_of(tokenizer, *, use_chat_template: bool = True) -> ChatTemplate | None:
  """The chat template a tokenizer carries (`HFTokenizer.chat_template`; byte and specjax BPE
  tokenizers carry none), or None when `use_chat_template` is False (`--no-chat-template`)."""
  if not isinstance(use_chat_template, bool):
    raise ValueError(f"use_chat_template must be a bool, got {use_chat_template!r}")
  return getattr(tokenizer, "chat_template", None) if use_chat_template else None


def encode_messages(tokenizer, messages: Sequence[Mapping[str, Any]], *,
                    use_chat_template: bool = True) -> list[int]:
  """Prompt token ids of a conversation: with the tokenizer's chat template (and
  `use_chat_template`), the template's rendering with the generation prompt, tokenized as
  transformers does (the template writes any BOS); without one, `plain_text(messages)`
  encoded plainly (no BOS, as the embedded prompt sets are)."""
  template = template_of(tokenizer, use_chat_template=use_chat_template)
  if template is not None:
    return template.encode(tokenizer, messages)
  return list(tokenizer.encode(plain_text(messages)))


def stop_ids(tokenizer) -> tuple[int, ...]:
  """The EOS ids to stop on: `HFTokenizer.eos_ids` (generation_config.json's `eos_token_id`,
  an int or a list, plus the tokenizer's eos), else the tokenizer's `eos_id`; () if none."""
  ids = getattr(tokenizer, "eos_ids", None)
  if ids is not None:
    return tuple(int(i) for i in ids)
  eos = getattr(tokenizer, "eos_id", None)
  return () if eos is None else (int(eos),)


def merge_eos_ids(first: Iterable[int], *more: int | None) -> tuple[int, ...]:
  """`first` then `more` (None skipped), each id once, in order of first appearance."""
  out: list[int] = []
  for i in (*first, *more):
    if i is not None and int(i) not in out:
      out.append(int(i))
  return tuple(out)


# ----------------------------------------------------------------------------- environment


@functools.lru_cache(maxsize=1)
def _environment():
  """The sandbox the templates run in (module docstring): one per process."""
  import jinja2
  import jinja2.ext
  import jinja2.nodes
  import jinja2.utils
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here
    it renders its body, in a scope of its own as a call block does."""
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  def raise_exception(message):
    raise jinja2.TemplateError(message)

  def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)

  def check_name(name):
    if isinstance(name, str) and name.startswith("_"):
      raise jinja2.exceptions.SecurityError(
          f"a chat template may not store the underscore name {name!r} on a namespace")

  class Namespace(jinja2.utils.Namespace):
    """jinja2's namespace without underscore attributes."""

    def __init__(*args, **kwargs):  # noqa: N805 - jinja2's own signature trick
      self, rest = args[0], args[1:]
      attrs = dict(*rest, **kwargs)
      for name in attrs:
        check_name(name)
      jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
      check_name(name)
      jinja2.utils.Namespace.__setitem__(self, name, value)

  class DictBuilder:
    """`dict(...)` and `dict.fromkeys(...)` in a template, with nothing else of the type."""

    def __call__(self, *args, **kwargs):
      return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
      return dict.fromkeys(*args, **kwargs)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[GenerationBlock, jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now,
                     dict=DictBuilder(), namespace=Namespace)
  return env


# ----------------------------------------------------------------------------- files


def _read_text(path: pathlib.Path) -> str:
  try:
    return path.read_bytes().decode("utf-8")
  except OSError as e:
    raise ValueError(f"cannot read {str(path)!r}: {e.strerror or e}") from e
  except UnicodeDecodeError as e:
    raise ValueError(f"cannot read {str(path)!r}: invalid UTF-8 at byte {e.start}") from e


def _read_json(path: pathlib.Path) -> dict:
  """A JSON object file's contents; {} when the file does not exist."""
  if not path.is_file():
    return {}
  try:
    data = json.loads(_read_text(path))
  except json.JSONDecodeError as e:
    raise ValueError(f"cannot read {str(path)!r}: invalid JSON at line {e.lineno} "
                     f"column {e.colno}: {e.msg}") from e
  except (RecursionError, ValueError):
    from specjax.data.json_files import loads
    loads(_read_text(path), repr(str(path)))
    raise
  if not isinstance(data, dict):
    raise ValueError(f"{str(path)!r} must hold a JSON object, got {type(data).__name__}")
  return data


def _config_templates(config: Mapping, path: pathlib.Path
                      ) -> tuple[dict[str, tuple[str, str]], bool]:
  """tokenizer_config.json's templates {name: (text, source)}, and whether they are the named
  (list) form, which must hold a "default"."""
  value = config.get("chat_template")
  if value is None:
    return {}, False
  if isinstance(value, str):
    return {"default": (value, f"{TOKENIZER_CONFIG} chat_template")}, False
  if isinstance(value, list):
    templates = {}
    for i, entry in enumerate(value):
      if not (isinstance(entry, Mapping) and isinstance(entry.get("name"), str)
              and isinstance(entry.get("template"), str)):
        raise ValueError(f"{str(path)!r}: chat_template[{i}] must be an object with string "
                         f"'name' and 'template', got {_short(entry)}")
      templates[entry["name"]] = (entry["template"],
                                  f"{TOKENIZER_CONFIG} chat_template {entry['name']!r}")
    return templates, True
  raise ValueError(f"{str(path)!r}: chat_template must be a string or a list of "
                   f"{{'name', 'template'}} objects, got {type(value).__name__}")


def _short(value: Any, limit: int = 80) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[:limit - 3] + "..."


def _one_line(e: object) -> str:
  return " ".join(str(e).split()) or type(e).__name__
