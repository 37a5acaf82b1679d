"""Tokenizers: a byte-level one for the built-in tiny models, and Hugging Face's tokenizer.json
with its special tokens and chat template."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from omni.compute.chat import ChatTemplate, load_chat_templates

if TYPE_CHECKING:
    from tokenizers import Tokenizer as _Tokenizer

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "add_missing_special_tokens",
           "load_tokenizer", "special_tokens_of"]

_ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


class Tokenizer(Protocol):
    """What an engine needs of a tokenizer. `max_token_chars`: no token covers more
    characters of the text as given (None: not known), so a text of n characters has at
    least n / max_token_chars tokens: what lets an engine refuse a text too long for its
    context without tokenizing it."""

    eos_token_ids: tuple[int, ...]
    max_token_chars: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: id = byte + 3, after pad (0), bos (1) and eos (2).

    Why: the built-in tiny models need a tokenizer that exists without downloads and that
    round-trips any text exactly.
    """

    pad_token_id = 0
    bos_token_id = 1
    eos_token_ids = (2,)
    offset = 3
    vocab_size = 256 + 3
    max_token_chars = 1  # a character is one to four bytes, each a token

    def encode(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        """The text of `token_ids`; pad, bos and eos have no text (the options change nothing)."""
        data = bytes(t - self.offset for t in token_ids if self.offset <= t < self.vocab_size)
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face tokenizer: ``tokenizer.json`` (through the `tokenizers` library) with the
    named special tokens and chat template of its ``tokenizer_config.json``.

    Args:
        path: the tokenizer.json file.
        eos_token_ids: the ids that end generation (`load_tokenizer` resolves them as
            transformers' `generate` does; None: the `eos_token`'s id, if any).
        special_tokens: named special tokens, e.g. ``{"bos_token": "<s>", "eos_token": "</s>"}``
            (transformers' `special_tokens_map`); chat templates see them as variables.
        added_tokens: tokenizer_config.json's `added_tokens_decoder` (id -> AddedToken dict).
            As transformers does, its entries and any named special token missing from
            tokenizer.json are added to the vocabulary, with their `special` flag (which
            `decode(skip_special_tokens=True)` drops).
        chat_template: the checkpoint's `ChatTemplate` (None: it has none).
    """

    def __init__(self, path: str | Path, eos_token_ids: tuple[int, ...] | None = None, *,
                 special_tokens: Mapping[str, str] | None = None,
                 added_tokens: Mapping[str, Mapping[str, Any]] | None = None,
                 chat_template: ChatTemplate | None = None):
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(str(path))
        self.special_tokens = dict(special_tokens or {})
        add_missing_special_tokens(self._tok, added_tokens, self.special_tokens.values())
        self.chat_template = chat_template
        if eos_token_ids is None:
            eos = self.eos_token_id
            eos_token_ids = () if eos is None else (eos,)
        self.eos_token_ids = tuple(eos_token_ids)

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """An upper bound on the characters of text one token covers: the longest token of
        the vocabulary (a byte-level token's string has a character per byte, at least as
        many as the text it stands for), times 4 under a Unicode-composing normalizer (NFC
        and NFKC merge at most 4 code points into one). None under a normalizer that may
        remove text (stripping, replacing): then no bound is known."""
        shrink = _normalizer_shrink(self._tok.normalizer)
        if shrink is None:
            return None
        longest = max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)
        return max(1, longest) * shrink

    @property
    def backend(self) -> _Tokenizer:
        """The `tokenizers.Tokenizer` itself (vocabulary, special tokens, `to_str()`)."""
        return self._tok

    def token_to_id(self, token: str | None) -> int | None:
        """The id of a token (special or not), None when it is not in the vocabulary."""
        return None if token is None else self._tok.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        """The id of `bos_token` (None: the tokenizer names none)."""
        return self.token_to_id(self.special_tokens.get("bos_token"))

    @property
    def eos_token_id(self) -> int | None:
        """The id of `eos_token` (None: the tokenizer names none)."""
        return self.token_to_id(self.special_tokens.get("eos_token"))

    @property
    def pad_token_id(self) -> int | None:
        """The id of `pad_token` (None: the tokenizer names none)."""
        return self.token_to_id(self.special_tokens.get("pad_token"))

    @property
    def unk_token_id(self) -> int | None:
        """The id of `unk_token` (None: the tokenizer names none)."""
        return self.token_to_id(self.special_tokens.get("unk_token"))

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """The ids of `text`. Special tokens written in the text (``<|im_start|>``) become their
        ids; `add_special_tokens` adds what tokenizer.json's post-processor adds (e.g. a BOS),
        as transformers' ``tokenizer(text)`` does (transformers 5 reads `add_bos_token` from
        there when the checkpoint has a tokenizer.json)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            **kwargs: Any) -> list[int] | str:
        """A conversation as prompt ids (or text with ``tokenize=False``), as transformers'
        ``apply_chat_template(..., return_dict=False)``: the text is rendered with the
        checkpoint's template and encoded without adding special tokens (the template writes
        them). `kwargs` go to `ChatTemplate.render` (tools, documents, template variables).

        Raises:
            ValueError: the checkpoint has no chat template, or `ChatTemplate.render` refuses.
        """
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (no chat_template.jinja and no "
                             "'chat_template' in tokenizer_config.json)")
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt,
                                         **kwargs)
        return self.encode(text) if tokenize else text

    def __repr__(self) -> str:
        return (f"<HFTokenizer vocab={self._tok.get_vocab_size()} eos={list(self.eos_token_ids)} "
                f"chat_template={self.chat_template is not None}>")


