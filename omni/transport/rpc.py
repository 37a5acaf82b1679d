"""ROUTER/DEALER RPC for trio: `RPCServer` runs async handlers, `RPCClient` calls them.

A call is one multipart message: a control frame (`wire.Request`) and optional payload frames
of raw bytes; the reply is a `wire.Response` or `wire.Error`, with payload frames too. Each
side dispatches replies inside its socket's owner task (`on_message`: synchronous, no extra
hop), so one DEALER socket carries any number of concurrent calls, told apart by request id.

Failure model: a handler that raises fails only its call (`RPCError` with the remote type name
and message); a malformed message is counted and dropped; a caller that gives up (cancelled
or timed out) sends `wire.Cancel` and the server cancels that handler; a server that stops
answering heartbeats is declared gone after `missed_heartbeats` intervals and every call in
flight fails with `PeerGone`.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import typing
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio
import zmq

from omni.transport.errors import PeerGone, RPCError, RPCTimeout, TransportError, WireError
from omni.transport.trio_zmq import DEFAULT_HWM, Buffer, Socket, background_nursery, open_socket
from omni.transport.wire import (
    Cancel,
    Codec,
    Error,
    Heartbeat,
    Request,
    Response,
    WireLimits,
    WireStats,
)

__all__ = ["Handler", "RPCClient", "RPCClientStats", "RPCServer", "RPCServerStats", "Reply"]

log = logging.getLogger(__name__)

Handler = Callable[..., Awaitable[Any]]
_MAX_ERROR_CHARS = 16_384  # a remote error's message is truncated to this
_GRACE = 0.005  # seconds to read replies already received before declaring a peer gone


@dataclass(frozen=True, slots=True)
class Reply:
    """A body with payload frames: what a handler returns to send frames back, and what
    `RPCClient.call_with_payload` returns."""

    body: Any = None
    payload: Sequence[Buffer] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Route:
    """A registered method. Why a record: the body type is resolved once, at registration."""

    handler: Handler
    body_type: Any
    with_payload: bool


@dataclass(frozen=True, slots=True)
class RPCServerStats:
    """A server's counters: requests by outcome (`cancelled`: by the caller's Cancel;
    `busy`: refused over `max_in_flight`), `dropped` messages (malformed, unexpected or
    duplicate); `wire` holds the codec's counters (rejected messages by reason)."""

    requests: int
    in_flight: int
    completed: int
    failed: int
    cancelled: int
    unknown_method: int
    busy: int
    dropped: int
    heartbeats: int
    wire: WireStats


@dataclass(frozen=True, slots=True)
class RPCClientStats:
    """A client's counters: `cancelled` counts the Cancel messages sent (callers cancelled
    or timed out), `late_replies` replies that came after their caller gave up, `dropped`
    messages that did not decode; `wire` holds the codec's counters."""

    calls: int
    in_flight: int
    completed: int
    failed: int
    timeouts: int
    cancelled: int
    peer_gone: int
    late_replies: int
    dropped: int
    heartbeats_sent: int
    peer_alive: bool
    wire: WireStats


def _infer_body_type(method: str, handler: Handler) -> Any:
    """The annotation of the handler's first parameter, or ``Any`` if it has none."""
    try:
        params = list(inspect.signature(handler).parameters)
        hints = typing.get_type_hints(handler)
    except (TypeError, ValueError):  # not introspectable (a builtin, a callable object ...)
        return Any
    except NameError as exc:  # e.g. a class defined in a function, under postponed annotations
        raise ValueError(f"method '{method}': cannot resolve the handler's annotations "
                         f"({exc}); pass body_type=") from None
    return hints.get(params[0], Any) if params else Any


class _Service:
    """What server and client share: a socket, a nursery, a codec, and `async with`."""

    def __init__(self, limits: WireLimits | None, ctx: zmq.Context[Any] | None):
        self._codec = Codec(limits)
        self._ctx = ctx
        self._sock: Socket | None = None
        self._nursery: trio.Nursery | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._dropped = 0

    async def _start(self, socket_type: int, **socket_args: Any) -> None:
        if self._stack is not None:
            raise TransportError(f"{self!r} is already running")
        stack = contextlib.AsyncExitStack()
        await stack.__aenter__()
        try:
            limits = self._codec.limits
            self._sock = await stack.enter_async_context(open_socket(
                self._ctx, socket_type, on_message=self._guarded_on_message,
                max_msg_size=max(limits.max_payload_bytes, limits.max_control_bytes),
                **socket_args))
            self._nursery = await stack.enter_async_context(background_nursery())
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        stack, self._stack = self._stack, None
        self._nursery = None
        assert stack is not None
        return await stack.__aexit__(*exc_info)

    def _guarded_on_message(self, frames: list[Buffer]) -> None:
        """The owner task calls this for each message: it must never raise."""
        try:
            self._on_message(frames)
        except Exception:  # a bug here must not stop the socket; count it and log it
            self._dropped += 1
            log.exception("%r: failed to dispatch a message", self)

    def _on_message(self, frames: list[Buffer]) -> None:
        raise NotImplementedError

    def _send_nowait(self, frames: list[Buffer]) -> bool:
        """Queue a message from the owner's callback; False (dropped) if the outbox is full."""
        try:
            self._require_socket().send_multipart_nowait(frames)
        except (trio.WouldBlock, TransportError):
            return False
        return True

    def _require_socket(self) -> Socket:
        if self._sock is None or self._stack is None:
            raise TransportError(f"{self!r} is not running (use `async with`)")
        return self._sock


