"""The wire codec: typed msgspec messages as msgpack, versioned and size-limited. No pickle.

A multipart ZeroMQ message is one *control* frame (a `Message`, at most
`WireLimits.max_control_bytes`) followed by zero or more *payload* frames of raw bytes (each at
most `max_payload_bytes`, at most `max_payload_frames` of them). The control frame is the
msgpack array ``[PROTOCOL_VERSION, message]`` where ``message`` is a tagged array
``[tag, field, ...]`` (msgspec ``array_like`` structs: short and fast to decode).

Bodies (a request's arguments, a response's value) travel as pre-encoded msgpack
(`msgspec.Raw`) so that the receiver can decode them straight into the type its handler
declares. Decoding anything that arrived from the network goes through `Codec.decode` and
`Codec.decode_body`, which raise `WireError` and nothing else, and count what they reject.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import msgspec

from omni.transport.errors import WireError

__all__ = [
    "MAX_CONTROL_BYTES", "MAX_PAYLOAD_BYTES", "MAX_PAYLOAD_FRAMES", "NIL", "PROTOCOL_VERSION",
    "AnyMessage", "Cancel", "Codec", "Error", "Heartbeat", "Message", "Request", "Response",
    "WireLimits", "WireStats", "decode", "encode", "payload_nbytes", "stats",
]

PROTOCOL_VERSION: Final = 1
MAX_CONTROL_BYTES: Final = 1 << 20  # 1 MiB: control messages are descriptors, not data
MAX_PAYLOAD_BYTES: Final = 64 << 20  # 64 MiB per payload frame
MAX_PAYLOAD_FRAMES: Final = 1024  # payload frames per message

NIL: Final = msgspec.Raw(b"\xc0")  # msgpack nil: the body of a call without arguments


class Message(msgspec.Struct, tag_field="kind", array_like=True, frozen=True,
              forbid_unknown_fields=True):
    """Base of the control messages; each subclass is one kind, tagged on the wire."""


class Request(Message, tag="req"):
    """A call of `method`; `id` is unique among the caller's calls in flight, or 0 for a
    notice: a one-way message that is never answered (`RPCClient.notify`)."""

    id: int
    method: str
    body: msgspec.Raw = NIL


class Response(Message, tag="res"):
    """The successful reply to request `id`; `body` is the handler's encoded return value."""

    id: int
    body: msgspec.Raw = NIL


class Error(Message, tag="err"):
    """The failed reply to request `id`: the remote error's type name, message and (a
    handler's error) traceback text."""

    id: int
    type: str
    message: str
    traceback: str = ""


class Heartbeat(Message, tag="hb"):
    """A ping from a client, echoed with the same `seq` by the server."""

    seq: int


class Cancel(Message, tag="cancel"):
    """The caller gave up on request `id` (cancelled or timed out): stop its handler."""

    id: int


AnyMessage = Request | Response | Error | Heartbeat | Cancel
_TAGS: Final = frozenset(cls.__struct_config__.tag for cls in (Request, Response, Error,
                                                                 Heartbeat, Cancel))


class _EnvelopeOut(msgspec.Struct, array_like=True, frozen=True):
    """The control frame as written: version first, so that any future layout is detectable."""

    v: int
    msg: AnyMessage


class _EnvelopeIn(msgspec.Struct, array_like=True, frozen=True):
    """The control frame as first read: the version is checked before the message is."""

    v: int
    msg: msgspec.Raw


class _Envelope(msgspec.Struct, array_like=True, frozen=True):
    """The control frame read in one pass: the fast path for well-formed frames (a frame
    that fails it is read again in two passes, to say why)."""

    v: int
    msg: AnyMessage


class _TagOnly(msgspec.Struct, array_like=True, frozen=True):
    """Reads only a message's tag, to tell an unknown kind from a malformed known one."""

    kind: str


