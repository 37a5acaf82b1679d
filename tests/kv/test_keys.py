"""Page keys: chaining, full pages only, extras, media, determinism, the pinned encoding."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omni.kv import keys as keys_module
from omni.kv.keys import ROOT_KEY, MediaSpan, block_keys, invalid_key, media_digest

TOKENS = list(range(100, 164))  # 64 tokens: 4 pages of 16


def _blake16(*parts: bytes) -> bytes:
    hasher = hashlib.blake2b(digest_size=16)
    for part in parts:
        hasher.update(part)
    return hasher.digest()


# --- the pinned encoding ------------------------------------------------------------------------


def test_golden_first_key_matches_the_documented_encoding() -> None:
    """key0 = blake2b16(ROOT_KEY + tokens as <i4 + msgpack([["model-x"], []])), pinned in hex."""
    root = _blake16(b"omni.kv.page-key.v1")
    tokens = struct.pack("<16i", *range(16))
    extra = b"\x92" + b"\x91\xa7model-x" + b"\x90"  # msgpack [["model-x"], []], written by hand
    expected = _blake16(root, tokens, extra)

    key = block_keys(list(range(16)), 16, ("model-x",))[0]

    assert ROOT_KEY == root
    assert key == expected
    assert key.hex() == "b1fa6f580d7e314e9820b79a063e9529"


def test_golden_chain_and_media_encoding() -> None:
    """A media page's extra is msgpack([extra, [[start, digest]]]); the next key chains on it."""
    digest = bytes(range(16))
    keys = block_keys(list(range(8)), 4, (), media=[MediaSpan(3, 2, digest)])
    media_extra = b"\x92\x90" + b"\x91\x92\x03\xc4\x10" + digest  # [[], [[3, bin16]]]
    key0 = _blake16(ROOT_KEY, struct.pack("<4i", 0, 1, 2, 3), media_extra)
    key1 = _blake16(key0, struct.pack("<4i", 4, 5, 6, 7), media_extra)  # span 3..4 overlaps both
    assert keys == [key0, key1]


def test_golden_media_digest_of_bytes() -> None:
    """media_digest(bytes) = blake2b16(msgpack(["bytes", [len]]) + the bytes)."""
    header = b"\x92\xa5bytes\x91\x03"
    assert media_digest(b"abc") == _blake16(header, b"abc")
    assert media_digest(b"abc").hex() == "dcd54d11415ad0664f20e98a6aade64c"


# --- pages and chaining -------------------------------------------------------------------------


def test_keys_are_16_bytes_one_per_full_page() -> None:
    """A trailing partial page gets no key; keys are 16 bytes."""
    assert len(block_keys(TOKENS, 16)) == 4
    assert len(block_keys(TOKENS[:63], 16)) == 3
    assert len(block_keys(TOKENS[:15], 16)) == 0
    assert block_keys([], 16) == []
    assert all(len(key) == 16 for key in block_keys(TOKENS, 16))


def test_partial_page_does_not_change_full_page_keys() -> None:
    """Extra tokens past the last full page leave every full page's key alone."""
    assert block_keys([*TOKENS, 1, 2, 3], 16) == block_keys(TOKENS, 16)


@pytest.mark.parametrize("page", [0, 1, 2, 3])
def test_changing_a_token_changes_its_page_and_every_later_key_only(page: int) -> None:
    """Chaining: a change in page i changes keys i.. and no key before i."""
    changed = list(TOKENS)
    changed[page * 16 + 5] += 1
    before, after = block_keys(TOKENS, 16), block_keys(changed, 16)
    assert before[:page] == after[:page]
    assert all(a != b for a, b in zip(before[page:], after[page:], strict=True))


def test_same_page_content_at_different_depths_gets_different_keys() -> None:
    """Chaining: identical pages at positions 0 and 1 still get distinct keys."""
    keys = block_keys([7] * 32, 16)
    assert keys[0] != keys[1]


def test_extra_changes_every_key() -> None:
    """A different extra (model id, tenant salt) changes every page's key."""
    plain = block_keys(TOKENS, 16)
    model_a = block_keys(TOKENS, 16, ("model-a",))
    model_b = block_keys(TOKENS, 16, ("model-b",))
    salted = block_keys(TOKENS, 16, ("model-a", b"tenant-1"))
    for one, other in [(plain, model_a), (model_a, model_b), (model_a, salted)]:
        assert all(a != b for a, b in zip(one, other, strict=True))


