"""Moving bytes between processes: the one mover, for the out-of-band buffers of stage values
(`omni.transport.values`) and for KV pages (a page batch is a buffer with a descriptor: its
layout, its keys and, between hosts, a checksum). Handles travel, bytes move once, by the
cheapest path for where the consumer is.

**Buffers of values** (`PayloadMover`, one per process: `payload_mover()`):

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

**KV pages** (`choose_mover` by locality, `unpack` whatever mover sent them):

- `same_process`: `SameProcessMover` hands over the tensor itself (the header names it in
  this process's registry; no frames).
- `same_machine`: `SharedMemoryMover` sends the store's `PageDescriptor`; the consumer maps
  the same shared memory (no frames).
- `remote`: `FrameMover` sends the bytes as one zero-copy frame, with the layout, the keys
  and an xxh3-128 checksum in the header.

A page mover is bound to the `KVLayout` its side expects: `unpack` refuses pages of any other
layout, a checksum that does not match, a lease that ended, or an id from another process,
always with a `TransportError` (`WireError` for a header or frames that do not add up). The
caller counts that as a miss and recomputes: a mover never returns wrong pages.

Torch-free at import: processes that move only values never load torch; the page movers load
it (and the KV store's handles) when they first pack or unpack pages.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import secrets
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol, TypeAlias

import msgspec
import xxhash

from omni._shm import Segment, owner_stamp, reclaim_dead, stamp_owner
from omni._units import parse_size
from omni.kv.descriptors import LayoutSpec, PageDescriptor
from omni.kv.errors import KVError
from omni.kv.keys import KeyField, check_keys, invalid_key
from omni.transport.errors import TransportError, WireError
from omni.transport.host import host_id

if TYPE_CHECKING:
    import torch

    from omni.kv.handle import Lease, OpenedPages
    from omni.kv.layout import KVLayout
    from omni.kv.store import KVStore

__all__ = [
    "CHUNK", "SHM_MIN", "BufferRef", "FrameHeader", "FrameMover", "Locality", "Mover",
    "MoverHeader", "MoverStats", "PageBatch", "PageSource", "PayloadMover",
    "PayloadSettingError", "PayloadTooLarge", "ReceivedPages", "SameProcessHeader",
    "SameProcessMover", "SharedMemoryHeader", "SharedMemoryMover", "choose_mover", "host_id",
    "locality", "mover_for", "payload_mover", "reclaim_dead_segments", "unpack",
]

SHM_MIN = 256 << 10  # buffers this large go through shared memory on one host
CHUNK = 64 << 20  # the largest payload frame a buffer is split into (the wire's frame limit)
POOL_MAX = 256 << 20  # larger buffers get a segment of their own, never kept
_PAGE = mmap.PAGESIZE

Locality = Literal["same_process", "same_machine", "remote"]
Frame: TypeAlias = Any  # bytes, memoryview or zmq.Frame: anything with the buffer protocol
MAX_PAGES = 1 << 16  # per message: a header that claims more is refused before any allocation
COPY_MARGIN_S = 30.0  # a shared-memory lease is renewed to last at least this long per copy


class _Counts:
    """Named counters that any thread adds to (a lease ends on whichever thread drops the
    last array made from its bytes)."""

    def __init__(self, *names: str) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(names, 0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


# -- buffers of values -----------------------------------------------------------------------


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
        self._counts = _Counts("shm_out", "frames_out", "shm_in", "frames_in", "transfers_out",
                               "transfers_in", "bytes_out", "bytes_in", "segments_created")

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
                self._counts.add(transfers_out=1, bytes_out=buffer.nbytes)
                continue
            refs.append(BufferRef(buffer.nbytes, frames=1))
            frames.append(buffer)
            self._counts.add(frames_out=1, bytes_out=buffer.nbytes)
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
        self._counts.add(shm_out=1, bytes_out=nbytes)
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
        self._counts.add(segments_created=1)
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
                self._counts.add(transfers_in=1, bytes_in=ref.nbytes)
            elif ref.frames:
                if ref.frames != 1 or position >= len(frames):
                    raise WireError(f"a buffer arrived in {ref.frames} frames, not 1")
                buffers.append(_frame(frames[position], ref.nbytes))
                position += 1
                self._counts.add(frames_in=1, bytes_in=ref.nbytes)
            else:
                buffers.append(self._unpack_shm(ref, peer))
                self._counts.add(shm_in=1, bytes_in=ref.nbytes)
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
        if not self._released:  # the common case, on every message: no lock (a lease that
            return []           # ends meanwhile goes with the next one)
        with self._lock:
            return self._released.pop(peer, [])

    # -- housekeeping ------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Counters, plus the segments this process owns, how many are leased, and their bytes."""
        with self._lock:
            return {**self._counts.snapshot(), "segments": len(self._segments),
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
    """The bytes of a received `frame` (of a buffer or of pages), which must hold `nbytes`.

    Raises:
        WireError: not a contiguous buffer, or another size.
    """
    try:
        view = memoryview(frame).cast("B")
    except TypeError as exc:  # not a buffer, or not a contiguous one
        raise WireError(f"a payload frame is not a contiguous buffer: {exc}") from None
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


# -- KV pages ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PageBatch:
    """Pages not held by a store lease: their keys and tensor ``[n, *page_shape]``.

    `stable=True` promises that nobody writes `pages` until the send is done (the zmq
    tracker says so); `FrameMover` then sends their bytes without a copy. With the default
    `stable=False` it sends a private copy.
    """

    keys: tuple[bytes, ...]
    pages: torch.Tensor
    stable: bool = False


PageSource: TypeAlias = "Lease | PageBatch"


class _Header(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind"):
    """Fields every mover header has: the pages' layout and their 16-byte keys."""

    layout: LayoutSpec
    keys: list[KeyField]


class SameProcessHeader(_Header, frozen=True, tag="same_process"):
    """Pages registered in process `pid` (instance `process_nonce`) under `object_id`."""

    pid: int
    process_nonce: str
    object_id: int


class SharedMemoryHeader(_Header, frozen=True, tag="shared_memory"):
    """Pages in a store's shared memory on host `host` (see `host_id`)."""

    host: str
    descriptor: PageDescriptor


class FrameHeader(_Header, frozen=True, tag="frames"):
    """Pages whose bytes follow as one frame of `nbytes`; `checksum` is xxh3-128 over the
    layout, the keys and the bytes."""

    nbytes: int
    checksum: Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]


MoverHeader: TypeAlias = SameProcessHeader | SharedMemoryHeader | FrameHeader


@dataclass(frozen=True)
class MoverStats:
    """Batches packed and unpacked by a mover, pages in each direction, unpacks refused."""

    packed: int
    unpacked: int
    pages_out: int
    pages_in: int
    refused: int


class ReceivedPages:
    """Pages a mover delivered. Read them, or `put_into` a store, then close (or ``with``).

    For shared memory the pages are views of the owner's memory, valid while the lease lives:
    `pages()` and `put_into` renew it before copying so the copy cannot be torn; after
    reading `page(i)` views yourself, check `valid()`.
    """

    def __init__(self, locality: Locality, layout: KVLayout, keys: Sequence[bytes], *,
                 pages: torch.Tensor | None = None, opened: OpenedPages | None = None):
        self.locality = locality
        self.layout = layout
        self.keys = tuple(keys)
        self._pages = pages  # [n, *page_shape], or None with `opened`
        self._opened = opened
        self._closed = False

    def __len__(self) -> int:
        return len(self.keys)

    def _check(self) -> None:
        if self._closed:
            raise TransportError("these received pages were closed")

    def valid(self) -> bool:
        """True until closed (and, for shared memory, while the lease lives)."""
        if self._opened is not None:
            return self._opened.valid()
        return not self._closed

    def page(self, index: int) -> torch.Tensor:
        """Page `index` as a view, no copy."""
        self._check()
        return self._opened[index] if self._opened is not None else self._pages[index]

    def pages(self) -> torch.Tensor:
        """All pages as one tensor ``[n, *page_shape]`` (a copy for shared memory only).

        Raises:
            TransportError: closed, or the shared-memory lease ended (a miss).
        """
        self._check()
        if self._opened is None:
            return self._pages
        import torch

        self._hold_lease()
        return torch.stack(list(self._opened))

    def put_into(self, store: KVStore) -> int:
        """Store these pages in `store` (one copy); returns how many were new there."""
        self._check()
        if self._opened is None:
            return store.put(self.keys, self._pages)
        self._hold_lease()
        return sum(store.put([key], page.unsqueeze(0))
                   for key, page in zip(self.keys, self._opened, strict=True))

    def _hold_lease(self) -> None:
        remaining = (self._opened.descriptor.expiry_ns - time.monotonic_ns()) / 1e9
        try:
            self._opened.renew(max(remaining, COPY_MARGIN_S))
        except KVError as exc:
            raise TransportError(f"shared-memory pages are gone: {exc}") from exc

    def close(self) -> None:
        """Let go of the pages (gives a shared-memory lease back). Idempotent."""
        if not self._closed:
            self._closed = True
            self._pages = None
            if self._opened is not None:
                self._opened.close()

    def __enter__(self) -> ReceivedPages:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<ReceivedPages {self.locality} pages={len(self.keys)} {state}>"




class Mover(Protocol):
    """Moves pages of one layout to a consumer of one locality."""

    locality: Locality
    layout: KVLayout

    def pack(self, source: PageSource) -> tuple[MoverHeader, list[Frame]]:
        """The header (a msgspec struct for the control message) and the frames to send."""
        ...

    def unpack(self, header: MoverHeader, frames: Sequence[Frame]) -> ReceivedPages:
        """The pages `pack` described. Raises TransportError (a miss), never wrong data."""
        ...

    def stats(self) -> MoverStats:
        """Counters of this mover."""
        ...


class _BaseMover:
    """Layout checks and counters shared by the movers."""

    locality: Locality

    def __init__(self, layout: KVLayout):
        self.layout = layout
        self._spec = layout.to_spec()
        self._counts = _Counts("packed", "unpacked", "pages_out", "pages_in", "refused")

    def stats(self) -> MoverStats:
        return MoverStats(**self._counts.snapshot())

    def _source(self, source: PageSource) -> tuple[tuple[bytes, ...], torch.Tensor]:
        """Keys and pages of `source`, checked against the layout. A lease's pages come as a
        tensor of their own: the lease may end while they are still in use or in flight."""
        from omni.kv.handle import Lease

        if isinstance(source, Lease):
            keys, pages = tuple(source.keys), source.pages()
            if len(keys) and pages.untyped_storage().data_ptr() == (
                    source.page(0).untyped_storage().data_ptr()):
                pages = pages.clone()  # consecutive slots: `pages()` was a view of the tier
        elif isinstance(source, PageBatch):
            keys, pages = tuple(source.keys), source.pages
        else:
            raise TypeError(f"a mover packs a Lease or a PageBatch, not {type(source).__name__}")
        expected = (len(keys), *self.layout.page_shape)
        if not keys or tuple(pages.shape) != expected or pages.dtype != self.layout.dtype:
            raise ValueError(f"pages must be a non-empty {list(expected)} {self.layout.dtype} "
                             f"tensor, got {list(pages.shape)} {pages.dtype}")
        check_keys(keys)
        return keys, pages

    def _check_header(self, header: Any, kind: type) -> None:
        if not isinstance(header, kind):
            problem = f"{type(self).__name__} cannot unpack a {type(header).__name__}"
        elif header.layout != self._spec:
            problem = f"pages of layout {header.layout} arrived where {self._spec} was expected"
        elif not 0 < len(header.keys) <= MAX_PAGES:
            problem = f"a header of {len(header.keys)} pages (1 to {MAX_PAGES})"
        elif (bad := invalid_key(header.keys)) is not None:
            problem = f"a header carries a bad page key: {bad}"
        else:
            return
        raise self._refused(WireError(problem))

    def _refused(self, exc: TransportError) -> TransportError:
        self._counts.add(refused=1)
        return exc

    def __repr__(self) -> str:
        s = self.stats()
        return (f"<{type(self).__name__} out={s.pages_out} in={s.pages_in} "
                f"refused={s.refused}>")


class _Registry:
    """Tensors handed to consumers in this process, by id. Why: a header is data (it may be
    forged, replayed or late), so a same-process hand-off looks its tensor up, checks it and
    takes it (once); entries nobody takes are dropped after their ttl, never leaked."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ids = itertools.count(1)
        self.entries: dict[int, tuple[tuple[bytes, ...], torch.Tensor, int]] = {}
        self.nonce = secrets.token_hex(8)

    def put(self, keys: tuple[bytes, ...], pages: torch.Tensor, ttl: float) -> int:
        now = time.monotonic_ns()
        with self.lock:
            for object_id in [i for i, e in self.entries.items() if e[2] <= now]:
                del self.entries[object_id]
            object_id = next(self.ids)
            self.entries[object_id] = (keys, pages, now + int(ttl * 1e9))
            return object_id

    def take(self, object_id: int) -> tuple[tuple[bytes, ...], torch.Tensor] | None:
        with self.lock:
            entry = self.entries.pop(object_id, None)
        if entry is None or entry[2] <= time.monotonic_ns():
            return None
        return entry[0], entry[1]

    def reset(self) -> None:
        """After fork: the child is another process, with nothing to hand over."""
        self.lock = threading.Lock()
        self.entries = {}
        self.nonce = secrets.token_hex(8)


_registry = _Registry()
os.register_at_fork(after_in_child=_registry.reset)


class SameProcessMover(_BaseMover):
    """Hands the tensor itself to a consumer in this process: no bytes move.

    `pack` registers the pages for `ttl` seconds; one `unpack` takes them. A lease's pages are
    copied out first (the lease may end before the consumer reads), a `PageBatch`'s tensor is
    handed over as it is.
    """

    locality: Locality = "same_process"

    def __init__(self, layout: KVLayout, *, ttl: float = 60.0):
        super().__init__(layout)
        self.ttl = ttl

    def pack(self, source: PageSource) -> tuple[SameProcessHeader, list[Frame]]:
        """Register the pages; the header names them. No frames."""
        keys, pages = self._source(source)
        object_id = _registry.put(keys, pages, self.ttl)
        self._counts.add(packed=1, pages_out=len(keys))
        return SameProcessHeader(self._spec, list(keys), os.getpid(), _registry.nonce,
                                 object_id), []

    def unpack(self, header: MoverHeader, frames: Sequence[Frame]) -> ReceivedPages:
        """Take the registered pages.

        Raises:
            WireError: another layout, or a header from another process.
            TransportError: the pages were taken already or expired.
        """
        self._check_header(header, SameProcessHeader)
        if frames:
            raise self._refused(WireError("same-process pages come without frames"))
        if (header.pid, header.process_nonce) != (os.getpid(), _registry.nonce):
            raise self._refused(WireError(
                f"same-process pages of process {header.pid} arrived in process "
                f"{os.getpid()}: their id means nothing here"))
        entry = _registry.take(header.object_id)
        if entry is None:
            raise self._refused(TransportError(
                f"same-process pages {header.object_id} were taken already or expired"))
        keys, pages = entry
        if list(keys) != header.keys:
            raise self._refused(WireError("same-process header keys differ from the pages'"))
        self._counts.add(unpacked=1, pages_in=len(keys))
        return ReceivedPages(self.locality, self.layout, keys, pages=pages)


class SharedMemoryMover(_BaseMover):
    """Hands a store lease's `PageDescriptor` to another process of this machine, which maps
    the same memory (`omni.kv.open_descriptor`). Only store pages: pack a `Lease`.

    The descriptor holds a lease of its own for `ttl` seconds (the store's default when None),
    so the sender may release its lease at once.
    """

    locality: Locality = "same_machine"

    def __init__(self, layout: KVLayout, *, ttl: float | None = None):
        super().__init__(layout)
        self.ttl = ttl

    def pack(self, source: PageSource) -> tuple[SharedMemoryHeader, list[Frame]]:
        """The lease's descriptor. No frames.

        Raises:
            TypeError: `source` is not a Lease.
            TransportError: the store's top tier cannot be mapped by another process.
        """
        from omni.kv.handle import Lease

        if not isinstance(source, Lease):
            raise TypeError("SharedMemoryMover moves store pages: pack a Lease (FrameMover "
                            "moves loose tensors)")
        if not len(source):
            raise ValueError("the lease holds no page")
        first = source.page(0)  # checked before exporting: an export pins pages until its ttl
        if tuple(first.shape) != self.layout.page_shape or first.dtype != self.layout.dtype:
            raise ValueError(f"the lease's pages are {list(first.shape)} {first.dtype}, this "
                             f"mover moves pages of {self.layout}")
        try:
            descriptor = source.descriptor(self.ttl)
        except KVError as exc:
            raise TransportError(f"cannot share these pages: {exc}") from exc
        self._counts.add(packed=1, pages_out=len(source))
        return SharedMemoryHeader(self._spec, list(source.keys), host_id(), descriptor), []

    def unpack(self, header: MoverHeader, frames: Sequence[Frame]) -> ReceivedPages:
        """Map the pages (no copy).

        Raises:
            WireError: another layout, another host, or keys that do not match the pages.
            TransportError: the lease ended or the descriptor names memory it may not.
        """
        self._check_header(header, SharedMemoryHeader)
        if header.host != host_id():
            raise self._refused(WireError(f"shared-memory pages of host {header.host} "
                                          f"arrived on host {host_id()}"))
        d = header.descriptor
        if d.layout != self._spec or len(d.offsets) != len(header.keys) or frames:
            raise self._refused(WireError("a shared-memory header whose descriptor does not "
                                          "match its layout and keys"))
        from omni.kv.handle import open_descriptor

        try:
            opened = open_descriptor(d)
        except KVError as exc:
            raise self._refused(TransportError(f"shared-memory pages are gone: {exc}")) from exc
        self._counts.add(unpacked=1, pages_in=len(header.keys))
        return ReceivedPages(self.locality, self.layout, header.keys, opened=opened)


class FrameMover(_BaseMover):
    """Sends the pages' bytes as one zero-copy frame, checked by xxh3-128 on arrival.

    Send the frames with ``copy=False, track=True`` (pyzmq copies frames under 64 KiB
    anyway). The frame is a view of a tensor nobody else writes: a private copy, or the
    caller's own under `PageBatch(stable=True)`; the frame keeps that tensor alive until
    libzmq lets go of it, and `stable=True` callers must not write it before the tracker
    says done. Pages on a GPU are copied to the host first.
    """

    locality: Locality = "remote"

    def pack(self, source: PageSource) -> tuple[FrameHeader, list[Frame]]:
        """The header and one frame of ``n * page_bytes`` bytes."""
        import torch

        keys, pages = self._source(source)
        if pages.device.type != "cpu":
            pages = pages.cpu()  # a fresh host copy: ours alone
        elif isinstance(source, PageBatch) and not source.stable:
            pages = pages.clone(memory_format=torch.contiguous_format)
        payload = memoryview(pages.contiguous().reshape(-1).view(torch.uint8).numpy())
        header = FrameHeader(self._spec, list(keys), payload.nbytes,
                             _checksum(self._spec, keys, payload))
        self._counts.add(packed=1, pages_out=len(keys))
        return header, [payload]

    def unpack(self, header: MoverHeader, frames: Sequence[Frame]) -> ReceivedPages:
        """The pages as a tensor over the received frame (a copy only for a read-only one).

        Raises:
            WireError: another layout, a frame count or size that does not match the header,
                or a checksum mismatch.
        """
        import torch

        self._check_header(header, FrameHeader)
        num_pages = len(header.keys)
        expected = num_pages * self.layout.page_bytes
        if len(frames) != 1:
            raise self._refused(WireError(f"{len(frames)} frames where 1 was expected"))
        if header.nbytes != expected:
            raise self._refused(WireError(f"a header of {header.nbytes} B for {num_pages} "
                                          f"pages of {self.layout.page_bytes} B"))
        try:
            payload = _frame(frames[0], expected)
        except WireError as exc:
            raise self._refused(exc) from None
        if _checksum(header.layout, header.keys, payload) != header.checksum:
            raise self._refused(WireError(f"checksum mismatch over {num_pages} pages"))
        if payload.readonly:  # torch tensors must be writable: bytes frames are copied
            payload = memoryview(bytearray(payload))
        pages = torch.frombuffer(payload, dtype=self.layout.dtype).view(
            num_pages, *self.layout.page_shape)  # [n, L, 2, page_size, H, D]
        self._counts.add(unpacked=1, pages_in=num_pages)
        return ReceivedPages(self.locality, self.layout, header.keys, pages=pages)


_spec_bytes = msgspec.msgpack.Encoder()


def _checksum(spec: LayoutSpec, keys: Sequence[bytes], payload: memoryview) -> bytes:
    """xxh3-128 over the layout, the keys and the bytes: frames paired with another message's
    header fail it too."""
    digest = xxhash.xxh3_128()
    digest.update(_spec_bytes.encode(spec))
    digest.update(b"".join(keys))
    digest.update(payload)
    return digest.digest()


def locality(local_host_id: str, peer_host_id: str, same_process: bool) -> Locality:
    """Where a peer is, relative to this process.

    Raises:
        ValueError: `same_process` with two different host ids.
    """
    if same_process:
        if local_host_id != peer_host_id:
            raise ValueError("a peer in this process cannot be on another host")
        return "same_process"
    return "same_machine" if local_host_id == peer_host_id else "remote"


_MOVERS: dict[Locality, type[_BaseMover]] = {
    "same_process": SameProcessMover, "same_machine": SharedMemoryMover, "remote": FrameMover}
_BY_HEADER: dict[type, type[_BaseMover]] = {
    SameProcessHeader: SameProcessMover, SharedMemoryHeader: SharedMemoryMover,
    FrameHeader: FrameMover}


def choose_mover(local_host_id: str, peer_host_id: str, same_process: bool, *,
                 layout: KVLayout) -> Mover:
    """The cheapest mover for a peer (see `locality`), for pages of `layout`."""
    return _MOVERS[locality(local_host_id, peer_host_id, same_process)](layout)


def mover_for(header: MoverHeader, layout: KVLayout) -> Mover:
    """The mover that unpacks `header`, expecting pages of `layout`."""
    try:
        return _BY_HEADER[type(header)](layout)
    except KeyError:
        raise WireError(f"no mover unpacks a {type(header).__name__}") from None


def unpack(header: MoverHeader, frames: Sequence[Frame], layout: KVLayout) -> ReceivedPages:
    """Receive pages whatever mover sent them (see `Mover.unpack`)."""
    return mover_for(header, layout).unpack(header, frames)
