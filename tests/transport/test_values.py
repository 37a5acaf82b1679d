"""Values that travel to workers: msgpack plus tensors and arrays, never pickle."""

from __future__ import annotations

import dataclasses
import enum
import re
import sys

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from omni.transport.errors import WireError
from omni.transport.values import (
    TypeRegistry,
    decode_value,
    encode_value,
    pack_value,
    unpack_value,
)


@dataclasses.dataclass(frozen=True)
class Point:
    x: int
    y: tuple


@dataclasses.dataclass
class Checked:
    value: int
    doubled: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        if self.value < 0:
            raise ValueError("negative")
        self.doubled = 2 * self.value


class Color(enum.Enum):
    RED = "red"


class Pair(msgspec.Struct):
    a: int
    b: list


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


def test_containers_and_classes_arrive_as_the_types_they_left_as() -> None:
    value = {"t": (1, (2, "x"), ()), "s": {1, 2}, "f": frozenset({"a"}), "p": Point(1, (2, 3)),
             "e": Color.RED, "m": Pair(1, [Point(0, ())]), "n": np.float32(2.5),
             "k": {(1, 2): "tuple key"}}
    back = decode_value(encode_value(value))
    assert back == value
    assert type(back["t"]) is tuple and type(back["t"][1]) is tuple
    assert type(back["s"]) is set and type(back["f"]) is frozenset
    assert type(back["p"]) is Point and type(back["m"]) is Pair and back["e"] is Color.RED
    assert type(back["n"]) is np.float32


def test_a_dataclass_is_rebuilt_as_it_was_without_calling_init() -> None:
    back = decode_value(encode_value(Checked(5)))
    assert type(back) is Checked and back.value == 5 and back.doubled == 10


def test_strides_dtype_and_the_read_only_flag_are_kept() -> None:
    base = np.arange(24, dtype=np.float64).reshape(2, 3, 4)
    frozen = np.arange(6, dtype=np.uint8)
    frozen.setflags(write=False)
    values = [np.asfortranarray(base), base.transpose(2, 0, 1),
              torch.arange(12.0).reshape(3, 4).t(), frozen, base[:, ::2],
              torch.arange(24).reshape(2, 3, 4).permute(1, 2, 0)]
    back = decode_value(encode_value(values))
    assert back[0].flags.f_contiguous and (back[0] == base).all()
    assert back[1].strides == values[1].strides and (back[1] == values[1]).all()
    assert back[2].stride() == (1, 4) and torch.equal(back[2], values[2])
    assert not back[3].flags.writeable and back[0].flags.writeable
    assert (back[4] == base[:, ::2]).all()  # a view with gaps arrives compact
    assert back[5].stride() == values[5].stride() and torch.equal(back[5], values[5])


def test_large_arrays_go_out_of_band_and_arrive_as_views_of_their_buffers() -> None:
    array = np.arange(1 << 16, dtype=np.float32)
    packed = pack_value({"a": array, "small": np.arange(4)})
    assert len(packed.buffers) == 1 and len(packed.body) < 1024
    buffer = bytearray(packed.buffers[0])
    back = unpack_value(packed.body, [buffer])
    assert (back["a"] == array).all() and (back["small"] == np.arange(4)).all()
    buffer[:4] = b"\0\0\x80\x3f"  # 1.0: the array views the buffer, no copy was made
    assert back["a"][0] == 1.0


def test_a_missing_or_reused_out_of_band_buffer_is_a_wire_error() -> None:
    packed = pack_value([np.zeros(1 << 15), np.zeros(1 << 15)])
    with pytest.raises(WireError, match="did not arrive"):
        unpack_value(packed.body, packed.buffers[:1])
    with pytest.raises(WireError, match="bytes"):
        unpack_value(packed.body, [packed.buffers[0], packed.buffers[1][:8]])


def test_streams_travel_only_where_the_caller_maps_them() -> None:
    async def items():
        yield 1

    stream = items()
    with pytest.raises(TypeError, match="stream"):
        encode_value({"s": stream})
    seen = []
    packed = pack_value({"s": stream}, streams=lambda s: seen.append(s) or 7)
    assert seen == [stream]
    assert unpack_value(packed.body, streams=lambda i: f"stream {i}") == {"s": "stream 7"}
    with pytest.raises(WireError, match="stream"):
        unpack_value(packed.body)
    stream.aclose().close()


def test_classes_that_cannot_be_found_are_refused_by_name() -> None:
    @dataclasses.dataclass
    class Local:
        x: int

    with pytest.raises(TypeError, match="inside a function"):
        encode_value(Local(1))
    forged = encode_value(Point(1, ())).replace(b"Point", b"Poynt")
    with pytest.raises(WireError, match="Poynt is not known"):
        decode_value(forged)


def test_a_type_shipped_under_another_module_name_resolves_both_ways() -> None:
    registry = TypeRegistry()
    module = sys.modules[__name__]
    registry.alias("driver_graph", module)
    assert registry.name_of(Point) == ("driver_graph", "Point")
    assert registry.resolve("driver_graph", "Point") is Point


def test_what_cannot_travel_is_named() -> None:
    with pytest.raises(TypeError, match="type object cannot travel"):
        encode_value({"fn": object()})
    with pytest.raises(TypeError, match="numpy array of Python objects"):
        encode_value(np.array([object()]))


def test_what_cannot_travel_is_found_by_its_place_in_the_value() -> None:
    with pytest.raises(TypeError, match=re.escape("value['a'][1]['b']: a value of type")):
        encode_value({"a": [1, {"b": object()}]})
    with pytest.raises(TypeError, match=re.escape("value[0].y[2]: a value of type")):
        encode_value([Point(1, (2, 3, object()))])


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
