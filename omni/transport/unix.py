"""Message sockets over Unix domain sockets, for the RPC between processes of one host.

Why not ZeroMQ's ipc://: a ZeroMQ message crosses ZeroMQ's I/O thread at both ends, four
thread hand-offs per round trip, which on a small machine cost more than the call itself
(a 64-byte round trip between two processes here: blocking pyzmq over ipc:// about 140 µs,
two trio tasks over a Unix stream socket about 90). Here the calling task writes to the
kernel itself and one reader task per connection reads and dispatches, as `trio_zmq.Socket`
does with ``on_message``.

The semantics are the subset RPC uses: a listening socket routes like a ROUTER (each message
arrives as ``[identity, *frames]``, a reply to ``[identity, *frames]`` goes to that connection,
or nowhere once it is gone); a connecting socket is a DEALER with one peer, which it reaches
again whenever the connection breaks (messages queued meanwhile are dropped, as ZeroMQ drops a
broken pipe's: the RPC layer's heartbeats and timeouts report the loss).

Format: a message is its frame count (u32, little-endian), each frame's length (u64), then
the frames' bytes back to back. A peer that breaks the limits (too many frames, a frame over
the size limit) or the format is disconnected. Only processes of this user reach a socket:
it lives in a 0700 folder (`omni.transport.host.ipc_directory`), and the listener also
checks each peer's uid (``SO_PEERCRED``).

Frames under 64 KiB arrive as `bytes`, larger ones as memoryviews of a buffer of their own,
read straight from the kernel. Frames sent are written from the caller's buffers (no copy
for large ones), so, as with ZeroMQ, never mutate a buffer you sent.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import logging
import os
import socket
import struct
from collections import deque
from collections.abc import AsyncIterator, Callable, Generator, Sequence
from typing import Any, Final

import trio

from omni.transport.errors import TransportError
from omni.transport.trio_zmq import background_nursery

__all__ = ["SCHEME", "UnixSocket", "encode", "is_unix", "open_unix_socket", "remove_stale",
           "write_now"]

log = logging.getLogger(__name__)

SCHEME: Final = "unix://"
_LARGE: Final = 64 * 1024  # frames at least this big are sent and received without a copy
_RECV_BUFFER: Final = 256 * 1024
_IOV_MAX: Final = 512  # buffers per sendmsg (Linux allows 1024)
_BURST: Final = 64  # messages a reader dispatches before it yields to other tasks
_COUNT: Final = struct.Struct("<I")
_RECONNECT_S: Final = (0.01, 0.5)  # first and longest wait between connection attempts

Buffer = bytes | bytearray | memoryview


def is_unix(address: str | None) -> bool:
    return address is not None and address.startswith(SCHEME)


def _path(address: str) -> str:
    path = address[len(SCHEME):]
    if not path:
        raise TransportError(f"no path in {address!r}")
    return path


def _as_bytes_view(frame: Buffer) -> memoryview | bytes:
    if type(frame) is bytes:
        return frame
    view = memoryview(frame)
    return view if view.ndim == 1 and view.itemsize == 1 else view.cast("B")


def encode(frames: Sequence[Buffer]) -> list[Buffer]:
    """The buffers that make up the message `frames`: the header and the small frames
    joined, the large frames as they are."""
    if not frames:
        raise ValueError("a message needs at least one frame")
    views = [frame if type(frame) is bytes else _as_bytes_view(frame) for frame in frames]
    lengths = [len(v) for v in views]
    header = _header(len(views)).pack(len(views), *lengths)
    if max(lengths) < _LARGE:
        return [b"".join([header, *views])]
    out: list[Buffer] = []
    small = [header]
    for view, length in zip(views, lengths, strict=True):
        if length < _LARGE:
            small.append(view)
            continue
        out.append(b"".join(small))
        small = []
        out.append(view)
    if small:
        out.append(b"".join(small))
    return out


def write_now(sock: socket.socket, buffers: list[Buffer]) -> list[Buffer]:
    """Write to non-blocking `sock` what the kernel takes of `buffers` now; the rest (empty:
    all written). Raises OSError when the connection broke."""
    try:
        sent = (sock.send(buffers[0]) if len(buffers) == 1
                else sock.sendmsg(buffers[:_IOV_MAX]))
    except (BlockingIOError, InterruptedError):
        return buffers
    for i, buffer in enumerate(buffers):
        size = len(buffer) if type(buffer) is bytes else memoryview(buffer).nbytes
        if sent < size:
            return [memoryview(buffer)[sent:] if sent else buffer, *buffers[i + 1:]]
        sent -= size
    return []


class _Connection:
    """One connected stream: the caller writes directly while nothing waits before it, the
    rest waits in `pending` for the writer; `reader` reads and dispatches."""

    def __init__(self, sock: socket.socket, identity: bytes, capacity: int):
        self.sock = sock
        self.identity = identity
        self.capacity = capacity
        self.pending: deque[tuple[memoryview, bool]] = deque()  # (bytes, ends a message)
        self.queued = 0  # messages not fully written
        self.room = trio.Event()  # set when a full outbox drains
        self.writer_wakeup = trio.Event()
        self.closed = False

    def send(self, frames: Sequence[Buffer]) -> None:
        """Write or queue one message; raises `trio.WouldBlock` when `capacity` messages
        wait already, `TransportError` when the connection is closed."""
        if self.closed:
            raise TransportError("the connection is closed")
        if self.queued >= self.capacity:
            raise trio.WouldBlock
        buffers = encode(frames)
        if not self.pending:
            buffers = self._write(buffers)
            if not buffers:
                return
        for buffer in buffers[:-1]:
            self.pending.append((memoryview(buffer), False))
        self.pending.append((memoryview(buffers[-1]), True))
        self.queued += 1
        self.writer_wakeup.set()

    def _write(self, buffers: list[Buffer]) -> list[Buffer]:
        """Write what the kernel takes now; the rest (empty: all written)."""
        try:
            return write_now(self.sock, buffers)
        except OSError:
            self.close()
            raise TransportError("the connection broke") from None

    async def flush_forever(self) -> None:
        """The writer: write what waits in `pending` whenever the socket takes it."""
        while not self.closed:
            if not self.pending:
                self.writer_wakeup = trio.Event()
                await self.writer_wakeup.wait()
                continue
            try:
                await trio.lowlevel.wait_writable(self.sock)
            except trio.ClosedResourceError:
                return
            while self.pending:
                views = [view for view, _ in itertools.islice(self.pending, _IOV_MAX)]
                try:
                    sent = self.sock.sendmsg(views)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    self.close()
                    return
                while sent:
                    view, ends = self.pending[0]
                    if sent < view.nbytes:
                        self.pending[0] = (view[sent:], ends)
                        break
                    sent -= view.nbytes
                    self.pending.popleft()
                    if ends:
                        self._sent_one()

    def _sent_one(self) -> None:
        self.queued -= 1
        if self.queued < self.capacity and not self.room.is_set():
            self.room.set()

    async def wait_room(self) -> None:
        while self.queued >= self.capacity and not self.closed:
            if self.room.is_set():
                self.room = trio.Event()
            await self.room.wait()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.pending.clear()
        self.queued = 0
        self.room.set()
        self.writer_wakeup.set()
        _close(self.sock)


@functools.lru_cache(maxsize=64)
def _header(count: int) -> struct.Struct:
    """The header of a message of `count` frames: the count, then each frame's length."""
    return struct.Struct(f"<I{count}Q")


