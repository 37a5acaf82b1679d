"""Waiting in tests for a condition, never for a length of time.

A test that sleeps a fixed time and then asserts bets that the machine kept up; on a loaded
machine it loses. These helpers poll a condition until it holds and give up only after a cap
that a passing run never comes near: the cap decides nothing but how long a broken run takes
to fail, so it is generous, and the failure names what was awaited.
"""

from __future__ import annotations

import inspect
import linecache
import time
from collections.abc import Awaitable, Callable

import trio

CAP_S = 60.0  # reached only when the awaited thing never happens


async def wait_until(predicate: Callable[[], object | Awaitable[object]], what: str = "", *,
                     cap: float = CAP_S, poll: float = 0.005) -> None:
    """Return once `predicate()` (awaited when it gives an awaitable) is true; fail the test
    after `cap` seconds naming `what` (the predicate's source line when not given).

    Graph files that tests' processes load wait through this too (with `cap` inf, inside the
    caller's own cancel scope): the processes the tests start can import `tests`."""
    async def holds() -> object:
        result = predicate()
        return await result if inspect.isawaitable(result) else result

    with trio.move_on_after(cap) as scope:
        while not await holds():
            await trio.sleep(poll)
    if scope.cancelled_caught:
        raise AssertionError(f"still waiting after {cap:g} s for: {_describe(predicate, what)}")


def wait_until_sync(predicate: Callable[[], object], what: str = "", *,
                    cap: float = CAP_S, poll: float = 0.01) -> None:
    """`wait_until` for code outside trio (polling subprocesses, files, threads)."""
    deadline = time.monotonic() + cap
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(
                f"still waiting after {cap:g} s for: {_describe(predicate, what)}")
        time.sleep(poll)


def _describe(predicate: Callable[[], object], what: str) -> str:
    if what:
        return what
    code = getattr(predicate, "__code__", None)
    if code is None:
        return repr(predicate)
    line = linecache.getline(code.co_filename, code.co_firstlineno).strip()
    return f"{line or predicate!r} ({code.co_filename}:{code.co_firstlineno})"
