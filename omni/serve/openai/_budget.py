"""The pixels and audio samples the chat requests in flight may hold decoded at once.

A cap per item is not a budget, and neither is a cap per request: twenty images each under the
pixel cap decode to a gigabyte, and twenty requests each under their own budget do as well. A
request therefore reserves what its items' headers say it will decode before it decodes any
of them, and releases it once it has been answered (or it failed, or was cancelled): the
decoded arrays live as long as the request. A request
that does not fit waits, up to a bound, for others to release; the caller answers one that
waited that long with 429 and ``Retry-After``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio

__all__ = ["BudgetStats", "DecodeBudget", "DecodeNeed"]


@dataclass(frozen=True)
class DecodeNeed:
    """What one request decodes: pixels over all its images, audio samples (every channel's)
    over all its clips."""

    pixels: int = 0
    samples: int = 0


@dataclass(frozen=True)
class BudgetStats:
    """A `DecodeBudget`'s state: what is reserved of what it allows, how many requests wait
    for room, and how many waited too long (refused)."""

    pixels: int
    samples: int
    max_pixels: int
    max_samples: int
    num_waiting: int
    num_refused: int


class DecodeBudget:
    """Pixels and samples reserved by the requests decoding now, within `max_pixels` and
    `max_samples`.

    Why a count of its own: the memory a decode takes grows with pixels and samples, not with
    requests, so `--max-concurrency` cannot bound it. The core (`try_reserve`, `release`) is
    synchronous; `reserved` only waits around it. Invariant: 0 <= reserved <= the maximum,
    for pixels and samples alike. Lives on the event loop: no lock.
    """

    def __init__(self, max_pixels: int, max_samples: int):
        self.max_pixels, self.max_samples = max_pixels, max_samples
        self._pixels = self._samples = 0
        self._num_waiting = self._num_refused = 0
        self._freed: anyio.Event | None = None  # made on the loop, by the first waiter

    def try_reserve(self, need: DecodeNeed) -> bool:
        """Reserve `need` if it fits beside what is reserved; whether it did."""
        if (self._pixels + need.pixels > self.max_pixels
                or self._samples + need.samples > self.max_samples):
            return False
        self._pixels += need.pixels
        self._samples += need.samples
        return True

    def release(self, need: DecodeNeed) -> None:
        """Give back what `try_reserve` reserved for `need`; wakes the waiting requests."""
        self._pixels -= need.pixels
        self._samples -= need.samples
        assert self._pixels >= 0 and self._samples >= 0, "released more than reserved"
        if self._freed is not None:
            self._freed.set()
            self._freed = None

    @asynccontextmanager
    async def reserved(self, need: DecodeNeed, wait_s: float) -> AsyncIterator[None]:
        """`need` reserved for the block (released as it ends, however it ends), waiting up
        to `wait_s` seconds for room.

        Raises:
            TimeoutError: no room within `wait_s` seconds.
        """
        reserved = False
        with anyio.move_on_after(wait_s):
            while not self.try_reserve(need):
                await self._wait_for_room()
            reserved = True  # no checkpoint since try_reserve: the deadline cannot undo it
        if not reserved:
            self._num_refused += 1
            raise TimeoutError(f"no room for {need} within {wait_s:g} s: {self!r}")
        try:
            yield
        finally:
            self.release(need)

    async def _wait_for_room(self) -> None:
        if self._freed is None:
            self._freed = anyio.Event()
        self._num_waiting += 1
        try:
            await self._freed.wait()
        finally:
            self._num_waiting -= 1

    def stats(self) -> BudgetStats:
        """What is reserved now, the maximums, the requests waiting and refused."""
        return BudgetStats(self._pixels, self._samples, self.max_pixels, self.max_samples,
                           self._num_waiting, self._num_refused)

    def __repr__(self) -> str:
        return (f"<DecodeBudget pixels={self._pixels}/{self.max_pixels} "
                f"samples={self._samples}/{self.max_samples} waiting={self._num_waiting}>")
