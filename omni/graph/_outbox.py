"""The queue between a request's task and the reader of its `ResultStream`.

Why not a trio memory channel: a channel's ``send_nowait`` and ``receive_nowait`` check
statistics, tasks and cancellation on every call, which for a stream of millions of small items
cost more than the rest of the way from node to reader. Here an item is a deque append and a
popleft; the two sides park (and can be cancelled) only when the queue is full or empty, so
each yields to the scheduler at least once per `size` items, and the producer waits for the
reader (backpressure) as with a channel.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import trio

__all__ = ["Outbox"]


class Outbox:
    """A bounded FIFO with one producer and one reader, each in a trio task.

    The producer `put`s and finally `close`s (the reader then gets `trio.EndOfChannel` once
    the queue is drained); the reader `get`s, and `abandon`s it when it stops reading (a later
    or waiting `put` raises `trio.BrokenResourceError`, as a channel's send would).
    """

    __slots__ = ("_abandoned", "_closed", "_items", "_readable", "_size", "_writable")

    def __init__(self, size: int) -> None:
        self._items: deque[Any] = deque()
        self._size = size
        self._closed = False
        self._abandoned = False
        self._readable = trio.lowlevel.ParkingLot()  # the reader, waiting for an item
        self._writable = trio.lowlevel.ParkingLot()  # the producer, waiting for room

    async def put(self, item: Any) -> None:
        if self._abandoned:
            raise trio.BrokenResourceError("the reader stopped reading")
        self._items.append(item)
        if self._readable:
            self._readable.unpark()
        while len(self._items) >= self._size:
            await self._writable.park()
            if self._abandoned:
                raise trio.BrokenResourceError("the reader stopped reading")

    def put_nowait(self, item: Any) -> bool:
        """Queue `item` if there is room (True), else do nothing (False: await `put`)."""
        if self._abandoned:
            raise trio.BrokenResourceError("the reader stopped reading")
        if len(self._items) >= self._size - 1:
            return False
        self._items.append(item)
        if self._readable:
            self._readable.unpark()
        return True

    async def get_all(self) -> list[Any]:
        """Every item queued, once there is at least one."""
        while not self._items:
            if self._closed or self._abandoned:
                raise trio.EndOfChannel
            await self._readable.park()
        items = list(self._items)
        self._items.clear()
        if self._writable:
            self._writable.unpark()
        return items

    async def get(self) -> Any:
        while not self._items:
            if self._closed or self._abandoned:
                raise trio.EndOfChannel
            await self._readable.park()
        item = self._items.popleft()
        if self._writable:
            self._writable.unpark()
        return item

    def close(self) -> None:
        """No more items: the reader ends once it has taken those queued."""
        self._closed = True
        self._readable.unpark_all()

    def abandon(self) -> None:
        """The reader is done: queued items are dropped, the producer stops at its next put."""
        self._abandoned = True
        self._items.clear()
        self._writable.unpark_all()
