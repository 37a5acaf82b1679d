"""A tier of page slots in memory: one preallocated pool tensor, on a GPU or in an arena."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Iterator, Sequence

import torch

from omni._shm import Segment
from omni.kv.layout import KVLayout

__all__ = ["RESERVE_STEP", "MemoryTier", "batched_copies", "check_page", "copy_page",
           "create_arena", "slots_for", "wait_for_host_copies"]

log = logging.getLogger("omni.kv")

# How much an arena-backed tier reserves at a time (rounded to whole pages). Why 4 MiB: growing
# is one fallocate that zeroes the new memory under the store's lock, about a millisecond for
# 4 MiB, and a 1 GiB tier needs only 256 of them; yet a tier never holds more than 4 MiB it has
# no page for, which a container's 64 MiB /dev/shm can spare. A fraction of the capacity would
# take 64 MiB at once for a 1 GiB tier: all of such a /dev/shm.
RESERVE_STEP = 4 << 20


def create_arena(name: str, layout: KVLayout, num_slots: int) -> Segment:
    """The arena of a tier of `num_slots` pages: full size, its first step reserved.

    Raises:
        OSError: the shared-memory filesystem has no room even for the first step.
    """
    size = num_slots * layout.page_bytes
    return Segment.create(name, size, reserve=min(size, _step_slots(layout) * layout.page_bytes))


def _step_slots(layout: KVLayout) -> int:
    return max(1, RESERVE_STEP // layout.page_bytes)


def slots_for(capacity_bytes: int, page_bytes: int, tier_name: str) -> int:
    """How many whole slots of `page_bytes` fit in `capacity_bytes`.

    Raises:
        ValueError: not even one fits.
    """
    num_slots = capacity_bytes // page_bytes
    if num_slots < 1:
        raise ValueError(f"tier {tier_name!r} holds no page: capacity {capacity_bytes} B < "
                         f"page size {page_bytes} B")
    return num_slots


def check_page(tier_name: str, layout: KVLayout, page: torch.Tensor, what: str = "page") -> None:
    """Raise ValueError unless `page` has the layout's page shape and dtype."""
    if tuple(page.shape) != layout.page_shape or page.dtype != layout.dtype:
        raise ValueError(f"tier {tier_name!r} expects a {what} of shape {layout.page_shape} "
                         f"{layout.dtype}, got {tuple(page.shape)} {page.dtype}")


# GPU <-> page-locked host copies that `batched_copies` left for later: the streams they were
# enqueued on. Any thread's CPU-side copy of a page waits for them first (`copy_page`).
_pending_streams: set[torch.cuda.Stream] = set()
_pending_lock = threading.Lock()
_batching = threading.local()  # .depth: `batched_copies` blocks open in this thread


@contextlib.contextmanager
def batched_copies() -> Iterator[None]:
    """Inside the block, this thread's copies between a GPU and page-locked host memory are
    enqueued without a wait each (`copy_page`); they are complete when the outermost block
    ends, after one wait per stream.

    Why: a wait after each page costs ~10 us of a 1.8 MiB page's ~36 us on the bus, so a
    promotion of many pages moved them at 0.6x of one large copy. What makes the later wait
    safe: a GPU copy only races with the CPU touching the same host memory, and every CPU-side
    copy of a page (`copy_page`), in any thread, first waits for the pending ones; the store
    makes its copies under its lock and ends the block before it hands pages to a caller.
    (A copy from or to memory that is not page-locked needs no later wait: CUDA returns from
    it only once the host memory is read, or written, in full.)
    """
    depth = getattr(_batching, "depth", 0)
    _batching.depth = depth + 1
    try:
        yield
    finally:
        _batching.depth = depth
        if depth == 0:
            wait_for_host_copies()


def wait_for_host_copies() -> None:
    """Wait until every GPU <-> host copy `batched_copies` left pending is complete."""
    if not _pending_streams:  # the common case: nothing to take the lock for
        return
    with _pending_lock:  # held while waiting: no thread reads the set as empty too early
        for stream in _pending_streams:
            stream.synchronize()
        _pending_streams.clear()


