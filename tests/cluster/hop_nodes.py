"""Nodes of the direct-hop tests (tests/cluster/test_direct_hops.py): a class node on worker
"w1" makes an array, one on "w2" sums it; the arrays only class nodes take stay on their
worker. `gate` (a function node, in the driver) holds a request until the test opens it."""

from __future__ import annotations

import numpy as np
import trio

import omni

GATE: list[trio.Event] = []  # the test's: `gate` waits on the last one


@omni.node(where="w1")
class Make:
    async def __call__(self, n: int) -> np.ndarray:
        return np.arange(n, dtype=np.float32)


@omni.node(where="w2")
class Total:
    async def __call__(self, x: np.ndarray, then: int = 0) -> float:
        return float(x.sum(dtype=np.float64)) + then


@omni.node(where="w1")
class Scale:
    async def __call__(self, x: np.ndarray) -> np.ndarray:
        return x * 2


@omni.node
async def gate(n: int) -> int:
    if GATE:
        await GATE[-1].wait()
    return 0


@omni.graph
def direct(n: int):
    """The array goes from w1 to w2; the driver gets the sum."""
    return Total()(Make()(n))


@omni.graph
def gated(n: int):
    """As `direct`, but w2's call waits for `gate` too."""
    return Total()(Make()(n), then=gate(n))


@omni.graph
def scaled(x: np.ndarray):
    """The driver's array to w1, twice it to w2; the driver gets the sum."""
    return Total()(Scale()(x))


@omni.graph
def returned(n: int):
    """The array is the graph's output: it comes to the driver."""
    return Make()(n)
