"""Page keys: chained 128-bit digests of token ids, extra keys and media.

A page holds the KV of `page_size` tokens, and the KV of a token depends on every token before it
(and on the model, and on any image or audio the prompt embeds). So a page's key digests the key of
the page before it, the page's own token ids, and the page's extra bytes. Two prompts share a page
key exactly when they share everything the page's KV depends on, which is what makes a prefix hit
("the longest run of leading keys present in the store") safe.

Keys are computed the same way in every process and on every machine: token ids as little-endian
int32, extras encoded with msgpack, blake2b with a 16-byte digest. Nothing here uses Python's
`hash()`, whose value depends on `PYTHONHASHSEED`.

The encoding (pinned by a golden test; changing it invalidates every stored page):

    key[i] = blake2b(digest_size=16) over the concatenation of
        key[i-1], or ROOT_KEY for i = 0                    16 bytes
        token_ids[i*P : (i+1)*P] as little-endian int32    4 * P bytes
        msgpack([list(extra), [[start, digest], ...]])     the page's extra bytes

where ``ROOT_KEY = blake2b(b"omni.kv.page-key.v1", digest_size=16)`` and the inner list names, in
order of (start, digest), every `MediaSpan` overlapping the page's token positions (usually none,
so most pages end with ``msgpack([list(extra), []])``). Nothing in a key says which page size or
KV layout produced it: put whatever decides the KV's meaning (model id, layout) in `extra`.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import numpy as np

__all__ = ["KEY_BYTES", "ROOT_KEY", "KeyField", "MediaSpan", "PageKey", "block_keys",
           "check_keys", "invalid_key", "media_digest"]

PageKey = bytes
"""A page's key: 16 bytes (a blake2b digest)."""

KEY_BYTES = 16
ROOT_KEY: PageKey = hashlib.blake2b(b"omni.kv.page-key.v1", digest_size=KEY_BYTES).digest()
"""The fixed "previous key" of a sequence's first page."""
KeyField = Annotated[bytes, msgspec.Meta(min_length=KEY_BYTES, max_length=KEY_BYTES)]
"""A page key as a field of a message (msgspec): decoding refuses any other length."""


def invalid_key(keys: Iterable[object]) -> str | None:
    """What is wrong with the first of `keys` that is not a page key, or None when every one
    is. Why sets of types and lengths: this runs on every page of every fetch, and whole
    keys checked one by one in Python would cost more than the rest of a warm fetch."""
    keys = keys if isinstance(keys, (list, tuple)) else list(keys)
    if set(map(type, keys)) <= {bytes} and set(map(len, keys)) <= {KEY_BYTES}:
        return None
    for key in keys:  # the slow path names the first culprit (bytes' subclasses pass)
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            return f"a page key is {KEY_BYTES} bytes (from block_keys), got {key!r:.40}"
    return None


def check_keys(keys: Iterable[object]) -> None:
    """Raise ValueError naming the first of `keys` that is not a page key (`invalid_key`)."""
    problem = invalid_key(keys)
    if problem is not None:
        raise ValueError(problem)

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_EXTRA_SCALARS = (str, int, float, bytes, bool, type(None))
_ENCODE = msgspec.msgpack.Encoder().encode
# A prepared, empty hasher: `.copy()` of it is cheaper than building a new blake2b per page.
_EMPTY_HASHER = hashlib.blake2b(digest_size=KEY_BYTES)


@dataclass(frozen=True)
class MediaSpan:
    """A media item (an image, an audio clip) that occupies prompt positions [start, start+length).

    Why: the token ids at those positions are placeholders (often the same id repeated), so the
    tokens alone cannot tell two images apart. The content `digest` (see `media_digest`) goes into
    the extra bytes of every page the span overlaps, so prompts that differ only in their media
    never share a page from the first page the media touches on.
    """

    start: int
    length: int
    digest: bytes

    def __post_init__(self) -> None:
        if not _is_int(self.start) or self.start < 0:
            raise ValueError(f"MediaSpan.start must be an integer >= 0, got {self.start!r}")
        if not _is_int(self.length) or self.length < 1:
            raise ValueError(f"MediaSpan.length must be an integer >= 1, got {self.length!r}")
        if not isinstance(self.digest, bytes) or not self.digest:
            raise ValueError(f"MediaSpan.digest must be non-empty bytes, got {self.digest!r}")


def block_keys(token_ids: Any, page_size: int, extra: tuple = (), *,
               media: Sequence[MediaSpan] = ()) -> list[PageKey]:
    """One chained 16-byte key per full page of `token_ids`; a trailing partial page gets none.

    Args:
        token_ids: a 1-D list, tuple, numpy array or torch tensor of integers in int32 range.
        page_size: tokens per page (>= 1).
        extra: values that apply to every page (model id, tenant salt, adapter...): a tuple or
            list of str, int, float, bytes, bool, None and nested tuples/lists of those.
        media: the prompt's media items; every page overlapping one carries its (start, digest).
            A span may extend past the last full page; the part beyond it keys nothing.

    Returns:
        ``len(token_ids) // page_size`` keys; ``block_keys(a + b)`` starts with ``block_keys(a)``
        when ``len(a)`` is a multiple of `page_size` (and the media lie within `a`).

    Raises:
        ValueError: page_size < 1, token_ids not 1-D, or a token id that is not an integer in
            int32 range (the message names its position).
        TypeError: an extra value (or nested value) of an unsupported type, or bad `media` items.
    """
    if not _is_int(page_size) or page_size < 1:
        raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
    data = _token_bytes(token_ids)
    num_pages = len(data) // (4 * page_size)
    base_extra = _encode_extra(extra, ())
    page_media = _media_by_page(media, page_size, num_pages)

    step = 4 * page_size
    view = memoryview(data)
    new_hasher = _EMPTY_HASHER.copy
    keys: list[PageKey] = []
    append = keys.append
    prev = ROOT_KEY
    for page in range(num_pages):
        hasher = new_hasher()
        hasher.update(prev)
        hasher.update(view[page * step:(page + 1) * step])
        spans = page_media.get(page)
        hasher.update(base_extra if spans is None else _encode_extra(extra, spans))
        prev = hasher.digest()
        append(prev)
    return keys


