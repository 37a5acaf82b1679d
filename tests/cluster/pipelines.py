"""Graphs the cluster tests run on workers, in the test's process or in worker processes
(which load this file's code)."""

from __future__ import annotations

import math
import os

import trio

import omni
from tests._wait import wait_until


def where() -> str:
    """The worker this node runs on (``driver`` outside a cluster worker)."""
    return getattr(omni.context().runtime, "name", "driver")


@omni.node(replicas=2)
class Shout:
    def __init__(self, suffix: str = "!"):
        self.suffix = suffix

    async def __call__(self, text: str) -> dict:
        return {"text": text.upper() + self.suffix, "worker": where(), "pid": os.getpid(),
                "replica": omni.context().replica}


@omni.node
class Words:
    async def __call__(self, text: str):
        for word in text.split():
            yield word


@omni.node
async def joined(parts: list) -> str:
    return "|".join(parts)


@omni.graph
def shout(text: str):
    return {"shout": Shout()(text), "words": joined(Words()(text))}


@omni.node(resources={"gpu": 1})
class OnGpu:
    def __call__(self, x: int) -> dict:  # synchronous: runs in a worker thread there
        return {"x": x * 2, "worker": where()}


@omni.node(where="w2")
class Pinned:
    async def __call__(self, x: int) -> str:
        return where()


@omni.graph
def placed(x: int):
    return {"gpu": OnGpu()(x), "pinned": Pinned()(x)}


# In the workers' current folder (a worker process's, or the test's own for workers in it):
STARTED = "started"  # a slow node adds "NODE WORKER" as it starts
RELEASE = "release"  # once it exists, slow nodes return at once


async def nap(node: str, seconds: float) -> str:
    """Note in `STARTED` that `node` started here, then sleep `seconds` or until the test
    creates `RELEASE`: a test waits for the calls to be running, not for a guessed time."""
    with open(STARTED, "a") as f:
        f.write(f"{node} {where()}\n")
    with trio.move_on_after(seconds):
        await wait_until(lambda: os.path.exists(RELEASE), "the release file", cap=math.inf)
    return where()


@omni.node(replicas=2, retries=2, idempotent=True, balance="least_loaded")
class SlowRetried:
    async def __call__(self, seconds: float) -> str:
        return await nap("SlowRetried", seconds)


@omni.node(replicas=2, balance="least_loaded")
class SlowOnce:
    async def __call__(self, seconds: float) -> str:
        return await nap("SlowOnce", seconds)


@omni.node(replicas=2, balance="least_loaded")
class SlowWords:
    """Streams one item, then naps: a worker killed now has passed an item on."""

    async def __call__(self, seconds: float):
        yield "first"
        yield await nap("SlowWords", seconds)


@omni.node
class Fails:
    async def __call__(self, x: int) -> int:
        raise ValueError(f"no good: {x}")
