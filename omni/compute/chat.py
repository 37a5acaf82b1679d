"""Chat templates: a checkpoint's own Jinja template, rendered exactly as transformers renders it.

A template comes from the checkpoint (`chat_template.jinja`, `additional_chat_templates/*.jinja`
or the `chat_template` entry of `tokenizer_config.json`, in transformers' order of precedence)
and is rendered in the same sandbox as `PreTrainedTokenizerBase.apply_chat_template`: an
`ImmutableSandboxedEnvironment` with `trim_blocks`, `lstrip_blocks` and the `loopcontrols`
extension; a `tojson` that does not escape HTML; the globals `raise_exception`, `strftime_now`,
`dict` and `namespace`; the variables `messages`, `tools`, `documents`,
`add_generation_prompt` and the tokenizer's named special tokens (`bos_token`, `eos_token`...).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "load_chat_templates"]

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
LEGACY_CHAT_TEMPLATE_FILE = "chat_template.json"  # a processor's, before chat_template.jinja
# Names a message's reasoning may come under; templates read the first (transformers aliases them).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplate:
    """A checkpoint's chat template(s) and the special tokens they may refer to.

    Args:
        templates: one Jinja template, or named templates (a dict, or transformers' list of
            ``{"name", "template"}``); `render` uses "default" ("tool_use" when tools are given
            and the checkpoint has one), as `apply_chat_template` does.
        special_tokens: variables every rendering sees, e.g. ``{"bos_token": "<s>"}``.

    Raises:
        ValueError: no template, a template that is not a string, a named set without a
            "default", or a template that is not valid Jinja.
    """

    def __init__(self, templates: str | Mapping[str, str] | Sequence[Mapping[str, str]],
                 special_tokens: Mapping[str, str] | None = None):
        self.templates = _named_templates(templates)
        self.special_tokens = dict(special_tokens or {})
        for name, source in self.templates.items():
            _compile(source, name)  # a broken template fails when the checkpoint loads

    def source(self, tools: Sequence[Any] | None = None) -> str:
        """The template text `render` uses (with or without `tools`)."""
        if len(self.templates) == 1 and "default" in self.templates:
            return self.templates["default"]
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise ValueError("this checkpoint has several chat templates and none named 'default': "
                         f"{', '.join(sorted(self.templates))}")

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
               tools: Sequence[Mapping[str, Any]] | None = None,
               documents: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        """The prompt text of a conversation, as ``apply_chat_template(..., tokenize=False)``.

        Args:
            messages: dicts with a "role" (str) and usually a "content": a string, or a list of
                parts (``{"type": "text", "text": ...}``) for templates that read them. Keys
                whose value is None are dropped first, as transformers does.
            add_generation_prompt: end with the header that opens the assistant's turn.
            tools: JSON schemas of the functions the model may call (templates that read them).
            documents: retrieved documents (dicts) for templates that read them.
            **kwargs: further template variables; they override the special tokens.

        Raises:
            ValueError: an empty conversation, a message that is not a dict with a string
                "role", content of another type, or a template that fails (its message, e.g.
                from the template's own ``raise_exception``).
        """
        chat = _plain([dict(m) for m in _checked_messages(messages)])
        chat = [_alias_reasoning(m) for m in chat]
        variables = _plain({**self.special_tokens, **kwargs})
        template = _compile(self.source(tools), "default" if tools is None else "tool_use")
        try:
            return template.render(messages=chat, tools=_plain(_checked_items("tools", tools)),
                                   documents=_plain(_checked_items("documents", documents)),
                                   add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as exc:  # raise_exception(...), undefined, sandbox
            raise ValueError(f"the chat template failed: {exc.message or exc}") from None
        except (TypeError, ValueError, LookupError, ArithmeticError) as exc:  # e.g. str + list
            raise ValueError(f"the chat template failed: {type(exc).__name__}: {exc}") from None

    def __repr__(self) -> str:
        return f"<ChatTemplate {', '.join(sorted(self.templates))}>"


def load_chat_templates(directory: str | Path,
                        tokenizer_config: Mapping[str, Any] | None = None,
                        ) -> str | dict[str, str] | None:
    """The chat template(s) of a checkpoint directory, or None when it has none.

    `chat_template.jinja` (the "default") and `additional_chat_templates/NAME.jinja` take
    precedence over a processor's legacy `chat_template.json` (``{"chat_template": ...}``: a
    multimodal checkpoint's, e.g. Qwen3-Omni's, whose template renders image and audio parts),
    then over the `chat_template` entry of `tokenizer_config.json` (a string, or a list of
    ``{"name", "template"}``), as in transformers.

    Raises:
        ValueError: an unreadable `chat_template.json`.
    """
    root = Path(directory)
    found: dict[str, str] = {}
    if (root / CHAT_TEMPLATE_FILE).is_file():
        found["default"] = (root / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (root / CHAT_TEMPLATE_DIR).is_dir():
        for file in sorted((root / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            found[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if found:
        return found["default"] if list(found) == ["default"] else found
    legacy = root / LEGACY_CHAT_TEMPLATE_FILE
    if legacy.is_file():
        try:
            template = json.loads(legacy.read_text(encoding="utf-8"))["chat_template"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"cannot read {legacy}: {exc!r}") from None
        if isinstance(template, str):
            return template
    entry = (tokenizer_config or {}).get("chat_template")
    if entry is None or isinstance(entry, str):
        return entry
    return _named_templates(entry)


# -- rendering as transformers does --------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask markers): renders its body.

    Why: templates written for transformers' assistant-token masks use this tag; without it they
    would not even compile.
    """

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


