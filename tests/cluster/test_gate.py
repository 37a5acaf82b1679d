"""A hosted replica's slots (`omni.cluster.gate.Gate`), shared by the worker's event loop,
which waits in line for one, and its lane's thread, which takes one only while one is free
and nobody waits, and otherwise leaves the call to the event loop."""

from __future__ import annotations

import pytest
import trio

from omni.cluster.gate import Gate
from tests._wait import CAP_S, wait_until


async def test_free_slots_are_taken_at_once_and_then_refused() -> None:
    gate = Gate(2)
    assert gate.try_acquire() and gate.try_acquire()
    assert not gate.try_acquire()
    gate.release()
    assert gate.try_acquire()
    with pytest.raises(ValueError, match="at least one slot"):
        Gate(0)


async def test_waiters_get_released_slots_first_come_first_served() -> None:
    gate = Gate(1)
    await gate.acquire()
    order: list[int] = []

    async def wait(i: int) -> None:
        await gate.acquire()
        order.append(i)

    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(wait, i)
                await wait_until(lambda i=i: len(gate._waiters) == i + 1)
            # a slot released while calls wait goes to the first of them: the lane's thread
            # cannot take it past them
            gate.release()
            assert not gate.try_acquire()
            await wait_until(lambda: order == [0])
            gate.release()
            await wait_until(lambda: order == [0, 1])
            gate.release()
    assert order == [0, 1, 2]
    gate.release()
    assert gate.try_acquire()


async def test_a_release_on_another_thread_wakes_the_waiter_on_the_event_loop() -> None:
    gate = Gate(1)
    assert await trio.to_thread.run_sync(gate.try_acquire)  # the lane's thread took it
    woke = trio.Event()

    async def wait() -> None:
        await gate.acquire()
        woke.set()

    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await wait_until(lambda: gate._waiters)
            await trio.to_thread.run_sync(gate.release)
            await woke.wait()
    assert not gate.try_acquire()  # the waiter holds it


async def test_a_waiter_that_gives_up_leaves_the_line() -> None:
    gate = Gate(1)
    await gate.acquire()
    with trio.move_on_after(0.01):
        await gate.acquire()
    assert not gate._waiters
    gate.release()
    assert gate.try_acquire()