@dataclass(frozen=True, slots=True)
class WireLimits:
    """The largest messages a codec accepts, in either direction."""

    max_control_bytes: int = MAX_CONTROL_BYTES
    max_payload_bytes: int = MAX_PAYLOAD_BYTES
    max_payload_frames: int = MAX_PAYLOAD_FRAMES


@dataclass(frozen=True, slots=True)
class WireStats:
    """What a codec has seen: messages encoded and decoded, and rejected ones by reason."""

    encoded: int
    decoded: int
    rejected_oversize: int
    rejected_malformed: int
    rejected_unknown: int
    rejected_version: int

    @property
    def rejected(self) -> int:
        """All rejected messages, whatever the reason."""
        return (self.rejected_oversize + self.rejected_malformed + self.rejected_unknown
                + self.rejected_version)


def _nbytes(frame: Any) -> int:
    return len(frame) if type(frame) is bytes else memoryview(frame).nbytes


def payload_nbytes(frames: Any) -> int:
    """The bytes of payload frames, all together."""
    return sum(_nbytes(frame) for frame in frames)


# Everything msgspec (or the interpreter, for deeply nested input) raises on hostile bytes.
_DECODE_FAILURES = (msgspec.MsgspecError, RecursionError, ValueError, TypeError, OverflowError)


