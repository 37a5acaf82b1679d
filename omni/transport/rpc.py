"""ROUTER/DEALER RPC for trio: `RPCServer` runs async handlers, `RPCClient` calls them.

A call is one multipart message: a control frame (`wire.Request`) and optional payload frames
of raw bytes; the reply is a `wire.Response` or `wire.Error`, with payload frames too. Each
side dispatches replies inside its socket's owner task (`on_message`: synchronous, no extra
hop), so one DEALER socket carries any number of concurrent calls, told apart by request id.

Bulk: with a `DataPlane` (`Credentials.data_plane()`: cluster sockets over TCP), a message
whose payload is large goes on a data channel beside the CURVE connection, sealed with
AES-256-GCM (`omni.transport.data_channel`); the handlers and callers see no difference.

A notice (`RPCClient.notify`: a `wire.Request` with id 0) runs its handler the same way and is
never answered: what the handler returns, or raises, stays on the server (counted).

Failure model: a handler that raises fails only its call (`RPCError` with the remote type name
and message); a malformed message is counted and dropped; a caller that gives up (cancelled
or timed out) sends `wire.Cancel` and the server cancels that handler; a server that stops
answering heartbeats is declared gone after `missed_heartbeats` intervals and every call in
flight fails with `PeerGone`. Heartbeats go on a second connection of the client's, so that no
large message, however long it takes to cross, is ever ahead of them (`RPCClient._heartbeat`).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import trio
import zmq

from omni.errors import describe, traceback_text
from omni.transport._rpc_base import (
    _MAX_ERROR_CHARS,
    _MAX_TRACEBACK_CHARS,
    Handler,
    Reply,
    RPCClientStats,
    RPCServerStats,
    _Service,
)
from omni.transport._rpc_client import RPCClient
from omni.transport.data_channel import (
    DataOpen,
    DataPlane,
    DataServer,
    is_bulk,
)
from omni.transport.errors import TransportError, WireError
from omni.transport.trio_zmq import DEFAULT_HWM, Buffer, Unroutable
from omni.transport.wire import (
    Cancel,
    Error,
    Heartbeat,
    Request,
    Response,
    WireLimits,
)

__all__ = ["Handler", "RPCClient", "RPCClientStats", "RPCServer", "RPCServerStats", "Reply"]


log = logging.getLogger(__name__)

_MAX_IDLE_WORKERS = 32  # idle handler tasks kept for the next requests; more end


@dataclass(frozen=True, slots=True)
class _Job:
    """A request handed to a worker: who asked, what, and the route that serves it."""

    identity: bytes
    msg: Request
    payload: list[Buffer]
    route: _Route
    key: tuple[bytes, int]  # in the server's table of active requests


class _Worker:
    """A task that runs requests one after another. Why workers: spawning a task and entering
    a cancel scope per request cost more than the rest of a small call on the server; an
    idle worker is handed the next request and rescheduled instead. `scope` is the cancel
    scope its requests run in (a new one after each cancelled request), which a `Cancel`
    message cancels; `job` is the request handed to it."""

    __slots__ = ("context", "job", "scope", "task")

    def __init__(self, job: _Job) -> None:
        self.job: _Job | None = job
        self.scope = trio.CancelScope()
        self.task: trio.lowlevel.Task | None = None
        self.context: contextvars.Context | None = None  # the task's first, kept pristine

    def hand(self, job: _Job) -> None:
        """Give the idle worker `job` and wake it. Each request starts in a fresh copy of the
        context the worker started with, as a task of its own would: set before the worker
        resumes, because trio runs each step of a task in the task's context of the moment."""
        assert self.task is not None and self.context is not None
        self.job = job
        self.task.context = self.context.copy()
        trio.lowlevel.reschedule(self.task)


@dataclass(frozen=True, slots=True)
class _Route:
    """A registered method. Why a record: the body type is resolved once, at registration."""

    handler: Handler
    body_type: Any
    with_payload: bool
    inline: bool = False
    refused: Callable[[Any], None] | None = None  # a notice's, when the server is full
    at_once: Callable[..., Any] | None = None  # tried inline first: None sends it to `handler`


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


