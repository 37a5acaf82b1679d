"""The data channel: large RPC messages beside CURVE, sealed with AES-256-GCM (real sockets on
loopback, a real token and ZAP authenticator)."""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import msgspec
import numpy as np
import pytest
import trio
import zmq

from omni.transport import Reply, RPCClient, RPCServer
from omni.transport.credentials import Credentials
from omni.transport.data_channel import (
    DATA_MIN,
    DataOpen,
    DataOpened,
    Receiver,
    Refused,
    Sender,
    channel_secrets,
    data_plane_mode,
)
from omni.transport.errors import TransportError
from omni.transport.security import ClusterToken
from omni.transport.trio_zmq import open_socket
from omni.transport.wire import WireLimits
from tests._wait import wait_until

BIG = 5 * (2 << 20) + 12_345  # several pieces, the last one short


@pytest.fixture(scope="module")
def token() -> ClusterToken:
    return ClusterToken.generate()


@pytest.fixture
def creds(token: ClusterToken) -> Iterator[Credentials]:
    with Credentials(token) as creds:
        yield creds


@dataclass
class Served:
    server: RPCServer
    calls: list[int]  # payload bytes each call of `echo` received


@pytest.fixture
async def served(creds: Credentials) -> AsyncIterator[Served]:
    server = RPCServer(ctx=creds.ctx, options=creds.server_options(),
                       data_plane=creds.data_plane())
    calls: list[int] = []

    async def echo(body: int, payload: list) -> Reply:
        calls.append(sum(memoryview(f).nbytes for f in payload))
        return Reply(body, payload)

    server.register("echo", echo, with_payload=True)
    async with server:
        yield Served(server, calls)


def _client(creds: Credentials, endpoint: str, *, data: bool = True) -> RPCClient:
    return RPCClient(endpoint, ctx=creds.ctx, options=creds.client_options(),
                     data_plane=creds.data_plane() if data else None, timeout=30)


async def test_a_large_message_crosses_on_the_data_channel_both_ways(
        creds: Credentials, served: Served) -> None:
    big = np.random.default_rng(0).integers(0, 255, BIG, dtype=np.uint8)
    async with _client(creds, served.server.endpoint) as client:
        await wait_until(lambda: client.data_mode == "encrypted")
        reply = await client.call_with_payload("echo", 7, payload=[b"head", big, b"x" * 100])
        small = await client.call_with_payload("echo", 8, payload=[b"tiny"])
        stats = client.stats().data
    assert reply.body == 7 and bytes(reply.payload[0]) == b"head"
    assert np.array_equal(np.frombuffer(reply.payload[1], np.uint8), big)
    assert bytes(reply.payload[2]) == b"x" * 100
    assert bytes(small.payload[0]) == b"tiny"
    # the channel's probe each way, then the large call and its reply went on the data
    # channel; the small one on CURVE
    assert stats is not None and stats.mode == "encrypted"
    assert (stats.messages_out, stats.messages_in) == (2, 2)
    assert stats.bytes_out == stats.bytes_in == BIG + 104
    server_stats = served.server.stats().data
    assert server_stats is not None
    assert (server_stats.messages_in, server_stats.messages_out) == (2, 2)
    assert server_stats.refused == server_stats.dropped == 0


async def test_before_the_channel_opens_or_without_one_messages_go_on_curve(
        creds: Credentials, served: Served) -> None:
    big = bytes(DATA_MIN)
    async with _client(creds, served.server.endpoint, data=False) as client:
        reply = await client.call_with_payload("echo", 1, payload=[big])
        assert bytes(reply.payload[0]) == big and client.stats().data is None
    assert served.server.stats().data.messages_in == 0  # type: ignore[union-attr]


@pytest.mark.parametrize(("server_mode", "client_mode", "expected"), [
    ("plaintext", "plaintext", "plaintext"),
    ("plaintext", "encrypted", "encrypted"),
    ("encrypted", "plaintext", "encrypted"),
])
async def test_plaintext_only_where_both_ends_say_so(
        token: ClusterToken, server_mode: str, client_mode: str, expected: str) -> None:
    big = np.arange(BIG, dtype=np.uint8)
    with Credentials(token, data_plane=server_mode) as server_creds, \
            Credentials(token, data_plane=client_mode) as client_creds:
        server = RPCServer(ctx=server_creds.ctx, options=server_creds.server_options(),
                           data_plane=server_creds.data_plane())

        async def echo(body: int, payload: list) -> Reply:
            return Reply(body, payload)

        server.register("echo", echo, with_payload=True)
        async with server, _client(client_creds, server.endpoint) as client:
            await wait_until(lambda: client.data_mode == expected)
            reply = await client.call_with_payload("echo", 1, payload=[big])
            assert np.array_equal(np.frombuffer(reply.payload[0], np.uint8), big)
            assert client.stats().data.messages_in == 2  # type: ignore[union-attr]


