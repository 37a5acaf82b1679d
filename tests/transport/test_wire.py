"""The wire codec: every message kind round-trips; anything malformed, oversize, unknown or of
another version is refused with `WireError` (and only that), and counted."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omni.transport import WireError, wire
from omni.transport.wire import (
    NIL,
    PROTOCOL_VERSION,
    Cancel,
    Codec,
    Error,
    Heartbeat,
    Request,
    Response,
    WireLimits,
)


class Point(msgspec.Struct):
    x: int
    y: int


def valid_frames(codec: Codec) -> list[bytes]:
    return [
        codec.encode(Request(1, "add", codec.encode_body(Point(1, 2)))),
        codec.encode(Response(2, codec.encode_body([1, "two", b"3"]))),
        codec.encode(Error(3, "ValueError", "bad")),
        codec.encode(Heartbeat(4)),
        codec.encode(Cancel(5)),
    ]


def test_every_message_kind_round_trips():
    codec = Codec()
    msgs = [Request(7, "m", codec.encode_body({"a": 1})), Response(7), Error(7, "E", "msg"),
            Heartbeat(9), Cancel(7)]
    for msg in msgs:
        frame = codec.encode(msg)
        got = codec.decode(frame)
        assert type(got) is type(msg)
        assert codec.encode(got) == frame
    assert codec.stats().encoded == 2 * len(msgs) and codec.stats().decoded == len(msgs)
    assert codec.decode_body(codec.decode(codec.encode(msgs[0])).body) == {"a": 1}


def test_a_body_decodes_into_the_declared_struct_or_raises_wire_error():
    codec = Codec()
    assert codec.decode_body(codec.encode_body(Point(1, 2)), Point) == Point(1, 2)
    with pytest.raises(WireError, match="Point"):
        codec.decode_body(codec.encode_body({"x": "not an int"}), Point)
    assert codec.decode_body(NIL) is None


def test_oversize_control_frames_are_rejected_before_decoding_and_counted():
    codec = Codec(WireLimits(max_control_bytes=100))
    with pytest.raises(WireError, match="exceeds"):
        codec.decode(b"\x00" * 101)
    assert codec.stats().rejected_oversize == 1


def test_encoding_refuses_messages_over_the_control_limit():
    codec = Codec(WireLimits(max_control_bytes=100))
    with pytest.raises(WireError, match="control message limit"):
        codec.encode_body(b"x" * 200)
    with pytest.raises(WireError, match="control message limit"):
        codec.encode(Error(1, "E", "m" * 200))


def test_payload_limits_are_enforced():
    codec = Codec(WireLimits(max_payload_bytes=10, max_payload_frames=2))
    codec.check_payload([b"x" * 10, memoryview(b"y" * 10)])
    with pytest.raises(WireError, match="frames exceed"):
        codec.check_payload([b""] * 3)
    with pytest.raises(WireError, match="payload frame of 11 bytes"):
        codec.check_payload([b"x" * 11])


def test_another_protocol_version_is_rejected_and_counted():
    frame = msgspec.msgpack.encode([PROTOCOL_VERSION + 1, ["hb", 1]])
    codec = Codec()
    with pytest.raises(WireError, match="protocol version"):
        codec.decode(frame)
    assert codec.stats().rejected_version == 1


def test_an_unknown_message_kind_is_rejected_and_counted_apart_from_malformed():
    codec = Codec()
    with pytest.raises(WireError, match="unknown message kind 'shutdown'"):
        codec.decode(msgspec.msgpack.encode([PROTOCOL_VERSION, ["shutdown", 1]]))
    with pytest.raises(WireError, match="malformed"):
        codec.decode(msgspec.msgpack.encode([PROTOCOL_VERSION, ["hb", "not an int"]]))
    stats = codec.stats()
    assert (stats.rejected_unknown, stats.rejected_malformed, stats.rejected) == (1, 1, 2)


def test_deeply_nested_input_is_a_wire_error_not_a_recursion_error():
    codec = Codec()
    with pytest.raises(WireError):
        codec.decode(b"\x92\x01" + b"\x91" * 100_000 + b"\xc0")
    with pytest.raises(WireError):
        codec.decode_body(msgspec.Raw(b"\x91" * 100_000 + b"\xc0"))


def test_module_level_functions_use_a_shared_codec():
    before = wire.stats().decoded
    assert wire.decode(wire.encode(Heartbeat(1))) == Heartbeat(1)
    assert wire.stats().decoded == before + 1


# -- fuzzing: only WireError ever comes out of decode --------------------------------------

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=5), children, max_size=5),
    max_leaves=20,
)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def assert_only_wire_error(codec: Codec, frame: bytes) -> None:
    try:
        msg = codec.decode(frame)
    except WireError:
        return
    assert isinstance(msg, Request | Response | Error | Heartbeat | Cancel)


@FUZZ
@given(st.binary(max_size=200))
def test_fuzz_random_bytes_raise_only_wire_error(frame):
    assert_only_wire_error(Codec(), frame)


@FUZZ
@given(st.integers(0, 4), st.data())
def test_fuzz_truncated_valid_frames_raise_only_wire_error(index, data):
    codec = Codec()
    frame = valid_frames(codec)[index]
    cut = data.draw(st.integers(0, len(frame) - 1))
    with pytest.raises(WireError):
        codec.decode(frame[:cut])


@FUZZ
@given(msgpack_values, st.booleans())
def test_fuzz_valid_msgpack_of_the_wrong_shape_raises_only_wire_error(value, wrapped):
    """Arbitrary msgpack, bare or inside a well-formed envelope with a known or odd tag."""
    payload = [PROTOCOL_VERSION, value] if wrapped else value
    assert_only_wire_error(Codec(), msgspec.msgpack.encode(payload))


@FUZZ
@given(st.sampled_from(["req", "res", "err", "hb", "cancel", "other"]),
       st.lists(msgpack_values, max_size=4))
def test_fuzz_known_tags_with_wrong_fields_raise_only_wire_error(tag, fields):
    assert_only_wire_error(Codec(), msgspec.msgpack.encode([PROTOCOL_VERSION, [tag, *fields]]))


@FUZZ
@given(st.binary(min_size=0, max_size=64), st.integers(1, 64))
def test_fuzz_oversize_frames_are_refused_whatever_they_hold(head, extra):
    codec = Codec(WireLimits(max_control_bytes=64))
    frame = (head + b"\x00" * (64 + extra))[: 64 + extra]
    with pytest.raises(WireError, match="exceeds"):
        codec.decode(frame)
    assert codec.stats().rejected_oversize == 1


@FUZZ
@given(st.binary(max_size=100))
def test_fuzz_bodies_decode_to_wire_error_or_a_value(raw):
    codec = Codec()
    for body_type in (Point, int, list[str]):
        try:
            codec.decode_body(msgspec.Raw(raw), body_type)
        except WireError:
            pass
