"""Moving the out-of-band buffers of values (`omni.transport.values`) between processes.

Handles travel, bytes move once, by locality:

- **same host**: the producer copies a buffer into a shared-memory segment of its own and sends
  a `BufferRef` naming it; the consumer maps the segment and the value's array views it (no
  msgpack copy, no encryption pass: the memory never leaves the machine). The consumer's array
  holds a *lease*: when the array (and every view or tensor made from it) is gone, the lease
  ends and the producer may reuse the segment. Leases go back in batches (`take_releases` on
  the consumer, `release` on the producer), riding on the calls and replies the two already
  exchange. A peer that is gone, or done (a driver that finished), is `forget`-ten: the
  segments it still held are unlinked rather than reused (it may still map them: a driver that
  stopped keeps the values it received), and the mappings of its segments are dropped.
- **another host** (or ``OMNI_PAYLOAD_SHM=0``): a buffer of up to `CHUNK` bytes goes as a
  ZeroMQ payload frame after the body, zero-copy on both ends (the consumer's array views the
  frame). A larger one is a *transfer*: the ref names it, and its bytes follow in chunks of
  `CHUNK`, one message each, that the consumer takes in order (`chunk` on the producer,
  `accept` on the consumer; the cluster pushes or pulls them one at a time). So no frame limit
  caps a value, and neither side holds more than the value and one chunk: the consumer's
  array is allocated once and each chunk copied into place as it lands.

Why a pool: a fresh segment costs a page fault and a page clear per 4 KiB on first write (here
~10x a memcpy), so segments up to `POOL_MAX` bytes are kept mapped and reused, and consumers
keep their mappings of a producer's segments, until that producer is forgotten. Larger buffers
get a segment of their own, written with pwrite (the producer never maps it, so its memory
does not grow) and unlinked when the lease ends. `shrink` empties the pool (a worker does when
its last driver has gone: nobody is left to reuse it).

Settings (environment): ``OMNI_PAYLOAD_SHM`` (``0``: this process sends every buffer as frames,
as between hosts; it still maps what others send it through shared memory),
``OMNI_PAYLOAD_MAX`` (the largest value's out-of-band bytes, default ``64GiB``: larger values
are refused with `PayloadTooLarge`), ``OMNI_PAYLOAD_POOL`` (segment bytes kept for reuse,
default ``1GiB``).
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import secrets
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import msgspec

from omni._shm import Segment, owner_stamp, reclaim_dead, stamp_owner
from omni._units import parse_size
from omni.transport.errors import TransportError, WireError

__all__ = ["CHUNK", "SHM_MIN", "BufferRef", "PayloadMover", "PayloadSettingError",
           "PayloadTooLarge", "payload_mover", "reclaim_dead_segments"]

SHM_MIN = 256 << 10  # buffers this large go through shared memory on one host
CHUNK = 64 << 20  # the largest payload frame a buffer is split into (the wire's frame limit)
POOL_MAX = 256 << 20  # larger buffers get a segment of their own, never kept
_PAGE = mmap.PAGESIZE


class PayloadTooLarge(TransportError):
    """A value's out-of-band bytes exceed the ``OMNI_PAYLOAD_MAX`` setting."""


class PayloadSettingError(TransportError):
    """An ``OMNI_PAYLOAD_*`` environment setting is not a size."""


class BufferRef(msgspec.Struct, array_like=True, frozen=True):
    """Where one out-of-band buffer is: `frames` payload frames, a shared-memory segment
    (`segment`, `lease`), or transfer `transfer`, whose chunks come in messages of their own."""

    nbytes: int
    frames: int = 0
    segment: str = ""
    lease: int = 0
    transfer: int = 0


class _Incoming:
    """A transfer being received: the buffer its chunks are copied into, in order."""

    __slots__ = ("buffer", "received")

    def __init__(self, nbytes: int):
        import numpy

        self.buffer = numpy.empty(nbytes, numpy.uint8)  # pages are touched as chunks land
        self.received = 0


