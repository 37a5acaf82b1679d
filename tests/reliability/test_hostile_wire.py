"""Hostile bytes on the wire: mutated valid frames of every message kind and of the KV fetch
messages decode to a value of the declared type or raise `WireError` (a header that decodes is
then refused by its mover with a `TransportError`), and oversize messages are refused while
the server keeps serving."""

from __future__ import annotations

import struct

import msgspec
import trio
import zmq
from hypothesis import given
from hypothesis import strategies as st

from omni.cluster.kv.peers import FetchReply, FetchRequest
from omni.transport import RPCClient, RPCServer, WireError, WireLimits, wire
from omni.transport.errors import TransportError
from omni.transport.movers import (
    FrameHeader,
    FrameMover,
    SameProcessMover,
    SharedMemoryMover,
    unpack,
)
from omni.transport.values import decode_value
from omni.transport.wire import Codec
from tests._wait import CAP_S, wait_until
from tests.reliability._support import LAYOUT, Tally, fuzz, keys_for, make_store, pages_of

KEYS = keys_for(3, extra="wire")


def valid_frames() -> list[tuple[bytes, object]]:
    """Control frames of every kind, each with the body type its receiver decodes."""
    codec = Codec()
    with make_store(device=4, host=4) as store:
        store.put(KEYS, pages_of(KEYS))
        with store.acquire(KEYS) as lease:
            headers = [FrameMover(LAYOUT).pack(lease)[0], SameProcessMover(LAYOUT).pack(lease)[0],
                       SharedMemoryMover(LAYOUT, ttl=0.01).pack(lease)[0]]
    request = codec.encode_body(FetchRequest(KEYS, "host-a", 1234))
    frames = [(codec.encode(wire.Request(7, "kv.fetch", request)), FetchRequest)]
    for header in headers:
        body = codec.encode_body(FetchReply(header))
        frames.append((codec.encode(wire.Response(7, body)), FetchReply))
    frames += [(codec.encode(wire.Error(7, "KeyError", "no such page")), None),
               (codec.encode(wire.Heartbeat(3)), None), (codec.encode(wire.Cancel(7)), None)]
    return frames


FRAMES = valid_frames()


@st.composite
def mutated(draw) -> tuple[bytes, object]:
    frame, body_type = draw(st.sampled_from(FRAMES))
    data = bytearray(frame)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "set", "insert", "delete", "duplicate"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif kind == "set" and data:
            data[at] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xCF, 0xD3, 0xDC,
                                             0xDD, 0xDE, 0xDF, 0xFF]))
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del data[at:at + draw(st.integers(1, 8))]
        else:
            span = draw(st.integers(1, 16))
            data[at:at] = data[at:at + span]
    return bytes(data), body_type


LEAVES = st.one_of(
    st.integers(-(2 ** 63), 2 ** 64 - 1), st.integers(-2, 70_000), st.none(), st.booleans(),
    st.floats(), st.text(max_size=12), st.binary(max_size=20), st.binary(min_size=16,
                                                                          max_size=16),
    st.sampled_from(["frames", "shared_memory", "same_process", "req", "res", "float32",
                     "omni-0123456789abcdef-host", "../../etc/passwd", "host", "device"]),
    st.lists(st.integers(-1, 1 << 20), max_size=4), st.lists(st.binary(min_size=16,
                                                                       max_size=16)))


def _paths(value: object, path: tuple = ()) -> list[tuple]:
    """Every node of a decoded msgpack tree, as a path of list indexes and dict keys."""
    out = [path]
    if isinstance(value, list):
        for i, item in enumerate(value):
            out += _paths(item, (*path, i))
    elif isinstance(value, dict):
        for key, item in value.items():
            out += _paths(item, (*path, key))
    return out


def _replace(value: object, path: tuple, new: object) -> object:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, list):
        return [_replace(v, rest, new) if i == head else v for i, v in enumerate(value)]
    return {k: _replace(v, rest, new) if k == head else v for k, v in value.items()}


@st.composite
def restructured(draw) -> tuple[bytes, object]:
    """A valid frame with a few of its values (fields, keys, whole sub-structures) replaced:
    well-formed msgpack that tests the typed decoding and the movers, not the parser."""
    frame, body_type = draw(st.sampled_from(FRAMES))
    tree = msgspec.msgpack.decode(frame)
    for _ in range(draw(st.integers(1, 3))):
        # A node inside the message's fields (its version and tag: tests/transport/test_wire).
        path = draw(st.sampled_from([p for p in _paths(tree) if len(p) > 2 or (
            len(p) == 2 and p[0] == 1 and p[1] > 0)]))
        old = tree
        for step in path:
            old = old[step]
        tree = _replace(tree, path, draw(st.one_of(_like(old), _like(old), LEAVES)))
    return msgspec.msgpack.encode(tree), body_type


