"""Handles to leased pages: `Lease` in the owning process, `PageDescriptor` on the wire, and
`open_descriptor` in another process of the same machine (the same memory, no copy)."""

from __future__ import annotations

import contextlib
import os
import re
import threading
import warnings
from typing import TYPE_CHECKING, Any

import torch

from omni._shm import Segment, shm_directory
from omni.kv.descriptors import DESCRIPTOR_VERSION, LayoutSpec, PageDescriptor
from omni.kv.errors import KVLeaseError
from omni.kv.layout import KVLayout
from omni.kv.leases import LeaseTable, attach_segment, now_ns, table_name

if TYPE_CHECKING:
    from omni.kv.store import KVStore

__all__ = ["Lease", "OpenedPages", "forget_mappings", "open_descriptor"]

_STORE_ID = re.compile(r"[0-9a-f]{8,32}")


class Lease:
    """Pages pinned in the store's top tier for as long as the lease is held.

    ``with store.acquire(keys) as lease:``. `len(lease)` pages are leased: the longest prefix
    of the keys whose pages were present and valid (fewer than asked when a page went away or
    failed verification: recompute the rest).
    """

    def __init__(self, store: KVStore, keys: list[bytes], slots: list[int]):
        self.keys = keys
        self._store = store
        self._slots = slots
        self._released = False

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def released(self) -> bool:
        return self._released

    def _check(self) -> None:
        if self._released:
            raise KVLeaseError("this lease was released")

    def pages(self, layer: int | None = None) -> torch.Tensor:
        """The pages as one tensor ``[n, *layout.page_shape]``, or only `layer`'s part of
        each, ``[n, *layout.page_shape[1:]]`` (a copy unless they happen to lie in consecutive
        slots). Taking them a layer at a time keeps each copy small enough to stay in cache
        for whatever the caller copies it into next."""
        self._check()
        return self._store._top_tier().gather(self._slots, layer)

    def page(self, index: int) -> torch.Tensor:
        """Page `index` itself, in the top tier (a view: valid while the lease is held)."""
        self._check()
        return self._store._top_tier().view(self._slots[index])

    def descriptor(self, ttl: float | None = None) -> PageDescriptor:
        """Hand these pages to another process: a lease of their own, ending after `ttl`
        seconds (the store's default when None) unless the holder releases it sooner."""
        self._check()
        return self._store._export(self.keys, self._slots, ttl)

    def release(self) -> None:
        """Unpin the pages (idempotent)."""
        if not self._released:
            self._released = True
            self._store._release(self.keys)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.release()

    def __del__(self) -> None:
        if not getattr(self, "_released", True):
            warnings.warn(f"a KV lease of {len(self.keys)} pages was never released",
                          ResourceWarning, stacklevel=1)
            with contextlib.suppress(Exception):  # the store may be closed already
                self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"<Lease pages={len(self.keys)} {state}>"


class OpenedPages:
    """Pages of another process's store, mapped into this one (`open_descriptor`).

    Index it or iterate it for page tensors (views of the shared memory: writes are seen by
    the owner). Close it, or use it in ``with``, to give the lease back; the pages must not
    be used after that (the owner may reuse their memory).
    """

    def __init__(self, descriptor: PageDescriptor, table: LeaseTable, pool: _Pool,
                 slots: list[int]):
        self.descriptor = descriptor
        self._table = table
        self._pool = pool
        self._slots = slots
        self._closed = False

    def __len__(self) -> int:
        return len(self._slots)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self._pool.page(self._slots[index])

    def __iter__(self) -> Any:
        return map(self._pool.page, self._slots)

    def valid(self) -> bool:
        """True while the lease is live (not released, not expired)."""
        if self._closed:
            return False
        try:
            self._table.check(self.descriptor.lease_slot, self.descriptor.lease_id)
        except KVLeaseError:
            return False
        return True

    def renew(self, ttl: float) -> None:
        """Set the lease to end `ttl` seconds from now (longer or shorter).

        Raises KVLeaseError when it has already ended."""
        d = self.descriptor
        self._table.renew(d.lease_slot, d.lease_id, now_ns() + int(ttl * 1e9))

    def close(self) -> None:
        """Give the lease back (idempotent)."""
        if not self._closed:
            self._closed = True
            self._table.release(self.descriptor.lease_slot, self.descriptor.lease_id)

    def __enter__(self) -> OpenedPages:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class _Pool:
    """One arena seen as pages of one layout, page views made once. Why: building a tensor per
    page per handoff costs more than the handoff itself."""

    def __init__(self, arena: Segment, layout: KVLayout):
        self.arena = arena
        self.num_pages = arena.size // layout.page_bytes
        if self.num_pages < 1:  # a forged layout: its pages would not fit (nor its strides)
            raise KVLeaseError(f"pages of {layout.page_bytes} bytes do not fit arena "
                               f"{arena.name} ({arena.size} bytes)")
        self._pages = arena.tensor(0, (self.num_pages, *layout.page_shape), layout.dtype)
        self._views: list[torch.Tensor | None] = [None] * self.num_pages

    def page(self, slot: int) -> torch.Tensor:
        view = self._views[slot]
        if view is None:
            view = self._views[slot] = self._pages[slot]
        return view


