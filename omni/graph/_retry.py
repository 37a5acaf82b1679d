"""Attempts of a node call: the node's timeout on each attempt, and its retries.

Why one helper: a plain call and a stream are retried by the same rules, which should not be
written twice. A node with ``retries=n`` gets up to n extra attempts after a failure, each under
its own ``timeout`` (a retry starts a fresh clock); ``NodeOptions.check`` allows retries only on
idempotent nodes, since a retry runs the body again. Only an `Exception` is retried: a
cancellation passes straight through. The error of the last attempt is raised.

An attempt lost with the process that hosted its replica (`ReplicaLost`) gets one more attempt
of its own, on top of ``retries`` and for every node: nothing of it came back, so the caller
has seen nothing twice (see `ReplicaLost` for what that promises and what not).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import trio

from omni.graph.errors import ReplicaLost

if TYPE_CHECKING:
    from omni.graph._node import NodeOptions

__all__ = ["LOST_RETRIES", "retrying"]

T = TypeVar("T")

LOST_RETRIES = 1  # extra attempts of a call lost with its replica's process


async def retrying(options: NodeOptions | None, attempt: Callable[[int], Awaitable[T]],
                   *, may_retry: Callable[[], bool] | None = None) -> T:
    """Await ``attempt(n)`` for n = 0, 1, ... until one returns; return what it returned.

    Args:
        options: the node's options (`retries`, `timeout`); None: one attempt, no timeout
            (a step that is not a node, such as a switch whose branches stream).
        attempt: one attempt; its number goes to the replica balancer (`CallInfo.attempt`).
        may_retry: asked after a failed attempt; False raises that attempt's error at once
            (a stream that has already produced an item).

    Raises:
        Exception: the last attempt's error (`TimeoutError` when it ran out of time).
    """
    retries = options.retries if options is not None else 0
    timeout = options.timeout if options is not None else None
    failures = lost = 0
    number = 0
    while True:
        try:
            if timeout is None:
                return await attempt(number)
            return await _timed(attempt(number), timeout)
        except Exception as exc:
            if may_retry is not None and not may_retry():
                raise
            if isinstance(exc, ReplicaLost) and lost < LOST_RETRIES:
                lost += 1
            else:
                failures += 1
                if failures > retries:
                    raise
        number += 1


async def _timed(attempt: Awaitable[T], timeout: float) -> T:
    """One attempt under the node's timeout, raised as `TimeoutError` naming it."""
    try:
        with trio.fail_after(timeout):
            return await attempt
    except trio.TooSlowError:
        raise TimeoutError(f"timed out after {timeout:g}s") from None
