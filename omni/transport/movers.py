"""Moving KV page bytes by locality: handles travel, bytes stay; bytes move once, by the
cheapest mover for where the consumer is.

- `same_process`: `SameProcessMover` hands over the tensor itself (the header names it in
  this process's registry; no frames).
- `same_machine`: `SharedMemoryMover` sends the store's `PageDescriptor`; the consumer maps
  the same shared memory (no frames).
- `remote`: `FrameMover` sends the bytes as one zero-copy frame, with the layout, the keys
  and an xxh3-128 checksum in the header.

A mover is bound to the `KVLayout` its side expects: `unpack` refuses pages of any other
layout, a checksum that does not match, a lease that ended, or an id from another process,
always with a `TransportError` (`WireError` for a header or frames that do not add up). The
caller counts that as a miss and recomputes: a mover never returns wrong pages.

Importing this module imports torch (through `omni.kv`, whose layout and descriptor structs
the headers embed); the rest of `omni.transport` does not need it.
"""

from __future__ import annotations

import itertools
import os
import secrets
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import xxhash

from omni.kv.errors import KVError
from omni.kv.handle import Lease, open_descriptor
from omni.kv.layout import KVLayout, LayoutSpec
from omni.transport._pages import (
    MAX_PAGES,
    Frame,
    FrameHeader,
    Locality,
    MoverHeader,
    MoverStats,
    PageBatch,
    PageSource,
    ReceivedPages,
    SameProcessHeader,
    SharedMemoryHeader,
)
from omni.transport.errors import TransportError, WireError
from omni.transport.host import host_id

if TYPE_CHECKING:
    import torch


__all__ = [
    "FrameHeader", "FrameMover", "Locality", "Mover", "MoverHeader", "MoverStats", "PageBatch",
    "PageSource", "ReceivedPages", "SameProcessHeader", "SameProcessMover",
    "SharedMemoryHeader", "SharedMemoryMover", "choose_mover", "host_id", "locality",
    "mover_for", "unpack",
]

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
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("packed", "unpacked", "pages_out", "pages_in",
                                      "refused"), 0)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def stats(self) -> MoverStats:
        with self._lock:
            return MoverStats(**self._counts)

    def _source(self, source: PageSource) -> tuple[tuple[bytes, ...], torch.Tensor]:
        """Keys and pages of `source`, checked against the layout. A lease's pages come as a
        tensor of their own: the lease may end while they are still in use or in flight."""
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
        for key in keys:
            if not isinstance(key, bytes) or len(key) != 16:
                raise ValueError(f"a page key is 16 bytes, got {key!r:.40}")
        return keys, pages

    def _check_header(self, header: Any, kind: type) -> None:
        if not isinstance(header, kind):
            problem = f"{type(self).__name__} cannot unpack a {type(header).__name__}"
        elif header.layout != self._spec:
            problem = f"pages of layout {header.layout} arrived where {self._spec} was expected"
        elif not 0 < len(header.keys) <= MAX_PAGES:
            problem = f"a header of {len(header.keys)} pages (1 to {MAX_PAGES})"
        elif any(not isinstance(key, bytes) or len(key) != 16 for key in header.keys):
            problem = "a header carries a page key that is not 16 bytes"
        else:
            return
        raise self._refused(WireError(problem))

    def _refused(self, exc: TransportError) -> TransportError:
        self._count(refused=1)
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
        self._count(packed=1, pages_out=len(keys))
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
        self._count(unpacked=1, pages_in=len(keys))
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
        self._count(packed=1, pages_out=len(source))
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
        try:
            opened = open_descriptor(d)
        except KVError as exc:
            raise self._refused(TransportError(f"shared-memory pages are gone: {exc}")) from exc
        self._count(unpacked=1, pages_in=len(header.keys))
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
        self._count(packed=1, pages_out=len(keys))
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
        try:
            payload = memoryview(frames[0]).cast("B")
        except TypeError as exc:  # not a buffer, or not a contiguous one
            raise self._refused(WireError(
                f"a page frame is not a contiguous buffer: {exc}")) from None
        if payload.nbytes != expected or header.nbytes != expected:
            raise self._refused(WireError(
                f"a frame of {payload.nbytes} B (header: {header.nbytes} B) for {num_pages} "
                f"pages of {self.layout.page_bytes} B"))
        if _checksum(header.layout, header.keys, payload) != header.checksum:
            raise self._refused(WireError(f"checksum mismatch over {num_pages} pages"))
        if payload.readonly:  # torch tensors must be writable: bytes frames are copied
            payload = memoryview(bytearray(payload))
        pages = torch.frombuffer(payload, dtype=self.layout.dtype).view(
            num_pages, *self.layout.page_shape)  # [n, L, 2, page_size, H, D]
        self._count(unpacked=1, pages_in=num_pages)
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
