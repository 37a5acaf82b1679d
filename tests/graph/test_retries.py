"""Retries and per-attempt timeouts, for plain and streaming nodes, through a real Runtime:
what is retried, how often, what the balancer is told, and which error the request ends with."""

from collections.abc import AsyncIterator

import pytest
import trio

import omni
from omni.graph.balance import RoundRobin


class Recording(RoundRobin):
    """Round robin that remembers the attempt number of every call it places."""

    def __init__(self) -> None:
        super().__init__()
        self.attempts: list[tuple[str, int]] = []

    def choose(self, replicas, call) -> int:
        self.attempts.append((call.request_id, call.attempt))
        return super().choose(replicas, call)


async def test_the_balancer_sees_each_attempt_of_a_call_numbered_from_zero():
    balancer = Recording()

    @omni.node(replicas=2, balance=balancer, retries=2, idempotent=True)
    class Flaky:
        async def __call__(self, x: int) -> int:
            if len(balancer.attempts) < 3:
                raise ConnectionError("replica not ready")
            return x

    async with omni.Runtime() as rt:
        assert await rt.run(Flaky(), x=7) == 7
        assert await rt.run(Flaky(), x=8) == 8  # a new call starts again from 0
    first, second = balancer.attempts[:3], balancer.attempts[3:]
    assert [attempt for _, attempt in first] == [0, 1, 2]
    assert len({request_id for request_id, _ in first}) == 1  # all three for one request
    assert [attempt for _, attempt in second] == [0]


async def test_the_balancer_sees_each_attempt_of_a_stream_numbered_from_zero():
    balancer = Recording()

    @omni.node(replicas=2, balance=balancer, retries=2, idempotent=True)
    class Words:
        async def __call__(self, text: str) -> AsyncIterator[str]:
            if len(balancer.attempts) < 3:
                raise ConnectionError("not ready")
            for word in text.split():
                yield word

    async with omni.Runtime() as rt:
        assert await rt.run(Words(), text="a b") == ["a", "b"]
    assert [attempt for _, attempt in balancer.attempts] == [0, 1, 2]


@pytest.mark.parametrize("options", [{}, {"idempotent": True}], ids=["plain", "idempotent"])
async def test_a_node_without_retries_runs_once(options):
    calls = []

    @omni.node(**options)
    async def broken(x: int) -> int:
        calls.append(x)
        raise ConnectionError("down")

    async with omni.Runtime() as rt:
        with pytest.raises(omni.NodeError, match="down"):
            await rt.run(broken, x=1)
    assert calls == [1]


async def test_a_node_that_is_not_idempotent_cannot_ask_for_retries():
    with pytest.raises(ValueError, match="retries=1 needs idempotent=True"):
        @omni.node(retries=1)
        async def charge(amount: int) -> int:
            return amount


async def test_the_error_of_the_last_attempt_is_the_one_raised():
    errors = [ConnectionError("first"), KeyError("second"), ValueError("third")]
    tried = []

    @omni.node(retries=2, idempotent=True)
    async def worse_each_time(x: int) -> int:
        tried.append(x)
        raise errors[len(tried) - 1]

    async with omni.Runtime() as rt:
        with pytest.raises(omni.NodeError, match="third") as info:
            await rt.run(worse_each_time, x=1)
    assert info.value.cause is errors[2]
    assert tried == [1, 1, 1]


async def test_each_attempt_has_the_whole_timeout(autojump_clock):
    """Two attempts of 1.5 s under a 2 s timeout: both fit only if the clock restarts."""
    started = []

    @omni.node(timeout=2, retries=1, idempotent=True)
    async def slow(x: int) -> int:
        started.append(trio.current_time())
        await trio.sleep(1.5)
        if len(started) == 1:
            raise ConnectionError("flaky")
        return x

    async with omni.Runtime() as rt:
        start = trio.current_time()
        assert await rt.run(slow, x=3) == 3
        assert trio.current_time() - start == pytest.approx(3.0)
    assert len(started) == 2


async def test_a_call_that_times_out_on_every_attempt_fails_with_the_timeout(autojump_clock):
    started = []

    @omni.node(timeout=1, retries=2, idempotent=True)
    async def stuck(x: int) -> int:
        started.append(trio.current_time())
        await trio.sleep_forever()

    async with omni.Runtime() as rt:
        start = trio.current_time()
        with pytest.raises(omni.NodeError, match="timed out after 1s") as info:
            await rt.run(stuck, x=1)
        assert trio.current_time() - start == pytest.approx(3.0)
    assert isinstance(info.value.cause, TimeoutError)
    assert [t - start for t in started] == pytest.approx([0.0, 1.0, 2.0])


async def test_a_cancelled_call_is_not_retried(autojump_clock):
    started = []

    @omni.node(retries=2, idempotent=True)
    async def waits(x: int) -> int:
        started.append(x)
        await trio.sleep_forever()

    async with omni.Runtime() as rt:
        with trio.move_on_after(1) as scope:
            await rt.run(waits, x=1)
    assert scope.cancelled_caught
    assert started == [1]


# -- streams ------------------------------------------------------------------------------------


@omni.node
async def total(items: AsyncIterator[int]) -> int:
    return sum([item async for item in items])


async def test_a_stream_retried_before_its_first_item_feeds_its_consumer_once():
    started = []

    @omni.node(retries=1, idempotent=True)
    async def count(n: int) -> AsyncIterator[int]:
        started.append(n)
        if len(started) == 1:
            raise ConnectionError("not yet")
        for i in range(n):
            yield i

    @omni.graph
    def g(n: int):
        items = count(n)
        return {"items": items, "total": total(items)}

    async with omni.Runtime() as rt:
        assert await rt.run(g, n=4) == {"items": [0, 1, 2, 3], "total": 6}
    assert started == [4, 4]


async def test_a_stream_that_timed_out_before_its_first_item_is_retried(autojump_clock):
    started = []

    @omni.node(timeout=1, retries=1, idempotent=True)
    async def late(n: int) -> AsyncIterator[int]:
        started.append(trio.current_time())
        if len(started) == 1:
            await trio.sleep(5)
        for i in range(n):
            yield i

    async with omni.Runtime() as rt:
        assert await rt.run(late, n=3) == [0, 1, 2]
    assert len(started) == 2


async def test_a_stream_that_timed_out_after_an_item_is_not_retried(autojump_clock):
    started = []

    @omni.node(timeout=1, retries=2, idempotent=True)
    async def stalls(n: int) -> AsyncIterator[int]:
        started.append(n)
        yield 0
        await trio.sleep(5)
        yield 1

    async with omni.Runtime() as rt:
        with pytest.raises(omni.NodeError, match="timed out after 1s"):
            await rt.run(stalls, n=2)
    assert started == [2]
