"""Streaming nodes: items flow to AsyncIterator consumers as produced, with backpressure."""

from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

import omni
from omni.graph.scheduler import STREAM_BUFFER
from tests._wait import CAP_S


@omni.node
async def count_up(n: int) -> AsyncIterator[int]:
    for i in range(n):
        yield i


@omni.node
async def total(items: AsyncIterator[int]) -> int:
    return sum([i async for i in items])


@omni.node
async def as_list(items: list[int]) -> list[int]:
    return items


async def test_consumer_receives_items_while_the_producer_is_still_running():
    log = []
    gate = trio.Event()

    @omni.node
    async def produce(n: int) -> AsyncIterator[int]:
        for i in range(n):
            log.append(f"produce {i}")
            if i == 2:
                await gate.wait()  # held until the consumer has seen item 1
            yield i

    @omni.node
    async def consume(items: AsyncIterator[int]) -> int:
        seen = 0
        async for i in items:
            log.append(f"consume {i}")
            if i == 1:
                gate.set()
            seen += 1
        return seen

    @omni.graph
    def g(n: int):
        return consume(produce(n))

    async with omni.Runtime() as rt:
        with trio.fail_after(CAP_S):
            assert await rt.run(g, n=4) == 4
    assert log.index("consume 1") < log.index("produce 3")


async def test_a_slow_consumer_holds_the_producer_back():
    produced = []
    consumed = trio.Event()

    @omni.node
    async def produce(n: int) -> AsyncIterator[int]:
        for i in range(n):
            produced.append(i)
            yield i

    @omni.node
    async def stall(items: AsyncIterator[int]) -> int:
        first = await items.__anext__()
        # Every task blocked: the producer went as far as it could, filling the edge's buffer.
        await trio.testing.wait_all_tasks_blocked()
        consumed.set()
        return first + len(produced)

    @omni.graph
    def g(n: int):
        return stall(produce(n))

    async with omni.Runtime() as rt:
        result = await rt.run(g, n=1000)
    assert result <= STREAM_BUFFER + 2
    assert len(produced) < 1000  # the producer stopped once nobody read any more


async def test_normal_parameter_receives_the_collected_list():
    @omni.graph
    def g(n: int):
        return as_list(count_up(n))

    async with omni.Runtime() as rt:
        assert await rt.run(g, n=3) == [0, 1, 2]


async def test_one_stream_feeds_several_consumers():
    @omni.graph
    def g(n: int):
        items = count_up(n)
        return {"a": total(items), "b": total(items), "all": as_list(items), "raw": items}

    async with omni.Runtime() as rt:
        assert await rt.run(g, n=5) == {"a": 10, "b": 10, "all": [0, 1, 2, 3, 4],
                                        "raw": [0, 1, 2, 3, 4]}


async def test_early_exit_of_the_only_consumer_stops_the_producer():
    closed = []

    @omni.node
    async def endless(n: int) -> AsyncIterator[int]:
        i = 0
        try:
            while True:
                yield i
                i += 1
        finally:
            closed.append(i)

    @omni.node
    async def first_three(items: AsyncIterator[int]) -> list[int]:
        out = []
        async for i in items:
            out.append(i)
            if len(out) == 3:
                return out
        return out

    @omni.graph
    def g(n: int):
        return first_three(endless(n))

    async with omni.Runtime() as rt:
        with trio.fail_after(CAP_S):
            assert await rt.run(g, n=0) == [0, 1, 2]
    assert len(closed) == 1


async def test_stream_outputs_reach_rt_stream_as_they_are_produced():
    gate = trio.Event()

    @omni.node
    async def tokens(text: str) -> AsyncIterator[str]:
        for i, w in enumerate(text.split()):
            if i == 1:
                await gate.wait()  # the caller must see the first token before this one
            yield w

    @omni.node
    async def shout(text: str) -> str:
        return text.upper()

    @omni.graph
    def g(text: str):
        return {"tokens": tokens(text), "loud": shout(text)}

    seen = []
    async with omni.Runtime() as rt:
        with trio.fail_after(CAP_S):
            async for name, item in rt.stream(g, text="a b c"):
                seen.append((name, item))
                if (name, item) == ("tokens", "a"):
                    gate.set()
    assert [i for n, i in seen if n == "tokens"] == ["a", "b", "c"]
    assert ("loud", "A B C") in seen


async def test_rt_run_collects_streaming_outputs():
    @omni.graph
    def g(n: int):
        return count_up(n)

    async with omni.Runtime() as rt:
        assert await rt.run(g, n=3) == [0, 1, 2]
        assert [item async for item in rt.stream(g, n=3)] == [("output", i) for i in range(3)]