def _normalizer_shrink(normalizer: Any) -> int | None:
    """How many characters of text at most become one under `normalizer` (1: none shrink
    it; None: it may remove text, no bound)."""
    if normalizer is None:
        return 1
    kind = type(normalizer).__name__
    if kind in ("NFD", "NFKD", "Lowercase", "Prepend"):
        return 1  # these decompose, change case or add: the text never gets shorter
    if kind in ("NFC", "NFKC"):
        return 4  # a canonical decomposition has at most 4 code points
    if kind == "Sequence":
        try:
            parts = [_normalizer_shrink(n) for n in normalizer]
        except TypeError:  # a Sequence that does not list its parts
            return None
        if any(part is None for part in parts):
            return None
        return functools.reduce(lambda a, b: a * b, parts, 1)
    return None


def load_tokenizer(directory: str | Path,
                   eos_token_ids: tuple[int, ...] | None = None) -> HFTokenizer | None:
    """The tokenizer of a model directory, or None when it ships no tokenizer.json.

    Reads tokenizer.json, the named special tokens of tokenizer_config.json (or, for older
    checkpoints, special_tokens_map.json) and the chat template (see `load_chat_templates`).
    `eos_token_ids` None: the `eos_token`'s id.

    Raises:
        ValueError: an unreadable tokenizer_config.json or an invalid chat template.
    """
    root = Path(directory)
    if not (root / "tokenizer.json").is_file():
        return None
    config = _read_json_object(root / "tokenizer_config.json")
    special = special_tokens_of(config, _read_json_object(root / "special_tokens_map.json"))
    templates = load_chat_templates(root, config)
    template = None if templates is None else ChatTemplate(templates, special)
    added = config.get("added_tokens_decoder")
    return HFTokenizer(root / "tokenizer.json", eos_token_ids, special_tokens=special,
                       added_tokens=added if isinstance(added, Mapping) else None,
                       chat_template=template)


def special_tokens_of(config: Mapping[str, Any],
                      legacy: Mapping[str, Any] | None = None) -> dict[str, str]:
    """transformers' `special_tokens_map` of a tokenizer_config.json dict: the named tokens
    (bos, eos, unk, sep, pad, cls, mask) and other ``*_token`` entries, each a string or an
    AddedToken dict (its "content"). `legacy` (special_tokens_map.json) fills in only when the
    config has no `added_tokens_decoder`, as transformers reads it."""
    merged = dict(config)
    if legacy and "added_tokens_decoder" not in config:
        merged.update(legacy)
    extra = merged.get("extra_special_tokens")
    named = {**(extra if isinstance(extra, Mapping) else {}), **merged}
    tokens: dict[str, str] = {}
    for key, value in named.items():
        if not key.endswith("_token") and key not in (extra or {}):
            continue
        content = value.get("content") if isinstance(value, Mapping) else value
        if isinstance(content, str):
            tokens[key] = content
    return tokens


def add_missing_special_tokens(backend: _Tokenizer,
                               added_tokens: Mapping[str, Mapping[str, Any]] | None,
                               named: Iterable[str]) -> None:
    """Add to `backend` what transformers adds when it loads a tokenizer: the entries of
    `added_tokens_decoder` it lacks (or holds with other flags, e.g. not special), in id order,
    then the named special tokens that are not in its vocabulary at all."""
    from tokenizers import AddedToken

    present = {t.content: t for t in backend.get_added_tokens_decoder().values()}
    entries = sorted((added_tokens or {}).items(), key=lambda item: int(item[0]))
    for _, entry in entries:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("content"), str):
            continue
        flags = {k: bool(entry[k]) for k in _ADDED_TOKEN_FLAGS if k in entry}
        token = AddedToken(entry["content"], **flags)
        old = present.get(token.content)
        if old is not None and all(getattr(old, k) == getattr(token, k)
                                   for k in _ADDED_TOKEN_FLAGS):
            continue
        (backend.add_special_tokens if token.special else backend.add_tokens)([token])
    missing = [t for t in dict.fromkeys(named) if backend.token_to_id(t) is None]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])


def _read_json_object(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {file}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} is not a JSON object")
    return data
