"""A tier of page slots in memory: one preallocated pool tensor, on a GPU or in an arena."""

from __future__ import annotations

import ctypes

import torch

from omni.kv.arena import Arena
from omni.kv.layout import KVLayout

__all__ = ["MemoryTier", "check_page", "copy_page", "slots_for"]


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


def copy_page(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy `src` into `dst`, asynchronously on the GPU but complete when this returns.

    A copy between a GPU and host memory is enqueued with ``non_blocking=True`` (pinned memory
    then moves by DMA without a staging buffer) and the stream is synchronized before returning:
    the tier manager may overwrite the host slot, or hand its bytes to the disk, right after.
    Copies within one GPU stay stream-ordered and are not waited for.
    """
    if not (dst.is_cuda or src.is_cuda):
        if (dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype
                and dst.shape == src.shape):
            # One memmove, GIL released: torch's copy_ splits a page across intra-op threads,
            # which stalls for milliseconds when the other core is busy.
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())
            return
        dst.copy_(src)
        return
    dst.copy_(src, non_blocking=True)
    if not (dst.is_cuda and src.is_cuda):
        torch.cuda.current_stream(dst.device if dst.is_cuda else src.device).synchronize()


class MemoryTier:
    """`num_slots` pages in one pool tensor ``[num_slots, *page_shape]``.

    Why one pool: slots are fixed-size, so a slot is an index, a batch of consecutive slots is a
    view, and an arena-backed pool gives every slot a byte offset another process can map.
    The tier takes ownership of `arena` and closes it on `close()`.
    """

    def __init__(self, name: str, layout: KVLayout, num_slots: int, *, arena: Arena | None,
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
    def arena(self) -> Arena | None:
        return self._arena

    def offset(self, slot: int) -> int:
        """Byte offset of `slot` from the start of the pool (and of the arena, which it fills)."""
        self._check_slot(slot)
        return slot * self._page_bytes

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
        """The slot itself ``[*page_shape]``, no copy: writes to it change the tier."""
        self._check_slot(slot)
        return self.pool[slot]

    def gather(self, slots: list[int]) -> torch.Tensor:
        """The pages in `slots` as ``[n, *page_shape]``.

        A view of the pool when the slots are consecutive and ascending (writing to it changes
        the tier); otherwise a copy.
        """
        for slot in slots:
            self._check_slot(slot)
        if not slots:
            return self.pool[:0]
        first = slots[0]
        if slots == list(range(first, first + len(slots))):
            return self.pool[first:first + len(slots)]
        return self.pool.index_select(0, torch.tensor(slots, device=self.pool.device))

    def close(self) -> None:
        """Drop the pool and close the arena. Idempotent; views already taken stay valid."""
        self._pool = None
        if self._arena is not None:
            self._arena.close()

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"tier {self.name!r} has no slot {slot} (0..{self.num_slots - 1})")

    def __repr__(self) -> str:
        where = f" arena={self._arena.name}" if self._arena is not None else ""
        state = " closed" if self._pool is None else ""
        return (f"<{type(self).__name__} {self.name} slots={self.num_slots} "
                f"page={self.layout.page_bytes}B {self.device}{where}{state}>")
