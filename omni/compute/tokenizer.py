"""Tokenizers: a byte-level one for the built-in tiny models, and Hugging Face's tokenizer.json."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tokenizers import Tokenizer as _Tokenizer

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer"]


class Tokenizer(Protocol):
    """What an engine needs of a tokenizer."""

    eos_token_ids: tuple[int, ...]

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
    """A Hugging Face ``tokenizer.json`` (through the `tokenizers` library)."""

    def __init__(self, path: str | Path, eos_token_ids: tuple[int, ...]):
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(str(path))
        self.eos_token_ids = eos_token_ids

    @property
    def backend(self) -> _Tokenizer:
        """The `tokenizers.Tokenizer` itself (vocabulary, special tokens, `to_str()`)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)


def load_tokenizer(directory: str | Path, eos_token_ids: tuple[int, ...]) -> HFTokenizer | None:
    """The tokenizer of a model directory, or None when it ships no tokenizer.json."""
    path = Path(directory) / "tokenizer.json"
    return HFTokenizer(path, eos_token_ids) if path.is_file() else None