class _Parser:
    """The message format without the I/O (one home for both readers: `_Reader` on trio,
    and `omni.transport.lane`'s thread): `message` is a generator that yields a view to
    receive into whenever it needs more bytes, is sent how many arrived (0: end of stream),
    and returns the message's frames, or None at a clean end of stream. Raises `_Broken`."""

    def __init__(self, *, max_frames: int, max_frame_bytes: int):
        self.max_frames = max_frames
        self.max_frame_bytes = max_frame_bytes
        self.buf = bytearray(_RECV_BUFFER)
        self.start = self.end = 0

    def buffered(self) -> bool:
        """Whether bytes of a next message wait in the buffer."""
        return self.start != self.end

    def message(self) -> Generator[memoryview, int, list[Buffer] | None]:
        if self.end - self.start < 4 and not (yield from self._fill(4, eof_ok=True)):
            return None
        (count,) = _COUNT.unpack_from(self.buf, self.start)
        if not 0 < count <= self.max_frames:
            raise _Broken(f"a message of {count} frames (limit {self.max_frames})")
        if self.end - self.start < 4 + 8 * count:
            yield from self._fill(4 + 8 * count)
        lengths = _header(count).unpack_from(self.buf, self.start)[1:]
        self.start += 4 + 8 * count
        for length in lengths:
            if length > self.max_frame_bytes:
                raise _Broken(f"a frame of {length} bytes (limit {self.max_frame_bytes})")
        frames: list[Buffer] = []
        for length in lengths:
            if length < _LARGE:
                if self.end - self.start < length:
                    yield from self._fill(length)
                frames.append(bytes(self.buf[self.start:self.start + length]))
                self.start += length
            else:
                frames.append((yield from self._large(length)))
        return frames

    def _fill(self, need: int, *, eof_ok: bool = False) -> Generator[memoryview, int, bool]:
        """Until `need` bytes are buffered from `start`; False at a clean end of stream."""
        while self.end - self.start < need:
            if len(self.buf) - self.start < need:  # make room at the front, or grow
                data = self.buf[self.start:self.end]
                if len(self.buf) < need:
                    self.buf = bytearray(max(need, _RECV_BUFFER))
                self.buf[:len(data)] = data
                self.start, self.end = 0, len(data)
            received = yield memoryview(self.buf)[self.end:]
            if received == 0:
                if eof_ok and self.end == self.start:
                    return False
                raise _Broken("closed in the middle of a message")
            self.end += received
        return True

    def _large(self, length: int) -> Generator[memoryview, int, memoryview]:
        """A large frame in a buffer of its own: what is buffered, then straight from the
        kernel."""
        frame = bytearray(length)
        view = memoryview(frame)
        have = min(length, self.end - self.start)
        view[:have] = memoryview(self.buf)[self.start:self.start + have]
        self.start += have
        while have < length:
            received = yield view[have:]
            if received == 0:
                raise _Broken("closed in the middle of a message")
            have += received
        return view


