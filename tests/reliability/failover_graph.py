"""The graph the failover tests run with `omni run --cluster` (its workers load this file's
code): a function node in the driver, then a class node with one replica on a worker.

The class node notes each call it serves in `SERVED` (in the workers' folder, ``served I
WORKER``). While `HOLD` exists and holds a number K, a call for request K or later notes
``holding I WORKER`` and waits until the file is gone (or its worker is killed): a test kills a
worker with a call in flight on it by condition, not by timing. (One replica, one call at a
time: one call holds, the others queue behind it in the driver.)
"""

from __future__ import annotations

import math
import os

import omni
from tests._wait import wait_until

HOLD = "hold"
SERVED = "served"


def _note(line: str) -> None:
    with open(SERVED, "a") as f:
        f.write(line + "\n")


def _hold_from() -> float:
    try:
        with open(HOLD) as f:
            return int(f.read())
    except (OSError, ValueError):
        return float("inf")


@omni.node
async def ask(i: int) -> int:
    return i


@omni.node
class Counter:
    async def __call__(self, i: int) -> dict:
        worker = omni.context().runtime.name
        if i >= _hold_from():
            _note(f"holding {i} {worker}")
            await wait_until(lambda: not os.path.exists(HOLD), "the hold file gone",
                             cap=math.inf)
        _note(f"served {i} {worker}")
        return {"i": i, "worker": worker}


@omni.graph
def failover(i: int):
    return Counter()(ask(i))