def test_the_mode_setting_is_checked_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_DATA_PLANE", "Plaintext ")
    assert data_plane_mode() == "plaintext"
    monkeypatch.setenv("OMNI_DATA_PLANE", "none")
    with pytest.raises(TransportError, match=r"OMNI_DATA_PLANE.*encrypted, plaintext"):
        data_plane_mode()


async def _open_by_hand(creds: Credentials, endpoint: str) -> tuple[bytes, bytes, int]:
    """Open a channel as a client would, returning its id, key and data port."""
    channel, key = os.urandom(16), os.urandom(32)
    async with _client(creds, endpoint, data=False) as client:
        opened = await client.call("_data.open", DataOpen(channel, key, "encrypted"),
                                   result_type=DataOpened)
    return channel, key, opened.port


def _data_socket(creds: Credentials, channel: bytes, password: str, port: int):
    options = {zmq.ROUTING_ID: channel, zmq.PLAIN_USERNAME: channel.hex().encode(),
               zmq.PLAIN_PASSWORD: password.encode()}
    return open_socket(creds.ctx, zmq.DEALER, connect=f"tcp://127.0.0.1:{port}",
                       options=options)


async def test_a_flipped_bit_is_refused_and_counted_and_the_channel_goes_on(
        creds: Credentials, served: Served) -> None:
    from omni.transport.wire import Request, encode

    channel, key, port = await _open_by_hand(creds, served.server.endpoint)
    up, _, password = channel_secrets(key, channel)
    sender = Sender(up)
    async with _data_socket(creds, channel, password, port) as sock:
        for probe in sender.frames(b"", []):  # what a client sends first: the channel's probe
            await sock.send_multipart(probe)
        payload = [np.ones(BIG, np.uint8)]
        messages = list(sender.frames(encode(Request(1, "echo", msgspec.Raw(b"\x01"))), payload))
        tampered = np.array(messages[2][1], copy=True)
        tampered[1000] ^= 0x04  # one bit of the second piece
        for message in [messages[0], messages[1], [messages[2][0], tampered]]:
            await sock.send_multipart(message)
        await wait_until(lambda: served.server.stats().data.refused == 1)
        stats = served.server.stats().data
        assert (stats.messages_in, stats.dropped) == (1, 1)  # the probe; the tampered one
        assert served.calls == []  # nothing of the tampered message was delivered
        # a replay of the good head is refused too; a fresh message goes through
        await sock.send_multipart(messages[0])
        await wait_until(lambda: served.server.stats().data.refused == 2)
        for message in sender.frames(encode(Request(2, "echo", msgspec.Raw(b"\x02"))), payload):
            await sock.send_multipart(message)
        await wait_until(lambda: served.calls == [BIG])


async def test_a_peer_without_the_key_is_refused_before_any_payload_is_read(
        creds: Credentials, served: Served) -> None:
    from omni.transport.wire import Request, encode

    channel, _, port = await _open_by_hand(creds, served.server.endpoint)
    denied = creds.auth_stats().data_denied
    forged_key = os.urandom(32)
    up, _, wrong_password = channel_secrets(forged_key, channel)
    async with _data_socket(creds, channel, wrong_password, port) as sock:
        for message in Sender(up).frames(encode(Request(1, "echo", msgspec.Raw(b"\x01"))),
                                         [np.ones(BIG, np.uint8)]):
            sock.send_multipart_nowait(message)
        await wait_until(lambda: creds.auth_stats().data_denied > denied)
    stats = served.server.stats().data
    assert stats is not None
    # the handshake failed: not one piece reached the server's receiver
    assert (stats.messages_in, stats.refused, stats.dropped, stats.bytes_in) == (0, 0, 0, 0)
    assert served.calls == []


