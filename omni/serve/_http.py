"""HTTP connections for ``omni serve``: hypercorn's protocol code, accepted and closed here.

Why not hypercorn's own ``serve``: its graceful shutdown closes the listener at once (a client
that connects during the drain is refused instead of answered 503) and then waits for every
connection to end, up to its timeout; a connection whose server-sent event stream finished
during that wait stays open (hypercorn's close after the last event is cancelled along with
the stream's task group), so one pooled client holds the process for the whole timeout.

Here the listener stays open until the server leaves; `close_idle` closes the connections
that wait for a next request and makes the busy ones close after their response (hypercorn's
``terminated`` event of the connections accepted so far; later ones get a context of their
own); leaving the `http_server` block closes every connection at once. The parts used
(``TCPServer``, ``WorkerContext``) are hypercorn's trio worker's own, as its ``worker_serve``
wires them, minus the ASGI lifespan (the app has no startup or shutdown hooks).

A connection's keep-alive timer (``keep_alive_timeout``, which also runs from the accept to
the first request) closes it only when it is still idle with nothing unread: hypercorn's
closes it whenever the timer fires, and when the event loop stalls past that moment (a busy
host) a request that arrived meanwhile is dropped unanswered, the client told only that the
server disconnected.
"""

from __future__ import annotations

import fcntl
import termios
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.events import Event, Updated
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.utils import repr_socket_addr, wrap_app

__all__ = ["HttpServer", "http_server"]

RECHECK_S = 0.01  # how soon an expired keep-alive timer looks again while a request arrives


class _Connection(TCPServer):
    """Hypercorn's connection, whose keep-alive timer never drops a request that arrived as
    it expired (see the module docstring)."""

    _idle = True  # no request in flight (hypercorn's `Updated` events say when that changes)

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, Updated):
            self._idle = event.idle  # before the timer is stopped: that waits for a lock
        await super().protocol_send(event)

    async def _idle_timeout(self) -> None:
        with trio.move_on_after(self.config.keep_alive_timeout):
            await self.context.terminated.wait()
        # The reader stops this task once it has parsed a request; until then a request whose
        # bytes are here (or parsed, in this same scheduling batch) keeps the connection open.
        while not (self._idle and _unread_bytes(self.stream.socket.fileno()) == 0):
            await trio.sleep(RECHECK_S)
        with trio.CancelScope(shield=True):
            await self._initiate_server_close()


def _unread_bytes(fd: int) -> int:
    """Bytes received on socket `fd` that nothing has read yet (0 once it is closed)."""
    try:
        return int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4), "little")
    except OSError:
        return 0


class HttpServer:
    """The listening server: its URLs, and the connections it has accepted."""

    def __init__(self, app: Any, config: Config, urls: list[str]):
        self.urls = urls
        self._app, self._config = app, config
        self._context = WorkerContext(None)  # the connections accepted since the last close
        self.num_connections = 0  # open now

    async def close_idle(self) -> None:
        """Close the connections waiting for a next request; make those answering one close
        once answered. Connections accepted later are served as before."""
        closing, self._context = self._context, WorkerContext(None)
        await closing.terminated.set()

    async def _handle(self, stream: trio.SocketStream) -> None:
        self.num_connections += 1
        try:
            await _Connection(self._app, self._config, self._context, {}, stream).run()
        finally:
            self.num_connections -= 1

    def __repr__(self) -> str:
        return f"<HttpServer {' '.join(self.urls)} connections={self.num_connections}>"


@asynccontextmanager
async def http_server(app: Any, config: Config) -> AsyncIterator[HttpServer]:
    """Serve the ASGI `app` on `config.bind` (plain HTTP) until the block ends, then close
    the listener and every connection (their requests are cancelled).

    Raises:
        OSError: an address cannot be bound.
    """
    sockets = config.create_sockets()
    listeners, urls = [], []
    for sock in sockets.insecure_sockets:
        sock.listen(config.backlog)
        listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
        urls.append("http://" + repr_socket_addr(sock.family, sock.getsockname()))
    server = HttpServer(wrap_app(app, config.wsgi_max_body_size, "asgi"), config, urls)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(trio.serve_listeners, server._handle, listeners,
                                   handler_nursery=nursery))
        try:
            yield server
        finally:
            nursery.cancel_scope.cancel()