class Codec:
    """One reusable msgpack `Encoder` and typed `Decoder`s (configured once: the hot path),
    the size limits, and counters of what was rejected.

    Each server and client owns one, so its `stats()` are its own; the module functions
    `encode`, `decode` and `stats` use a shared default codec.
    """

    def __init__(self, limits: WireLimits | None = None):
        self.limits = limits if limits is not None else WireLimits()
        self._encoder = msgspec.msgpack.Encoder()
        self._whole = msgspec.msgpack.Decoder(_Envelope)
        self._envelope = msgspec.msgpack.Decoder(_EnvelopeIn)
        self._message = msgspec.msgpack.Decoder(AnyMessage)
        self._tag = msgspec.msgpack.Decoder(_TagOnly)
        self._body_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}
        self._encoded = self._decoded = 0
        self._oversize = self._malformed = self._unknown = self._version = 0

    # -- encoding (our own messages: too large is the caller's error) ------------------------

    def encode(self, msg: AnyMessage) -> bytes:
        """The control frame for `msg`. Raises `WireError` if it exceeds the control limit."""
        frame = self._encoder.encode(_EnvelopeOut(PROTOCOL_VERSION, msg))
        if len(frame) > self.limits.max_control_bytes:
            raise WireError(f"{type(msg).__name__} of {len(frame)} bytes exceeds the "
                            f"{self.limits.max_control_bytes}-byte control message limit")
        self._encoded += 1
        return frame

    def encode_body(self, value: Any) -> msgspec.Raw:
        """`value` (a msgspec Struct or any msgpack-able value) pre-encoded as a body.

        Raises `WireError` if it cannot be encoded or exceeds the control limit.
        """
        if value is None:
            return NIL
        try:
            raw = self._encoder.encode(value)
        except (TypeError, ValueError, OverflowError) as exc:
            raise WireError(f"cannot encode a {type(value).__name__} body: {exc}") from None
        if len(raw) > self.limits.max_control_bytes:
            raise WireError(f"body of {len(raw)} bytes exceeds the "
                            f"{self.limits.max_control_bytes}-byte control message limit; "
                            "send bulk bytes as payload frames")
        return msgspec.Raw(raw)

    def payload_fits(self, frames: Any) -> bool:
        """Whether received payload frames keep to the limits (ZeroMQ's own message size
        limit has a margin for encryption, so a frame a little over it arrives)."""
        limits = self.limits
        return len(frames) <= limits.max_payload_frames and all(
            _nbytes(frame) <= limits.max_payload_bytes for frame in frames)

    def check_payload(self, frames: Any) -> None:
        """Raise `WireError` if `frames` (a list of payload buffers) breaks the limits."""
        limits = self.limits
        if len(frames) > limits.max_payload_frames:
            raise WireError(f"{len(frames)} payload frames exceed the limit of "
                            f"{limits.max_payload_frames}")
        for frame in frames:
            if _nbytes(frame) > limits.max_payload_bytes:
                raise WireError(f"a payload frame of {_nbytes(frame)} bytes exceeds the "
                                f"{limits.max_payload_bytes}-byte limit")

    # -- decoding (bytes from the network: only WireError, and counted) ----------------------

    def decode(self, frame: Any) -> AnyMessage:
        """The message in control frame `frame` (bytes or a buffer).

        Raises `WireError` (and nothing else) for an oversize frame, another protocol
        version, an unknown message kind, or bytes that are not a well-formed message.
        """
        size = _nbytes(frame)
        if size > self.limits.max_control_bytes:
            self._oversize += 1
            raise WireError(f"control frame of {size} bytes exceeds the "
                            f"{self.limits.max_control_bytes}-byte limit")
        try:  # one pass; a frame that fails it is read again below, to say why
            whole = self._whole.decode(frame)
        except _DECODE_FAILURES:
            pass
        else:
            if whole.v == PROTOCOL_VERSION:
                self._decoded += 1
                return whole.msg
        try:
            envelope = self._envelope.decode(frame)
        except _DECODE_FAILURES as exc:
            self._malformed += 1
            raise WireError(f"malformed control frame: {exc}") from None
        if envelope.v != PROTOCOL_VERSION:
            self._version += 1
            raise WireError(f"protocol version {envelope.v} (this side speaks "
                            f"{PROTOCOL_VERSION})")
        try:
            msg = self._message.decode(envelope.msg)
        except _DECODE_FAILURES as exc:
            raise self._reject_message(envelope.msg, exc) from None
        self._decoded += 1
        return msg

    def _reject_message(self, raw: msgspec.Raw, exc: Exception) -> WireError:
        """Count and describe a message that did not decode: unknown kind, or malformed."""
        try:
            kind: str | None = self._tag.decode(raw).kind
        except _DECODE_FAILURES:
            kind = None
        if kind is not None and kind not in _TAGS:
            self._unknown += 1
            return WireError(f"unknown message kind {kind!r}")
        self._malformed += 1
        return WireError(f"malformed message: {exc}")

    def decode_body(self, raw: msgspec.Raw, body_type: Any = Any) -> Any:
        """Decode a body into `body_type` (a msgspec Struct, a builtin type, ``Any`` ...).

        Raises `WireError` (and nothing else) if it does not decode or does not match.
        """
        decoder = self._body_decoders.get(body_type)
        if decoder is None:
            decoder = self._body_decoders[body_type] = msgspec.msgpack.Decoder(body_type)
        try:
            return decoder.decode(raw)
        except _DECODE_FAILURES as exc:
            self._malformed += 1
            name = getattr(body_type, "__name__", repr(body_type))
            raise WireError(f"body does not decode as {name}: "
                            f"{exc}") from None

    def stats(self) -> WireStats:
        """Counters of encoded, decoded and rejected messages."""
        return WireStats(self._encoded, self._decoded, self._oversize, self._malformed,
                         self._unknown, self._version)

    def __repr__(self) -> str:
        s = self.stats()
        return (f"<Codec v{PROTOCOL_VERSION} encoded={s.encoded} decoded={s.decoded} "
                f"rejected={s.rejected}>")


_default = Codec()


def encode(msg: AnyMessage) -> bytes:
    """`Codec.encode` on the shared default codec."""
    return _default.encode(msg)


def decode(frame: Any) -> AnyMessage:
    """`Codec.decode` on the shared default codec: raises `WireError` and nothing else."""
    return _default.decode(frame)


def stats() -> WireStats:
    """The shared default codec's counters."""
    return _default.stats()