class RPCServer(_Service):
    """A ROUTER that runs each request's handler in its own task.

    >>> server = RPCServer()
    >>> server.register("add", add)            # async def add(body: AddArgs) -> int
    >>> async with server:
    ...     print(server.endpoint)              # tcp://127.0.0.1:PORT

    Args:
        bind: the address to bind; ``tcp://127.0.0.1:*`` picks a free port.
        ctx: the shared ZeroMQ context (``None``: the process-wide instance).
        limits: the wire size limits.
        max_in_flight: handlers running at once; more requests are refused with an error
            (``ServerBusy``) instead of being queued without bound.
    """

    def __init__(self, bind: str = "tcp://127.0.0.1:*", *, ctx: zmq.Context[Any] | None = None,
                 limits: WireLimits | None = None, max_in_flight: int = 1024,
                 sndhwm: int = DEFAULT_HWM, rcvhwm: int = DEFAULT_HWM):
        super().__init__(limits, ctx)
        self._bind = bind
        self._hwm = (sndhwm, rcvhwm)
        self._max_in_flight = max_in_flight
        self._routes: dict[str, _Route] = {}
        self._active: dict[tuple[bytes, int], trio.CancelScope] = {}
        self._requests = self._completed = self._failed = self._cancelled = 0
        self._unknown = self._busy = self._heartbeats = 0

    def register(self, method: str, handler: Handler, *, body_type: Any = None,
                 with_payload: bool = False) -> None:
        """Serve `method` with ``await handler(body)`` (``handler(body, payload)`` when
        `with_payload`: the request's payload frames as a list).

        The body is decoded into `body_type` (default: the annotation of the handler's first
        parameter, else ``Any``). The handler returns a msgspec Struct or any msgpack-able
        value, or a `Reply` to send payload frames back. Raises ValueError if `method` is
        already registered, or the body type cannot be resolved or decoded into.
        """
        if method in self._routes:
            raise ValueError(f"method '{method}' is already registered")
        body_type = _infer_body_type(method, handler) if body_type is None else body_type
        try:
            msgspec.msgpack.Decoder(body_type)
        except TypeError as exc:
            raise ValueError(f"method '{method}': cannot decode bodies as {body_type!r}: "
                             f"{exc}") from None
        self._routes[method] = _Route(handler, body_type, with_payload)

    async def __aenter__(self) -> RPCServer:
        await self._start(zmq.ROUTER, bind=self._bind, sndhwm=self._hwm[0],
                          rcvhwm=self._hwm[1], send_buffer=self._max_in_flight + 64)
        return self

    @property
    def endpoint(self) -> str:
        """The address bound (a ``*`` port resolved); raises `TransportError` if not running."""
        endpoint = self._require_socket().endpoint
        assert endpoint is not None
        return endpoint

    # -- dispatch, in the socket's owner task ------------------------------------------------

    def _on_message(self, frames: list[Buffer]) -> None:
        if len(frames) < 2 or len(frames) - 2 > self._codec.limits.max_payload_frames:
            self._dropped += 1
            return
        identity = bytes(frames[0])
        try:
            msg = self._codec.decode(frames[1])
        except WireError:
            self._dropped += 1  # the codec counted why
            return
        if type(msg) is Request:
            self._start_request(identity, msg, frames[2:])
        elif type(msg) is Cancel:
            scope = self._active.get((identity, msg.id))
            if scope is not None:
                scope.cancel()
        elif type(msg) is Heartbeat:
            self._heartbeats += 1
            self._send_nowait([identity, self._codec.encode(msg)])
        else:  # a Response or an Error has no business arriving here
            self._dropped += 1

    def _start_request(self, identity: bytes, msg: Request, payload: list[Buffer]) -> None:
        self._requests += 1
        route = self._routes.get(msg.method)
        key = (identity, msg.id)
        if route is None:
            self._unknown += 1
            self._reply_error(identity, msg.id, "UnknownMethod", f"no method '{msg.method}'")
        elif len(self._active) >= self._max_in_flight:
            self._busy += 1
            self._reply_error(identity, msg.id, "ServerBusy",
                              f"{len(self._active)} requests in flight")
        elif key in self._active or self._nursery is None:
            self._dropped += 1  # a duplicate id, or a request during shutdown
        else:
            scope = self._active[key] = trio.CancelScope()
            self._nursery.start_soon(self._handle, identity, msg, payload, route, scope)

    def _reply_error(self, identity: bytes, request_id: int, kind: str, message: str) -> None:
        self._send_nowait([identity, self._codec.encode(Error(request_id, kind, message))])

    # -- one task per request ----------------------------------------------------------------

    async def _handle(self, identity: bytes, msg: Request, payload: list[Buffer],
                      route: _Route, scope: trio.CancelScope) -> None:
        try:
            with scope:
                reply = await self._invoke(msg, payload, route)
        finally:
            del self._active[(identity, msg.id)]
        if scope.cancelled_caught:  # the caller sent Cancel: it wants no reply
            self._cancelled += 1
            return
        reply.insert(0, identity)
        try:  # the task ends here, so no checkpoint is owed unless the outbox is full
            sock = self._require_socket()
            try:
                sock.send_multipart_nowait(reply)
            except trio.WouldBlock:
                await sock.send_multipart(reply)
        except TransportError:
            pass  # shutting down: the client will time out or see the peer gone

    async def _invoke(self, msg: Request, payload: list[Buffer], route: _Route) -> list[Buffer]:
        """Run the handler; its reply frames, or an `Error` frame if anything failed."""
        codec = self._codec
        try:
            body = codec.decode_body(msg.body, route.body_type)
            result = await (route.handler(body, payload) if route.with_payload
                            else route.handler(body))
            if isinstance(result, Reply):
                codec.check_payload(result.payload)
                frames = [codec.encode(Response(msg.id, codec.encode_body(result.body)))]
                frames.extend(result.payload)
            else:
                frames = [codec.encode(Response(msg.id, codec.encode_body(result)))]
        except Exception as exc:  # the caller gets the type name and message, never the object
            self._failed += 1
            text = str(exc)[:_MAX_ERROR_CHARS]
            return [codec.encode(Error(msg.id, type(exc).__name__, text))]
        self._completed += 1
        return frames

    def stats(self) -> RPCServerStats:
        """Counters of requests by outcome, of dropped messages, and the codec's."""
        return RPCServerStats(self._requests, len(self._active), self._completed, self._failed,
                              self._cancelled, self._unknown, self._busy, self._dropped,
                              self._heartbeats, self._codec.stats())

    def __repr__(self) -> str:
        where = self._sock.endpoint if self._sock is not None and self._stack else "stopped"
        return (f"<RPCServer {where} methods={len(self._routes)} in_flight={len(self._active)} "
                f"completed={self._completed} failed={self._failed} dropped={self._dropped}>")