class _TemplateDict:
    """The template's `dict`: builds dicts, but offers no attribute into the class itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's `namespace` refusing underscore names (no route to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's trick: `namespace(self=1)` works
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes, got {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_TemplateDict(), namespace=_TemplateNamespace)
    return env


@lru_cache(maxsize=64)
def _compile_source(source: str) -> jinja2.Template:
    return _environment().from_string(source)


def _compile(source: str, name: str) -> jinja2.Template:
    """The compiled template (cached by its text); ValueError naming it if it is not Jinja."""
    try:
        return _compile_source(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template {name!r} is not valid Jinja (line {exc.lineno}): "
                         f"{exc.message}") from None


def _named_templates(templates: object) -> dict[str, str]:
    if isinstance(templates, str):
        named: dict[Any, Any] = {"default": templates}
    elif isinstance(templates, Mapping):
        named = dict(templates)
    elif isinstance(templates, Sequence) and all(
            isinstance(t, Mapping) and {"name", "template"} <= set(t) for t in templates):
        named = {t["name"]: t["template"] for t in templates}
    else:
        raise ValueError("a chat template must be a string, a dict of named templates or a list "
                         f"of {{'name', 'template'}} dicts, got {type(templates).__name__}")
    if not named:
        raise ValueError("no chat template given")
    bad = [repr(k) for k, v in named.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise ValueError(f"chat templates must be strings named by strings: {', '.join(bad)}")
    return named


def _checked_messages(messages: object) -> Iterator[Mapping[str, Any]]:
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: a conversation needs at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got "
                             f"{type(message).__name__}")
        message = {k: v for k, v in message.items() if v is not None}
        if not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] needs a string 'role', got {message.get('role')!r}")
        content = message.get("content")
        if content is not None and not isinstance(content, str) and not (
                isinstance(content, list) and all(isinstance(p, Mapping) for p in content)):
            raise ValueError(f"messages[{i}]['content'] must be a string or a list of parts "
                             f"(dicts), got {type(content).__name__}")
        yield message


def _checked_items(name: str, items: object) -> list[Any] | None:
    if items is None:
        return None
    if isinstance(items, str | bytes) or not isinstance(items, Sequence) or not all(
            isinstance(item, Mapping) for item in items):
        raise ValueError(f"{name} must be a list of dicts (JSON schemas for tools)")
    return list(items)


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """A message's reasoning under every name templates read it (as transformers)."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _plain(value: Any) -> Any:
    """`value` rebuilt from plain JSON types (transformers' `_plain_template_data`): objects the
    sandbox does not know could be unsafe become an inert ``<TypeName>`` placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind in (str, int, float):
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"