def test_extra_distinguishes_types_and_nesting() -> None:
    """1 and True, "1" and b"1", (1, 2) and ((1, 2),) are different extras."""
    variants = [(1,), (True,), ("1",), (b"1",), (1.0,), (None,), (1, 2), ((1, 2),), ([1, [2]],)]
    firsts = {block_keys(TOKENS, 16, extra)[0] for extra in variants}
    assert len(firsts) == len(variants)


def test_page_size_decides_the_pages() -> None:
    """Page size 8 gives twice as many keys as 16, and different ones."""
    keys8, keys16 = block_keys(TOKENS, 8), block_keys(TOKENS, 16)
    assert len(keys8) == 8 and not set(keys8) & set(keys16)
    assert len(block_keys(TOKENS[:3], 1)) == 3


def test_lists_tuples_numpy_and_torch_give_the_same_keys() -> None:
    """Every accepted container (and integer width or byte order) gives equal keys."""
    expected = block_keys(TOKENS, 16)
    inputs = [
        tuple(TOKENS),
        np.array(TOKENS, dtype=np.int64),
        np.array(TOKENS, dtype=np.int32),
        np.array(TOKENS, dtype=">i4"),
        np.array(TOKENS, dtype=np.uint32),
        torch.tensor(TOKENS),
        torch.tensor(TOKENS, dtype=torch.int32),
        [np.int64(t) for t in TOKENS],
    ]
    for token_ids in inputs:
        assert block_keys(token_ids, 16) == expected


def test_int32_extremes_are_accepted() -> None:
    """The smallest and largest int32 values are valid token ids."""
    assert len(block_keys([-(2**31), 2**31 - 1], 1)) == 2


@pytest.mark.proc  # interpreters started with other PYTHONHASHSEEDs
def test_keys_are_the_same_in_processes_with_different_hash_seeds() -> None:
    """Keys do not depend on PYTHONHASHSEED (no `hash()`): two subprocesses agree with this one."""
    # keys.py is loaded by path so the subprocess skips `omni.kv`'s torch import (seconds).
    script = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('keys', {keys_module.__file__!r})\n"
        "keys_module = importlib.util.module_from_spec(spec)\n"
        "sys.modules['keys'] = keys_module\n"
        "spec.loader.exec_module(keys_module)\n"
        "block_keys, MediaSpan = keys_module.block_keys, keys_module.MediaSpan\n"
        "keys = block_keys(list(range(100, 164)), 16, ('model-x', 3, b'salt', None, (1.5, True)),"
        " media=[MediaSpan(20, 10, b'img-digest-00000')])\n"
        "print(','.join(k.hex() for k in keys))\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONHASHSEED": seed})
        for seed in ("1", "4242")
    ]
    outputs = [proc.communicate(timeout=60)[0].strip() for proc in procs]
    here = block_keys(TOKENS, 16, ("model-x", 3, b"salt", None, (1.5, True)),
                      media=[MediaSpan(20, 10, b"img-digest-00000")])
    assert all(proc.returncode == 0 for proc in procs)
    assert outputs[0] == outputs[1] == ",".join(key.hex() for key in here)


# --- media --------------------------------------------------------------------------------------


def _image(pixel_value: int = 0) -> np.ndarray:
    image = np.zeros((8, 8, 3), dtype=np.uint8)
    image[4, 4, 1] = pixel_value
    return image


def test_one_pixel_of_difference_splits_keys_from_the_image_first_page_on() -> None:
    """Images differing in one pixel: keys are shared until the image's first page, then differ."""
    tokens = list(range(80))  # 5 pages of 16; the image occupies positions 40..55 (pages 2 and 3)
    span_a = MediaSpan(40, 16, media_digest(_image(0)))
    span_b = MediaSpan(40, 16, media_digest(_image(1)))
    keys_a = block_keys(tokens, 16, ("m",), media=[span_a])
    keys_b = block_keys(tokens, 16, ("m",), media=[span_b])
    assert keys_a[:2] == keys_b[:2]
    assert all(a != b for a, b in zip(keys_a[2:], keys_b[2:], strict=True))


