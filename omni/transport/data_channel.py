"""The data channel: an RPC connection's bulk frames, sealed with AES-256-GCM, beside CURVE.

CURVE (libzmq's encryption of every byte, in its I/O thread) authenticates cluster sockets and
carries their control messages; at a gigabyte a second it is also what caps a large value
between hosts. So an RPC client and server that both have one open a *data channel* beside
their CURVE connection, and any message whose payload frames total `DATA_MIN` bytes or more
(a stage value, a chunk of a transfer, KV pages) goes there instead:

- **Key agreement**: the client draws a channel id and a 32-byte key and sends both in the
  ``_data.open`` call, over the CURVE connection (encrypted, and both ends authenticated by
  it). From the key, HKDF-SHA256 derives one AES-256-GCM key per direction and the channel's
  admission password. The server answers with its data socket's port, and the client's
  first message on it is a probe (an empty message, answered in kind): the channel is used
  only once that round trip worked, so a data port that a firewall blocks leaves the
  connection on CURVE rather than losing replies.
- **Admission**: the server's data socket is a ROUTER with ZeroMQ's PLAIN mechanism, vetted
  by the process's ZAP authenticator (`omni.transport.security.Authenticator.admit_data`): a
  peer that cannot name an open channel and its password is refused in the handshake, before
  it can send a byte of payload. (The password is derived, never the key; one seen on the wire
  admits a connection whose frames still fail their tags.)
- **Frames**: a message is a *head* (the control frame and the payload frames' sizes) and
  then its payload bytes in *pieces* of at most `PIECE` bytes, each a ZeroMQ message
  ``[nonce, sealed]`` of its own, so sealing one piece overlaps ZeroMQ sending the last, and
  opening one the next arriving. The 12-byte nonce is the message's sequence number and the
  piece's index: a nonce is never reused under a key, a piece out of order or from another
  message fails its tag, a message's sequence number must exceed the last one accepted (no
  replay), and a piece whose tag fails (a flipped bit) drops its message and is counted
  (`DataChannelStats.refused`). Only a whole, authenticated message is delivered.
- **Plaintext** (``OMNI_DATA_PLANE=plaintext`` on both ends, for a network the operator
  trusts): the same framing and admission, the pieces unsealed. Either end saying
  ``encrypted`` (the default) makes the channel encrypted.

Control messages, heartbeats and cancels stay on the CURVE connection; a message below
`DATA_MIN`, or sent before the channel is open, goes there too (the channel is an
optimisation: nothing waits for it). So do large messages while the data connection is down
(its TCP connection broke; ZeroMQ reconnects it): the client follows its connection through
ZeroMQ's monitor events, and the server learns it from a reply's head, refused before any of
the reply went out (counted: `RPCServerStats.rerouted`). A message on the wire when the
connection breaks is lost, as on any connection: its call times out.
Unix-socket connections (one host) have none. Memory: a head commits none; a payload frame's
buffer is allocated as its first piece lands, within the wire limits.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import trio
import zmq

from omni.transport.errors import TransportError
from omni.transport.security import DATA_ZAP_DOMAIN, Authenticator
from omni.transport.trio_zmq import ZERO_COPY_THRESHOLD, Buffer, Socket, open_socket
from omni.transport.wire import WireLimits, payload_nbytes

__all__ = ["DATA_MIN", "MODES", "PIECE", "DataChannelStats", "DataClient", "DataOpen",
           "DataOpened", "DataPlane", "DataServer", "Receiver", "Refused", "Sender",
           "channel_secrets", "data_plane_mode", "is_bulk"]

log = logging.getLogger("omni.transport.data")

DATA_MIN: Final = 256 << 10  # a message with this many payload bytes goes on the data channel
PIECE: Final = 2 << 20  # the largest piece a payload frame is sealed in
MODES: Final = ("encrypted", "plaintext")
_NONCE = struct.Struct("<QI")  # sequence number, piece index (0: the head)
_TAG = 16  # AES-GCM's tag
_KEY = 32  # AES-256
_HWM = 64  # pieces ZeroMQ queues per peer and direction (128 MiB): backpressure beyond
# open channels a server keeps; past that a new client stays on CURVE (never an open channel
# closed under its client, whose messages would then go unread)
MAX_CHANNELS = 16384
PROBE_S = 10.0  # how long a new channel's first round trip may take before it is given up
# TCP keepalives on data sockets: a channel idle between bursts must not be dropped by a NAT
# or firewall while its CURVE connection, kept busy by heartbeats, lives on
_KEEPALIVE = {zmq.TCP_KEEPALIVE: 1, zmq.TCP_KEEPALIVE_IDLE: 30, zmq.TCP_KEEPALIVE_INTVL: 10}


def data_plane_mode(value: str | None = None) -> str:
    """The data plane's mode: `value`, else ``OMNI_DATA_PLANE``, else ``encrypted``.

    Raises:
        TransportError: not one of `MODES`.
    """
    mode = value if value is not None else os.environ.get("OMNI_DATA_PLANE", "encrypted")
    mode = mode.strip().lower()
    if mode not in MODES:
        raise TransportError(f"data plane mode {mode!r} (OMNI_DATA_PLANE / --data-plane) is "
                             f"not one of {', '.join(MODES)}")
    return mode


class DataOpen(msgspec.Struct, array_like=True, frozen=True):
    """A client's ``_data.open``: its channel id and key, and the mode it asks for."""

    channel: bytes
    key: bytes
    mode: str