def test_the_receiver_refuses_what_it_cannot_authenticate() -> None:
    up = os.urandom(32)
    limits = WireLimits()
    messages = list(Sender(up).frames(b"control", [bytes(range(256)) * 9000]))
    assert len(messages) == 3  # the head and two pieces
    receiver = Receiver(up, limits)
    with pytest.raises(Refused, match="out of order"):
        receiver.feed(messages[1])  # a piece before its head
    with pytest.raises(Refused, match="authentication"):
        Receiver(os.urandom(32), limits).feed(messages[0])  # another key
    assert receiver.feed(messages[0]) is None
    with pytest.raises(Refused, match="out of order"):
        receiver.feed(messages[2])  # a piece skipped
    assert receiver.refused == 2 and receiver.dropped == 1
    fresh = Receiver(up, limits)
    assert fresh.feed(messages[0]) is None and fresh.feed(messages[1]) is None
    control, data = fresh.feed(messages[2])  # type: ignore[misc]
    assert control == b"control" and bytes(data) == bytes(range(256)) * 9000


def test_a_head_beyond_the_wire_limits_allocates_nothing() -> None:
    up = os.urandom(32)
    messages = list(Sender(up).frames(b"c", [bytes(1000), bytes(1000)]))
    receiver = Receiver(up, WireLimits(max_payload_bytes=999))
    with pytest.raises(Refused, match="wire limits"):
        receiver.feed(messages[0])


async def test_large_calls_in_flight_at_once_each_arrive_whole(
        creds: Credentials, served: Served) -> None:
    arrays = [np.full(DATA_MIN + i * 4099, i, np.uint8) for i in range(12)]
    async with _client(creds, served.server.endpoint) as client:
        await wait_until(lambda: client.data_mode == "encrypted")
        results: dict[int, bytes] = {}

        async def one(i: int) -> None:
            reply = await client.call_with_payload("echo", i, payload=[arrays[i]])
            results[i] = bytes(reply.payload[0])

        async with trio.open_nursery() as nursery:
            for i in range(len(arrays)):
                nursery.start_soon(one, i)
        assert client.stats().data.messages_out == 1 + len(arrays)  # type: ignore[union-attr]
    assert all(results[i] == arrays[i].tobytes() for i in range(len(arrays)))