class RPCServer(_Service):
    """A ROUTER that runs each request's handler in a task of its own while it runs (worker
    tasks, reused: each request still starts in a fresh copy of the server's context).

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
        options: further socket options, e.g. `Credentials.server_options()` for CURVE.
        data_plane: serve data channels (a TCP address only; `Credentials.data_plane()`).
    """

    def __init__(self, bind: str = "tcp://127.0.0.1:*", *, ctx: zmq.Context[Any] | None = None,
                 limits: WireLimits | None = None, max_in_flight: int = 1024,
                 sndhwm: int = DEFAULT_HWM, rcvhwm: int = DEFAULT_HWM,
                 options: dict[int, Any] | None = None, data_plane: DataPlane | None = None):
        super().__init__(limits, ctx)
        self._data = (DataServer(data_plane, ctx, self._codec.limits,
                                 self._guarded_on_message)
                      if data_plane is not None and bind.startswith("tcp://") else None)
        self._options = options
        self._bind = bind
        self._hwm = (sndhwm, rcvhwm)
        self._max_in_flight = max_in_flight
        self._routes: dict[str, _Route] = {}
        self._active: dict[tuple[bytes, int], _Worker] = {}
        self._notices = 0  # received: the active key of each is -(its number)
        self._idle: list[_Worker] = []
        self._requests = self._completed = self._failed = self._cancelled = 0
        self._rerouted = 0
        self._unknown = self._busy = self._heartbeats = 0

    def register(self, method: str, handler: Handler | Callable[..., Any], *,
                 body_type: Any = None, with_payload: bool = False, inline: bool = False,
                 refused: Callable[[Any], None] | None = None,
                 at_once: Callable[..., Any] | None = None) -> None:
        """Serve `method` with ``await handler(body)`` (``handler(body, payload)`` when
        `with_payload`: the request's payload frames as a list).

        The body is decoded into `body_type` (default: the annotation of the handler's first
        parameter, else ``Any``). The handler returns a msgspec Struct or any msgpack-able
        value, or a `Reply` to send payload frames back. `inline`: the handler is a plain
        function that never blocks, run where the message is read, without a task of its
        own (one trip less through trio's scheduler); its reply goes out without waiting,
        dropped as a heartbeat's would be if the outbox is full. `refused`: called with the
        decoded body of a notice refused because `max_in_flight` handlers run (a call is
        answered ``ServerBusy``; a notice cannot be, so the server says so this way).
        `at_once`: a plain function taking what the handler takes, run first as an inline
        handler is; what it returns is the reply, unless it is None: then the request goes to
        `handler` as if `at_once` were not there (a fast path for what needs no waiting).
        Raises ValueError if `method` is already registered, or the body type cannot be
        resolved or decoded into.
        """
        if method in self._routes:
            raise ValueError(f"method '{method}' is already registered")
        body_type = _infer_body_type(method, handler) if body_type is None else body_type
        try:
            msgspec.msgpack.Decoder(body_type)
        except TypeError as exc:
            raise ValueError(f"method '{method}': cannot decode bodies as {body_type!r}: "
                             f"{exc}") from None
        self._routes[method] = _Route(handler, body_type, with_payload, inline, refused,
                                      at_once)

    async def __aenter__(self) -> RPCServer:
        await self._start(zmq.ROUTER, bind=self._bind, sndhwm=self._hwm[0],
                          rcvhwm=self._hwm[1], send_buffer=self._max_in_flight + 64,
                          options=self._options)
        if self._data is not None:
            assert self._stack is not None
            try:
                await self._data.start(self._stack, self._bind[len("tcp://"):].rsplit(":", 1)[0])
            except BaseException:
                await self.__aexit__(None, None, None)
                raise
        return self

    @property
    def endpoint(self) -> str:
        """The address bound (a ``*`` port resolved); raises `TransportError` if not running."""
        endpoint = self._require_socket().endpoint
        assert endpoint is not None
        return endpoint

    # -- dispatch, in the socket's owner task ------------------------------------------------

    def _on_message(self, frames: list[Buffer]) -> None:
        if len(frames) < 2 or not self._codec.payload_fits(frames[2:]):
            self._dropped += 1
            return
        identity = bytes(frames[0])
        try:
            msg = self._codec.decode(frames[1])
        except WireError:
            self._dropped += 1  # the codec counted why
            return
        if type(msg) is Request:
            if msg.method.startswith("_data."):
                self._data_request(identity, msg)
            else:
                self._start_request(identity, msg, frames[2:])
        elif type(msg) is Cancel:
            worker = self._active.get((identity, msg.id))
            if worker is not None:
                worker.scope.cancel()
        elif type(msg) is Heartbeat:
            self._heartbeats += 1
            self._send_nowait([identity, self._codec.encode(msg)])
        else:  # a Response or an Error has no business arriving here
            self._dropped += 1

    def dispatch(self, msg: Request, payload: list[Buffer]) -> None:
        """Run notice `msg`, which came another way (handed over by a lane's thread:
        `omni.transport.lane`), as if it had come to this server: by its route, within
        ``max_in_flight``, counted. On the event loop's thread."""
        if msg.id != 0:
            raise ValueError("only a notice can be dispatched: nothing would carry its answer")
        self._start_request(b"", msg, payload)

    def _start_request(self, identity: bytes, msg: Request, payload: list[Buffer]) -> None:
        self._requests += 1
        route = self._routes.get(msg.method)
        key = (identity, msg.id)
        if msg.id == 0:  # a notice: never answered, so never refused by a reply either
            self._notices += 1
            key = (identity, -self._notices)
        if route is None:
            self._unknown += 1
            self._reply_error(identity, msg.id, "UnknownMethod", f"no method '{msg.method}'")
        elif route.inline:
            frames = self._invoke_inline(msg, payload, route)
            if msg.id:
                self._send_nowait([identity, *frames])
        elif route.at_once is not None \
                and (frames := self._invoke_inline(msg, payload, route, at_once=True)) is not None:
            if msg.id:
                self._send_nowait([identity, *frames])
        elif len(self._active) >= self._max_in_flight:
            self._busy += 1
            self._reply_error(identity, msg.id, "ServerBusy",
                              f"{len(self._active)} requests in flight")
            if msg.id == 0 and route.refused is not None:
                try:
                    route.refused(self._codec.decode_body(msg.body, route.body_type))
                except Exception:  # (a body that does not decode is counted by the codec)
                    log.debug("the refusal of a '%s' notice failed", msg.method, exc_info=True)
        elif key in self._active or self._nursery is None:
            self._dropped += 1  # a duplicate id, or a request during shutdown
        else:
            job = _Job(identity, msg, payload, route, key)
            if self._idle:
                worker = self._active[key] = self._idle.pop()
                worker.hand(job)
            else:
                worker = self._active[key] = _Worker(job)
                self._nursery.start_soon(self._work, worker)

    def _data_request(self, identity: bytes, msg: Request) -> None:
        """``_data.open`` / ``_data.close``, answered at once (they only touch a table)."""
        codec, data = self._codec, self._data
        if data is None or msg.method not in ("_data.open", "_data.close"):
            self._unknown += 1
            self._reply_error(identity, msg.id, "UnknownMethod", f"no method '{msg.method}'")
            return
        try:
            if msg.method == "_data.close":
                data.close(identity)
                result: Any = None
            else:
                result = data.open(identity, codec.decode_body(msg.body, DataOpen))
        except TransportError as exc:
            self._reply_error(identity, msg.id, type(exc).__name__, str(exc))
            return
        self._send_nowait([identity, codec.encode(Response(msg.id, codec.encode_body(result)))])

    def _reply_error(self, identity: bytes, request_id: int, kind: str, message: str) -> None:
        if request_id == 0:  # a notice's sender wants no answer
            return
        self._send_nowait([identity, self._codec.encode(Error(request_id, kind, message))])

    # -- the worker tasks --------------------------------------------------------------------

    async def _work(self, worker: _Worker) -> None:
        """Run the worker's requests until it is not needed any more.

        A request runs in the worker's cancel scope. Its reply goes out from inside the scope
        only when that cannot wait (the outbox has room) and no Cancel came; otherwise the
        worker leaves the scope first (a Cancel that came too late must not interrupt the
        reply, nor leak into the next request) and continues in a new one.
        """
        task = worker.task = trio.lowlevel.current_task()
        worker.context = task.context.copy()
        while True:
            scope, reply = worker.scope, None
            with scope:
                while True:
                    reply = await self._run(worker)
                    if scope.cancel_called or not self._reply_nowait(reply):
                        break
                    if not await self._next_job(worker):
                        return
            if scope.cancelled_caught:  # the caller sent Cancel: it wants no reply
                self._cancelled += 1
            elif reply is not None:
                await self._reply(reply)
            worker.scope = trio.CancelScope()
            if not await self._next_job(worker):
                return

    async def _run(self, worker: _Worker) -> list[Buffer] | None:
        """The reply to the worker's request, identity first (None for a notice); it is in
        flight until then."""
        job = worker.job
        assert job is not None
        try:
            reply = await self._invoke(job.msg, job.payload, job.route)
        finally:
            del self._active[job.key]
        if job.msg.id == 0:
            return None
        reply.insert(0, job.identity)
        return reply

    def _bulk_channel(self, reply: list[Buffer]) -> Any:
        """The caller's data channel, when `reply` is large and the caller has one."""
        if self._data is None or len(reply) <= 2:
            return None
        channel = self._data.channel_of(reply[0])
        return channel if channel is not None and is_bulk(reply[2:]) else None

    def _reply_nowait(self, reply: list[Buffer] | None) -> bool:
        """Send `reply` unless that would wait (False: the outbox is full, or the reply
        goes on the caller's data channel); a notice's (None) is sent at once."""
        return reply is None or (self._bulk_channel(reply) is None
                                 and self._send_reply_nowait(reply))

    def _send_reply_nowait(self, reply: list[Buffer]) -> bool:
        try:
            self._require_socket().send_multipart_nowait(reply)
        except trio.WouldBlock:
            return False
        except TransportError:
            pass  # shutting down: the client will time out or see the peer gone
        return True

    async def _reply(self, reply: list[Buffer]) -> None:
        channel = self._bulk_channel(reply)
        if channel is not None:
            assert self._data is not None
            try:
                await self._data.send(channel, reply[1], reply[2:])
                return
            except Unroutable:  # its data connection is down: the reply takes CURVE
                self._rerouted += 1
            except TransportError:
                return  # shutting down: the client will time out or see the peer gone
        if not self._send_reply_nowait(reply):
            with contextlib.suppress(TransportError):
                await self._require_socket().send_multipart(reply)

    async def _next_job(self, worker: _Worker) -> bool:
        """Wait idle until handed a request; False (at once) when enough workers idle."""
        worker.job = None
        if len(self._idle) >= _MAX_IDLE_WORKERS or self._nursery is None:
            return False
        self._idle.append(worker)

        def abort(_: Any) -> trio.lowlevel.Abort:  # shutting down
            self._idle.remove(worker)
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)
        return True

    async def _invoke(self, msg: Request, payload: list[Buffer], route: _Route) -> list[Buffer]:
        """Run the handler; its reply frames, or an `Error` frame if anything failed."""
        try:
            result = await self._handle(msg, payload, route)
        except Exception as exc:
            return self._failure(msg.id, exc)
        return self._success(msg.id, result)

    def _invoke_inline(self, msg: Request, payload: list[Buffer], route: _Route, *,
                       at_once: bool = False) -> list[Buffer] | None:
        """`_invoke` for an inline route: the handler is a plain function (with `at_once`,
        the route's `at_once`: None when it returned None)."""
        try:
            result = self._handle(msg, payload, route, at_once=at_once)
        except Exception as exc:
            return self._failure(msg.id, exc)
        if at_once and result is None:
            return None
        return self._success(msg.id, result)

    def _handle(self, msg: Request, payload: list[Buffer], route: _Route, *,
                at_once: bool = False) -> Any:
        """What the handler (with `at_once`, the route's `at_once`) returns for `msg` (an
        awaitable, unless the route is inline or `at_once`)."""
        body = self._codec.decode_body(msg.body, route.body_type)
        handler = route.at_once if at_once else route.handler
        assert handler is not None
        return handler(body, payload) if route.with_payload else handler(body)

    def _success(self, request_id: int, result: Any) -> list[Buffer]:
        """The reply frames of a handler's `result` (a `Reply`: with its payload frames);
        none for a notice, whose result nobody reads."""
        if request_id == 0:
            self._completed += 1
            return []
        codec = self._codec
        try:
            if isinstance(result, Reply):
                codec.check_payload(result.payload)
                frames = [codec.encode(Response(request_id, codec.encode_body(result.body)))]
                frames.extend(result.payload)
            else:
                frames = [codec.encode(Response(request_id, codec.encode_body(result)))]
        except Exception as exc:
            return self._failure(request_id, exc)
        self._completed += 1
        return frames

    def _failure(self, request_id: int, exc: Exception) -> list[Buffer]:
        """The `Error` frame of a failed request: the caller gets the type name, the message
        and the traceback text (trio's groups of one unwrapped: `omni.errors.describe`), never
        the object (none for a notice)."""
        self._failed += 1
        if request_id == 0:
            return []
        kind, message = describe(exc)
        error = Error(request_id, kind, message[:_MAX_ERROR_CHARS],
                      traceback_text(exc, _MAX_TRACEBACK_CHARS))
        return [self._codec.encode(error)]

    def stats(self) -> RPCServerStats:
        """Counters of requests by outcome, of dropped messages, and the codec's."""
        return RPCServerStats(self._requests, len(self._active), self._completed, self._failed,
                              self._cancelled, self._unknown, self._busy, self._dropped,
                              self._heartbeats, self._codec.stats(),
                              None if self._data is None else self._data.stats(),
                              self._rerouted, self._notices)

    def __repr__(self) -> str:
        where = self._sock.endpoint if self._sock is not None and self._stack else "stopped"
        return (f"<RPCServer {where} methods={len(self._routes)} in_flight={len(self._active)} "
                f"completed={self._completed} failed={self._failed} dropped={self._dropped}>")