async def test_rt_stream_reports_a_failure_after_the_items_before_it():
    @omni.node
    async def breaks(n: int) -> AsyncIterator[int]:
        yield 1
        raise RuntimeError("stream broke")

    @omni.graph
    def g(n: int):
        return breaks(n)

    seen = []
    async with omni.Runtime() as rt:
        with pytest.raises(omni.NodeError, match="stream broke"):
            async for _, item in rt.stream(g, n=1):
                seen.append(item)
        assert rt.stats().requests_failed == 1
    assert seen == [1]


async def test_rt_stream_batches_hold_the_same_pairs_in_order_and_the_failure():
    """`batches()` gives what iterating gives, in lists of what has arrived: every pair once,
    in order, across many buffer-fulls, and a failure after the items before it."""
    @omni.graph
    def g(n: int):
        return count_up(n)

    @omni.node
    async def breaks(n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i
        raise RuntimeError("stream broke")

    @omni.graph
    def broken(n: int):
        return breaks(n)

    async with omni.Runtime() as rt:
        async with rt.stream(g, n=2000) as stream:
            batches = [batch async for batch in stream.batches()]
        assert [pair for batch in batches for pair in batch] == [
            ("output", i) for i in range(2000)]
        assert all(batches) and len(batches) > 1
        seen = []
        with pytest.raises(omni.NodeError, match="stream broke"):
            async with rt.stream(broken, n=600) as stream:
                async for batch in stream.batches():
                    seen += [item for _, item in batch]
        assert seen == list(range(600))


async def test_closing_rt_stream_early_cancels_the_request():
    finalized = trio.Event()

    @omni.node
    async def endless(n: int) -> AsyncIterator[int]:
        try:
            while True:
                yield n
                await trio.sleep(0)
        finally:
            finalized.set()

    @omni.graph
    def g(n: int):
        return endless(n)

    async with omni.Runtime() as rt:
        async with rt.stream(g, n=7) as stream:
            async for _, item in stream:
                assert item == 7
                break
        with trio.fail_after(CAP_S):
            await finalized.wait()


async def test_streaming_switch_forwards_the_chosen_branch_items():
    @omni.node
    async def down(n: int) -> AsyncIterator[int]:
        for i in reversed(range(n)):
            yield i

    @omni.graph
    def twice(n: int):
        return count_up(n)

    @omni.graph
    def g(mode: str, n: int):
        return {"node": omni.switch(mode, {"up": count_up, "down": down}, n),
                "graph": total(omni.switch(mode, {"up": twice, "down": twice}, n))}

    async with omni.Runtime() as rt:
        assert await rt.run(g, mode="down", n=3) == {"node": [2, 1, 0], "graph": 3}
        assert await rt.run(g, mode="up", n=3) == {"node": [0, 1, 2], "graph": 3}


async def test_streaming_nodes_retry_only_before_their_first_item():
    attempts = []

    @omni.node(retries=2, idempotent=True)
    async def flaky(n: int) -> AsyncIterator[int]:
        attempts.append(n)
        if len(attempts) == 1:
            raise ConnectionError("not yet")
        yield 1
        if len(attempts) == 2:
            raise ConnectionError("mid-stream")
        yield 2

    @omni.graph
    def g(n: int):
        return flaky(n)

    async with omni.Runtime() as rt:
        with pytest.raises(omni.NodeError, match="mid-stream"):
            await rt.run(g, n=0)
    assert len(attempts) == 2


@omni.node
async def side_by_side(a: AsyncIterator[int], b: AsyncIterator[int]) -> dict:
    """Reads its two streams in turn, an item from each."""
    firsts, seconds = [], []
    second = b.__aiter__()
    async for item in a:
        firsts.append(item)
        seconds.append(await second.__anext__())
    return {"a": firsts, "b": seconds, "distinct": a is not b}


async def test_one_stream_into_two_parameters_is_teed_and_said_at_build():
    """Each parameter sees every item (not one iterator split between them), with
    backpressure; the build warns that reading one to its end first could block."""
    n = 5 * STREAM_BUFFER
    with pytest.warns(UserWarning, match="reads one stream through parameters a, b"):
        @omni.graph
        def teed(n: int):
            items = count_up(n)
            return {"pair": side_by_side(items, items), "total": total(items)}

    async with omni.Runtime() as rt:
        with trio.fail_after(30):
            out = await rt.run(teed, n=n)
    assert out["pair"] == {"a": list(range(n)), "b": list(range(n)), "distinct": True}
    assert out["total"] == sum(range(n))  # a third reader, another node, sees it all too
