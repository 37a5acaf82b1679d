"""Graphs the cluster tests run on real workers (the workers load this file's code)."""

from __future__ import annotations

import os

import trio

import omni


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


@omni.node(replicas=2, retries=2, idempotent=True, balance="least_loaded")
class SlowRetried:
    async def __call__(self, seconds: float) -> str:
        await trio.sleep(seconds)
        return where()


@omni.node(replicas=2, balance="least_loaded")
class SlowOnce:
    async def __call__(self, seconds: float) -> str:
        await trio.sleep(seconds)
        return where()


@omni.node
class Fails:
    async def __call__(self, x: int) -> int:
        raise ValueError(f"no good: {x}")