async def test_a_data_port_that_does_not_answer_leaves_the_client_on_curve(
        creds: Credentials, served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """A firewall in front of the data port: the probe gets no answer, the channel is given
    up, and large calls and replies go on the CURVE connection (none is lost)."""
    from omni.transport import data_channel

    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        nowhere = closed.getsockname()[1]
    monkeypatch.setattr(data_channel.DataServer, "port", property(lambda self: nowhere))
    monkeypatch.setattr(data_channel, "PROBE_S", 0.3)
    big = np.arange(BIG, dtype=np.uint8)
    async with _client(creds, served.server.endpoint) as client:
        await wait_until(lambda: client.stats().data.mode == "off")  # type: ignore[union-attr]
        reply = await client.call_with_payload("echo", 1, payload=[big])
        assert np.array_equal(np.frombuffer(reply.payload[0], np.uint8), big)
        assert client.data_mode == ""
    assert served.server.stats().data.messages_in == 0  # type: ignore[union-attr]


async def test_a_client_past_the_servers_channels_stays_on_curve(
        creds: Credentials, served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """No open channel is ever closed under its client: one client more than the server
    keeps is refused a channel and served on its CURVE connection."""
    from omni.transport import data_channel

    monkeypatch.setattr(data_channel, "MAX_CHANNELS", 1)
    big = np.arange(BIG, dtype=np.uint8)
    async with _client(creds, served.server.endpoint) as first:
        await wait_until(lambda: first.data_mode == "encrypted")  # it has the one channel
        async with _client(creds, served.server.endpoint) as second:
            await wait_until(lambda: second.stats().data.mode == "off")  # type: ignore
            for client in (first, second):
                reply = await client.call_with_payload("echo", 1, payload=[big])
                assert np.array_equal(np.frombuffer(reply.payload[0], np.uint8), big)
        assert first.stats().data.messages_out == 2  # type: ignore[union-attr]


class _Proxy:
    """A TCP forwarder on loopback in front of a server's data port, as a middlebox would be:
    `cut` breaks every connection through it and refuses new ones (the data connection is
    down while CURVE lives on); `resume` accepts on the same port again."""

    def __init__(self, target: int):
        self.target = target
        self.port = 0
        self._scopes: list[trio.CancelScope] = []

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        with trio.CancelScope() as scope:
            self._scopes.append(scope)
            await trio.serve_listeners(self._forward, listeners, task_status=task_status)

    async def _forward(self, inbound: trio.SocketStream) -> None:
        with trio.CancelScope() as scope:
            self._scopes.append(scope)
            async with inbound, await trio.open_tcp_stream("127.0.0.1", self.target) as out:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._copy, inbound, out)
                    nursery.start_soon(self._copy, out, inbound)

    @staticmethod
    async def _copy(source: trio.SocketStream, sink: trio.SocketStream) -> None:
        while data := await source.receive_some():
            await sink.send_all(data)

    def cut(self) -> None:
        for scope in self._scopes:
            scope.cancel()
        self._scopes.clear()


def _events(monitor: zmq.Socket, seen: list[int]) -> list[int]:
    """The monitor's events so far (read without waiting)."""
    from zmq.utils.monitor import recv_monitor_message

    while True:
        try:
            seen.append(recv_monitor_message(monitor, zmq.NOBLOCK)["event"])
        except zmq.Again:
            return seen


async def test_while_the_data_connection_is_down_large_messages_take_curve(
        creds: Credentials, monkeypatch: pytest.MonkeyPatch) -> None:
    """The data channel's TCP connection breaks and stays down while the CURVE connection
    lives on: large replies and requests go on CURVE (a reply so sent is counted as
    rerouted), none is lost; once the data connection is back, they take it again."""
    from omni.transport import data_channel

    big = np.arange(BIG, dtype=np.uint8)

    async def make(body: int) -> Reply:
        return Reply(body, [big])

    async def size(body: int, payload: list) -> int:
        return sum(memoryview(frame).nbytes for frame in payload)

    server = RPCServer(ctx=creds.ctx, options=creds.server_options(),
                       data_plane=creds.data_plane())
    server.register("make", make)
    server.register("size", size, with_payload=True)
    real_port = data_channel.DataServer.port

    def data_traffic() -> tuple[int, int, int]:
        """Messages the server's data channels carried in and out, replies rerouted."""
        stats = server.stats()
        assert stats.data is not None
        return stats.data.messages_in, stats.data.messages_out, stats.rerouted

    async with server, trio.open_nursery() as nursery:
        data = server._data  # the data socket, watched for the disconnect it must see
        assert data is not None
        proxy = _Proxy(real_port.fget(data))  # type: ignore[attr-defined]
        await nursery.start(proxy.serve)
        monkeypatch.setattr(data_channel.DataServer, "port", property(lambda _: proxy.port))
        monitor = data._sock.zmq_socket.get_monitor_socket(  # type: ignore[union-attr]
            zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        seen: list[int] = []
        replies = []
        try:
            async with _client(creds, server.endpoint) as client:
                await wait_until(lambda: client.data_mode == "encrypted")
                replies.append(await client.call_with_payload("make", 1))
                assert await client.call("size", 0, payload=[big]) == BIG
                assert data_traffic() == (2, 2, 0)  # the probe, then one each way

                proxy.cut()  # and nothing listens there until it serves again
                await wait_until(lambda: zmq.EVENT_DISCONNECTED in _events(monitor, seen)
                                 and client.data_mode == "")
                replies.append(await client.call_with_payload("make", 2))
                assert await client.call("size", 0, payload=[big]) == BIG
                assert data_traffic() == (2, 2, 1)  # both on CURVE

                seen.clear()
                await nursery.start(proxy.serve)  # the same port: the client reconnects
                await wait_until(lambda: zmq.EVENT_HANDSHAKE_SUCCEEDED in _events(monitor, seen)
                                 and client.data_mode == "encrypted")
                replies.append(await client.call_with_payload("make", 3))
                assert await client.call("size", 0, payload=[big]) == BIG
                assert data_traffic() == (3, 3, 1)  # the data channel again
        finally:
            data._sock.zmq_socket.disable_monitor()  # type: ignore[union-attr]
            monitor.close(linger=0)
            proxy.cut()
    for n, reply in enumerate(replies, 1):
        assert reply.body == n and np.array_equal(np.frombuffer(reply.payload[0], np.uint8),
                                                  big)