def _like(value: object) -> st.SearchStrategy:
    """Another value of the same kind: what passes type checks and must still be refused."""
    if isinstance(value, bool) or value is None:
        return st.sampled_from([True, False, None])
    if isinstance(value, int):
        return st.one_of(st.integers(value - 2, value + 2), st.integers(-1, 1 << 17),
                         st.integers(-(2 ** 63), 2 ** 64 - 1))
    if isinstance(value, str):
        return st.one_of(st.text(max_size=12), LEAVES.filter(lambda v: isinstance(v, str)),
                         st.just(value[::-1]))
    if isinstance(value, bytes):
        return st.one_of(st.binary(min_size=len(value), max_size=len(value)),
                         st.binary(max_size=24))
    if isinstance(value, list) and value:
        return st.one_of(st.just(value[1:]), st.just(value + value[:1]), st.just(value[::-1]))
    return LEAVES


def test_mutated_frames_decode_or_raise_only_wire_errors(record):
    tally = Tally()

    @fuzz(600)
    @given(st.one_of(mutated(), restructured()))
    def decode(case):
        frame, body_type = case
        codec = Codec()
        try:
            msg = codec.decode(frame)
        except WireError:
            tally("refused")
            return
        if body_type is None or not isinstance(msg, wire.Request | wire.Response):
            tally("decoded")
            return
        try:
            body = codec.decode_body(msg.body, body_type)
        except WireError:
            tally("refused")
            return
        if isinstance(body, FetchRequest):
            assert all(isinstance(k, bytes) and len(k) == 16 for k in body.keys)
        elif body.header is not None:
            header = body.header
            frames = [bytes(min(header.nbytes, 1 << 20))] if isinstance(
                header, FrameHeader) and header.nbytes >= 0 else []
            try:  # the pages it names: unpacked or refused, never anything else
                unpack(header, frames, LAYOUT).close()
            except TransportError:
                tally("header refused")
        tally("decoded")

    decode()
    tries = tally["refused"] + tally["decoded"]
    record("input.wire_mutations", tries=tries,
           outcome=f"{tally['refused']} refused with WireError; {tally['decoded']} decoded "
                   f"to well-typed values, {tally['header refused']} of them page headers "
                   "then refused by their mover; no other exception")


LIMITS = WireLimits(max_control_bytes=4096, max_payload_bytes=64 << 10, max_payload_frames=4)
MAX_FRAME = max(LIMITS.max_control_bytes, LIMITS.max_payload_bytes)  # ZeroMQ's MAXMSGSIZE


async def test_oversize_messages_are_refused_and_the_server_keeps_serving(record):
    tally = Tally()
    codec = Codec(LIMITS)
    server = RPCServer(limits=LIMITS)

    async def echo(body: object) -> object:
        return body

    server.register("echo", echo, body_type=object)
    ok = codec.encode(wire.Request(1, "echo", codec.encode_body("x")))
    oversize = {
        "control frame": [[b"\x92\x01" + b"\x00" * n] for n in (4096, 10_000, 1 << 20)],
        "payload frame": [[ok, b"\x00" * n] for n in ((64 << 10) + 1, 1 << 20)],
        "payload frames": [[ok, *[b"p"] * n] for n in (5, 64, 4096)],
    }
    with trio.fail_after(CAP_S):
        async with server, RPCClient(server.endpoint, limits=LIMITS) as client:
            for kind, messages in oversize.items():
                for frames in messages:
                    dropped, requests = server.stats().dropped, server.stats().requests
                    raw = zmq.Context.instance().socket(zmq.DEALER)
                    raw.linger = 0
                    monitor = raw.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                    raw.connect(server.endpoint)
                    try:
                        raw.send_multipart(frames)
                        if max(map(len, frames)) <= MAX_FRAME:  # dropped and counted
                            await wait_until(lambda d=dropped: server.stats().dropped > d)
                        else:  # over ZeroMQ's MAXMSGSIZE: it may cut the peer off first
                            await wait_until(
                                lambda d=dropped, m=monitor: server.stats().dropped > d
                                or m.poll(0), "the message dropped or its sender cut off")
                    finally:
                        raw.disable_monitor()
                        monitor.close(linger=0)
                        raw.close()
                    assert server.stats().requests == requests  # nothing reached a handler
                    assert await client.call("echo", "still here") == "still here"
                    tally(kind)
            # Our own side refuses to send what the other would refuse.
            for body in (b"x" * 5000, ["y" * 100] * 100):
                try:
                    await client.call("echo", body)
                    raise AssertionError("an oversize body was sent")
                except WireError as exc:
                    assert "limit" in str(exc)
                    tally("own")
    # A value that claims more than it carries is refused, not allocated.
    for shape in ([1 << 28], [1 << 40], [4096, 4096, 64], [-1, 8]):
        header = msgspec.msgpack.encode(("float32", shape))
        ext = msgspec.msgpack.Ext(1, struct.pack("<I", len(header)) + header)
        try:
            decode_value(msgspec.msgpack.encode({"kv": ext}))
            raise AssertionError(f"a tensor of shape {shape} without bytes decoded")
        except WireError:
            tally("value")
    tries = sum(tally.counts.values())
    record("input.oversize", tries=tries,
           outcome=f"{tries} refused: frames over the limits and too many frames dropped "
                   "(counted by the server, or cut off by ZeroMQ past its MAXMSGSIZE), oversize "
                   "bodies not sent, tensors claiming bytes they lack not allocated; the "
                   "server answered after each")


