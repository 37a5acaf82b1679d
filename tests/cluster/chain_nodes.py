"""Nodes of the chain tests (tests/cluster/test_chains.py): three class nodes, one per worker
("w1", "w2", "w3"), each taking the one before as its only argument. `HOLD` (the test's)
holds `Double`'s call for the value named, once; `Double` fails on 13 and records how many
of its calls run at once. Their synchronous twins (`SyncDouble`: `SYNC_HOLD`, `SYNC_RUNNING`)
record the thread each call ran on."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import trio

import omni
from tests._wait import CAP_S

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


# -- synchronous nodes: their stages run on the workers' lanes (`omni.transport.lane`) -------

THREADS: list[tuple[str, int]] = []  # (node, thread) of each synchronous call
SYNC_HOLD: dict[int, threading.Event] = {}  # value -> what SyncDouble's call waits for, once
SYNC_RUNNING: list[int] = [0, 0]  # SyncDouble's calls running now, and the most at once
_running = threading.Lock()


def _ran(node: str) -> None:
    THREADS.append((node, threading.get_ident()))


@omni.node(where="w1")
class SyncAddOne:
    def __call__(self, x: int) -> int:
        _ran("SyncAddOne")
        return x + 1


@omni.node(where="w2")
class SyncDouble:
    def __call__(self, x: int) -> int:
        _ran("SyncDouble")
        with _running:
            SYNC_RUNNING[0] += 1
            SYNC_RUNNING[1] = max(SYNC_RUNNING)
        try:
            hold = SYNC_HOLD.pop(x, None)
            if hold is not None:
                hold.wait(CAP_S)
            if x == 13:
                raise ValueError("13 is not doubled here")
            return 2 * x
        finally:
            with _running:
                SYNC_RUNNING[0] -= 1


@omni.node(where="w3")
class SyncNegate:
    def __call__(self, x: int) -> int:
        _ran("SyncNegate")
        return -x


@omni.node(where="w1")
class SyncScale:
    def __call__(self, x: np.ndarray) -> np.ndarray:
        _ran("SyncScale")
        return x * 2


@omni.node(where="w2")
class SyncTotal:
    def __call__(self, x: np.ndarray) -> float:
        _ran("SyncTotal")
        return float(x.sum(dtype=np.float64))


@omni.graph
def sync_line(x: int):
    """w1 -> w2 -> w3, each stage on its worker's lane: -(2 * (x + 1))."""
    return SyncNegate()(SyncDouble()(SyncAddOne()(x)))


@omni.graph
def mixed_line(x: int):
    """As `sync_line`, with the asynchronous Double on w2 (its stage goes to w2's event
    loop)."""
    return SyncNegate()(Double()(SyncAddOne()(x)))


@omni.node(where="w2", concurrency=2)
class SyncWide:
    """Doubles, two calls at once: more than a lane runs."""

    def __call__(self, x: int) -> int:
        _ran("SyncWide")
        return 2 * x


@omni.graph
def wide_line(x: int):
    """As `sync_line`, with SyncWide on w2 (its stages go to w2's event loop)."""
    return SyncNegate()(SyncWide()(SyncAddOne()(x)))


@omni.graph
def sync_double(x: int):
    """SyncDouble alone: a plain call on w2."""
    return SyncDouble()(x)


@omni.graph
def sync_scaled(x: np.ndarray):
    """The driver's array to w1 (in shared memory when large), twice it to w2 (kept on w1
    when 1 MiB or more, and taken from there); the driver gets the sum."""
    return SyncTotal()(SyncScale()(x))


@omni.node(where="w2")
class SyncNap:
    """Doubles, once the test lets it: notes ``SyncNap WORKER`` in the workers' folder's
    `pipelines.STARTED` file as it starts, then waits for `pipelines.RELEASE` (polling: it runs
    on a lane, or in a worker thread, where nothing else can wake it)."""

    def __call__(self, x: int) -> int:
        from tests.cluster.pipelines import RELEASE, STARTED, where

        with open(STARTED, "a") as f:
            f.write(f"SyncNap {where()}\n")
        deadline = time.monotonic() + CAP_S
        while not os.path.exists(RELEASE) and time.monotonic() < deadline:
            time.sleep(0.01)
        return 2 * x


@omni.graph
def napping_line(x: int):
    """As `sync_line`, with SyncNap on w2: -(2 * (x + 1))."""
    return SyncNegate()(SyncNap()(SyncAddOne()(x)))
