"""Attempts of a node call: the node's timeout on each attempt, and its retries.

Why one helper: a plain call and a stream are retried by the same rules, which should not be
written twice. A node with ``retries=n`` gets up to n extra attempts after a failure, each under
its own ``timeout`` (a retry starts a fresh clock); ``NodeOptions.check`` allows retries only on
idempotent nodes, since a retry runs the body again. Only an `Exception` is retried: a
cancellation passes straight through. The error of the last attempt is raised.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, TypeVar

import trio

if TYPE_CHECKING:
    from omni.graph._node import NodeOptions

__all__ = ["retrying", "with_timeout"]

T = TypeVar("T")


async def retrying(options: NodeOptions | None, attempt: Callable[[int], Awaitable[T]],
                   *, may_retry: Callable[[], bool] | None = None) -> T:
    """Await ``attempt(n)`` for n = 0, 1, ... until one returns; return what it returned.

    Args:
        options: the node's options (`retries`, `timeout`); None: one attempt, no timeout
            (a step that is not a node, such as a switch whose branches stream).
        attempt: one attempt; its number goes to the replica balancer (`CallInfo.attempt`).
        may_retry: asked after a failed attempt that has retries left; False raises that
            attempt's error at once (a stream that has already produced an item).

    Raises:
        Exception: the last attempt's error (`TimeoutError` when it ran out of time).
    """
    retries = options.retries if options is not None else 0
    for number in range(retries + 1):
        try:
            async with with_timeout(options):
                return await attempt(number)
        except Exception:
            if number == retries or (may_retry is not None and not may_retry()):
                raise
    raise AssertionError("unreachable")  # pragma: no cover


@asynccontextmanager
async def with_timeout(options: NodeOptions | None) -> AsyncIterator[None]:
    """The node's timeout around one attempt, raised as `TimeoutError` naming it."""
    if options is None or options.timeout is None:
        yield
        return
    try:
        with trio.fail_after(options.timeout):
            yield
    except trio.TooSlowError:
        raise TimeoutError(f"timed out after {options.timeout:g}s") from None
