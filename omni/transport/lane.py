"""A lane: one thread outside the event loop that receives notices and sends notices on, over
Unix sockets, for the hops of a pipeline between the processes of one host.

Why: a notice that wakes a trio process costs two trips through its scheduler (the reader
task, then the handler's), about 70 µs of the hop on a small machine before any work is
done, where a blocking thread waking on the same socket costs about 11 (`perf/_ring.py`).
A compiled graph's actor runs its stages on such a thread; so does a lane, for the work its
owner can do there without awaiting anything (`omni.cluster.worker`: a chain's stage of a
synchronous node), handing the rest to its event loop (`hand_to_loop`).

The bytes are the RPC's over `omni.transport.unix`: a message is a `wire.Request` with id 0
(a notice) and its payload frames, in the Unix socket format, so that a lane sends notices
to an `RPCServer`'s Unix endpoint as well as to another lane, and an `RPCClient` (without
heartbeats: nothing here answers them) sends to a lane. Only processes of this user connect
(the socket's 0700 folder, and ``SO_PEERCRED``); a peer that breaks the format or the
limits is disconnected, a message that does not decode is dropped and counted.

The thread waits in one ``epoll`` for its listener, its connections and a wake-up socket
(`stop`). Notices it sends are written at once while the peer reads; what the kernel does
not take waits, in order, until the peer's socket is writable, up to `MAX_PENDING_BYTES` per
peer, so a slow peer never blocks the lane (two lanes sending to each other cannot wait on
each other).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import os
import select
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import trio

from omni.transport.errors import TransportError, WireError
from omni.transport.unix import (
    _IOV_MAX,
    Buffer,
    _Broken,
    _listen,
    _Parser,
    _path,
    _same_user,
    encode,
    write_now,
)
from omni.transport.wire import Codec, Request, WireLimits

__all__ = ["MAX_PENDING_BYTES", "Lane", "LaneStats"]

log = logging.getLogger(__name__)

MAX_PENDING_BYTES: Final = 64 << 20  # unsent bytes a lane holds for one peer

Handler = Callable[[Request, list[Buffer]], None]


@dataclass(frozen=True, slots=True)
class LaneStats:
    """A lane's counters: notices `received` (and handled), `dropped` (did not decode, or
    their handler raised), `sent`, peers it could not `unreachable` reach, and `broken`
    connections (a peer that broke the format, or went away with bytes unsent)."""

    received: int
    dropped: int
    sent: int
    unreachable: int
    broken: int


class _In:
    """A connection a peer opened: its parser, and the view it waits to fill."""

    __slots__ = ("parser", "parsing", "sock", "view")

    def __init__(self, sock: socket.socket, parser: _Parser):
        self.sock = sock
        self.parser = parser
        self.parsing = parser.message()
        self.view = next(self.parsing)  # (an empty buffer always needs bytes)


class _Out:
    """A connection this lane opened to a peer, and what waits to be written to it."""

    __slots__ = ("endpoint", "pending", "pending_bytes", "sock")

    def __init__(self, endpoint: str, sock: socket.socket):
        self.endpoint = endpoint
        self.sock = sock
        self.pending: collections.deque[memoryview] = collections.deque()
        self.pending_bytes = 0


class Lane:
    """See the module docstring. `handle(request, payload)` runs on the lane's thread for
    each notice; it may call `notify` and `hand_to_loop`. What it raises is counted as
    dropped: a `WireError` (it refused the notice) quietly, anything else logged with its
    traceback (a bug). `run` binds `bind` (``unix://PATH``) and serves until cancelled."""

    def __init__(self, bind: str, handle: Handler, *, limits: WireLimits | None = None):
        _path(bind)
        self.endpoint = bind
        self.codec = Codec(limits)
        self._handle = handle
        limits = self.codec.limits
        self._limits = {"max_frames": limits.max_payload_frames + 1,
                        "max_frame_bytes": max(limits.max_payload_bytes,
                                               limits.max_control_bytes)}
        self._epoll: select.epoll | None = None  # the thread's, while it serves
        self._owners: dict[int, Any] = {}  # fd -> what it is (None: the wake-up socket)
        self._outs: dict[str, _Out] = {}
        self._waker, self._wakeup = socket.socketpair()
        self._token: trio.lowlevel.TrioToken | None = None
        self._received = self._dropped = self._sent = self._unreachable = self._broken = 0

    # -- the event loop's side -----------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Bind, then run the lane's thread until cancelled; `task_status.started()` once
        bound. Raises `TransportError` naming the path when it cannot be bound."""
        listener = _listen(self.endpoint)
        self._token = trio.lowlevel.current_trio_token()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._stop_when_cancelled)
                task_status.started()
                await trio.to_thread.run_sync(self._serve, listener,
                                              limiter=trio.CapacityLimiter(1))
                nursery.cancel_scope.cancel()
        finally:
            listener.close()
            for sock in (self._waker, self._wakeup):
                sock.close()
            with contextlib.suppress(OSError):
                os.unlink(_path(self.endpoint))

    async def _stop_when_cancelled(self) -> None:
        try:
            await trio.sleep_forever()
        finally:
            self.stop()

    def stop(self) -> None:
        """Make the lane's thread return (from any thread)."""
        with contextlib.suppress(OSError):
            self._waker.send(b"\0")

    def stats(self) -> LaneStats:
        return LaneStats(self._received, self._dropped, self._sent, self._unreachable,
                         self._broken)

    # -- the lane's side -------------------------------------------------------------------

    def notify(self, endpoint: str, method: str, body: Any = None, *,
               payload: Sequence[Buffer] = ()) -> None:
        """Send a notice to the lane or Unix RPC server at `endpoint` (on the lane's thread).

        Raises `TransportError` if nobody listens there or the peer stopped reading (more
        than `MAX_PENDING_BYTES` wait for it), `WireError` if the message breaks the limits.
        """
        codec = self.codec
        if payload:
            codec.check_payload(payload)
        frames = [codec.encode(Request(0, method, codec.encode_body(body))), *payload]
        buffers = encode(frames)
        out = self._outs.get(endpoint) or self._connect(endpoint)
        if not out.pending:
            try:
                buffers = write_now(out.sock, buffers)
            except OSError:
                self._close_out(out)
                raise TransportError(f"the connection to {endpoint} broke") from None
            if not buffers:
                self._sent += 1
                return
        views = [memoryview(b).cast("B") for b in buffers]
        size = sum(v.nbytes for v in views)
        # (refused only behind a backlog: nothing of it went out then, where the rest of a
        # message begun must follow, whatever its size, or the stream would be cut mid-way)
        if out.pending and out.pending_bytes + size > MAX_PENDING_BYTES:
            raise TransportError(f"the peer at {endpoint} does not read: "
                                 f"{out.pending_bytes} bytes wait for it")
        if not out.pending:
            self._watch(out, write=True)
        out.pending.extend(views)
        out.pending_bytes += size
        self._sent += 1

    def hand_to_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the event loop's thread, soon (from the lane's thread). Does
        nothing once the loop has finished."""
        assert self._token is not None
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(functools.partial(fn, *args))

    def _serve(self, listener: socket.socket) -> None:
        self._wakeup.setblocking(False)
        self._epoll = select.epoll()
        self._owners = {self._wakeup.fileno(): None, listener.fileno(): listener}
        for fd in self._owners:
            self._epoll.register(fd, select.EPOLLIN)
        try:
            while True:
                for fd, events in self._epoll.poll():
                    owner = self._owners.get(fd)
                    if type(owner) is _In:
                        self._read(owner)
                    elif owner is None:
                        return
                    elif owner is listener:
                        self._accept(listener)
                    elif events & select.EPOLLOUT:
                        self._flush(owner)  # type: ignore[arg-type]
                    else:  # a peer we send to closed its end, or sent us bytes
                        self._drain_out(owner)  # type: ignore[arg-type]
        finally:
            for owner in self._owners.values():
                if isinstance(owner, (_In, _Out)):
                    owner.sock.close()
            self._owners.clear()
            self._outs.clear()
            self._epoll.close()

    def _accept(self, listener: socket.socket) -> None:
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.warning("lane %s: cannot accept: %s", self.endpoint, exc)
            return
        if not _same_user(sock):
            sock.close()
            return
        sock.setblocking(False)
        self._owners[sock.fileno()] = _In(sock, _Parser(**self._limits))
        self._epoll.register(sock.fileno(), select.EPOLLIN)

    def _read(self, conn: _In) -> None:
        """Receive what waits on `conn` and handle each whole message in it. A read shorter
        than asked for took all there was: back to the wait then, not another read."""
        while True:
            asked = len(conn.view)
            try:
                received = conn.sock.recv_into(conn.view)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                received = 0
            try:
                try:
                    conn.view = conn.parsing.send(received)
                    if received < asked:
                        return
                    continue
                except StopIteration as done:
                    frames = done.value
                while frames is not None:
                    self._deliver(frames)
                    conn.parsing = conn.parser.message()
                    try:
                        conn.view = next(conn.parsing)
                        frames = None
                    except StopIteration as done:
                        frames = done.value
                if received == 0:  # the peer closed between messages
                    self._close_in(conn)
                    return
                if received < asked:
                    return
            except _Broken as exc:
                log.debug("lane %s: a connection ended: %s", self.endpoint, exc)
                self._broken += 1
                self._close_in(conn)
                return

    def _deliver(self, frames: list[Buffer]) -> None:
        codec = self.codec
        try:
            msg = codec.decode(frames[0])
            if type(msg) is not Request or msg.id != 0 or not codec.payload_fits(frames[1:]):
                raise WireError(f"a lane takes notices, not a {type(msg).__name__}")
        except WireError as exc:
            self._dropped += 1
            log.debug("lane %s: dropped a message: %s", self.endpoint, exc)
            return
        self._received += 1
        try:
            self._handle(msg, frames[1:])
        except WireError as exc:  # the handler refused what it got: the sender's fault
            self._dropped += 1
            log.debug("lane %s: dropped a %r notice: %s", self.endpoint, msg.method, exc)
        except Exception:
            self._dropped += 1
            log.exception("lane %s: the handler of %r failed", self.endpoint, msg.method)

    def _connect(self, endpoint: str) -> _Out:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(_path(endpoint))
        except OSError as exc:
            sock.close()
            self._unreachable += 1
            raise TransportError(f"cannot reach {endpoint}: {exc.strerror or exc}") from None
        sock.setblocking(False)
        out = self._outs[endpoint] = _Out(endpoint, sock)
        self._watch(out, write=False)
        return out

    def _watch(self, out: _Out, *, write: bool) -> None:
        fd = out.sock.fileno()
        events = select.EPOLLIN | (select.EPOLLOUT if write else 0)
        if fd in self._owners:
            self._epoll.modify(fd, events)
        else:
            self._owners[fd] = out
            self._epoll.register(fd, events)

    def _flush(self, out: _Out) -> None:
        """Write what waits for `out`, as far as the kernel takes it."""
        while out.pending:
            try:
                sent = out.sock.sendmsg(list(itertools.islice(out.pending, _IOV_MAX)))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._close_out(out)
                return
            out.pending_bytes -= sent
            while sent:
                size = out.pending[0].nbytes
                if sent < size:
                    out.pending[0] = out.pending[0][sent:]
                    break
                sent -= size
                out.pending.popleft()
        self._watch(out, write=False)

    def _drain_out(self, out: _Out) -> None:
        """A connection we send on became readable: the peer closed it (or sent bytes it
        should not have: dropped)."""
        try:
            data = out.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close_out(out)

    def _close_in(self, conn: _In) -> None:
        self._forget(conn.sock)

    def _close_out(self, out: _Out) -> None:
        if out.pending:
            self._broken += 1
            log.warning("lane %s: the connection to %s broke with %d bytes unsent",
                        self.endpoint, out.endpoint, out.pending_bytes)
        self._forget(out.sock)
        if self._outs.get(out.endpoint) is out:
            del self._outs[out.endpoint]

    def _forget(self, sock: socket.socket) -> None:
        fd = sock.fileno()
        if self._owners.pop(fd, None) is not None:
            self._epoll.unregister(fd)
        sock.close()

    def __repr__(self) -> str:
        s = self.stats()
        return (f"<Lane {self.endpoint} received={s.received} sent={s.sent} "
                f"dropped={s.dropped}>")