def copy_page(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy `src` into `dst`, asynchronously on the GPU but complete when this returns, or,
    between a GPU and page-locked memory inside `batched_copies`, when that block ends.

    A copy between a GPU and host memory is enqueued with ``non_blocking=True`` (pinned memory
    then moves by DMA without a staging buffer) and the stream is synchronized before returning:
    the tier manager may overwrite the host slot, or hand its bytes to the disk, right after.
    Copies within one GPU stay stream-ordered and are not waited for. A copy between two CPU
    tensors first waits for pending GPU copies (one of them may read or write its memory).
    """
    if not (dst.is_cuda or src.is_cuda):
        wait_for_host_copies()
        if (dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype
                and dst.shape == src.shape):
            # One memmove, GIL released: torch's copy_ splits a page across intra-op threads,
            # which stalls for milliseconds when the other core is busy.
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())
            return
        dst.copy_(src)
        return
    dst.copy_(src, non_blocking=True)
    if dst.is_cuda and src.is_cuda:
        return
    stream = torch.cuda.current_stream(dst.device if dst.is_cuda else src.device)
    if getattr(_batching, "depth", 0):
        with _pending_lock:
            _pending_streams.add(stream)
    else:
        stream.synchronize()


class MemoryTier:
    """`num_slots` pages in one pool tensor ``[num_slots, *page_shape]``.

    Why one pool: slots are fixed-size, so a slot is an index, a batch of consecutive slots is a
    view, and an arena-backed pool gives every slot a byte offset another process can map.
    The tier takes ownership of `arena` and closes it on `close()`.

    An arena's memory is reserved as slots are needed (`reserve`), lowest slots first: slots
    below `reserved_slots` may be written, the others must be reserved first. When the
    shared-memory filesystem has no room left, the tier holds `reserved_slots` pages and says
    so once in the log (the tier manager then evicts as it does from a full tier).
    """

    def __init__(self, name: str, layout: KVLayout, num_slots: int, *, arena: Segment | None,
                 device: torch.device | str) -> None:
        """Raises ValueError: no slot, an arena too small, or an arena for a non-CPU device."""
        device = torch.device(device)
        if num_slots < 1:
            raise ValueError(f"tier {name!r} holds no page: num_slots={num_slots}")
        self.name = name
        self.layout = layout
        self.num_slots = num_slots
        self.device = device
        self._page_bytes = layout.page_bytes
        self._arena = arena
        self._reserved_slots = num_slots  # memory that is not an arena is all there
        self._warned = False
        shape = (num_slots, *layout.page_shape)
        if arena is None:
            self._pool: torch.Tensor | None = torch.empty(shape, dtype=layout.dtype, device=device)
            return
        if device.type != "cpu":
            raise ValueError(f"tier {name!r}: an arena is host memory, not {device}")
        if arena.size < num_slots * layout.page_bytes:
            raise ValueError(f"tier {name!r}: arena {arena.name!r} of {arena.size} B is smaller "
                             f"than {num_slots} pages of {layout.page_bytes} B")
        self._pool = arena.tensor(0, shape, layout.dtype)
        if arena.reserved is not None:
            self._reserved_slots = min(num_slots, arena.reserved // layout.page_bytes)

    @property
    def pool(self) -> torch.Tensor:
        """The pool tensor ``[num_slots, *page_shape]``. Raises ValueError once closed."""
        if self._pool is None:
            raise ValueError(f"tier {self.name!r} is closed")
        return self._pool

    @property
    def arena_name(self) -> str | None:
        """The shared-memory arena holding the pool, for other processes to attach; or None."""
        return None if self._arena is None else self._arena.name

    @property
    def arena(self) -> Segment | None:
        return self._arena

    @property
    def reserved_slots(self) -> int:
        """Slots ``0 .. reserved_slots - 1`` have their memory reserved: they may be written."""
        return self._reserved_slots

    def reserve(self, slot: int) -> bool:
        """Reserve the memory of `slot` (and of every slot below it) before anything writes to
        it, growing by `RESERVE_STEP` at a time. False when the shared-memory filesystem has
        no room for it: the tier stays at `reserved_slots` (logged once, with the fix).

        Raises:
            IndexError: no such slot.
        """
        self._check_slot(slot)
        if slot < self._reserved_slots:
            return True
        arena = self._arena
        assert arena is not None, "memory that is not an arena is reserved whole"
        pb = self._page_bytes
        step_end = min(self.num_slots, self._reserved_slots + _step_slots(self.layout))
        if not (arena.reserve(max(slot + 1, step_end) * pb) or arena.reserve((slot + 1) * pb)):
            self._warn_full()
            return False
        self._reserved_slots = min(self.num_slots, arena.reserved // pb)
        return True

    def _warn_full(self) -> None:
        if self._warned:
            return
        self._warned = True
        pb, arena = self._page_bytes, self._arena
        log.warning("KV %s tier: no room left in %s, so it holds %d pages (%s) of the %d (%s) "
                    "configured and evicts from there; free space in %s (in a container, raise "
                    "--shm-size) or give it a smaller --kv-%s", self.name, arena.path.parent,
                    self._reserved_slots, _mib(self._reserved_slots * pb), self.num_slots,
                    _mib(self.num_slots * pb), arena.path.parent, self.name)

    def offsets(self, slots: Sequence[int]) -> list[int]:
        """Byte offsets of `slots` from the start of the pool (and of the arena, which it
        fills)."""
        if slots:  # every one lies between these two
            self._check_slot(min(slots))
            self._check_slot(max(slots))
        pb = self._page_bytes
        return [slot * pb for slot in slots]

    def write(self, slot: int, page: torch.Tensor, key: bytes) -> None:
        """Copy `page` (any device) into `slot`. `key` is not stored: memory cannot go stale.

        Raises:
            ValueError: a page of another shape or dtype.
            IndexError: no such slot.
        """
        check_page(self.name, self.layout, page)
        copy_page(self.view(slot), page)

    def read_into(self, slot: int, out: torch.Tensor, key: bytes) -> bool:
        """Copy the page in `slot` into `out` (any device); always True.

        Raises:
            ValueError: `out` of another shape or dtype.
            IndexError: no such slot.
        """
        check_page(self.name, self.layout, out, "destination")
        copy_page(out, self.view(slot))
        return True

    def view(self, slot: int) -> torch.Tensor:
        """The slot itself ``[*page_shape]``, no copy: writes to it change the tier.

        Raises:
            IndexError: no such slot, or one whose memory is not reserved (see `reserve`).
        """
        self._check_slot(slot, reserved=True)
        return self.pool[slot]

    def gather(self, slots: list[int], layer: int | None = None) -> torch.Tensor:
        """The pages in `slots` as ``[n, *page_shape]``, or only `layer`'s part of each,
        ``[n, *page_shape[1:]]`` (the layout's first axis is the layer).

        A view of the pool when the slots are consecutive and ascending (writing to it changes
        the tier); otherwise a copy.
        """
        pool = self.pool if layer is None else self.pool[:, layer]
        if not slots:
            return pool[:0]
        first, last = slots[0], slots[-1]
        if last - first == len(slots) - 1 and slots == list(range(first, last + 1)):
            self._check_slot(first, reserved=True)  # the run lies between its two ends
            self._check_slot(last, reserved=True)
            return pool[first:last + 1]
        for slot in slots:
            self._check_slot(slot, reserved=True)
        return pool.index_select(0, torch.tensor(slots, device=pool.device))

    def close(self) -> None:
        """Drop the pool and close the arena. Idempotent; views already taken stay valid."""
        self._pool = None
        if self._arena is not None:
            self._arena.close()

    def _check_slot(self, slot: int, *, reserved: bool = False) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"tier {self.name!r} has no slot {slot} (0..{self.num_slots - 1})")
        if reserved and slot >= self._reserved_slots:  # touching it could be a SIGBUS
            raise IndexError(f"tier {self.name!r}: slot {slot} lies beyond its reserved memory "
                             f"({self._reserved_slots} slots); reserve it first")

    def __repr__(self) -> str:
        where = "" if self._arena is None else (
            f" arena={self._arena.name} reserved={self._reserved_slots}")
        state = " closed" if self._pool is None else ""
        return (f"<{type(self).__name__} {self.name} slots={self.num_slots} "
                f"page={self.layout.page_bytes}B {self.device}{where}{state}>")


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):,.1f} MiB"
