"""KV page layout (shape, bytes, wire spec) and `parse_size`."""

from __future__ import annotations

import msgspec
import pytest
import torch

from omni.kv.descriptors import LayoutSpec
from omni.kv.layout import KVLayout, parse_size


@pytest.mark.parametrize(("dtype", "itemsize"), [
    (torch.float16, 2), (torch.bfloat16, 2), (torch.float32, 4), (torch.float64, 8),
    (torch.int8, 1), (torch.uint8, 1), (torch.float8_e4m3fn, 1), (torch.float8_e5m2, 1),
])
def test_page_shape_and_bytes_per_dtype(dtype: torch.dtype, itemsize: int) -> None:
    """A page is [layers, 2 (K, V), page_size, kv_heads, head_dim] elements of the dtype."""
    layout = KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, page_size=16, dtype=dtype)
    assert layout.page_shape == (2, 2, 16, 4, 8)
    assert layout.page_numel == 2 * 2 * 16 * 4 * 8
    assert layout.itemsize == itemsize
    assert layout.page_bytes == 2 * 2 * 16 * 4 * 8 * itemsize
    assert torch.empty(layout.page_shape, dtype=dtype).nbytes == layout.page_bytes


def test_default_dtype_is_float16() -> None:
    """Without a dtype, pages are float16."""
    assert KVLayout(1, 1, 1, 1).dtype == torch.float16


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "page_size"])
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_sizes_must_be_positive_integers(field: str, bad: object) -> None:
    """Zero, negative, float, bool or str sizes raise ValueError naming the field."""
    sizes = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "page_size": 16, field: bad}
    with pytest.raises(ValueError, match=field):
        KVLayout(**sizes)


@pytest.mark.parametrize("bad", ["float16", None, float])
def test_dtype_must_be_a_torch_dtype(bad: object) -> None:
    """A dtype given by name or as a Python type raises ValueError."""
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(2, 2, 8, 16, dtype=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32,
                                   torch.float8_e4m3fn])
def test_spec_round_trips_through_msgpack(dtype: torch.dtype) -> None:
    """to_spec -> msgpack encode -> decode as LayoutSpec -> from_spec gives an equal layout."""
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, page_size=32, dtype=dtype)
    wire = msgspec.msgpack.encode(layout.to_spec())
    spec = msgspec.msgpack.decode(wire, type=LayoutSpec)
    assert spec.dtype == str(dtype).removeprefix("torch.")
    assert KVLayout.from_spec(spec) == layout


def test_from_spec_rejects_unknown_dtype_and_bad_sizes() -> None:
    """An unknown dtype name or a zero size in a spec raises ValueError."""
    with pytest.raises(ValueError, match="dtype"):
        KVLayout.from_spec(LayoutSpec(1, 1, 1, 1, "float128"))
    with pytest.raises(ValueError, match="page_size"):
        KVLayout.from_spec(LayoutSpec(1, 1, 1, 0, "float16"))


def test_spec_decode_rejects_wrong_field_types() -> None:
    """A wire spec with a string where an int belongs fails msgspec validation."""
    wire = msgspec.msgpack.encode({"num_layers": "2", "num_kv_heads": 1, "head_dim": 1,
                                   "page_size": 1, "dtype": "float16"})
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(wire, type=LayoutSpec)


@pytest.mark.parametrize(("text", "expected"), [
    ("8GiB", 8 * 2**30),
    ("512MiB", 512 * 2**20),
    ("1.5GB", 1_500_000_000),
    ("4096", 4096),
    (4096, 4096),
    (0, 0),
    ("64 kib", 64 * 1024),
    ("2TB", 2 * 10**12),
    ("10b", 10),
])
def test_parse_size_accepts_ints_and_unit_strings(text: int | str, expected: int) -> None:
    """Ints pass through; strings take decimal (kB, MB, GB) and binary (KiB, MiB, GiB) units."""
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["-1", -1, "lots", True, False, "", "8 GiBs", "1e9", "GiB"])
def test_parse_size_rejects_negatives_words_and_bools(bad: object) -> None:
    """Negative sizes, words, bools, unknown units and bare units raise ValueError."""
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)  # type: ignore[arg-type]