class DataOpened(msgspec.Struct, array_like=True, frozen=True):
    """The server's answer: its data socket's port (on the host the client reached) and
    the mode both ends use."""

    port: int
    mode: str


@dataclass(frozen=True, slots=True)
class DataChannelStats:
    """One end's data channel traffic: `mode` (``encrypted``, ``plaintext``; on a client,
    "" while its channel is being opened and ``off`` when it has none), whole messages and
    their payload bytes each way,
    pieces `refused` (a tag that failed, a piece out of order, a replayed or malformed head)
    and messages `dropped` unfinished (a piece refused, or the next message began)."""

    mode: str
    messages_out: int
    messages_in: int
    bytes_out: int
    bytes_in: int
    refused: int
    dropped: int


def channel_secrets(key: bytes, channel: bytes) -> tuple[bytes, bytes, str]:
    """The client-to-server key, the server-to-client key and the admission password of
    the channel `channel` whose key is `key` (HKDF-SHA256)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    if len(key) != _KEY or not channel:
        raise TransportError("a data channel needs a 32-byte key and an id")
    okm = HKDF(hashes.SHA256(), 3 * _KEY, salt=channel, info=b"omni data channel v1"
               ).derive(key)
    return okm[:_KEY], okm[_KEY:2 * _KEY], okm[2 * _KEY:].hex()


def new_channel() -> tuple[bytes, bytes]:
    """A fresh channel id and key."""
    return secrets.token_bytes(16), secrets.token_bytes(_KEY)


def admission_name(channel: bytes) -> str:
    """The PLAIN user name a channel's connection presents."""
    return channel.hex()


def is_bulk(payload: Sequence[Buffer]) -> bool:
    """Whether a message with these payload frames goes on the data channel."""
    return payload_nbytes(payload) >= DATA_MIN


class Refused(TransportError):
    """A piece the data channel did not accept (why, in the message)."""


class _Head(msgspec.Struct, array_like=True, frozen=True):
    control: bytes
    sizes: list[int]


_head_decoder = msgspec.msgpack.Decoder(_Head)


def _aead(key: bytes | None) -> Any:
    if key is None:
        return None
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(key)