def test_same_image_gives_same_keys_and_differs_from_no_image() -> None:
    """Equal media digests share every key; a page with media differs from one without."""
    tokens = list(range(48))
    span = MediaSpan(16, 16, media_digest(_image(3)))
    again = MediaSpan(16, 16, media_digest(_image(3).copy()))
    with_media = block_keys(tokens, 16, media=[span])
    assert with_media == block_keys(tokens, 16, media=[again])
    without = block_keys(tokens, 16)
    assert with_media[0] == without[0] and with_media[1] != without[1]


def test_same_image_at_a_shifted_position_gives_different_keys() -> None:
    """The span's start is part of the key: the same image two tokens later keys differently."""
    tokens = list(range(64))
    digest = media_digest(_image(9))
    at_20 = block_keys(tokens, 16, media=[MediaSpan(20, 8, digest)])
    at_22 = block_keys(tokens, 16, media=[MediaSpan(22, 8, digest)])
    assert at_20[0] == at_22[0]
    assert all(a != b for a, b in zip(at_20[1:], at_22[1:], strict=True))


def test_a_span_marks_every_page_it_overlaps() -> None:
    """A span crossing a page boundary changes both pages it touches, and not the page before."""
    tokens = list(range(64))
    plain = block_keys(tokens, 16)
    span = MediaSpan(30, 4, b"d" * 16)  # positions 30..33: pages 1 and 2
    digest_pages = block_keys(tokens, 16, media=[span])
    assert digest_pages[0] == plain[0]
    # Page 3 differs only through chaining; compare with the span moved into page 2 alone.
    only_page_2 = block_keys(tokens, 16, media=[MediaSpan(32, 2, b"d" * 16)])
    assert digest_pages[1] != plain[1] and only_page_2[1] == plain[1]


def test_media_order_does_not_matter_and_spans_may_run_past_the_last_page() -> None:
    """Spans are sorted before encoding; a span past the last full page is harmless."""
    tokens = list(range(40))
    one, two = MediaSpan(0, 4, b"a" * 16), MediaSpan(8, 40, b"b" * 16)
    assert block_keys(tokens, 16, media=[one, two]) == block_keys(tokens, 16, media=[two, one])
    assert len(block_keys(tokens, 16, media=[MediaSpan(100, 5, b"c" * 16)])) == 2


def test_media_digest_depends_on_dtype_shape_and_content() -> None:
    """Any change of dtype, shape or a single value changes the digest."""
    image = _image(0)
    base = media_digest(image)
    assert media_digest(image.copy()) == base
    assert media_digest(image.astype(np.int16)) != base
    assert media_digest(image.reshape(8, 24)) != base
    assert media_digest(_image(1)) != base
    assert media_digest(image.tobytes()) != base


def test_media_digest_agrees_across_numpy_torch_layout_and_byte_order() -> None:
    """Equal content gives equal digests: numpy vs torch, strided vs contiguous, big vs little."""
    array = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    digest = media_digest(array)
    assert media_digest(torch.from_numpy(array)) == digest
    assert media_digest(np.asfortranarray(array)) == digest
    assert media_digest(array.astype(">f4")) == digest
    transposed = np.arange(24, dtype=np.float32).reshape(4, 3, 2).transpose(2, 1, 0)
    assert media_digest(transposed) == media_digest(np.ascontiguousarray(transposed))
    bf16 = torch.arange(6, dtype=torch.bfloat16)
    assert media_digest(bf16) != media_digest(bf16.to(torch.float16))
    assert media_digest(bytearray(b"xyz")) == media_digest(b"xyz") == media_digest(
        memoryview(b"xyz"))


def test_media_digest_rejects_unsupported_inputs() -> None:
    """Object arrays and arbitrary objects raise TypeError."""
    with pytest.raises(TypeError, match="object"):
        media_digest(np.array([1, "a"], dtype=object))
    with pytest.raises(TypeError, match="str"):
        media_digest("an image path")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"start": -1, "length": 1, "digest": b"d"}, "start"),
    ({"start": 0, "length": 0, "digest": b"d"}, "length"),
    ({"start": 1.5, "length": 1, "digest": b"d"}, "start"),
    ({"start": 0, "length": 1, "digest": b""}, "digest"),
    ({"start": 0, "length": 1, "digest": "abc"}, "digest"),
])
def test_media_span_validates_its_fields(kwargs: dict, match: str) -> None:
    """MediaSpan rejects negative starts, empty lengths and non-bytes digests."""
    with pytest.raises(ValueError, match=match):
        MediaSpan(**kwargs)