# Mappings kept across handoffs, by name, each with the inode it was opened at: mapping an
# arena and faulting its pages in again for every descriptor would cost more than copying.
# A name whose file is gone (its store closed) or was replaced is dropped and mapped anew.
_tables: dict[str, tuple[int, LeaseTable]] = {}
_pools: dict[tuple[str, LayoutSpec], tuple[int, _Pool]] = {}
_mappings_lock = threading.Lock()


def _inode(directory: str, name: str) -> int:
    try:
        return os.stat(os.path.join(directory, name)).st_ino
    except FileNotFoundError:
        raise KVLeaseError(f"shared memory {name!r} does not exist (its store closed?)") from None


def _table_for(directory: str, name: str) -> LeaseTable:
    inode = _inode(directory, name)
    cached = _tables.get(name)
    if cached is None or cached[0] != inode:
        _tables[name] = (inode, LeaseTable.attach(name))
    return _tables[name][1]


def _pool_for(directory: str, name: str, spec: LayoutSpec, layout: KVLayout) -> _Pool:
    inode = _inode(directory, name)
    cached = _pools.get((name, spec))
    if cached is None or cached[0] != inode:
        _pools[(name, spec)] = (inode, _Pool(attach_segment(name), layout))
    return _pools[(name, spec)][1]


def forget_mappings() -> None:
    """Unmap every arena this process mapped for descriptors (they are kept between opens)."""
    with _mappings_lock:
        for _, table in _tables.values():
            table.close()
        for _, pool in _pools.values():
            pool.arena.close()
        _tables.clear()
        _pools.clear()


def open_descriptor(descriptor: PageDescriptor) -> OpenedPages:
    """Map the pages of `descriptor` (from another process of this machine) without a copy.

    The arena stays mapped in this process after the pages are closed, so the next handoff
    from the same store costs no mapping (`forget_mappings` unmaps).

    Raises:
        KVLeaseError: the lease is unknown, released or expired, or the descriptor names an
            arena or offsets it may not (another store's memory, out of bounds, misaligned).
    """
    d = descriptor
    if d.version != DESCRIPTOR_VERSION:
        raise KVLeaseError(f"descriptor version {d.version} is not supported")
    if not _STORE_ID.fullmatch(d.store_id) or d.tier not in ("device", "host"):
        raise KVLeaseError(f"descriptor names store {d.store_id!r} tier {d.tier!r}")
    if d.arena != f"omni-{d.store_id}-{d.tier}" or d.lease_table != table_name(d.store_id):
        raise KVLeaseError(f"descriptor names arena {d.arena!r}, not its store's")
    try:
        layout = KVLayout.from_spec(d.layout)
    except ValueError as exc:
        raise KVLeaseError(f"descriptor layout: {exc}") from None
    directory = str(shm_directory())
    with _mappings_lock:
        table = _table_for(directory, d.lease_table)
        table.check(d.lease_slot, d.lease_id)
        pool = _pool_for(directory, d.arena, d.layout, layout)
    size, arena_size = layout.page_bytes, pool.arena.size
    offsets = list(d.offsets)
    # Whole pages in the arena: checked at C speed first (this runs per page of every
    # handoff), one by one only to name what is wrong.
    slots = [offset // size for offset in offsets] if set(map(type, offsets)) <= {int} else None
    if slots is None or (offsets and (min(offsets) < 0 or max(offsets) + size > arena_size
                                      or list(map(size.__mul__, slots)) != offsets)):
        slots = []
        for offset in offsets:
            if not isinstance(offset, int) or offset < 0 or offset % size or (
                    offset + size > arena_size):
                raise KVLeaseError(f"page offset {offset!r} is outside arena {d.arena} "
                                   f"({arena_size} bytes, pages of {size})")
            slots.append(offset // size)
    return OpenedPages(d, table, pool, slots)