def _pieces(sizes: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(frame, offset, length) of each piece, in order: each frame cut into `PIECE`s."""
    for index, size in enumerate(sizes):
        for offset in range(0, size, PIECE):
            yield index, offset, min(PIECE, size - offset)


class Sender:
    """One direction's sealing: messages in, ZeroMQ messages ``[nonce, body]`` out.

    `key` None: plaintext (the pieces go as views of the caller's frames, zero-copy)."""

    def __init__(self, key: bytes | None):
        self._aead = _aead(key)
        self._seq = 0
        self.messages = self.bytes = 0

    def frames(self, control: bytes, payload: Sequence[Buffer]) -> Iterator[list[Buffer]]:
        """The ZeroMQ messages of one message, made as they are taken (seal as you send)."""
        import numpy

        self._seq += 1
        seq, aead = self._seq, self._aead
        views = [memoryview(frame).cast("B") for frame in payload]
        sizes = [view.nbytes for view in views]
        head = msgspec.msgpack.encode(_Head(bytes(control), sizes))
        nonce = _NONCE.pack(seq, 0)
        yield [nonce, head if aead is None else aead.encrypt(nonce, head, None)]
        for index, (frame, offset, length) in enumerate(_pieces(sizes), start=1):
            nonce = _NONCE.pack(seq, index)
            piece = views[frame][offset:offset + length]
            if aead is None:
                yield [nonce, piece]
            else:
                sealed = numpy.empty(length + _TAG, numpy.uint8)  # not zeroed: written whole
                aead.encrypt_into(nonce, piece, None, sealed)
                yield [nonce, sealed]
        self.messages += 1
        self.bytes += sum(sizes)


class _Incoming:
    """A message being received. A payload frame's buffer is allocated when its first piece
    lands: a head commits no memory for what was never sent."""

    __slots__ = ("buffers", "control", "next", "plan", "seq", "sizes")

    def __init__(self, seq: int, head: _Head):
        self.seq = seq
        self.control = head.control
        self.sizes = head.sizes
        self.buffers: list[Any] = [None] * len(head.sizes)
        self.plan = list(_pieces(head.sizes))
        self.next = 1

    def target(self, frame: int, offset: int, length: int) -> memoryview:
        buffer = self.buffers[frame]
        if buffer is None:
            import numpy

            buffer = self.buffers[frame] = numpy.empty(self.sizes[frame], numpy.uint8)
        return memoryview(buffer)[offset:offset + length]

    def message(self) -> list[Buffer]:
        frames: list[Buffer] = [self.control]
        for buffer, size in zip(self.buffers, self.sizes, strict=True):
            if buffer is None:  # an empty frame: no piece
                frames.append(b"")
            else:
                frames.append(buffer.tobytes() if size < ZERO_COPY_THRESHOLD
                              else memoryview(buffer))
        return frames


class Receiver:
    """One direction's opening: ZeroMQ messages ``[nonce, body]`` in, whole messages
    ``[control, *payload]`` out (payload frames below 64 KiB as bytes, larger ones as
    memoryviews). Refuses anything it cannot authenticate, or take (`Refused`)."""

    def __init__(self, key: bytes | None, limits: WireLimits):
        self._aead = _aead(key)
        self._limits = limits
        self._last = 0  # the last sequence number whose head was authenticated
        self._current: _Incoming | None = None
        self.messages = self.bytes = self.refused = self.dropped = 0

    def feed(self, frames: list[Buffer]) -> list[Buffer] | None:
        """Take one ZeroMQ message; the whole message once its last piece is in."""
        try:
            return self._feed(frames)
        except Exception as exc:  # Refused, or e.g. MemoryError: never the socket's problem
            self.refused += 1
            self._drop()
            if isinstance(exc, Refused):
                raise
            raise Refused(f"a piece could not be taken: {exc!r}") from None

    def _drop(self) -> None:
        if self._current is not None:
            self._current = None
            self.dropped += 1

    def _feed(self, frames: list[Buffer]) -> list[Buffer] | None:
        if len(frames) != 2 or memoryview(frames[0]).nbytes != _NONCE.size:
            raise Refused("a data channel message that is not [nonce, body]")
        nonce = bytes(frames[0])
        seq, index = _NONCE.unpack(nonce)
        body = memoryview(frames[1]).cast("B")
        if index == 0:
            self._drop()
            return self._head(seq, nonce, body)
        current = self._current
        if current is None or seq != current.seq or index != current.next:
            raise Refused(f"piece {index} of message {seq} out of order")
        frame, offset, length = current.plan[index - 1]
        target = current.target(frame, offset, length)
        aead = self._aead
        if aead is None:
            if body.nbytes != length:
                raise Refused(f"piece {index} of message {seq}: {body.nbytes} bytes, "
                              f"not {length}")
            target[:] = body
        else:
            if body.nbytes != length + _TAG:
                raise Refused(f"piece {index} of message {seq} has the wrong size")
            try:
                aead.decrypt_into(nonce, body, None, target)
            except Exception:  # InvalidTag: tampered with, or not sealed with our key
                raise Refused(f"piece {index} of message {seq} failed authentication") \
                    from None
        current.next += 1
        return self._finish() if current.next > len(current.plan) else None

    def _head(self, seq: int, nonce: bytes, body: memoryview) -> list[Buffer] | None:
        limits = self._limits
        if body.nbytes > limits.max_control_bytes + 16 * (limits.max_payload_frames + 8):
            raise Refused(f"a head of {body.nbytes} bytes")
        if self._aead is None:
            raw = bytes(body)
        else:
            try:
                raw = self._aead.decrypt(nonce, body, None)
            except Exception:
                raise Refused(f"the head of message {seq} failed authentication") from None
        if seq <= self._last:
            raise Refused(f"message {seq} replayed or reordered (last {self._last})")
        try:
            head = _head_decoder.decode(raw)
        except msgspec.DecodeError:
            raise Refused(f"the head of message {seq} does not decode") from None
        if (len(head.control) > limits.max_control_bytes
                or len(head.sizes) > limits.max_payload_frames
                or any(not 0 <= size <= limits.max_payload_bytes for size in head.sizes)):
            raise Refused(f"message {seq} exceeds the wire limits")
        self._last = seq
        self._current = _Incoming(seq, head)
        return self._finish() if not self._current.plan else None

    def _finish(self) -> list[Buffer]:
        current, self._current = self._current, None
        assert current is not None
        self.messages += 1
        self.bytes += sum(current.sizes)
        return current.message()


@dataclass(frozen=True, slots=True)
class DataPlane:
    """What a process's RPC servers and clients need to open data channels: the mode this
    end asks for and, to serve them, the ZAP authenticator of the sockets' context."""

    mode: str = "encrypted"
    authenticator: Authenticator | None = None


class _Channel:
    """The server's record of one open channel."""

    __slots__ = ("control", "lock", "name", "ready", "receiver", "routing", "sender")

    def __init__(self, routing: bytes, control: bytes, sender: Sender, receiver: Receiver):
        self.ready = False  # until the client's probe came: its connection is routable
        self.routing = routing  # the data socket's routing id (the channel id)
        self.control = control  # the CURVE connection's routing id
        self.name = admission_name(routing)
        self.sender, self.receiver = sender, receiver
        self.lock = trio.Lock()  # one message's pieces at a time


async def _send_message(sock: Socket, prefix: list[Buffer], sender: Sender, control: bytes,
                        payload: Sequence[Buffer], *, check_route: bool = False) -> None:
    """Send a message's head and pieces. With `check_route` (a ROUTER_MANDATORY socket) the
    head goes tracked: `Unroutable` when the peer is not connected, before anything of the
    message went out, so that another way may carry it."""
    for index, message in enumerate(sender.frames(control, payload)):
        message = [*prefix, *message]
        if index == 0 and check_route:
            await sock.send_multipart(message, track=True)
            continue
        try:
            sock.send_multipart_nowait(message)
        except trio.WouldBlock:
            await sock.send_multipart(message)


class DataServer:
    """An RPC server's data channels: its PLAIN-vetted data socket, one record per channel.

    `deliver(control_identity, frames)` takes each whole message that arrives, as if it
    had come on the CURVE connection of that identity."""

    def __init__(self, plane: DataPlane, ctx: zmq.Context[Any] | None, limits: WireLimits,
                 deliver: Callable[[list[Buffer]], None]):
        if plane.authenticator is None:
            raise TransportError("serving data channels needs the context's authenticator")
        self.plane = plane
        self._ctx = ctx
        self._limits = limits
        self._deliver = deliver
        self._sock: Socket | None = None
        self._by_routing: dict[bytes, _Channel] = {}
        self._by_control: dict[bytes, _Channel] = {}
        self._closed = [0] * 6  # the traffic of channels closed or replaced (`_counts`)

    async def start(self, stack: contextlib.AsyncExitStack, host: str) -> None:
        auth = self.plane.authenticator
        assert auth is not None
        # ROUTER_MANDATORY: a peer at its high-water mark makes sends wait (not vanish), one
        # that is gone makes them fail loudly
        options = {zmq.PLAIN_SERVER: 1, zmq.ZAP_DOMAIN: DATA_ZAP_DOMAIN.encode(),
                   zmq.ROUTER_MANDATORY: 1, **_KEEPALIVE}
        self._sock = await stack.enter_async_context(open_socket(
            self._ctx, zmq.ROUTER, bind=f"tcp://{host}:*", options=options,
            max_msg_size=PIECE + _TAG + 4096, sndhwm=_HWM, rcvhwm=_HWM,
            on_message=self._on_message))
        auth.guard(self._sock.zmq_socket)
        stack.callback(self._close_all)

    @property
    def port(self) -> int:
        assert self._sock is not None and self._sock.endpoint is not None
        return int(self._sock.endpoint.rsplit(":", 1)[1])

    def open(self, control: bytes, request: DataOpen) -> DataOpened:
        """Open the channel a client asked for on the CURVE connection `control`."""
        if len(request.channel) != 16 or len(request.key) != _KEY:
            raise TransportError("a data channel needs a 16-byte id and a 32-byte key")
        mode = "plaintext" if request.mode == self.plane.mode == "plaintext" else "encrypted"
        up, down, password = channel_secrets(request.key, request.channel)
        plain = mode == "plaintext"
        channel = _Channel(request.channel, control, Sender(None if plain else down),
                           Receiver(None if plain else up, self._limits))
        for old in (self._by_routing.get(request.channel), self._by_control.get(control)):
            if old is not None:
                self._close(old)
        if len(self._by_routing) >= MAX_CHANNELS:
            raise TransportError(f"{len(self._by_routing)} data channels are open here: this "
                                 "connection stays on CURVE")
        self._by_routing[channel.routing] = self._by_control[control] = channel
        assert self.plane.authenticator is not None
        self.plane.authenticator.admit_data(channel.name, password)
        return DataOpened(self.port, mode)

    def channel_of(self, control: bytes) -> _Channel | None:
        """The open channel of CURVE connection `control` that replies may take, if any."""
        channel = self._by_control.get(control)
        return channel if channel is not None and channel.ready else None

    def close(self, control: bytes) -> None:
        channel = self._by_control.get(control)
        if channel is not None:
            self._close(channel)

    def _close(self, channel: _Channel) -> None:
        self._by_routing.pop(channel.routing, None)
        if self._by_control.get(channel.control) is channel:
            del self._by_control[channel.control]
        counts = _counts(channel.sender, channel.receiver)
        self._closed = [a + b for a, b in zip(self._closed, counts, strict=True)]
        if self.plane.authenticator is not None:
            self.plane.authenticator.revoke_data(channel.name)

    def _close_all(self) -> None:
        for channel in list(self._by_routing.values()):
            self._close(channel)

    async def send(self, channel: _Channel, control: bytes, payload: Sequence[Buffer]) -> None:
        """Send a message to `channel`'s client.

        Raises:
            Unroutable: its data connection is down; nothing was sent.
            TransportError: the socket closed (shutting down).
        """
        assert self._sock is not None
        async with channel.lock:
            await _send_message(self._sock, [channel.routing], channel.sender, control, payload,
                                check_route=True)

    def _on_message(self, frames: list[Buffer]) -> None:
        channel = self._by_routing.get(bytes(frames[0]))
        if channel is None:  # admitted, then closed: its frames are not read
            self._closed[4] += 1  # refused
            return
        try:
            message = channel.receiver.feed(frames[1:])
        except Refused as exc:
            log.warning("data channel %s: refused a piece: %s", fingerprint(channel.routing),
                        exc)
            return
        if message is None:
            return
        if channel.ready:
            self._deliver([channel.control, *message])
        elif message == [b""]:  # the client's probe: answer it, and the channel is in use
            channel.ready = True
            assert self._sock is not None
            with contextlib.suppress(trio.WouldBlock, TransportError):
                for piece in channel.sender.frames(b"", []):
                    self._sock.send_multipart_nowait([channel.routing, *piece])
        else:
            channel.receiver.refused += 1  # nothing but the probe comes first

    def stats(self) -> DataChannelStats:
        return _stats(self.plane.mode, [self._closed, *(_counts(c.sender, c.receiver)
                                                        for c in self._by_routing.values())])


class DataClient:
    """An RPC client's data channel: opened over its CURVE connection, then a PLAIN DEALER.

    `deliver(frames)` takes each whole message that arrives, ``[control, *payload]``."""

    def __init__(self, plane: DataPlane, ctx: zmq.Context[Any] | None, limits: WireLimits,
                 deliver: Callable[[list[Buffer]], None]):
        self.plane = plane
        self._ctx = ctx
        self._limits = limits
        self._deliver = deliver
        self._sock: Socket | None = None
        self._sender: Sender | None = None
        self._receiver: Receiver | None = None
        self._lock = trio.Lock()
        self._probed = trio.Event()
        self._up = False  # the data connection works: from the probe's answer to a disconnect
        self._address = ""
        self.mode = ""  # "" while opening; the channel's mode once open; "off" without one

    @property
    def ready(self) -> bool:
        """Whether large messages may take the channel now: open, and its connection up (while
        ZeroMQ reconnects a broken one, they go on the CURVE connection)."""
        return self._sock is not None and self._up

    async def run(self, call: Callable[..., Awaitable[Any]], endpoint: str) -> None:
        """Open the channel (``_data.open`` through `call`), make one round trip on it (a
        probe: an empty message each way), then hold its socket until cancelled. A server
        without data channels, one that cannot be reached, or a data port that does not
        answer within `PROBE_S` (a firewall) leaves this client on its CURVE connection."""
        channel, key = new_channel()
        try:
            opened = await call("_data.open", DataOpen(channel, key, self.plane.mode),
                                result_type=DataOpened)
        except TransportError as exc:
            log.debug("no data channel to %s: %s", endpoint, exc)
            self.mode = "off"
            return
        up, down, password = channel_secrets(key, channel)
        plain = opened.mode == "plaintext"
        if plain and self.plane.mode != "plaintext":
            log.warning("the server at %s answered with a plaintext data channel to an "
                        "encrypted request: not used", endpoint)
            self.mode = "off"
            return
        host = endpoint.rsplit(":", 1)[0]
        options = {zmq.ROUTING_ID: channel,
                   zmq.PLAIN_USERNAME: admission_name(channel).encode(),
                   zmq.PLAIN_PASSWORD: password.encode(), **_KEEPALIVE}
        self._sender = Sender(None if plain else up)
        self._receiver = Receiver(None if plain else down, self._limits)
        address = self._address = f"{host}:{opened.port}"
        async with open_socket(self._ctx, zmq.DEALER, connect=address, options=options,
                               max_msg_size=PIECE + _TAG + 4096, sndhwm=_HWM, rcvhwm=_HWM,
                               on_message=self._on_message) as sock, self._watching(sock):
            for piece in self._sender.frames(b"", []):
                await sock.send_multipart(piece)
            with trio.move_on_after(PROBE_S):
                await self._probed.wait()
            if not self._probed.is_set():
                log.warning("the data channel at %s did not answer within %g s (a firewall?): "
                            "large messages to %s go on its CURVE connection", address,
                            PROBE_S, endpoint)
                self.mode = "off"
                return
            self._sock, self.mode, self._up = sock, opened.mode, True
            try:
                await trio.sleep_forever()
            finally:
                self._sock = None

    @contextlib.asynccontextmanager
    async def _watching(self, sock: Socket) -> AsyncIterator[None]:
        """Follow the data connection through ZeroMQ's monitor events: down from a
        disconnect until the next handshake succeeds."""
        zsock = sock.zmq_socket
        address = f"inproc://omni-data-monitor-{secrets.token_hex(8)}"
        zsock.monitor(address, zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        try:
            async with open_socket(zsock.context, zmq.PAIR, connect=address,
                                   on_message=self._on_event):
                yield
        finally:
            with contextlib.suppress(zmq.ZMQError):
                zsock.disable_monitor()

    def _on_event(self, frames: list[Buffer]) -> None:
        from zmq.utils.monitor import parse_monitor_message

        event = parse_monitor_message([bytes(frame) for frame in frames])["event"]
        if event == zmq.EVENT_DISCONNECTED and self._up:
            self._up = False
            log.info("the data channel at %s is down: large messages take the CURVE "
                     "connection until it is back", self._address)
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and self._probed.is_set():
            self._up = True

    async def send(self, control: bytes, payload: Sequence[Buffer]) -> None:
        sock, sender = self._sock, self._sender
        assert sock is not None and sender is not None
        async with self._lock:
            await _send_message(sock, [], sender, control, payload)

    def _on_message(self, frames: list[Buffer]) -> None:
        assert self._receiver is not None
        try:
            message = self._receiver.feed(frames)
        except Refused as exc:
            log.warning("data channel: refused a piece from the server: %s", exc)
            return
        if message is None:
            return
        if self._probed.is_set():
            self._deliver(message)
        elif message == [b""]:  # the probe's answer
            self._probed.set()

    def stats(self) -> DataChannelStats:
        if self._sender is None or self._receiver is None:
            return _stats(self.mode, [])
        return _stats(self.mode, [_counts(self._sender, self._receiver)])


def _counts(sender: Sender, receiver: Receiver) -> list[int]:
    """One channel's traffic, in `DataChannelStats`'s order after the mode."""
    return [sender.messages, receiver.messages, sender.bytes, receiver.bytes,
            receiver.refused, receiver.dropped]


def _stats(mode: str, counts: Iterable[list[int]]) -> DataChannelStats:
    return DataChannelStats(mode, *(sum(column) for column in zip([0] * 6, *counts,
                                                                  strict=True)))


def fingerprint(channel: bytes) -> str:
    """A short, loggable name of a channel (never its key)."""
    return hashlib.sha256(channel).hexdigest()[:8]