def media_digest(data: Any) -> bytes:
    """A 16-byte content digest of a media item, for `MediaSpan.digest`.

    Digests ``msgpack([dtype_name, shape])`` followed by the C-contiguous little-endian bytes,
    so equal content gives equal digests (a numpy array and a torch tensor with the same dtype,
    shape and values agree) and any change of dtype, shape or content changes the digest.

    Args:
        data: bytes (dtype "bytes", shape [len]), bytearray/memoryview, a numpy array or a torch
            tensor (any device; it is copied to the host).

    Raises:
        TypeError: another type, or an array whose bytes do not describe its content (object or
            structured dtypes).
    """
    if isinstance(data, bytes | bytearray | memoryview):
        raw = bytes(data)
        return _digest_parts("bytes", (len(raw),), raw)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(data, torch.Tensor):
        tensor = data.detach().cpu().contiguous()
        dtype_name = str(tensor.dtype).removeprefix("torch.")
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        return _digest_parts(dtype_name, tuple(tensor.shape), raw)
    if isinstance(data, np.ndarray):
        if data.dtype.kind in "OV":
            raise TypeError(f"media_digest cannot digest numpy dtype {data.dtype} (object or "
                            "structured arrays have no canonical bytes)")
        array = np.ascontiguousarray(data, dtype=data.dtype.newbyteorder("<"))
        return _digest_parts(array.dtype.name, array.shape, array.tobytes())
    raise TypeError(f"media_digest takes bytes, a numpy array or a torch tensor, "
                    f"got {type(data).__name__}")


def _digest_parts(dtype_name: str, shape: tuple[int, ...], raw: bytes) -> bytes:
    hasher = hashlib.blake2b(_ENCODE([dtype_name, list(shape)]), digest_size=KEY_BYTES)
    hasher.update(raw)
    return hasher.digest()


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _token_bytes(token_ids: Any) -> bytes:
    """The token ids as little-endian int32 bytes, after validating them."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.numpy(force=True)
    try:
        array = np.asarray(token_ids)
    except (ValueError, TypeError) as exc:  # ragged nested lists and the like
        raise ValueError(f"token_ids must be a 1-D sequence of integers: {exc}") from None
    if array.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tuple(array.shape)}")
    if array.size == 0:
        return b""
    if array.dtype.kind in "iu":
        if array.min() < _INT32_MIN or array.max() > _INT32_MAX:
            _raise_bad_token(array)
        return array.astype("<i4", copy=False).tobytes()
    _raise_bad_token(token_ids if isinstance(token_ids, list | tuple) else array)
    raise AssertionError("unreachable")  # pragma: no cover


def _raise_bad_token(tokens: Sequence[Any]) -> None:
    for position, value in enumerate(tokens):
        if not _is_int(value) or not _INT32_MIN <= value <= _INT32_MAX:
            raise ValueError(f"token_ids[{position}] = {value!r} is not an integer in int32 range")
    raise ValueError("token_ids must be integers in int32 range")  # pragma: no cover


def _encode_extra(extra: tuple, spans: Sequence[tuple[int, bytes]]) -> bytes:
    if not isinstance(extra, tuple | list):
        raise TypeError(f"extra must be a tuple, got {type(extra).__name__}: {extra!r}")
    _check_extra(extra)
    try:
        return _ENCODE([list(extra), [list(span) for span in spans]])
    except OverflowError as exc:
        raise TypeError(f"extra holds an integer msgpack cannot encode ({exc}): "
                        f"{extra!r}") from None


def _check_extra(values: tuple | list) -> None:
    # Only types with one canonical msgpack form: no dicts (order), no sets (hash order).
    for value in values:
        if isinstance(value, tuple | list):
            _check_extra(value)
        elif not isinstance(value, _EXTRA_SCALARS):
            raise TypeError(f"unsupported extra key value {value!r} ({type(value).__name__}); "
                            "use str, int, float, bytes, bool, None or tuples/lists of those")


def _media_by_page(media: Sequence[MediaSpan], page_size: int,
                   num_pages: int) -> dict[int, list[tuple[int, bytes]]]:
    """page index -> the (start, digest) of every span overlapping it, sorted."""
    by_page: dict[int, list[tuple[int, bytes]]] = {}
    for span in sorted(media, key=_span_order):
        first = span.start // page_size
        last = min((span.start + span.length - 1) // page_size, num_pages - 1)
        for page in range(first, last + 1):
            by_page.setdefault(page, []).append((int(span.start), span.digest))
    return by_page


def _span_order(span: MediaSpan) -> tuple[int, bytes]:
    if not isinstance(span, MediaSpan):
        raise TypeError(f"media items must be MediaSpan, got {type(span).__name__}: {span!r}")
    return (span.start, span.digest)
