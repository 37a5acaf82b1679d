"""Values that travel to workers: msgpack plus tensors and arrays, never pickle."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from omni.transport.errors import WireError
from omni.transport.values import decode_value, encode_value


@pytest.mark.parametrize("value", [None, True, 3, -2**40, 1.5, "héllo", b"\x00\xff",
                                   [1, [2, "x"]], {"a": {"b": [None]}}])
def test_plain_values_round_trip(value) -> None:
    assert decode_value(encode_value(value)) == value


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                   torch.uint8, torch.bool])
def test_tensors_round_trip_bit_for_bit(dtype) -> None:
    tensor = (torch.arange(24).reshape(2, 3, 4) % 7).to(dtype)
    back = decode_value(encode_value({"t": tensor, "empty": torch.empty(0, 5, dtype=dtype)}))
    assert back["t"].dtype == dtype and torch.equal(back["t"], tensor)
    assert back["empty"].shape == (0, 5)


def test_non_contiguous_tensors_and_numpy_arrays_travel() -> None:
    tensor = torch.arange(12.0).reshape(3, 4).t()
    array = np.arange(6, dtype=np.int16).reshape(2, 3)
    back = decode_value(encode_value([tensor, array]))
    assert torch.equal(back[0], tensor)
    assert back[1].dtype == np.int16 and (back[1] == array).all()


def test_tuples_arrive_as_lists_and_dataclasses_as_dicts() -> None:
    @dataclasses.dataclass
    class Point:
        x: int
        y: int

    assert decode_value(encode_value((1, Point(2, 3)))) == [1, {"x": 2, "y": 3}]


def test_what_cannot_travel_is_named() -> None:
    with pytest.raises(TypeError, match="type object cannot travel"):
        encode_value({"fn": object()})
    with pytest.raises(TypeError, match="numpy array of Python objects"):
        encode_value(np.array([object()]))


def test_a_tensor_whose_bytes_do_not_fit_its_shape_is_a_wire_error() -> None:
    data = bytearray(encode_value(torch.zeros(4)))
    forged = bytes(data[:-4])  # 3 floats' bytes for a shape of 4
    with pytest.raises(WireError):
        decode_value(forged)


@given(st.binary(max_size=300))
def test_fuzz_random_bytes_raise_only_wire_error(data: bytes) -> None:
    try:
        decode_value(data)
    except WireError:
        pass
