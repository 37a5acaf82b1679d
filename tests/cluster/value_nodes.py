"""Nodes whose values test what crosses to a worker (the workers load this file's code)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import torch
import trio

import omni
from omni.transport.movers import payload_mover


@dataclasses.dataclass(frozen=True)
class Frame:
    index: int
    pixels: np.ndarray
    tags: tuple[str, ...]


@omni.node
class Inspect:
    """Returns what it was given, and how it arrived."""

    async def __call__(self, frame: Frame, latent: torch.Tensor) -> dict:
        return {"frame": frame, "latent": latent, "types": (type(frame).__name__,
                                                            type(frame.tags).__name__),
                "stride": latent.stride(), "worker_stats": payload_mover().stats()}


@omni.node
class Echo:
    async def __call__(self, value: np.ndarray) -> np.ndarray:
        return value


@omni.node
class Tally:
    """Consumes a stream argument item by item and streams running totals back."""

    async def __call__(self, items: AsyncIterator[Frame]) -> AsyncIterator[int]:
        total = 0
        async for item in items:
            total += int(item.pixels.sum())
            yield total


@omni.node
async def frames(count: int) -> AsyncIterator[Frame]:
    for i in range(count):
        yield Frame(i, np.full((256, 256), i, np.int64), ("a", str(i)))


@omni.graph
def tally(count: int):
    return Tally()(frames(count))


@omni.node
class TakesACallback:
    async def __call__(self, on_done: Callable[[int], None]) -> int:
        return 0


@omni.node
class Count:
    async def __call__(self, items: AsyncIterator[Any]) -> int:
        return len([item async for item in items])


@omni.node
async def some_items(bad: bool) -> AsyncIterator[Any]:
    yield 1
    yield object() if bad else 2


@omni.graph
def count(bad: bool):
    return Count()(some_items(bad))


@omni.node
class OnDevice:
    """Doubles a tensor where it is, reporting the device it arrived on (CUDA tests)."""

    async def __call__(self, value: torch.Tensor) -> dict:
        return {"device": str(value.device), "doubled": value * 2}


@omni.node
class Bounce:
    """Sends each array of a stream argument back, plus one."""

    async def __call__(self, items: AsyncIterator[np.ndarray]) -> AsyncIterator[np.ndarray]:
        async for item in items:
            yield item + 1


@omni.node
async def big_arrays(count: int, nbytes: int) -> AsyncIterator[np.ndarray]:
    for i in range(count):
        yield np.full(nbytes, i, np.uint8)


@omni.graph
def bounce(count: int, nbytes: int):
    return Bounce()(big_arrays(count, nbytes))


@omni.node
class BreaksAfterOne:
    """Streams `x`, then fails (a moment later: the driver is then waiting for more)."""

    async def __call__(self, x: int) -> AsyncIterator[int]:
        yield x
        await trio.sleep(0.01)
        raise RuntimeError("broke after one item")