class _Call:
    """A call in flight. Why a record: the owner's callback (a reply) or the heartbeat task
    (peer gone) resolves it while the caller waits; the first resolution wins. It parks the
    caller with trio's low-level primitives: a `trio.Event` per call costs measurably more."""

    __slots__ = ("done", "error", "payload", "response", "task")

    def __init__(self) -> None:
        self.done = False
        self.response: Response | Error | None = None
        self.payload: list[Buffer] = []
        self.error: BaseException | None = None
        self.task: trio.lowlevel.Task | None = None  # the caller, while it is parked

    def resolve(self) -> None:
        self.done = True
        if self.task is not None:
            task, self.task = self.task, None
            trio.lowlevel.reschedule(task)

    async def wait(self) -> None:
        """Until resolved, or cancelled (then `done` stays False)."""
        if self.done:
            await trio.lowlevel.checkpoint()
            return
        self.task = trio.lowlevel.current_task()

        def abort(_: Any) -> trio.lowlevel.Abort:
            self.task = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)


class RPCClient(_Service):
    """A DEALER that multiplexes concurrent calls to one server, with heartbeats.

    >>> async with RPCClient(server.endpoint) as client:
    ...     total = await client.call("add", AddArgs(1, 2), timeout=5)

    Args:
        endpoint: the server's address.
        ctx: the shared ZeroMQ context (``None``: the process-wide instance).
        heartbeat_interval: seconds between pings; ``None`` disables heartbeats.
        missed_heartbeats: intervals without any message from the server before it is
            declared gone (in-flight calls fail with `PeerGone`).
        timeout: the default per-call timeout in seconds (``None``: no limit).
        limits: the wire size limits.
    """

    def __init__(self, endpoint: str, *, ctx: zmq.Context[Any] | None = None,
                 heartbeat_interval: float | None = 1.0, missed_heartbeats: int = 3,
                 timeout: float | None = None, limits: WireLimits | None = None,
                 sndhwm: int = DEFAULT_HWM, rcvhwm: int = DEFAULT_HWM,
                 send_buffer: int = 1024):
        super().__init__(limits, ctx)
        self.endpoint = endpoint
        self.timeout = timeout
        self._interval = heartbeat_interval
        self._missed = missed_heartbeats
        self._socket_args = {"sndhwm": sndhwm, "rcvhwm": rcvhwm, "send_buffer": send_buffer}
        self._pending: dict[int, _Call] = {}
        self._next_id = 0
        self._last_seen = 0.0
        self._alive = True
        self._calls = self._completed = self._failed = self._timeouts = 0
        self._cancelled = self._gone = self._late = self._pings = 0

    async def __aenter__(self) -> RPCClient:
        await self._start(zmq.DEALER, connect=self.endpoint, **self._socket_args)
        self._last_seen, self._alive = trio.current_time(), True
        if self._interval is not None:
            assert self._nursery is not None
            self._nursery.start_soon(self._heartbeat)
        return self

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
        heartbeats, `WireError` if the request is too large or the reply does not decode, and
        `TransportError` if the client is not running. Cancelling the caller, or a timeout,
        tells the server to cancel the handler.
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

    async def _call(self, method: str, body: Any, payload: Sequence[Buffer],
                    timeout: float | None) -> _Call:
        """Send the request and wait; the call once it has a `Response`, else raise."""
        sock = self._require_socket()
        if not self._alive:
            raise PeerGone(self.endpoint, trio.current_time() - self._last_seen)
        codec = self._codec
        if payload:
            codec.check_payload(payload)
        call_id = self._next_id = self._next_id + 1
        frames = [codec.encode(Request(call_id, method, codec.encode_body(body))), *payload]
        timeout = self.timeout if timeout is None else timeout
        call = self._pending[call_id] = _Call()
        self._calls += 1
        queued = False
        try:
            try:  # no checkpoint on the fast path: waiting for the reply is the checkpoint
                sock.send_multipart_nowait(frames)
            except trio.WouldBlock:
                await sock.send_multipart(frames)
            queued = True
            if timeout is None:
                await call.wait()
            else:
                with trio.move_on_after(timeout):
                    await call.wait()
        finally:
            del self._pending[call_id]
            if queued and not call.done:  # cancelled or timed out: tell the server
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
        raise RPCError(method, response.type, response.message)

    # -- in the socket's owner task ----------------------------------------------------------

    def _on_message(self, frames: list[Buffer]) -> None:
        try:
            msg = self._codec.decode(frames[0])
        except WireError:
            self._dropped += 1
            return
        self._last_seen = trio.current_time()
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

    # -- heartbeats --------------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        """Ping every interval; declare the peer gone once it is silent too long."""
        assert self._interval is not None
        interval, next_ping, seq = self._interval, trio.current_time(), 0
        while True:
            now = trio.current_time()
            if now >= next_ping:
                seq += 1
                self._pings += self._send_nowait([self._codec.encode(Heartbeat(seq))])
                next_ping = now + interval
            deadline = self._last_seen + self._missed * interval
            if self._alive and now >= deadline:
                # After the event loop stalled, a pong may already wait on the socket: give
                # the owner a moment to read it before declaring the peer gone.
                await trio.sleep(_GRACE)
                if trio.current_time() >= self._last_seen + self._missed * interval:
                    self._declare_gone(trio.current_time())
                continue
            await trio.sleep_until(min(next_ping, deadline) if self._alive else next_ping)

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
        try:
            return await super().__aexit__(*exc_info)
        finally:  # calls still waiting in other tasks would never get a reply
            self._fail_pending(lambda: TransportError(
                f"{self!r} closed with the call in flight"))

    def stats(self) -> RPCClientStats:
        """Counters of calls by outcome, heartbeats, dropped messages, and the codec's."""
        return RPCClientStats(self._calls, len(self._pending), self._completed, self._failed,
                              self._timeouts, self._cancelled, self._gone, self._late,
                              self._dropped, self._pings, self._alive, self._codec.stats())

    def __repr__(self) -> str:
        state = ("alive" if self._alive else "gone") if self._stack else "stopped"
        return (f"<RPCClient {self.endpoint} {state} in_flight={len(self._pending)} "
                f"calls={self._calls} timeouts={self._timeouts} failed={self._failed}>")