class PayloadMover:
    """A process's payload movement, both as producer and as consumer (see the module doc).

    Thread-safe: leases end from whichever thread drops the last array.
    """

    def __init__(self, *, shm: bool | None = None, max_bytes: int | None = None,
                 pool_bytes: int | None = None, chunk: int = CHUNK):
        self.shm = _env_flag("OMNI_PAYLOAD_SHM", True) if shm is None else shm
        self.max_bytes = max_bytes if max_bytes is not None else _env_size(
            "OMNI_PAYLOAD_MAX", "64GiB")
        self.pool_bytes = pool_bytes if pool_bytes is not None else _env_size(
            "OMNI_PAYLOAD_POOL", "1GiB")
        self.chunk = chunk
        # omni-pay-PID-tSTART-TOKEN-N: whose, for the reclaim of a killed process's segments
        self._prefix = f"omni-pay-{owner_stamp()}-{secrets.token_hex(4)}"
        self._names = itertools.count(1)
        self._leases = itertools.count(1)
        self._lock = threading.Lock()
        # Ours, by name: pooled ones mapped here, a one-off large one written unmapped.
        self._segments: dict[str, Segment] = {}
        self._leased: dict[int, tuple[Segment, str]] = {}  # lease -> (segment, holding peer)
        self._busy: set[str] = set()  # names of ours under a lease
        # theirs, by name, most recent last: (the peer it came from, the segment mapped here)
        self._maps: OrderedDict[str, tuple[str, Segment]] = OrderedDict()
        self._mapped_bytes = 0
        self._released: dict[str, list[int]] = {}  # producer peer -> leases we ended
        self._transfers = itertools.count(1)
        self._sending: dict[int, tuple[str, memoryview]] = {}  # transfer -> (peer, buffer)
        self._receiving: dict[tuple[str, int], _Incoming] = {}  # (peer, transfer) ->
        self._counts = dict.fromkeys(("shm_out", "frames_out", "shm_in", "frames_in",
                                      "transfers_out", "transfers_in", "bytes_out", "bytes_in",
                                      "segments_created"), 0)

    # -- producing ---------------------------------------------------------------------------

    def pack(self, buffers: Sequence[memoryview], *, peer: str, same_host: bool
             ) -> tuple[list[BufferRef], list[Any]]:
        """The refs (for the message body) and the frames (after it) that carry `buffers` to
        `peer`. Shared-memory leases are held for `peer` until it releases them.

        Raises:
            PayloadTooLarge: the buffers add up to more than `max_bytes`.
        """
        total = sum(b.nbytes for b in buffers)
        if total > self.max_bytes:
            raise PayloadTooLarge(f"a value of {total:,} bytes exceeds the {self.max_bytes:,}-"
                                  "byte limit on values between processes (OMNI_PAYLOAD_MAX)")
        refs: list[BufferRef] = []
        frames: list[Any] = []
        for buffer in buffers:
            if self.shm and same_host and buffer.nbytes >= SHM_MIN:
                refs.append(self._to_segment(buffer, peer))
                continue
            if buffer.nbytes > self.chunk:
                transfer = next(self._transfers)
                with self._lock:
                    self._sending[transfer] = (peer, buffer)
                refs.append(BufferRef(buffer.nbytes, transfer=transfer))
                self._count(transfers_out=1, bytes_out=buffer.nbytes)
                continue
            refs.append(BufferRef(buffer.nbytes, frames=1))
            frames.append(buffer)
            self._count(frames_out=1, bytes_out=buffer.nbytes)
        return refs, frames

    def chunk_of(self, peer: str, transfer: int, offset: int) -> memoryview:
        """The chunk of outgoing `transfer` that starts at `offset`, for `peer`; taking the
        last one ends the transfer.

        Raises:
            WireError: no such transfer for `peer`, or not a chunk's offset.
        """
        with self._lock:
            entry = self._sending.get(transfer)
            if entry is None or entry[0] != peer:
                raise WireError(f"no payload transfer {transfer} for this peer")
            buffer = entry[1]
            if not 0 <= offset < buffer.nbytes or offset % self.chunk:
                raise WireError(f"offset {offset} is not a chunk of transfer {transfer}")
            end = min(offset + self.chunk, buffer.nbytes)
            if end == buffer.nbytes:
                del self._sending[transfer]
        return buffer[offset:end]

    def accept(self, peer: str, transfer: int, nbytes: int, offset: int, data: Any) -> None:
        """Chunk `data` of `peer`'s `transfer` (of `nbytes` in all), which starts at `offset`:
        chunks come in order.

        Raises:
            PayloadTooLarge: `nbytes` is over `max_bytes`.
            WireError: the chunk is not the next one, or overruns the transfer.
        """
        view = memoryview(data).cast("B")
        key = (peer, transfer)
        with self._lock:
            incoming = self._receiving.get(key)
            if incoming is None:
                if offset != 0:
                    raise WireError(f"payload transfer {transfer} began at offset {offset}")
                if not 0 < nbytes <= self.max_bytes:
                    raise PayloadTooLarge(f"a value of {nbytes:,} bytes exceeds the "
                                          f"{self.max_bytes:,}-byte limit on values between "
                                          "processes (OMNI_PAYLOAD_MAX)")
                incoming = self._receiving[key] = _Incoming(nbytes)
        if offset != incoming.received or incoming.buffer.nbytes != nbytes \
                or offset + view.nbytes > nbytes or not view.nbytes:
            self.drop_transfers(peer, [transfer])
            raise WireError(f"chunk of {view.nbytes} bytes at offset {offset} does not follow "
                            f"{incoming.received} of {nbytes} bytes of transfer {transfer}")
        incoming.buffer[offset:offset + view.nbytes] = view
        incoming.received += view.nbytes

    def drop_transfers(self, peer: str, transfers: Sequence[int]) -> None:
        """Forget transfers to or from `peer` (a call that failed half-way)."""
        with self._lock:
            for transfer in transfers:
                self._receiving.pop((peer, transfer), None)
                entry = self._sending.get(transfer)
                if entry is not None and entry[0] == peer:
                    del self._sending[transfer]

    def _to_segment(self, buffer: memoryview, peer: str) -> BufferRef:
        nbytes = buffer.nbytes
        with self._lock:
            segment = self._free_segment(nbytes) if nbytes <= POOL_MAX else None
            if segment is None:
                segment = self._new_segment(nbytes)
            lease = next(self._leases)
            self._leased[lease] = (segment, peer)
            self._busy.add(segment.name)
        try:
            if segment.mapped:
                segment.buffer[:nbytes] = buffer
            else:
                segment.write(buffer)
        except BaseException:
            self.release(peer, [lease])
            raise
        self._count(shm_out=1, bytes_out=nbytes)
        return BufferRef(nbytes, segment=segment.name, lease=lease)

    def _free_segment(self, nbytes: int) -> Segment | None:
        fits = [s for s in self._segments.values() if s.name not in self._busy and s.mapped
                and nbytes <= s.size <= 2 * nbytes + _PAGE]
        return min(fits, key=lambda s: s.size) if fits else None

    def _new_segment(self, nbytes: int) -> Segment:
        pooled = nbytes <= POOL_MAX
        size = max(_PAGE, -(-nbytes // _PAGE) * _PAGE)
        # Reserved whole: a full /dev/shm is an error here, not a SIGBUS when written.
        segment = Segment.create(f"{self._prefix}-{next(self._names)}", size, mapped=pooled,
                                 populate=pooled)
        self._segments[segment.name] = segment
        self._counts["segments_created"] += 1
        return segment

    def release(self, peer: str, leases: Sequence[int]) -> None:
        """`peer` is done with these leases: their segments may be reused (or are unlinked)."""
        with self._lock:
            for lease in leases:
                entry = self._leased.get(lease)
                if entry is None or entry[1] != peer:
                    continue  # unknown, or not that peer's: ignore
                del self._leased[lease]
                self._busy.discard(entry[0].name)
            self._trim()

    def forget(self, peer: str) -> None:
        """`peer` is gone or done: unlink the segments it still held a lease on (never reused:
        it may still map them; its mappings stay valid and the memory goes with the last of
        them), drop our mappings of its segments and its transfers.

        Why unlink and not pool: a driver that finished may still hold arrays it received, and
        a peer taken for dead may only have stalled; a segment reused under either would
        change their bytes."""
        with self._lock:
            for lease in [k for k, (_, p) in self._leased.items() if p == peer]:
                self._unlink(self._leased.pop(lease)[0])
            self._released.pop(peer, None)
            for transfer in [t for t, (p, _) in self._sending.items() if p == peer]:
                del self._sending[transfer]
            for key in [k for k in self._receiving if k[0] == peer]:
                del self._receiving[key]
            self._unmap(peer)
            self._trim()

    def unmap(self, peer: str) -> None:
        """Drop our mappings of `peer`'s segments (each is unmapped once the arrays made
        from it are gone), leaving its leases and transfers as they are: for a process done
        with `peer` while others here may still be using it."""
        with self._lock:
            self._unmap(peer)

    def _unmap(self, peer: str) -> None:
        for name in [n for n, (p, _) in self._maps.items() if p == peer]:
            self._mapped_bytes -= self._maps.pop(name)[1].size

    def shrink(self) -> int:
        """Unlink every free segment of the pool (leased ones stay); how many. For a process
        whose peers are all gone: the pool only pays off while someone sends again."""
        with self._lock:
            free = [s for s in self._segments.values() if s.name not in self._busy]
            for segment in free:
                self._unlink(segment)
        return len(free)

    def _trim(self) -> None:
        """Unlink free segments beyond the pool budget (one-off large ones always)."""
        kept = 0
        for segment in sorted(self._segments.values(), key=lambda s: s.size):
            if segment.name in self._busy:
                continue
            if segment.mapped and kept + segment.size <= self.pool_bytes:
                kept += segment.size
                continue
            self._unlink(segment)

    def _unlink(self, segment: Segment) -> None:
        del self._segments[segment.name]
        self._busy.discard(segment.name)
        segment.close()  # a copy into it still running: unmapped when that ends

    # -- consuming ---------------------------------------------------------------------------

    def unpack(self, refs: Sequence[BufferRef], frames: Sequence[Any], *, peer: str
               ) -> list[Any]:
        """The buffers `refs` describe (from `peer`), for `omni.transport.values.unpack_value`.

        Raises:
            WireError: the refs and the frames do not add up, or a segment cannot be mapped.
        """
        buffers: list[Any] = []
        position = 0
        for ref in refs:
            if ref.transfer:
                with self._lock:
                    incoming = self._receiving.pop((peer, ref.transfer), None)
                if incoming is None or incoming.received != ref.nbytes \
                        or incoming.buffer.nbytes != ref.nbytes:
                    raise WireError(f"payload transfer {ref.transfer} did not arrive whole")
                buffers.append(incoming.buffer)
                self._count(transfers_in=1, bytes_in=ref.nbytes)
            elif ref.frames:
                if ref.frames != 1 or position >= len(frames):
                    raise WireError(f"a buffer arrived in {ref.frames} frames, not 1")
                buffers.append(_frame(frames[position], ref.nbytes))
                position += 1
                self._count(frames_in=1, bytes_in=ref.nbytes)
            else:
                buffers.append(self._unpack_shm(ref, peer))
                self._count(shm_in=1, bytes_in=ref.nbytes)
        if position != len(frames):
            raise WireError(f"{len(frames)} payload frames arrived for {position}")
        return buffers

    def _unpack_shm(self, ref: BufferRef, peer: str) -> Any:
        import numpy

        segment = self._map(ref, peer)
        # The holder exports the mapped bytes: every array, view or tensor made from them keeps
        # it alive (NumPy collapses a view's base to the first non-array object), so the lease
        # ends exactly when the last of them goes.
        holder = (ctypes.c_ubyte * ref.nbytes).from_buffer(segment.buffer)
        weakref.finalize(holder, self._ended, peer, ref.lease)
        return numpy.frombuffer(holder, numpy.uint8)

    def _map(self, ref: BufferRef, peer: str) -> Segment:
        if not ref.segment.startswith("omni-pay-"):
            raise WireError(f"not a payload segment: {ref.segment!r}")
        with self._lock:
            cached = self._maps.get(ref.segment)
            if cached is not None and cached[1].size >= ref.nbytes:
                self._maps.move_to_end(ref.segment)
                return cached[1]
        try:
            segment = Segment.attach(ref.segment, populate=True)
        except (OSError, ValueError) as exc:
            raise WireError(f"payload segment {ref.segment!r} cannot be mapped: {exc}") from None
        if segment.size < ref.nbytes:
            segment.close()
            raise WireError(f"payload segment {ref.segment} holds {segment.size} bytes, not "
                            f"{ref.nbytes}")
        if segment.size <= POOL_MAX:
            with self._lock:
                replaced = self._maps.pop(ref.segment, None)  # a smaller mapping of it
                if replaced is not None:
                    self._mapped_bytes -= replaced[1].size
                self._maps[ref.segment] = (peer, segment)
                self._mapped_bytes += segment.size
                while self._mapped_bytes > self.pool_bytes and len(self._maps) > 1:
                    # dropped, not closed: unmapped once the arrays made from it go
                    _, (_, old) = self._maps.popitem(last=False)
                    self._mapped_bytes -= old.size
        return segment

    def _ended(self, peer: str, lease: int) -> None:
        with self._lock:
            self._released.setdefault(peer, []).append(lease)

    def take_releases(self, peer: str) -> list[int]:
        """The leases of `peer`'s segments that ended here since the last call."""
        with self._lock:
            return self._released.pop(peer, [])

    # -- housekeeping ------------------------------------------------------------------------

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def stats(self) -> dict[str, int]:
        """Counters, plus the segments this process owns, how many are leased, and their bytes."""
        with self._lock:
            return {**self._counts, "segments": len(self._segments),
                    "leased": len(self._leased), "transfers": len(self._sending)
                    + len(self._receiving),
                    "segment_bytes": sum(s.size for s in self._segments.values()),
                    "mapped_bytes": self._mapped_bytes}

    def close(self) -> None:
        """Unlink every segment this process owns (arrays already mapped elsewhere stay valid)."""
        with self._lock:
            for segment in list(self._segments.values()):
                self._unlink(segment)
            self._leased.clear()
            self._maps.clear()
            self._mapped_bytes = 0

    def __repr__(self) -> str:
        stats = self.stats()
        return (f"<PayloadMover shm={'on' if self.shm else 'off'} segments={stats['segments']} "
                f"leased={stats['leased']}>")


def _frame(frame: Any, nbytes: int) -> memoryview:
    view = memoryview(frame).cast("B")
    if view.nbytes != nbytes:
        raise WireError(f"a payload frame of {view.nbytes} bytes arrived for {nbytes}")
    return view


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value not in ("0", "false", "no", "off")


def _env_size(name: str, default: str) -> int:
    value = os.environ.get(name) or default
    try:
        return parse_size(value)
    except ValueError as exc:
        raise PayloadSettingError(f"{name}={value!r}: {exc}") from None


def reclaim_dead_segments() -> int:
    """Unlink the payload segments of processes that are gone (killed before they could);
    how many. A segment names its owner (pid and start time); one whose owner is alive, or
    whose pid this process cannot see, is left alone."""
    return len(reclaim_dead("omni-pay-*", lambda path: stamp_owner(path.name.split("-")[2:])))


_mover: PayloadMover | None = None
_mover_lock = threading.Lock()


def payload_mover() -> PayloadMover:
    """The process's `PayloadMover` (its segments are unlinked when the process exits; those
    of processes killed before they could are unlinked when the next one starts)."""
    global _mover
    with _mover_lock:
        if _mover is None:
            import atexit

            reclaim_dead_segments()
            _mover = PayloadMover()
            atexit.register(_mover.close)
        return _mover
