"""A peer's liveness: one busy with a large transfer is alive, one that stops is gone.

The transfer is held mid-way by a TCP relay between client and server, so it lasts as long
as the test wants, on any machine. Real sockets on loopback and real time: ZeroMQ moves the
bytes in its own threads, which a mock clock cannot wait for. The waits are counted in
heartbeats sent, never in seconds.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import AsyncIterator

import pytest
import trio

from omni.transport.errors import PeerGone
from omni.transport.rpc import Reply, RPCClient, RPCServer
from tests._wait import CAP_S, wait_until

INTERVAL = 0.2  # a spurious "gone" needs a pong on an idle connection held up for 0.6 s
FRAME = 8 << 20  # far more than the relay lets through while it holds a transfer
HOLD_AFTER = 1 << 20


class Relay:
    """A TCP relay on 127.0.0.1 to `port` that a test can hold. Why: to make a transfer last
    as long as a test needs, and a peer fall silent, without betting on a machine's speed.

    `hold_transfers()`: a connection stops forwarding towards the server once it has carried
    `HOLD_AFTER` bytes (a large frame stuck mid-way; `held` is set), until `release()`.
    `hold_everything()`: no connection forwards anything either way (a peer gone silent).
    """

    def __init__(self, port: int) -> None:
        self._target = ("127.0.0.1", port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self.held = threading.Event()
        self._limit: int | None = None
        self._flowing = threading.Event()  # cleared: nothing moves
        self._flowing.set()
        self._released = threading.Event()
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def hold_transfers(self) -> None:
        self._limit = HOLD_AFTER

    def hold_everything(self) -> None:
        self._flowing.clear()

    def release(self) -> None:
        self._limit = None
        self._released.set()

    def close(self) -> None:
        self._released.set()
        self._flowing.set()
        for sock in self._sockets:
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(self._target)
            self._sockets += [client, server]
            for src, dst, upstream in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, upstream),
                                 daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        forwarded = 0
        try:
            while True:
                self._flowing.wait()
                if upstream and self._limit is not None and forwarded >= self._limit:
                    self.held.set()
                    self._released.wait()
                data = src.recv(1 << 16)
                if not data:
                    return
                self._flowing.wait()
                dst.sendall(data)
                forwarded += len(data)
        except OSError:  # the relay closed
            return


@pytest.fixture
async def served() -> AsyncIterator[tuple[RPCServer, Relay]]:
    async def size(_: object, payload: list) -> Reply:
        return Reply(sum(memoryview(f).nbytes for f in payload), [])

    server = RPCServer("tcp://127.0.0.1:*")
    server.register("size", size, body_type=object, with_payload=True)
    async with server:
        relay = Relay(int(server.endpoint.rsplit(":", 1)[1]))
        try:
            yield server, relay
        finally:
            relay.close()


async def pings_go_by(client: RPCClient, count: int) -> None:
    sent = client.stats().heartbeats_sent
    await wait_until(lambda: client.stats().heartbeats_sent >= sent + count)


async def test_a_server_busy_receiving_a_large_frame_is_alive_and_one_gone_silent_is_not(
        served: tuple[RPCServer, Relay]) -> None:
    """A frame held mid-way for many heartbeat windows: the server is alive all along (its
    pongs do not wait behind the frame) and the call is answered once the frame is through.
    Then the same server falling silent is declared gone, and the call in flight fails."""
    _, relay = served
    with trio.fail_after(CAP_S):
        async with RPCClient(relay.endpoint, heartbeat_interval=INTERVAL) as client:
            assert await client.call("size", None, payload=[b"x"]) == 1
            relay.hold_transfers()
            async with trio.open_nursery() as nursery:
                answers: list[int] = []

                async def call() -> None:
                    answers.append(await client.call("size", None, payload=[bytes(FRAME)]))

                nursery.start_soon(call)
                await wait_until(relay.held.is_set)
                await pings_go_by(client, 5 * 3)  # five windows of three heartbeats
                assert client.peer_alive and client.stats().peer_gone == 0
                relay.release()
            assert answers == [FRAME] and client.stats().peer_gone == 0

            relay.hold_everything()
            with pytest.raises(PeerGone):
                await client.call("size", None, payload=[bytes(FRAME)])
            assert not client.peer_alive and client.stats().peer_gone == 1
