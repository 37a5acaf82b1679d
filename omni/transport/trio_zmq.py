"""Trio-native ZeroMQ sockets: one owner task per socket, memory channels for everyone else.

pyzmq has no trio integration, and a ZeroMQ socket's FD is *edge-triggered*: it becomes
readable when the socket's state may have changed, and any call on the socket (a send, a
receive, even reading ``EVENTS``) can consume that notification. If two tasks touched one
socket, one could consume the edge the other is parked on, and the other would sleep forever.
So exactly one task, the *owner* (`Socket._own`), ever waits on the ZeroMQ socket. It loops:
receive while ``EVENTS`` says POLLIN and the inbox has room, send while ``EVENTS`` says POLLOUT
and the outbox has messages, and only when neither can progress park until the FD is
readable (readable, also to wait for POLLOUT: that is ZeroMQ's contract).
Other tasks talk to the owner through two bounded trio memory channels (the outbox and the
inbox), which gives backpressure, and wake it through a `_Waker` when it is parked.

One shortcut: a task that sends while nothing is queued or half-sent sends the message itself
(a direct send) instead of queueing it and waking the owner, which would cost a trip through
the scheduler, an eventfd write and read and a re-park: a fifth of a small RPC's round trip.
Why that is safe: every task runs on the trio thread, and between its awaits the owner is
suspended (parked, or at a checkpoint), never inside a ZeroMQ call, so the calls never
interleave; an empty outbox means the message cannot overtake an earlier one; and the edge
the send may have consumed is restored by the rule the owner itself follows: right after the
send the task reads ``EVENTS`` and wakes the owner if ZeroMQ has something for it (POLLIN, or
POLLOUT awaited because ZeroMQ took only part of the message). If ``EVENTS`` says nothing,
ZeroMQ signals the FD afresh for whatever comes next, so the parked owner wakes as before.

Zero-copy sends: frames of `ZERO_COPY_THRESHOLD` (64 KiB) bytes or more go out with
``copy=False``; smaller ones are copied (pyzmq would copy them anyway). A zero-copy frame is
read by ZeroMQ's I/O thread *after* `send_multipart` returns, so **never mutate a buffer you
sent**: pass immutable `bytes`, or a memoryview of memory you will not touch again until
ZeroMQ is done with it, which `send_multipart(..., track=True)` followed by `wait_sent` tells
you. (vLLM once shipped corrupted tensors by reusing an in-flight send buffer.) Received
frames of 64 KiB or more arrive as memoryviews of the received message (no copy; the
receiver owns them).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import trio
import zmq

from omni.transport._waker import _Waker
from omni.transport.errors import TransportError

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_HWM", "ZERO_COPY_THRESHOLD", "Buffer", "Socket", "SocketStats", "Unroutable",
           "background_nursery", "open_socket", "wait_sent"]

ZERO_COPY_THRESHOLD: Final = 64 * 1024  # pyzmq copies smaller frames even with copy=False
DEFAULT_HWM: Final = 1000  # messages ZeroMQ queues per peer and direction
Buffer = bytes | bytearray | memoryview

# Plain ints: pyzmq's flag enums cost microseconds per operation on the hot path.
_POLLIN: Final = int(zmq.POLLIN)
_POLLOUT: Final = int(zmq.POLLOUT)
_EVENTS: Final = int(zmq.EVENTS)
_NOBLOCK: Final = int(zmq.NOBLOCK)
_NOBLOCK_SNDMORE: Final = int(zmq.NOBLOCK | zmq.SNDMORE)
_BURST: Final = 64  # operations the owner performs before it yields to other tasks


@contextlib.asynccontextmanager
async def background_nursery() -> AsyncIterator[trio.Nursery]:
    """A nursery for background tasks that must not outlive the block.

    When the block ends the tasks are cancelled. An exception raised by the block itself comes
    out as is, not wrapped in an `ExceptionGroup` as a plain nursery would wrap it (so that
    users of `open_socket`, `RPCServer`, `RPCClient` see their own errors). The background
    tasks are expected not to raise; if one does, that is a bug and comes out as a group.
    """
    body_error: BaseException | None = None
    async with trio.open_nursery() as nursery:
        try:
            yield nursery
        except BaseException as exc:  # also Cancelled: re-raised below, outside the nursery
            body_error = exc
        finally:
            nursery.cancel_scope.cancel()
    if body_error is not None:
        raise body_error


@dataclass(frozen=True, slots=True)
class SocketStats:
    """A socket's counters: messages and bytes each way, messages waiting in each buffer,
    times the owner woke from parking, and messages ZeroMQ refused (dropped)."""

    messages_sent: int
    messages_received: int
    bytes_sent: int
    bytes_received: int
    outbox: int
    inbox: int
    wakeups: int
    send_errors: int


class Unroutable(TransportError):
    """ZeroMQ refused a tracked message: on a ROUTER_MANDATORY socket, its peer is not
    connected (gone, or reconnecting). Nothing of it went out."""


class _Outgoing:
    """A message queued for the owner. Why a record: a message ZeroMQ refused half-way (EAGAIN
    on a later part) resumes at `next_part`, and a tracked send reports back through `done`."""

    __slots__ = ("copy", "done", "frames", "next_part", "trackers")

    def __init__(self, frames: Sequence[Buffer], copy: bool | None, track: bool):
        if not frames:
            raise ValueError("a message needs at least one frame")
        for frame in frames:  # refuse a non-buffer here, where the caller can see it
            if type(frame) is not bytes:
                memoryview(frame)
        self.frames = frames
        self.copy = copy
        self.next_part = 0
        self.trackers: list[zmq.MessageTracker] | None = [] if track else None
        self.done: trio.Event | None = trio.Event() if track else None


class Socket:
    """A ZeroMQ socket for trio. Create it with `open_socket`, which runs its owner task.

    Any number of tasks may `send_multipart` and `recv_multipart` at once: the calls go
    through bounded memory channels to the one task that owns the ZeroMQ socket (a send
    with nothing queued goes straight to ZeroMQ: see the module docstring). When ZeroMQ
    is at its high-water mark the outbox fills and senders wait (backpressure); when nobody
    receives, the inbox fills and the owner stops reading, and ZeroMQ queues up to its HWM.

    Bulk streams: queue with `send_multipart_nowait` (await `send_multipart` only when it
    raises `trio.WouldBlock`) and drain with `recv_multipart_nowait` after each await; that
    spares a checkpoint per message.

    With `on_message`, received messages are not queued: the owner calls
    ``on_message(frames)`` for each, synchronously (one hop less for RPC dispatch). The
    callback must not block or raise; it may queue replies with `send_multipart_nowait`.
    """

    def __init__(self, zsock: zmq.Socket[Any], *, send_buffer: int = 64,
                 recv_buffer: int = 64,
                 on_message: Callable[[list[Buffer]], None] | None = None,
                 use_epoll: bool | None = None):
        self._zsock = zsock
        self._waker = _Waker(zsock.FD, use_epoll=use_epoll)
        self._kind = zmq.SocketType(zsock.type).name
        self.endpoint: str | None = None
        self._out_tx, self._out_rx = trio.open_memory_channel[_Outgoing](send_buffer)
        self._in_tx, self._in_rx = trio.open_memory_channel[list[Buffer]](recv_buffer)
        self._on_message = on_message
        self._queued = 0  # messages in the outbox: checked before receive_nowait (no raise)
        self._current: _Outgoing | None = None  # taken from the outbox, not yet fully sent
        self._held: list[Buffer] | None = None  # received while the inbox was full
        self._closed = False
        self._error: BaseException | None = None
        self._sent = self._received = self._bytes_sent = self._bytes_received = 0
        self._wakeups = self._send_errors = 0
        self._streaming = False  # the last message received was bulk (see `_own`)
        self._dispatching = False  # the owner is in `on_message`: it reads EVENTS next anyway

    @property
    def zmq_socket(self) -> zmq.Socket[Any]:
        """The underlying ZeroMQ socket: for settings and security bookkeeping only (sending
        or receiving on it directly would break the owner's protocol)."""
        return self._zsock

    # -- the API for any task ----------------------------------------------------------------

    async def send_multipart(self, frames: Sequence[Buffer], *, copy: bool | None = None,
                             track: bool = False) -> zmq.MessageTracker | None:
        """Queue one multipart message; waits only while the outbox is full.

        `copy=None` copies frames under `ZERO_COPY_THRESHOLD` and sends larger ones zero-copy;
        True or False forces one way for every frame. The frames must not be mutated until
        ZeroMQ is done with them (see the module docstring). With `track=True`, waits until
        the owner has handed the message to ZeroMQ and returns a `zmq.MessageTracker` that is
        done once ZeroMQ has released every zero-copy frame (await it with `wait_sent`).

        Raises `TransportError` if the socket is closed.
        """
        item = _Outgoing(frames, copy, track)
        if self._send_now(item):
            await trio.lowlevel.checkpoint()
        else:
            await self._queue(item)
        if item.done is None:
            return None
        await item.done.wait()
        if item.next_part < len(frames):  # it never went out
            raise self._closed_error() if self._closed else Unroutable(
                f"{self!r}: ZeroMQ refused the message (its peer is not connected)")
        return zmq.MessageTracker(*item.trackers) if item.trackers else zmq.MessageTracker()

    async def _queue(self, item: _Outgoing) -> None:
        """Put `item` in the outbox for the owner, waiting for room; always a checkpoint."""
        try:
            self._out_tx.send_nowait(item)
        except trio.WouldBlock:  # backpressure: wait for room in the outbox
            try:
                await self._out_tx.send(item)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                raise self._closed_error() from None
            self._queued += 1
            self._waker.poke()
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise self._closed_error() from None
        else:
            self._queued += 1
            self._waker.poke()  # before our checkpoint, so that the owner sends during it
            await trio.lowlevel.checkpoint()

    def send_multipart_nowait(self, frames: Sequence[Buffer], *,
                              copy: bool | None = None) -> None:
        """Send or queue a message without waiting (for callbacks, and where awaiting is
        impossible, e.g. while cancelled). Raises `trio.WouldBlock` if the outbox is full and
        `TransportError` if the socket is closed."""
        item = _Outgoing(frames, copy, False)
        if self._send_now(item):
            return
        try:
            self._out_tx.send_nowait(item)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise self._closed_error() from None
        self._queued += 1
        self._waker.poke()

    def _send_now(self, item: _Outgoing) -> bool:
        """The direct send (see the module docstring): hand `item` to ZeroMQ from the calling
        task if nothing is queued or half-sent before it. False: queue it instead.

        What ZeroMQ does not take at once (EAGAIN at its HWM) stays with the owner as the
        current message, so the order holds and the owner finishes it on POLLOUT.
        """
        if self._queued or self._current is not None or self._closed:
            return False
        self._current = item
        self._send_current()
        if self._dispatching:  # in the owner's callback: the owner reads EVENTS next
            return True
        try:
            events = self._zsock.getsockopt(_EVENTS)
        except zmq.ZMQError:  # e.g. the context is terminating: the owner finds out too
            events = _POLLIN
        if events & _POLLIN or self._current is not None:
            self._waker.poke()
        return True

    async def recv_multipart(self) -> list[Buffer]:
        """The next message: frames under 64 KiB as `bytes`, larger ones as memoryviews.

        Raises `TransportError` once the socket is closed and the inbox drained, and at once
        if messages go to an `on_message` callback instead.
        """
        if self._on_message is not None:
            raise TransportError(f"{self!r} delivers messages to its on_message callback")
        try:
            frames = await self._in_rx.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise self._closed_error() from None
        if self._held is not None:
            self._waker.poke()  # the owner holds a message for the room just made
        return frames

    def recv_multipart_nowait(self) -> list[Buffer]:
        """The next message if one is waiting in the inbox (a bulk consumer drains the inbox
        this way after each `recv_multipart`, without a checkpoint per message). Raises
        `trio.WouldBlock` if the inbox is empty, `TransportError` if the socket is closed."""
        try:
            frames = self._in_rx.receive_nowait()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise self._closed_error() from None
        if self._held is not None:
            self._waker.poke()
        return frames

    async def __aiter__(self) -> AsyncIterator[list[Buffer]]:
        """Messages until the socket closes."""
        while True:
            try:
                frames = await self.recv_multipart()
            except TransportError:
                return
            yield frames

    def stats(self) -> SocketStats:
        """Counters of traffic and of messages waiting in the outbox and inbox."""
        return SocketStats(self._sent, self._received, self._bytes_sent, self._bytes_received,
                           self._out_rx.statistics().current_buffer_used
                           + (self._current is not None),
                           self._in_rx.statistics().current_buffer_used
                           + (self._held is not None),
                           self._wakeups, self._send_errors)

    def __repr__(self) -> str:
        s = self.stats()
        state = " closed" if self._closed else ""
        return (f"<Socket {self._kind}{state} {self.endpoint} sent={s.messages_sent} "
                f"received={s.messages_received} outbox={s.outbox} inbox={s.inbox}>")

    def _closed_error(self) -> TransportError:
        if self._error is not None:
            return TransportError(f"{self!r} failed: {self._error!r}")
        return TransportError(f"{self!r} is closed")

    # -- the owner task: the only one that waits on the ZeroMQ socket ------------------------

    async def _own(self) -> None:
        """Move messages between ZeroMQ and the channels until cancelled.

        Invariant: the owner parks only right after reading ``EVENTS`` and finding nothing it
        can act on, with no await in between (see the module docstring).
        """
        getsockopt, park = self._zsock.getsockopt, self._waker.park
        since_checkpoint = 0
        try:
            while True:
                if self._held is not None:
                    self._deliver_held()
                events = getsockopt(_EVENTS)
                progressed = False
                if events & _POLLIN and self._held is None:
                    self._receive_one()
                    progressed = True
                if events & _POLLOUT and (self._current is not None or self._queued > 0):
                    self._send_current()
                    progressed = True
                if not progressed and self._streaming:
                    # Bulk frames come in streams: yield once (the consumer runs, the next
                    # frame may land) and look again before paying for a park and a wake-up.
                    self._streaming = False
                    since_checkpoint = 0
                    await trio.lowlevel.checkpoint()
                elif not progressed:  # parked right after reading EVENTS: the invariant
                    since_checkpoint = 0
                    await park()
                    self._wakeups += 1
                elif (since_checkpoint := since_checkpoint + 1) >= _BURST:
                    since_checkpoint = 0  # busy both ways: let the other tasks run
                    await trio.lowlevel.checkpoint()
        except zmq.ZMQError as exc:  # e.g. the context was terminated under us
            self._error = exc
        finally:
            self._closed = True
            self._release_tracked()
            self._out_rx.close()
            self._in_tx.close()
            self._waker.close()

    def _release_tracked(self) -> None:
        """Closing: wake the senders waiting for tracked messages that will never go out."""
        pending = [self._current] if self._current is not None else []
        with contextlib.suppress(trio.WouldBlock):
            while True:
                pending.append(self._out_rx.receive_nowait())
        for item in pending:
            if item.done is not None:
                item.done.set()

    def _receive_one(self) -> None:
        """Receive one message (ZeroMQ said POLLIN) and deliver it."""
        recv, frames, more, size = self._zsock.recv, [], True, 0
        while more:  # after the first part the others are there: delivery is atomic
            part = recv(_NOBLOCK, copy=False)
            n = len(part)
            frames.append(part.bytes if n < ZERO_COPY_THRESHOLD else part.buffer)
            size += n
            more = part.more
        self._received += 1
        self._bytes_received += size
        self._streaming = size >= ZERO_COPY_THRESHOLD
        if self._on_message is not None:
            self._dispatching = True
            try:
                self._on_message(frames)
            finally:
                self._dispatching = False
            return
        try:
            self._in_tx.send_nowait(frames)
        except trio.WouldBlock:
            self._held = frames

    def _deliver_held(self) -> None:
        """Move the held message into the inbox if it has room now."""
        try:
            self._in_tx.send_nowait(self._held)  # type: ignore[arg-type]
        except trio.WouldBlock:
            return
        self._held = None

    def _send_current(self) -> None:
        """Send the current (else the next queued) message's remaining parts; keep it as
        current if ZeroMQ says EAGAIN."""
        item = self._current
        if item is None:
            try:
                item = self._current = self._out_rx.receive_nowait()
            except trio.WouldBlock:  # its sender has not counted it yet
                return
            self._queued -= 1
        send, frames, last = self._zsock.send, item.frames, len(item.frames) - 1
        track = item.trackers is not None
        while item.next_part <= last:
            i = item.next_part
            frame = frames[i]
            size = len(frame) if type(frame) is bytes else memoryview(frame).nbytes
            copy = item.copy if item.copy is not None else size < ZERO_COPY_THRESHOLD
            try:
                tracker = send(frame, _NOBLOCK if i == last else _NOBLOCK_SNDMORE,
                               copy=copy, track=track and not copy)
            except zmq.Again:  # at the HWM (only ever on a first part, in practice)
                return
            except zmq.ZMQError as exc:  # e.g. EHOSTUNREACH with ROUTER_MANDATORY: drop it
                if item.done is None:  # a tracked send's caller hears of it (TransportError)
                    log.warning("%r: dropped a message: %s", self, exc)
                self._send_errors += 1
                self._current = None
                if item.done is not None:
                    item.done.set()
                return
            if item.trackers is not None and isinstance(tracker, zmq.MessageTracker):
                item.trackers.append(tracker)
            item.next_part += 1
            self._bytes_sent += size
        self._current = None
        self._sent += 1
        if item.done is not None:
            item.done.set()


async def wait_sent(tracker: zmq.MessageTracker, *, poll: float = 1e-4,
                    max_poll: float = 0.01) -> None:
    """Wait until ZeroMQ has released every zero-copy frame `tracker` follows (the buffers
    may be reused after that). Polls, backing off from `poll` to `max_poll` seconds."""
    while not tracker.done:
        await trio.sleep(poll)
        poll = min(poll * 2, max_poll)


def _configure(zsock: zmq.Socket[Any], *, sndhwm: int, rcvhwm: int, max_msg_size: int | None,
               options: dict[int, Any] | None) -> None:
    zsock.setsockopt(zmq.LINGER, 0)  # closing never blocks on unsent messages
    zsock.setsockopt(zmq.SNDHWM, sndhwm)
    zsock.setsockopt(zmq.RCVHWM, rcvhwm)
    if max_msg_size is not None:  # a peer sending a larger frame is disconnected by ZeroMQ
        zsock.setsockopt(zmq.MAXMSGSIZE, max_msg_size)
    for option, value in (options or {}).items():
        zsock.setsockopt(option, value)


def _attach(zsock: zmq.Socket[Any], bind: str | None, connect: str | None) -> str | None:
    """Bind or connect; the endpoint actually bound (``*`` ports resolved) or connected."""
    address = bind if bind is not None else connect
    try:
        if bind is not None:
            zsock.bind(bind)
            return zsock.getsockopt_string(zmq.LAST_ENDPOINT)
        if connect is not None:
            zsock.connect(connect)
        return connect
    except zmq.ZMQError as exc:
        verb = "bind" if bind is not None else "connect"
        reason = "address already in use" if exc.errno == zmq.EADDRINUSE else exc.strerror
        raise TransportError(f"cannot {verb} {address}: {reason}") from exc


@contextlib.asynccontextmanager
async def open_socket(ctx: zmq.Context[Any] | None, socket_type: int, *,
                      bind: str | None = None, connect: str | None = None,
                      sndhwm: int = DEFAULT_HWM, rcvhwm: int = DEFAULT_HWM,
                      send_buffer: int = 64, recv_buffer: int = 64,
                      max_msg_size: int | None = None,
                      options: dict[int, Any] | None = None,
                      on_message: Callable[[list[Buffer]], None] | None = None,
                      use_epoll: bool | None = None) -> AsyncIterator[Socket]:
    """A `Socket` of `socket_type` (``zmq.ROUTER``, ``zmq.DEALER`` ...) with its owner task.

    Args:
        ctx: the shared ZeroMQ context (``None``: ``zmq.Context.instance()``).
        bind / connect: at most one address; ``tcp://127.0.0.1:*`` binds an ephemeral port,
            and `Socket.endpoint` is the address actually bound.
        sndhwm / rcvhwm: ZeroMQ's high-water marks, in messages.
        send_buffer / recv_buffer: the outbox and inbox sizes, in messages.
        max_msg_size: ZeroMQ's MAXMSGSIZE, the largest frame accepted from a peer.
        options: further ``setsockopt`` options, applied before bind/connect.
        on_message: deliver received messages to this callback instead of the inbox (see
            `Socket`).
        use_epoll: how a parked owner is woken (see `_Waker`); ``None`` picks the fastest.

    Raises `TransportError` naming the address if it cannot be bound or connected. On exit
    the owner is cancelled and the socket closed at once (``LINGER=0``): messages not yet
    transmitted are dropped.
    """
    if bind is not None and connect is not None:
        raise ValueError("give bind or connect, not both")
    zsock = (ctx if ctx is not None else zmq.Context.instance()).socket(socket_type)
    try:
        _configure(zsock, sndhwm=sndhwm, rcvhwm=rcvhwm, max_msg_size=max_msg_size,
                   options=options)
        endpoint = _attach(zsock, bind, connect)
        sock = Socket(zsock, send_buffer=send_buffer, recv_buffer=recv_buffer,
                      on_message=on_message, use_epoll=use_epoll)
        sock.endpoint = endpoint
        async with background_nursery() as nursery:
            nursery.start_soon(sock._own)
            yield sock
    finally:
        zsock.close(linger=0)
