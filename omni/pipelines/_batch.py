"""Calls of one node that arrive together run as one batch: `Batcher`.

Why: a DiT denoising several requests of one size and step count in one pass per step gives
each its own image for less than running them one after another, and a replica runs one
pipeline call at a time anyway (a diffusers pipeline keeps its scheduler's state while it
runs). A node with ``concurrency`` above 1 passes each call to its `Batcher`: while a batch
runs, the calls that arrive wait; when it ends, one of them runs the next batch: the call
that has waited longest and every waiting call of its key (up to `max_batch`). Calls of other
keys wait for a later batch. A call cancelled while it waits leaves; a batch that has
started runs to its end for all of its calls.

A batch that fails is run again one call at a time, so that each call gets its own result
or its own error: one request's bad input never fails another's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from typing import Any, Generic, TypeVar

import trio

__all__ = ["Batcher"]

T = TypeVar("T")
R = TypeVar("R")


class _Call(Generic[T]):
    def __init__(self, key: Hashable, item: T):
        self.key, self.item = key, item
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None

    def settle(self, result: Any = None, error: BaseException | None = None) -> None:
        self.done, self.result, self.error = True, result, error


class Batcher(Generic[T, R]):
    """Runs `run(items)` (a result per item, in order) on the calls waiting with one key.

    Args:
        run: one batch's work.
        max_batch: the most calls in one batch.
    """

    def __init__(self, run: Callable[[list[T]], Awaitable[list[R]]], max_batch: int):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch!r}")
        self._run, self.max_batch = run, max_batch
        self._waiting: list[_Call[T]] = []
        self._running = False
        self._turn = trio.Event()  # set as each batch ends
        self.batches = 0  # batches run so far (a failed batch's single reruns not counted)

    async def __call__(self, key: Hashable, item: T) -> R:
        """`item`'s result, once a batch of its `key` has run (raises what its run raised)."""
        call = _Call(key, item)
        self._waiting.append(call)
        try:
            while not call.done:
                if self._running:
                    await self._turn.wait()
                else:
                    await self._run_batch()
        finally:
            if call in self._waiting:  # cancelled before a batch took it
                self._waiting.remove(call)
        if call.error is not None:
            raise call.error
        return call.result

    async def _run_batch(self) -> None:
        """Run the longest-waiting call and the others waiting with its key as one batch
        (whichever waiting call runs it: calls are served in the order they came)."""
        key = self._waiting[0].key
        batch = [c for c in self._waiting if c.key == key][: self.max_batch]
        for c in batch:
            self._waiting.remove(c)
        self._running = True
        try:
            with trio.CancelScope(shield=True):  # the work cannot stop halfway: finish it
                await self._settle(batch)
        finally:
            self._running = False
            turn, self._turn = self._turn, trio.Event()
            turn.set()

    async def _settle(self, batch: list[_Call[T]]) -> None:
        self.batches += 1
        try:
            results = await self._run([c.item for c in batch])
        except Exception as exc:
            if len(batch) == 1:
                batch[0].settle(error=exc)
                return
            for c in batch:  # each call's own result or error
                try:
                    (result,) = await self._run([c.item])
                except Exception as own:
                    c.settle(error=own)
                else:
                    c.settle(result)
            return
        for c, result in zip(batch, results, strict=True):
            c.settle(result)
