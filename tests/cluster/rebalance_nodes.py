"""The node the rebalancing test runs on its workers."""

from __future__ import annotations

import math
import os

import trio

import omni
from tests._wait import wait_until

HOLD_S = 120.0  # the longest a call waits for its release file


@omni.node(replicas=2, balance="least_loaded", concurrency=4)  # calls beside a held one
class Spread:
    async def __call__(self, seconds: float = 0.0, until: str = "") -> str:
        """Sleep `seconds`, or until the file `until` exists; the worker's name."""
        if until:
            with trio.move_on_after(HOLD_S):
                await wait_until(lambda: os.path.exists(until), until, cap=math.inf)
        await trio.sleep(seconds)
        return omni.context().runtime.name