class _Reader:
    """Reads messages from a connection and hands each to `deliver` (never raises)."""

    def __init__(self, sock: socket.socket, *, max_frames: int, max_frame_bytes: int):
        self.sock = sock
        self.parser = _Parser(max_frames=max_frames, max_frame_bytes=max_frame_bytes)
        self.drained = False  # the last read was short: it took all there was

    async def run(self, deliver: Callable[[list[Buffer]], None]) -> str:
        """Deliver messages until the peer closes; why the connection ended."""
        delivered = 0
        parser = self.parser
        try:
            while True:
                frames = await self._message()
                if frames is None:
                    return "closed by the peer"
                deliver(frames)
                delivered += 1
                if delivered >= _BURST or not parser.buffered():
                    delivered = 0
                    if parser.buffered():
                        await trio.lowlevel.checkpoint()
        except _Broken as exc:
            return str(exc)

    async def _message(self) -> list[Buffer] | None:
        parsing = self.parser.message()
        try:
            view = parsing.send(None)
            while True:
                view = parsing.send(await self._recv_into(view))
        except StopIteration as done:
            return done.value

    async def _recv_into(self, view: memoryview) -> int:
        """Receive into `view`: the bytes that came, 0 at the end of the stream. After a
        short read the socket is waited on first (a read then would only say EAGAIN)."""
        while True:
            if self.drained:
                try:
                    await trio.lowlevel.wait_readable(self.sock)
                except trio.ClosedResourceError:
                    raise _Broken("closed") from None
            try:
                received = self.sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                self.drained = True
                continue
            except OSError as exc:
                raise _Broken(os.strerror(exc.errno) if exc.errno else str(exc)) from None
            self.drained = 0 < received < len(view)
            return received