def test_media_items_must_be_media_spans() -> None:
    """A tuple in place of a MediaSpan is a TypeError."""
    with pytest.raises(TypeError, match="MediaSpan"):
        block_keys(TOKENS, 16, media=[(0, 4, b"d")])  # type: ignore[list-item]


# --- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [0, -16, True, 1.5, "16"])
def test_page_size_must_be_a_positive_integer(page_size: object) -> None:
    """page_size < 1 or not an int raises ValueError."""
    with pytest.raises(ValueError, match="page_size"):
        block_keys(TOKENS, page_size)  # type: ignore[arg-type]


@pytest.mark.parametrize(("token_ids", "position"), [
    ([1, 2, 3, 2**31, 5], 3),
    ([1, -(2**31) - 1], 1),
    ([1, 2, 2**70], 2),
    ([1, 2.5, 3], 1),
    ([1, 2, "3"], 2),
    ([True, False], 0),
    (np.array([0, 1, 2**40]), 2),
    (np.array([0.0, 1.0]), 0),
    (torch.tensor([1.0, 2.0]), 0),
])
def test_bad_token_ids_raise_value_error_naming_the_position(token_ids: object,
                                                             position: int) -> None:
    """A non-integer or out-of-int32 token id raises ValueError naming its position."""
    with pytest.raises(ValueError, match=rf"token_ids\[{position}\]"):
        block_keys(token_ids, 1)


@pytest.mark.parametrize("token_ids", [np.zeros((2, 16), dtype=np.int64), torch.zeros(2, 16),
                                       [[1, 2], [3]], 5])
def test_token_ids_must_be_one_dimensional(token_ids: object) -> None:
    """2-D arrays, ragged lists and scalars raise ValueError."""
    with pytest.raises(ValueError, match="1-D"):
        block_keys(token_ids, 16)


@pytest.mark.parametrize("bad", [{"a": 1}, {1, 2}, np.int64(3), object(), 2**64])
def test_unsupported_extra_values_raise_type_error_naming_them(bad: object) -> None:
    """dicts, sets, numpy scalars, arbitrary objects, too-large ints: TypeError with the value."""
    with pytest.raises(TypeError, match="extra") as info:
        block_keys(TOKENS, 16, ("model", ("nested", bad)))
    assert repr(bad) in str(info.value)


def test_extra_must_be_a_tuple_or_list() -> None:
    """A bare string as `extra` is a TypeError, not a tuple of characters."""
    with pytest.raises(TypeError, match="tuple"):
        block_keys(TOKENS, 16, "model-x")  # type: ignore[arg-type]


# --- properties ---------------------------------------------------------------------------------

token_lists = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=80)


@settings(max_examples=60, deadline=None)
@given(a=token_lists, b=token_lists, page_size=st.integers(1, 9),
       extra=st.tuples(st.text(max_size=4), st.integers(0, 2**40)))
def test_prefix_property(a: list[int], b: list[int], page_size: int,
                         extra: tuple[str, int]) -> None:
    """block_keys(a + b) starts with the keys of a's full pages."""
    num_full = len(a) // page_size
    assert block_keys(a + b, page_size, extra)[:num_full] == block_keys(a, page_size, extra)[
        :num_full]


@settings(max_examples=60, deadline=None)
@given(pages=st.lists(st.lists(st.integers(0, 3), min_size=4, max_size=4), min_size=1,
                      max_size=20))
def test_keys_within_a_sequence_are_unique(pages: list[list[int]]) -> None:
    """Every key in a sequence is distinct, even when page contents repeat (chaining)."""
    tokens = [token for page in pages for token in page]
    keys = block_keys(tokens, 4)
    assert len(set(keys)) == len(keys) == len(pages)


def test_invalid_key_names_the_first_thing_that_is_not_a_page_key():
    keys = block_keys(range(32), 16)

    class Key(bytes):
        """A caller's own key type."""

    assert invalid_key(keys) is None and invalid_key([]) is None
    assert invalid_key([Key(keys[0]), *keys]) is None  # bytes' subclasses are keys too
    assert "got b'short'" in invalid_key([*keys, b"short"])
    assert "got 'text" in invalid_key([keys[0], "text" * 8])
    assert "got None" in invalid_key(iter([None]))
