"""A hosted replica's slots for calls in flight (its node's ``concurrency``), shared by the
worker's event loop and its lane's thread (`omni.transport.lane`).

The event loop waits for a slot, first come first served (`acquire`); the lane's thread never
waits: it takes a slot only while one is free and no call waits for one (`try_acquire`), and
otherwise hands its stage to the event loop, where it queues like any call. Either side
releases; a slot released while calls wait goes straight to the first of them.
"""

from __future__ import annotations

import collections
import contextlib
import threading

import trio

__all__ = ["Gate"]


class _Waiter:
    __slots__ = ("event", "handed")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.handed = False  # a release gave it its slot


class Gate:
    """`slots` calls in flight at once. Made on the event loop's thread."""

    def __init__(self, slots: int):
        if slots < 1:
            raise ValueError(f"a gate needs at least one slot, got {slots}")
        self._lock = threading.Lock()
        self._free = slots
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._token = trio.lowlevel.current_trio_token()
        self._loop = threading.get_ident()

    def try_acquire(self) -> bool:
        """Take a slot if one is free and no call waits for one (from any thread)."""
        with self._lock:
            if self._free and not self._waiters:
                self._free -= 1
                return True
        return False

    async def acquire(self) -> None:
        """Take a slot, waiting in line for one. A free slot is taken without a trip through
        trio's scheduler (the call itself yields anyway)."""
        with self._lock:
            if self._free and not self._waiters:
                self._free -= 1
                return
            waiter = _Waiter()
            self._waiters.append(waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            with self._lock:
                handed = waiter.handed
                if not handed:
                    self._waiters.remove(waiter)
            if handed:  # the slot came as this waiter gave up: pass it on
                self.release()
            raise

    def release(self) -> None:
        """Give a slot back (from any thread): to the first call waiting, if any."""
        with self._lock:
            if not self._waiters:
                self._free += 1
                return
            waiter = self._waiters.popleft()
            waiter.handed = True
        if threading.get_ident() == self._loop:
            waiter.event.set()
        else:
            with contextlib.suppress(trio.RunFinishedError):  # (then nobody waits)
                self._token.run_sync_soon(waiter.event.set)

    def __repr__(self) -> str:
        return f"<Gate free={self._free} waiting={len(self._waiters)}>"