class _Broken(Exception):
    """The peer broke the format or the connection."""


class UnixSocket:
    """A message socket over Unix domain sockets (see the module docstring); create it with
    `open_unix_socket`. The same API as `trio_zmq.Socket` with ``on_message``."""

    def __init__(self, *, listening: bool, on_message: Callable[[list[Buffer]], None],
                 send_buffer: int, max_frames: int, max_frame_bytes: int):
        self.listening = listening
        self.endpoint: str | None = None
        self._on_message = on_message
        self._capacity = max(1, send_buffer)
        self._limits = {"max_frames": max_frames, "max_frame_bytes": max_frame_bytes}
        self._connections: dict[bytes, _Connection] = {}
        self._peer: _Connection | None = None  # a connecting socket's current connection
        self._connected = trio.Event()  # a connecting socket's; set while connected
        self._early: list[Sequence[Buffer]] = []  # sent while not connected
        self._identities = itertools.count(1)
        self._closed = False
        self._dropped = 0

    # -- the API -----------------------------------------------------------------------------

    def send_multipart_nowait(self, frames: Sequence[Buffer]) -> None:
        """Write or queue `frames` without waiting. A listening socket routes by the first
        frame (the identity; a message for a connection that is gone is dropped); a
        connecting one queues while it is not connected. Raises `trio.WouldBlock` when the
        outbox is full, `TransportError` once closed."""
        if self._closed:
            raise TransportError(f"{self!r} is closed")
        if self.listening:
            if len(frames) < 2:
                raise ValueError("a routed message needs an identity frame and a message")
            connection = self._connections.get(bytes(frames[0]))
            if connection is None:
                self._dropped += 1
                return
            frames = frames[1:]
        else:
            connection = self._peer
            if connection is None or connection.closed:
                if len(self._early) >= self._capacity:
                    raise trio.WouldBlock
                encode(frames)  # refuse what cannot be sent now, not once connected
                self._early.append(frames)
                return
        try:
            connection.send(frames)
        except TransportError:
            self._dropped += 1  # the connection broke: the peer's loss is reported above us

    async def send_multipart(self, frames: Sequence[Buffer]) -> None:
        """Like `send_multipart_nowait`, waiting while the outbox is full."""
        while True:
            try:
                self.send_multipart_nowait(frames)
            except trio.WouldBlock:
                connection = (self._connections.get(bytes(frames[0])) if self.listening
                              else self._peer)
                if connection is None or connection.closed:
                    await self._connected.wait()
                else:
                    await connection.wait_room()
                continue
            await trio.lowlevel.checkpoint()
            return

    def __repr__(self) -> str:
        kind = "listening" if self.listening else "connecting"
        state = " closed" if self._closed else ""
        count = len(self._connections) if self.listening else int(bool(self._peer))
        return (f"<UnixSocket {kind}{state} {self.endpoint} connections={count} "
                f"dropped={self._dropped}>")

    # -- the tasks ---------------------------------------------------------------------------

    async def _serve(self, listener: socket.socket, nursery: trio.Nursery) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                await trio.lowlevel.wait_readable(listener)
                continue
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("%r: cannot accept: %s", self, exc)
                    await trio.sleep(0.1)
                    continue
                raise
            if not _same_user(sock):
                sock.close()
                continue
            sock.setblocking(False)
            identity = next(self._identities).to_bytes(8, "little")
            connection = self._connections[identity] = _Connection(sock, identity,
                                                                   self._capacity)
            nursery.start_soon(self._run_connection, connection)

    async def _run_connection(self, connection: _Connection) -> None:
        identity = connection.identity

        def deliver(frames: list[Buffer]) -> None:
            if self.listening:
                frames.insert(0, identity)
            try:
                self._on_message(frames)
            except Exception:  # the callback must not raise; never let it end the reader
                log.exception("%r: failed to dispatch a message", self)

        reader = _Reader(connection.sock, **self._limits)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(connection.flush_forever)
                why = await reader.run(deliver)
                log.debug("%r: connection ended: %s", self, why)
                nursery.cancel_scope.cancel()
        finally:
            connection.close()
            if self.listening:
                self._connections.pop(identity, None)

    async def _connect_forever(self, path: str) -> None:
        """Keep one connection to `path`, reaching it again after every break."""
        wait = _RECONNECT_S[0]
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.connect(path)
            except (BlockingIOError, InterruptedError):
                await trio.lowlevel.wait_writable(sock)
                failure = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            except OSError as exc:
                failure = exc.errno or -1
            else:
                failure = 0
            if failure:
                sock.close()
                await trio.sleep(wait)
                wait = min(wait * 2, _RECONNECT_S[1])
                continue
            wait = _RECONNECT_S[0]
            peer = self._peer = _Connection(sock, b"", self._capacity)
            early, self._early = self._early, []
            for frames in early:
                with contextlib.suppress(TransportError, trio.WouldBlock):
                    peer.send(frames)
            self._connected.set()
            try:
                await self._run_connection(self._peer)
            finally:
                self._connected = trio.Event()


