"""The RPC client: calls multiplexed on one DEALER socket, with timeouts, cancellation and
heartbeats (see `omni.transport.rpc`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import trio
import zmq

from omni._parking import Parked
from omni.transport._rpc_base import (
    _GRACE,
    Reply,
    RPCClientStats,
    _Service,
)
from omni.transport.data_channel import DataClient, DataPlane, is_bulk
from omni.transport.errors import PeerGone, RPCError, RPCTimeout, TransportError, WireError
from omni.transport.trio_zmq import DEFAULT_HWM, Buffer
from omni.transport.wire import (
    Cancel,
    Error,
    Heartbeat,
    Request,
    Response,
    WireLimits,
)

__all__ = ["RPCClient"]


class _Call(Parked):
    """A call in flight. Why a record: the owner's callback (a reply), the heartbeat task
    (peer gone) or the timer task (its deadline passed: `timed_out`) resolves it while the
    caller waits; the first resolution wins."""

    __slots__ = ("deadline", "error", "payload", "response", "timed_out")

    def __init__(self, deadline: float) -> None:
        super().__init__()
        self.deadline = deadline
        self.timed_out = False
        self.response: Response | Error | None = None
        self.payload: list[Buffer] = []
        self.error: BaseException | None = None


class RPCClient(_Service):
    """A DEALER that multiplexes concurrent calls to one server, with heartbeats.

    >>> async with RPCClient(server.endpoint) as client:
    ...     total = await client.call("add", AddArgs(1, 2), timeout=5)

    Args:
        endpoint: the server's address.
        ctx: the shared ZeroMQ context (``None``: the process-wide instance).
        heartbeat_interval: seconds between pings, which go on a second connection to
            the server (no large message ahead of them); ``None`` disables heartbeats
            and opens no second connection.
        missed_heartbeats: intervals without any message from the server before it is
            declared gone (in-flight calls fail with `PeerGone`).
        timeout: the default per-call timeout in seconds (``None``: no limit).
        limits: the wire size limits.
        options: further socket options, e.g. `Credentials.client_options()` for CURVE.
        data_plane: open a data channel to the server for large messages (a TCP endpoint
            only; `Credentials.data_plane()`); until it is open they go on this socket.
    """

    def __init__(self, endpoint: str, *, ctx: zmq.Context[Any] | None = None,
                 heartbeat_interval: float | None = 1.0, missed_heartbeats: int = 3,
                 timeout: float | None = None, limits: WireLimits | None = None,
                 sndhwm: int = DEFAULT_HWM, rcvhwm: int = DEFAULT_HWM,
                 send_buffer: int = 1024, options: dict[int, Any] | None = None,
                 data_plane: DataPlane | None = None):
        super().__init__(limits, ctx)
        self._data = (DataClient(data_plane, ctx, self._codec.limits, self._guarded_on_message)
                      if data_plane is not None and endpoint.startswith("tcp://") else None)
        self.endpoint = endpoint
        self.timeout = timeout
        self._interval = heartbeat_interval
        self._missed = missed_heartbeats
        self._socket_args = {"sndhwm": sndhwm, "rcvhwm": rcvhwm, "send_buffer": send_buffer,
                             "options": options}
        self._pending: dict[int, _Call] = {}
        self._timer = trio.CancelScope()  # its deadline: when the timer task looks next
        self._next_id = 0
        self._last_seen = 0.0
        self._unanswered = 0  # pings sent since the server was last heard from
        self._alive = True
        self._calls = self._completed = self._failed = self._timeouts = 0
        self._cancelled = self._gone = self._late = self._pings = self._notices = 0

    async def __aenter__(self) -> RPCClient:
        await self._start(zmq.DEALER, connect=self.endpoint, **self._socket_args,
                          heartbeats=self._interval is not None)
        self._last_seen, self._alive = trio.current_time(), True
        assert self._nursery is not None
        self._timer = trio.CancelScope()
        self._nursery.start_soon(self._expire_calls)
        if self._interval is not None:
            self._nursery.start_soon(self._heartbeat)
        if self._data is not None:
            self._nursery.start_soon(self._data.run, self.call, self.endpoint)
        return self

    @property
    def data_mode(self) -> str:
        """The open data channel's mode (``encrypted`` or ``plaintext``); "" while none is."""
        return self._data.mode if self._data is not None and self._data.ready else ""

    @property
    def peer_alive(self) -> bool:
        """False from the moment the server missed its heartbeats until it answers again."""
        return self._alive

    async def call(self, method: str, body: Any = None, *, payload: Sequence[Buffer] = (),
                   timeout: float | None = None, result_type: Any = Any) -> Any:
        """Call `method` with `body` (a msgspec Struct or msgpack-able value) and optional
        payload frames; the reply's body decoded as `result_type`. Payload frames the server
        sends back are discarded (see `call_with_payload`).

        Raises `RPCError` if the handler raised or the method is unknown, `RPCTimeout` after
        `timeout` seconds (default: the client's), `PeerGone` if the server stops answering
        heartbeats, `WireError` if the request is too large or the reply does not decode,
        `TransportError` if the client is not running, and ValueError (before sending) for a
        negative or NaN timeout. Cancelling the caller, or a timeout, tells the server to
        cancel the handler.
        """
        call = await self._call(method, body, payload, timeout)
        return self._codec.decode_body(call.response.body, result_type)  # type: ignore[union-attr]

    async def call_with_payload(self, method: str, body: Any = None, *,
                                payload: Sequence[Buffer] = (), timeout: float | None = None,
                                result_type: Any = Any) -> Reply:
        """Like `call`, but returns a `Reply` with the body and the payload frames sent back
        (frames of 64 KiB or more as memoryviews, received without a copy)."""
        call = await self._call(method, body, payload, timeout)
        body = self._codec.decode_body(call.response.body, result_type)  # type: ignore[union-attr]
        return Reply(body, call.payload)

    async def notify(self, method: str, body: Any = None, *,
                     payload: Sequence[Buffer] = ()) -> None:
        """Send `method` with `body` and payload frames as a notice: the server runs the
        handler and answers nothing, so nothing here learns whether or how it ran. Returns
        once the message is queued (on the data channel when it is large).

        Raises `PeerGone` if the server has stopped answering heartbeats, `WireError` if the
        message is too large, `TransportError` if the client is not running.
        """
        sock = self._require_socket()
        if not self._alive:
            raise PeerGone(self.endpoint, trio.current_time() - self._last_seen)
        codec = self._codec
        if payload:
            codec.check_payload(payload)
        head = codec.encode(Request(0, method, codec.encode_body(body)))
        self._notices += 1
        if self._data is not None and self._data.ready and payload and is_bulk(payload):
            await self._data.send(head, payload)
            return
        frames = [head, *payload]
        try:
            sock.send_multipart_nowait(frames)
        except trio.WouldBlock:
            await sock.send_multipart(frames)

    async def _call(self, method: str, body: Any, payload: Sequence[Buffer],
                    timeout: float | None) -> _Call:
        """Send the request and wait; the call once it has a `Response`, else raise."""
        sock = self._require_socket()
        if not self._alive:
            raise PeerGone(self.endpoint, trio.current_time() - self._last_seen)
        timeout = self.timeout if timeout is None else timeout
        if timeout is not None and not timeout >= 0:  # NaN too
            raise ValueError(f"timeout must be None or seconds >= 0, got {timeout!r}")
        codec = self._codec
        if payload:
            codec.check_payload(payload)
        call_id = self._next_id = self._next_id + 1
        frames = [codec.encode(Request(call_id, method, codec.encode_body(body))), *payload]
        deadline = math.inf if timeout is None else trio.current_time() + timeout
        call = self._pending[call_id] = _Call(deadline)
        if deadline < self._timer.deadline:  # sooner than the timer task looks next
            self._timer.deadline = deadline
        self._calls += 1
        queued = False
        try:
            if self._data is not None and self._data.ready and payload and is_bulk(payload):
                await self._data.send(frames[0], payload)
            else:
                try:  # no checkpoint on the fast path: waiting for the reply is the checkpoint
                    sock.send_multipart_nowait(frames)
                except trio.WouldBlock:
                    await sock.send_multipart(frames)
            queued = True
            await call.wait()
        finally:
            del self._pending[call_id]
            if queued and (call.timed_out or not call.done):  # tell the server
                self._cancelled += 1
                self._send_nowait([codec.encode(Cancel(call_id))])
        response = call.response
        if type(response) is Response:
            self._completed += 1
            return call
        if call.error is not None:
            raise call.error
        if response is None:
            self._timeouts += 1
            raise RPCTimeout(method, math.inf if timeout is None else timeout)
        self._failed += 1
        raise RPCError(method, response.type, response.message, response.traceback)

    # -- in the socket's owner task ----------------------------------------------------------

    def _on_message(self, frames: list[Buffer]) -> None:
        if not self._codec.payload_fits(frames[1:]):
            self._dropped += 1  # a reply no honest server sends: its call times out
            return
        try:
            msg = self._codec.decode(frames[0])
        except WireError:
            self._dropped += 1
            return
        self._last_seen = trio.current_time()
        self._unanswered = 0
        self._alive = True
        if type(msg) is Response or type(msg) is Error:
            call = self._pending.get(msg.id)
            if call is None or call.done:
                self._late += 1  # its caller gave up already
                return
            call.response, call.payload = msg, frames[1:]
            call.resolve()
        elif type(msg) is not Heartbeat:
            self._dropped += 1

    # -- timeouts ----------------------------------------------------------------------------

    async def _expire_calls(self) -> None:
        """Time out the calls past their deadline. Why one task for all calls: a cancel scope
        with a deadline per call costs more than a tenth of a small call's round trip.

        The task sleeps until the `_timer` scope's deadline, which a call lowers when it is
        due sooner; waking, it resolves the calls due and sleeps until the next one. Calls
        due later than the timer's deadline leave it alone, so a run of calls with the same
        timeout costs one wake-up per timeout, not one per call.
        """
        while True:
            with self._timer:
                await trio.sleep_forever()
            now, earliest = trio.current_time(), math.inf
            for call in self._pending.values():
                if call.done:
                    continue
                if call.deadline <= now:
                    call.timed_out = True
                    call.resolve()
                else:
                    earliest = min(earliest, call.deadline)
            self._timer = trio.CancelScope(deadline=earliest)

    # -- heartbeats --------------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        """Ping every interval; declare the peer gone once it has been silent for
        `missed_heartbeats` intervals *and* left as many pings unanswered. Any message from
        the server is a word from it: a reply as much as a pong.

        Why both: when this process stalls (a long copy on the event loop, a loaded machine)
        it sends no pings, so the silence is its own; counting unanswered pings keeps a stall
        here from being taken for a dead peer, while a dead peer is still noticed within
        `missed_heartbeats` intervals of its last word.

        Why pings on a connection of their own (`_beat_sock`): a connection delivers in
        order, so a ping sent behind a large message reaches the server only after it, and
        the pong only after the server has received it whole. A frame of the largest size
        over CURVE is encrypted and decrypted in ZeroMQ's I/O threads and on a loaded machine
        takes longer than the window; a slow link does the same to a plaintext one. The pings
        then waited behind the frame, and a server busy receiving it was declared gone. On
        their own connection, which carries nothing else, no frame is ahead of them either
        way (a large reply neither): a pong is late only when the server's process, or its
        I/O thread, is.
        """
        assert self._interval is not None
        interval, next_ping, seq = self._interval, trio.current_time(), 0
        while True:
            now = trio.current_time()
            if now >= next_ping:
                seq += 1
                if self._send_beat(self._codec.encode(Heartbeat(seq))):
                    self._pings += 1
                    self._unanswered += 1
                next_ping = now + interval
            deadline = self._last_seen + self._missed * interval
            if self._alive and now >= deadline and self._unanswered >= self._missed:
                # After the event loop stalled, a pong may already wait on the socket: give
                # the owner a moment to read it before declaring the peer gone.
                await trio.sleep(_GRACE)
                if self._unanswered >= self._missed and \
                        trio.current_time() >= self._last_seen + self._missed * interval:
                    self._declare_gone(trio.current_time())
                continue
            wake = next_ping if not self._alive or now >= deadline else min(next_ping, deadline)
            await trio.sleep_until(wake)

    def _send_beat(self, ping: bytes) -> bool:
        """Queue `ping` on the heartbeat connection; False (dropped) if its outbox is full."""
        assert self._beat_sock is not None
        try:
            self._beat_sock.send_multipart_nowait([ping])
        except (trio.WouldBlock, TransportError):
            return False
        return True

    def _declare_gone(self, now: float) -> None:
        self._alive = False
        self._gone += 1
        silent_for = now - self._last_seen
        self._fail_pending(lambda: PeerGone(self.endpoint, silent_for))

    def _fail_pending(self, make_error: Callable[[], TransportError]) -> None:
        """Fail every call in flight, each with its own exception object."""
        for call in self._pending.values():
            if not call.done:
                call.error = make_error()
                call.resolve()

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        if self._data is not None and self._data.ready:  # the server may forget it now
            self._next_id += 1
            self._send_nowait([self._codec.encode(Request(self._next_id, "_data.close"))])
        try:
            return await super().__aexit__(*exc_info)
        finally:  # calls still waiting in other tasks would never get a reply
            self._fail_pending(lambda: TransportError(
                f"{self!r} closed with the call in flight"))

    def stats(self) -> RPCClientStats:
        """Counters of calls by outcome, heartbeats, dropped messages, and the codec's."""
        return RPCClientStats(self._calls, len(self._pending), self._completed, self._failed,
                              self._timeouts, self._cancelled, self._gone, self._late,
                              self._dropped, self._pings, self._alive, self._codec.stats(),
                              None if self._data is None else self._data.stats(),
                              self._notices)

    def __repr__(self) -> str:
        state = ("alive" if self._alive else "gone") if self._stack else "stopped"
        return (f"<RPCClient {self.endpoint} {state} in_flight={len(self._pending)} "
                f"calls={self._calls} timeouts={self._timeouts} failed={self._failed}>")
