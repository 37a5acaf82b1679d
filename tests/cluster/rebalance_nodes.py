"""The node the rebalancing test runs on its workers."""

from __future__ import annotations

import os

import trio

import omni

HOLD_S = 120.0  # the longest a call waits for its release file


@omni.node(replicas=2, balance="least_loaded", concurrency=4)  # calls beside a held one
class Spread:
    async def __call__(self, seconds: float = 0.0, until: str = "") -> str:
        """Sleep `seconds`, or until the file `until` exists; the worker's name."""
        if until:
            with trio.move_on_after(HOLD_S):
                while not os.path.exists(until):
                    await trio.sleep(0.02)
        await trio.sleep(seconds)
        return omni.context().runtime.name