def remove_stale(folder: str | os.PathLike[str], pattern: str = "*.sock") -> int:
    """Remove the socket files in `folder` nobody listens on (left by killed processes);
    how many."""
    from pathlib import Path

    removed = 0
    for path in Path(folder).glob(pattern):
        if _stale(str(path)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed += 1
    return removed


def _stale(path: str) -> bool:
    """Whether `path` is a socket file nobody listens on."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    finally:
        probe.close()
    return False


def _close(sock: socket.socket) -> None:
    """Close `sock`, waking the tasks trio has waiting on it first."""
    with contextlib.suppress(OSError, ValueError):
        if sock.fileno() >= 0:
            trio.lowlevel.notify_closing(sock)
    with contextlib.suppress(OSError):
        sock.close()


def _same_user(sock: socket.socket) -> bool:
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:  # no SO_PEERCRED here: the folder's permissions are the check
        return True
    _, uid, _ = struct.unpack("3i", creds)
    return uid == os.getuid()


@contextlib.asynccontextmanager
async def open_unix_socket(*, bind: str | None = None, connect: str | None = None,
                           on_message: Callable[[list[Buffer]], None], send_buffer: int = 64,
                           max_frames: int = 1024 + 2, max_frame_bytes: int = 1 << 26,
                           **_ignored: Any) -> AsyncIterator[UnixSocket]:
    """A `UnixSocket` listening at `bind` or connected to `connect` (``unix://PATH``), with
    its tasks. Options that only mean something to ZeroMQ (high-water marks, socket options)
    are accepted and ignored, so that callers open either kind alike.

    Raises `TransportError` naming the path when it cannot be bound. Connecting never fails:
    the socket keeps trying, queueing what is sent meanwhile. On exit the connections close,
    dropping what was not written, and a listening socket's file is removed.
    """
    if (bind is None) == (connect is None):
        raise ValueError("give bind or connect, not both")
    sock = UnixSocket(listening=bind is not None, on_message=on_message,
                      send_buffer=send_buffer, max_frames=max_frames,
                      max_frame_bytes=max_frame_bytes)
    listener = _listen(bind) if bind is not None else None
    sock.endpoint = bind if bind is not None else connect
    try:
        async with background_nursery() as nursery:
            if listener is not None:
                nursery.start_soon(sock._serve, listener, nursery)
            else:
                nursery.start_soon(sock._connect_forever, _path(connect))  # type: ignore[arg-type]
            yield sock
    finally:
        sock._closed = True
        for connection in [*sock._connections.values(), *([sock._peer] if sock._peer else [])]:
            connection.close()
        if listener is not None:
            _close(listener)
            with contextlib.suppress(OSError):
                os.unlink(_path(bind))  # type: ignore[arg-type]


def _listen(bind: str) -> socket.socket:
    path = _path(bind)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            listener.bind(path)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or not _stale(path):
                raise
            os.unlink(path)  # left by a process that was killed: nobody listens there
            listener.bind(path)
        listener.listen(128)
    except OSError as exc:
        listener.close()
        reason = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise TransportError(f"cannot bind {bind}: {reason}") from None
    listener.setblocking(False)
    return listener
