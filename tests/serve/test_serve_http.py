"""The HTTP connections of ``omni serve`` (`omni.serve._http`) on a real socket: a request that
arrives as its connection's keep-alive timer runs out, while the event loop is stalled (a busy
host), is answered, not dropped unanswered; a connection that stays idle, or sends only part of
a request, is still closed once the timer has run out.

The server runs in a thread of its own (its event loop is the one that stalls); the clients are
plain sockets in the test's thread. The stall lasts until the test has sent its request, so the
order is fixed by the test, not by timing."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import trio
from hypercorn.config import Config

from omni.serve._http import HttpServer, http_server
from tests._wait import CAP_S, wait_until_sync

KEEP_ALIVE_S = 0.2


class Stall:
    """``GET /stall`` blocks the server's event loop (a synchronous wait in the app) until
    `release`; any other path answers 200 ``ok``."""

    def __init__(self) -> None:
        self.stalled, self.released = threading.Event(), threading.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/stall":
            self.stalled.set()
            self.released.wait(CAP_S)  # blocks the whole event loop, as a busy host does
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


@contextmanager
def serving(app: Any) -> Iterator[tuple[HttpServer, tuple[str, int]]]:
    """`app` served on a free loopback port in a thread; the server and its address."""
    ready: list[HttpServer] = []
    stop = threading.Event()

    async def main() -> None:
        config = Config()
        config.bind = ["127.0.0.1:0"]
        config.keep_alive_timeout = KEEP_ALIVE_S
        async with http_server(app, config) as server:
            ready.append(server)
            while not stop.is_set():
                await trio.sleep(0.01)

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    try:
        wait_until_sync(lambda: bool(ready), "the server to listen")
        host, port = ready[0].urls[0].removeprefix("http://").rsplit(":", 1)
        yield ready[0], (host, int(port))
    finally:
        stop.set()
        thread.join(CAP_S)


def reply(sock: socket.socket) -> bytes:
    """What the server sent before it closed or paused (b"" when it closed at once)."""
    sock.settimeout(CAP_S)
    try:
        return sock.recv(1024)
    except ConnectionResetError:
        return b""


def test_a_request_arriving_as_the_keep_alive_timer_ends_in_a_stall_is_answered() -> None:
    app = Stall()
    with serving(app) as (server, address):
        with socket.create_connection(address) as late, \
                socket.create_connection(address) as busy:
            wait_until_sync(lambda: server.num_connections == 2, "both connections accepted")
            busy.sendall(b"GET /stall HTTP/1.1\r\nhost: omni\r\n\r\n")
            assert app.stalled.wait(CAP_S)
            # the loop is stalled: `late`'s timer runs out, then its request arrives
            threading.Event().wait(KEEP_ALIVE_S * 2)
            late.sendall(b"GET /ok HTTP/1.1\r\nhost: omni\r\n\r\n")
            app.released.set()
            assert reply(late).startswith(b"HTTP/1.1 200"), "dropped unanswered"
            assert reply(busy).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("sent", [b"", b"GET /ok HTTP/1.1\r\nho"], ids=["nothing", "part"])
def test_a_connection_without_a_whole_request_is_closed_once_its_timer_ends(
        sent: bytes) -> None:
    with serving(Stall()) as (server, address), socket.create_connection(address) as client:
        client.sendall(sent)
        assert reply(client) == b""  # closed by the server, nothing sent
        wait_until_sync(lambda: server.num_connections == 0, "the connection to end")
