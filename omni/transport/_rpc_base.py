"""What the RPC server and client share: replies, stats records and the socket-owning base."""

from __future__ import annotations

import abc
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio
import zmq

from omni.transport.data_channel import DataChannelStats
from omni.transport.errors import TransportError
from omni.transport.trio_zmq import Buffer, Socket, background_nursery, open_socket
from omni.transport.unix import UnixSocket, is_unix, open_unix_socket
from omni.transport.wire import (
    Codec,
    WireLimits,
    WireStats,
)

__all__ = ["Handler", "RPCClientStats", "RPCServerStats", "Reply"]

log = logging.getLogger("omni.transport.rpc")

Handler = Callable[..., Awaitable[Any]]
_MAX_ERROR_CHARS = 16_384  # a remote error's message is truncated to this
_MAX_TRACEBACK_CHARS = 32_768  # and its traceback text to its last this many characters
# ZeroMQ applies its message size limit to what arrives on the wire: a CURVE-encrypted frame is
# a few dozen bytes longer than its payload. The limits themselves are enforced by the codec.
_FRAMING_MARGIN = 4096
_GRACE = 0.005  # seconds to read replies already received before declaring a peer gone
# The heartbeat connection carries one small message each way per interval: shallow queues.
_BEAT_SOCKET: dict[str, Any] = {"sndhwm": 16, "rcvhwm": 16, "send_buffer": 4}


@dataclass(frozen=True, slots=True)
class Reply:
    """A body with payload frames: what a handler returns to send frames back, and what
    `RPCClient.call_with_payload` returns."""

    body: Any = None
    payload: Sequence[Buffer] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class RPCServerStats:
    """A server's counters: requests by outcome (`cancelled`: by the caller's Cancel;
    `busy`: refused over `max_in_flight`), `dropped` messages (malformed, unexpected or
    duplicate); `wire` holds the codec's counters (rejected messages by reason), `data` its
    data channels' (None: it serves none), `rerouted` the large replies that took the CURVE
    connection because their client's data connection was down, `notices` the requests
    that wanted no answer (counted in `requests` too)."""

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
    data: DataChannelStats | None = None
    rerouted: int = 0
    notices: int = 0


@dataclass(frozen=True, slots=True)
class RPCClientStats:
    """A client's counters: `cancelled` counts the Cancel messages sent (callers cancelled
    or timed out), `late_replies` replies that came after their caller gave up, `dropped`
    messages that did not decode; `wire` holds the codec's counters, `data` its data
    channel's (None: it has none open), `notices` the one-way messages sent."""

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
    data: DataChannelStats | None = None
    notices: int = 0


class _Service(abc.ABC):
    """What server and client share: a socket, a nursery, a codec, and `async with`."""

    def __init__(self, limits: WireLimits | None, ctx: zmq.Context[Any] | None):
        self._codec = Codec(limits)
        self._ctx = ctx
        self._sock: Socket | UnixSocket | None = None
        self._beat_sock: Socket | UnixSocket | None = None
        self._nursery: trio.Nursery | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._dropped = 0

    async def _start(self, socket_type: int, *, heartbeats: bool = False,
                     **socket_args: Any) -> None:
        """Open the socket and the nursery; with `heartbeats`, a second connection to the
        same address for heartbeats alone (`_beat_sock`: see `RPCClient._heartbeat`)."""
        if self._stack is not None:
            raise TransportError(f"{self!r} is already running")
        stack = contextlib.AsyncExitStack()
        await stack.__aenter__()
        try:
            self._sock = await stack.enter_async_context(
                self._open(socket_type, **socket_args))
            if heartbeats:
                self._beat_sock = await stack.enter_async_context(self._open(
                    socket_type, **{**socket_args, **_BEAT_SOCKET}))
            self._nursery = await stack.enter_async_context(background_nursery())
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack

    def _open(self, socket_type: int, **socket_args: Any
              ) -> contextlib.AbstractAsyncContextManager[Socket | UnixSocket]:
        """A socket of `socket_type` whose messages go to `_on_message`: over a Unix socket
        for a ``unix://`` address, else ZeroMQ."""
        limits = self._codec.limits
        largest = max(limits.max_payload_bytes, limits.max_control_bytes)
        address = socket_args.get("bind") or socket_args.get("connect")
        if is_unix(address):  # processes of one host: no ZeroMQ I/O thread in the way
            return open_unix_socket(on_message=self._guarded_on_message,
                                    max_frames=limits.max_payload_frames + 2,
                                    max_frame_bytes=largest, **socket_args)
        return open_socket(self._ctx, socket_type, on_message=self._guarded_on_message,
                           max_msg_size=largest + _FRAMING_MARGIN, **socket_args)

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        stack, self._stack = self._stack, None
        self._nursery = None
        assert stack is not None
        try:
            return await stack.__aexit__(*exc_info)
        finally:  # after the background tasks that use it have ended
            self._beat_sock = None

    def _guarded_on_message(self, frames: list[Buffer]) -> None:
        """The owner task calls this for each message: it must never raise."""
        try:
            self._on_message(frames)
        except Exception:  # a bug here must not stop the socket; count it and log it
            self._dropped += 1
            log.exception("%r: failed to dispatch a message", self)

    @abc.abstractmethod
    def _on_message(self, frames: list[Buffer]) -> None:
        """Handle one received message (in the socket's owner task; must not block)."""

    def _send_nowait(self, frames: list[Buffer]) -> bool:
        """Queue a message from the owner's callback; False (dropped) if the outbox is full."""
        try:
            self._require_socket().send_multipart_nowait(frames)
        except (trio.WouldBlock, TransportError):
            return False
        return True

    def _require_socket(self) -> Socket | UnixSocket:
        if self._sock is None or self._stack is None:
            raise TransportError(f"{self!r} is not running (use `async with`)")
        return self._sock


