"""Constrained decoding: JSON schemas, regexes and EBNF grammars through xgrammar.

A request that sets one of `json_schema`, `regex`, `ebnf` or `structural_tag` (SGLang's
fields, mutually exclusive) samples only tokens its grammar allows. `GrammarBackend` compiles
a grammar once per (kind, text) for one tokenizer and model vocabulary and keeps the compiled
grammar in an LRU; `GrammarConstraint` is one request's position in it, the `TokenConstraint`
the batched sampler asks for a token bitmask each step.

xgrammar (SGLang's default grammar backend) is the optional extra ``omni[grammar]``: this
module imports it only when a grammar is compiled, so importing `omni.compute` never does.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import trio

from omni.compute.tokenizer import ByteTokenizer, HFTokenizer

if TYPE_CHECKING:
    import xgrammar

__all__ = ["GRAMMAR_CACHE_SIZE", "INSTALL_HINT", "GrammarBackend", "GrammarConstraint",
           "GrammarKind", "GrammarStats", "grammar_spec", "json_schema_ebnf"]

log = logging.getLogger("omni.compute")

GrammarKind = Literal["json_schema", "regex", "ebnf", "structural_tag"]
GRAMMAR_KINDS: tuple[GrammarKind, ...] = ("json_schema", "regex", "ebnf", "structural_tag")
GRAMMAR_CACHE_SIZE = 256  # compiled grammars a backend keeps (least recently used goes first)
INSTALL_HINT = "constrained decoding needs xgrammar: pip install 'omni[grammar]'"
ANY_JSON = "$$ANY$$"  # SGLang's json_schema value for "any JSON value"

# Keywords xgrammar 0.2 accepts in a JSON schema but does not enforce: a schema using one
# is refused (as SGLang does), since its outputs would not validate against it.
_UNENFORCED_KEYWORDS = frozenset({
    "contains", "dependentRequired", "dependentSchemas", "else", "if", "maxContains",
    "minContains", "multipleOf", "not", "then", "uniqueItems"})
# The character classes of xgrammar 0.2's JSON strings, and what they become here: a
# length-bounded string (minLength / maxLength) lets control characters through and every
# string lets UTF-8-encoded surrogates through (a byte-level vocabulary can spell them), both
# of which make text that json.loads refuses. Schemas are compiled from their EBNF with the
# classes fixed.
_STRING_CHAR_FIXES = (
    (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\uD800-\uDFFF]'),
    (r'[^\0-\x1f\"\\\r\n]', r'[^\0-\x1f\"\\\uD800-\uDFFF]'),
)
_INSTANCE_KEYWORDS = frozenset({"const", "default", "enum", "examples"})  # data, not schemas
_NAMED_SCHEMAS = frozenset({"$defs", "definitions", "properties", "patternProperties"})


def _xgrammar() -> Any:
    """The xgrammar module; ImportError naming the extra when it is not installed."""
    try:
        import xgrammar
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} ({exc})") from exc
    return xgrammar


def grammar_spec(params: Any) -> tuple[GrammarKind, str] | None:
    """The grammar a `SamplingParams` asks for as ``(kind, text)``, or None.

    `json_schema` may be a JSON string (SGLang's type) or a dict (serialised here).

    Raises:
        ValueError: more than one of json_schema, regex, ebnf and structural_tag is set,
            or one is not a string.
    """
    values = {kind: getattr(params, kind, None) for kind in GRAMMAR_KINDS}
    chosen = [(k, v) for k, v in values.items() if v is not None and v != ""]
    if not chosen:
        return None
    if len(chosen) > 1:
        raise ValueError("only one of json_schema, regex, ebnf or structural_tag can be set, "
                         f"got {', '.join(k for k, _ in chosen)}")
    kind, value = chosen[0]
    if kind == "json_schema" and isinstance(value, dict):
        value = json.dumps(value)
    if not isinstance(value, str):
        raise ValueError(f"{kind} must be a string, got {type(value).__name__}")
    return kind, value


@dataclass(frozen=True, slots=True)
class GrammarStats:
    """What a `GrammarBackend` compiled and reused."""

    num_compiled: int  # grammars compiled (valid or not)
    num_cache_hits: int
    num_cached: int  # entries in the LRU now
    cache_size: int


class GrammarConstraint:
    """One request's position in a compiled grammar (implements `TokenConstraint`).

    Why a wrapper: xgrammar's matcher refuses a token outside the grammar, which only happens
    when the sampler had to fall back to EOS because the grammar allowed nothing; the request
    then ends (`is_terminated`) instead of failing the whole decode batch.
    """

    def __init__(self, matcher: xgrammar.GrammarMatcher, kind: GrammarKind) -> None:
        self._matcher = matcher
        self.kind = kind
        self.num_accepted = 0
        self.rejected_token: int | None = None  # set when a token broke the grammar
        # the matcher's state changes only in `accept`: read it there once, not on every
        # question the sampler and the stop check ask per step; and only a stop token can
        # end it (a matcher made without terminate_without_stop_token terminates by
        # accepting one), so only then is it asked
        self._terminated = matcher.is_terminated()
        self._stop_ids = frozenset(matcher.stop_token_ids)
        self._accept_token = matcher.accept_token

    def __repr__(self) -> str:
        return (f"<GrammarConstraint {self.kind} accepted={self.num_accepted} "
                f"terminated={self.is_terminated()}>")

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into row `row` of `bitmask` (int32 [B, ceil(V/32)]);
        False when every token is allowed (nothing to mask).

        Bit j of word w allows token 32 * w + j (xgrammar's layout).
        """
        return self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> None:
        """Advance past the sampled `token_id` (nothing once terminated)."""
        if self._terminated:
            return
        if self._accept_token(token_id):
            self.num_accepted += 1
            if token_id in self._stop_ids:
                self._terminated = self._matcher.is_terminated()
            return
        log.warning("token %d is outside the request's %s; the request ends", token_id,
                    self.kind)
        self.rejected_token = token_id
        self._terminated = True

    def is_terminated(self) -> bool:
        """True once the grammar is complete (its stop token accepted) or was broken."""
        return self._terminated


class GrammarBackend:
    """Compiles grammars for one tokenizer and model vocabulary, and caches them.

    Args:
        tokenizer: a `ByteTokenizer` or an `HFTokenizer` (its tokenizer.json gives xgrammar
            the vocabulary and its encoding).
        vocab_size: the model's vocabulary (logits width; may exceed the tokenizer's, the
            extra ids are never allowed).
        eos_token_ids: the tokens that end a completed grammar.
        cache_size: compiled grammars kept, least recently used evicted first.
        any_whitespace: JSON schemas allow any whitespace between items (SGLang's default).

    Raises:
        ImportError: xgrammar is not installed (the message names ``omni[grammar]``).
        ValueError: a tokenizer xgrammar cannot describe, or no EOS ids.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], *,
                 cache_size: int = GRAMMAR_CACHE_SIZE, any_whitespace: bool = True) -> None:
        xgr = _xgrammar()
        if not eos_token_ids:
            raise ValueError("constrained decoding needs the model's EOS token ids")
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.any_whitespace = any_whitespace
        self.tokenizer_info = _tokenizer_info(xgr, tokenizer, vocab_size, list(eos_token_ids))
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, cache_enabled=False)
        # (kind, text) -> the compiled grammar, or the error message of one that failed
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()  # compilation runs in worker threads
        self._num_compiled = 0
        self._num_hits = 0

    def __repr__(self) -> str:
        return (f"<GrammarBackend vocab={self.vocab_size} "
                f"cached={len(self._cache)}/{self.cache_size}>")

    def stats(self) -> GrammarStats:
        """Compilations, cache hits and cache occupancy so far."""
        with self._lock:
            return GrammarStats(self._num_compiled, self._num_hits, len(self._cache),
                                self.cache_size)

    def compile(self, kind: GrammarKind, text: str) -> Any:
        """The compiled grammar for `text` (cached). Blocking: see `compile_async`.

        Raises:
            ValueError: `text` is not a valid grammar of its kind; names the field and
                xgrammar's message.
        """
        key = (kind, text)
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                self._num_hits += 1
        if entry is None:
            entry = self._compile_uncached(kind, text)
            with self._lock:
                self._num_compiled += 1
                self._cache[key] = entry
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        if isinstance(entry, str):
            raise ValueError(f"invalid {kind}: {entry}")
        return entry

    async def compile_async(self, kind: GrammarKind, text: str) -> Any:
        """`compile` in a worker thread, so the event loop never waits on a compilation."""
        with self._lock:
            entry = self._cache.get((kind, text))
        if entry is not None and not isinstance(entry, str):
            return self.compile(kind, text)  # a hit costs a dict lookup: no thread hop
        return await trio.to_thread.run_sync(self.compile, kind, text)

    def constraint(self, compiled: Any, kind: GrammarKind) -> GrammarConstraint:
        """A fresh `GrammarConstraint` at the start of `compiled` (one per request)."""
        return GrammarConstraint(_xgrammar().GrammarMatcher(compiled), kind)

    def _compile_uncached(self, kind: GrammarKind, text: str) -> Any:
        """The compiled grammar, or xgrammar's error message as a string."""
        if "\x00" in text:  # xgrammar's regex converter crashes on NUL
            return "NUL characters are not allowed"
        try:
            if kind == "json_schema":
                return self._compile_json(text)
            if kind == "regex":
                return self._compiler.compile_regex(text)
            if kind == "ebnf":
                return self._compiler.compile_grammar(text)
            return self._compile_structural_tag(text)
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:
            return _first_line(str(exc))

    def _compile_json(self, text: str) -> Any:
        return self._compiler.compile_grammar(
            json_schema_ebnf(text, any_whitespace=self.any_whitespace))

    def _compile_structural_tag(self, text: str) -> Any:
        tag = json.loads(text)
        if not isinstance(tag, dict):
            raise ValueError("a structural_tag must be a JSON object")
        if tag.get("structures") is None:  # today's format: {"type": ..., "format": {...}}
            return self._compiler.compile_structural_tag(text)
        xgr = _xgrammar()  # the older format: structures (begin, schema, end) + triggers
        items = [xgr.StructuralTagItem(begin=s["begin"], end=s["end"],
                                       schema=json.dumps(s.get("schema") or {}))
                 for s in tag["structures"]]
        legacy = xgr.StructuralTag.from_legacy_structural_tag(items, tag["triggers"])
        legacy.format.at_least_one = bool(tag.get("at_least_one", False))
        return self._compiler.compile_structural_tag(legacy)


def json_schema_ebnf(text: str, *, any_whitespace: bool = True) -> str:
    """The EBNF grammar a `json_schema` compiles to, with this module's fixes to strings.

    `any_whitespace` False: no whitespace between tokens, beyond one space after ``,`` and
    ``:`` (SGLang's ``--constrained-json-disable-any-whitespace``): a small model then cannot
    write blanks until it runs out of tokens. Blocking (xgrammar works through the schema):
    call it in a worker thread for a schema a client sent.

    Raises:
        ImportError: xgrammar is not installed.
        ValueError: `text` is not JSON, holds NUL characters, uses a keyword xgrammar does not
            enforce (named with its JSON pointer), or is not a schema xgrammar takes.
    """
    if text == ANY_JSON:
        text = "{}"  # the empty schema: any JSON value
    schema = json.loads(text)  # JSONDecodeError is a ValueError
    if "\x00" in json.dumps(schema):
        raise ValueError("NUL characters are not allowed")
    for pointer, problem in _unenforced(schema, "#"):
        raise ValueError(f"the schema at {pointer} uses {problem}, which xgrammar "
                         "does not enforce")
    try:
        grammar = str(_xgrammar().Grammar.from_json_schema(text, any_whitespace=any_whitespace))
    except (RuntimeError, KeyError, TypeError) as exc:
        raise ValueError(_first_line(str(exc))) from None
    for loose, strict in _STRING_CHAR_FIXES:
        grammar = grammar.replace(loose, strict)
    return grammar


def _first_line(message: str) -> str:
    """xgrammar's message without its source location prefix and trailing dump."""
    line = message.strip().splitlines()[0] if message.strip() else "unknown error"
    if line.startswith("[") and "] " in line:  # "[08:12:12] /project/cpp/x.cc:83: ..."
        line = line.split("] ", 1)[1]
        head, sep, rest = line.partition(": ")
        line = rest if sep and head.endswith(tuple("0123456789")) else line
    return line


def _unenforced(schema: Any, pointer: str) -> Iterator[tuple[str, str]]:
    """(JSON pointer, problem) for each keyword xgrammar would silently ignore."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            yield from _unenforced(item, f"{pointer}/{i}")
        return
    if not isinstance(schema, dict):
        return
    for keyword in sorted(_UNENFORCED_KEYWORDS.intersection(schema)):
        yield pointer, f"the keyword {keyword!r}"
    for keyword, value in schema.items():
        if keyword in _INSTANCE_KEYWORDS:
            continue
        if keyword in _NAMED_SCHEMAS and isinstance(value, dict):
            for name, child in value.items():
                yield from _unenforced(child, f"{pointer}/{keyword}/{name}")
        elif isinstance(value, dict | list):
            yield from _unenforced(value, f"{pointer}/{keyword}")


def _tokenizer_info(xgr: Any, tokenizer: Any, vocab_size: int,
                    eos_token_ids: list[int]) -> xgrammar.TokenizerInfo:
    """xgrammar's view of `tokenizer`: every model token id's bytes and how they encode."""
    if isinstance(tokenizer, ByteTokenizer):
        # ids below the offset (pad, bos, eos) are special: no text
        vocab = [b""] * tokenizer.offset + [bytes([b]) for b in range(256)]
        vocab = (vocab + [b""] * vocab_size)[:vocab_size]
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=eos_token_ids)
    if isinstance(tokenizer, HFTokenizer):
        backend = tokenizer.backend
        vocab = [""] * vocab_size
        for token, token_id in backend.get_vocab(with_added_tokens=True).items():
            if token_id < vocab_size:
                vocab[token_id] = token
        metadata = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
        return xgr.TokenizerInfo(vocab, metadata["vocab_type"], vocab_size=vocab_size,
                                 stop_token_ids=eos_token_ids,
                                 add_prefix_space=metadata["add_prefix_space"])
    raise ValueError(f"constrained decoding needs a ByteTokenizer or an HFTokenizer, got "
                     f"{type(tokenizer).__name__}")
