"""Nodes of the chain tests (tests/cluster/test_chains.py): three class nodes, one per worker
("w1", "w2", "w3"), each taking the one before as its only argument. `HOLD` (the test's)
holds `Double`'s call for the value named, once; `Double` fails on 13 and records how many
of its calls run at once."""

from __future__ import annotations

import trio

import omni

HOLD: dict[int, trio.Event] = {}  # value -> what Double's call with it waits for, once
RUNNING: list[int] = [0, 0]  # Double's calls running now, and the most at once


@omni.node(where="w1")
class AddOne:
    async def __call__(self, x: int) -> int:
        return x + 1


@omni.node(where="w2")
class Double:
    async def __call__(self, x: int) -> int:
        RUNNING[0] += 1
        RUNNING[1] = max(RUNNING)
        try:
            if x in HOLD:
                await HOLD.pop(x).wait()
            for _ in range(3):  # room for another call to run meanwhile, were it let in
                await trio.sleep(0)
            if x == 13:
                raise ValueError("13 is not doubled here")
            return 2 * x
        finally:
            RUNNING[0] -= 1


@omni.node(where="w3")
class Negate:
    async def __call__(self, x: int) -> int:
        return -x


@omni.node(where="w1")
class Half:
    async def __call__(self, x: int) -> int:
        return x // 2


@omni.graph
def line(x: int):
    """w1 -> w2 -> w3: -(2 * (x + 1))."""
    return Negate()(Double()(AddOne()(x)))


@omni.graph
def back(x: int):
    """w1 -> w2 -> w1: x + 1."""
    return Half()(Double()(AddOne()(x)))
