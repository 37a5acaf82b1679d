"""Running graphs from asyncio (trio guest mode) and synchronously (`omni.run`).

Every test here is a plain synchronous function that drives its own `asyncio.run(...)` (or
`omni.run`), so that trio runs as asyncio's guest exactly as it does in an asyncio app.
"""

import asyncio

import pytest
import trio

import omni
from tests._wait import CAP_S


async def until(predicate, what: str) -> None:
    """`wait_until` for the asyncio side of these tests (trio runs as its guest)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CAP_S
    while not predicate():
        assert loop.time() < deadline, f"still waiting after {CAP_S:g} s for: {what}"
        await asyncio.sleep(0.005)


@omni.node
async def upper(text: str) -> str:
    return text.upper()


@omni.node
async def words(text: str):
    for word in text.split():
        await trio.sleep(0)
        yield word


@omni.node
async def explode(text: str) -> str:
    raise ValueError(f"cannot handle {text!r}")


@omni.graph
def shout(text: str):
    return upper(text)


@omni.graph
def split(text: str):
    return {"upper": upper(text), "words": words(text)}


@omni.graph
def broken(text: str):
    return explode(upper(text))


def test_a_graph_runs_while_other_asyncio_tasks_keep_running():
    """The node waits (in trio) until an asyncio ticker has advanced: both loops interleave."""
    ticks = [0]
    reached = trio.Event()
    trio_side: list[trio.lowlevel.TrioToken] = []

    @omni.node
    async def wait_for_ticks(n: int) -> int:
        trio_side.append(trio.lowlevel.current_trio_token())
        with trio.fail_after(CAP_S):
            await reached.wait()
        return ticks[0]

    async def ticker() -> None:
        while True:
            await asyncio.sleep(0.001)
            ticks[0] += 1
            if ticks[0] >= 10 and trio_side:  # the asyncio side wakes the trio side
                trio_side[0].run_sync_soon(reached.set)

    async def main() -> int:
        async with omni.AsyncioRuntime() as rt:
            task = asyncio.create_task(ticker())
            try:
                return await rt.run(wait_for_ticks, n=10)
            finally:
                task.cancel()

    assert asyncio.run(main()) >= 10


def test_run_returns_single_and_dict_outputs():
    async def main():
        async with omni.AsyncioRuntime() as rt:
            return await rt.run(shout, text="hi"), await rt.run(split, text="a b")

    assert asyncio.run(main()) == ("HI", {"upper": "A B", "words": ["a", "b"]})


def test_stream_yields_items_in_order():
    async def main():
        async with omni.AsyncioRuntime() as rt:
            return [pair async for pair in rt.stream(split, text="one two three")]

    items = asyncio.run(main())
    assert [item for name, item in items if name == "words"] == ["one", "two", "three"]
    assert ("upper", "ONE TWO THREE") in items
    assert len(items) == 4


def test_leaving_a_stream_early_in_async_with_stops_its_request():
    stopped = []

    @omni.node
    async def endless(n: int):
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            stopped.append(True)

    async def main():
        async with omni.AsyncioRuntime() as rt:
            got = []
            async with rt.stream(endless, n=0) as stream:
                async for _, item in stream:
                    got.append(item)
                    if len(got) == 3:
                        break
            for _ in range(1000):  # the request's cancellation runs in trio's next turns
                if stopped:
                    break
                await asyncio.sleep(0.001)
            return got, list(stopped)

    got, stopped_before_close = asyncio.run(main())
    assert got == [0, 1, 2]
    assert stopped_before_close == [True]


def test_input_errors_raise_in_asyncio_before_anything_runs():
    async def main():
        async with omni.AsyncioRuntime() as rt:
            with pytest.raises(omni.InputError, match="no input 'txt'"):
                await rt.run(shout, txt="x")
            with pytest.raises(omni.InputError, match="missing input 'text'"):
                rt.stream(split)  # raised by the call itself, before iterating
            with pytest.raises(omni.InputError):
                await rt.run(upper, wrong=1)
            return rt.stats().requests_started

    assert asyncio.run(main()) == 0


def test_a_node_error_propagates_to_asyncio_with_the_node_named():
    async def main():
        async with omni.AsyncioRuntime() as rt:
            with pytest.raises(omni.NodeError) as info:
                await rt.run(broken, text="x")
            assert await rt.run(shout, text="still fine") == "STILL FINE"
            return info.value

    error = asyncio.run(main())
    assert error.node == "explode"
    assert isinstance(error.cause, ValueError)
    assert "cannot handle 'X'" in str(error)


def test_a_node_error_in_a_stream_propagates_to_asyncio():
    async def main():
        async with omni.AsyncioRuntime() as rt:
            with pytest.raises(omni.NodeError) as info:
                async for _ in rt.stream(broken, text="x"):
                    pass
            return info.value.node

    assert asyncio.run(main()) == "explode"


def test_cancelling_the_asyncio_task_cancels_the_trio_node():
    """When `wait_for` raises, the node has already been cancelled and its `finally` ran."""
    events: list[str] = []

    @omni.node
    async def forever(x: int) -> int:
        events.append("started")
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            events.append("cancelled")
            raise
        finally:
            events.append("finally")
        return x

    async def main():
        async with omni.AsyncioRuntime() as rt:
            request = asyncio.ensure_future(rt.run(forever, x=1))
            await until(lambda: "started" in events, "the node to start")
            with pytest.raises(TimeoutError):  # times out now, with the node running
                await asyncio.wait_for(request, timeout=0)
            seen = list(events)
            return seen, rt.stats()

    seen, stats = asyncio.run(main())
    assert seen == ["started", "cancelled", "finally"]
    assert stats.requests_in_flight == 0
    assert stats.requests_failed == 1


def test_two_requests_from_asyncio_gather_run_concurrently():
    """Each request waits for the other to start: only concurrent execution completes."""
    arrived = {"a": None, "b": None}

    @omni.node
    async def meet(me: str, other: str) -> str:
        arrived[me].set()
        with trio.fail_after(CAP_S):
            await arrived[other].wait()
        return me

    async def main():
        arrived["a"], arrived["b"] = trio.Event(), trio.Event()
        async with omni.AsyncioRuntime() as rt:
            return await asyncio.gather(rt.run(meet, me="a", other="b"),
                                        rt.run(meet, me="b", other="a"))

    assert asyncio.run(main()) == ["a", "b"]


def test_leaving_async_with_ends_the_trio_run_and_exits_instances():
    events: list[str] = []

    @omni.node
    class Session:
        async def __aenter__(self):
            events.append("enter")
            return self

        async def __aexit__(self, *exc_info):
            await trio.sleep(0)
            events.append("exit")

        async def __call__(self, x: int) -> int:
            return x

    @omni.graph
    def g(x: int):
        return Session()(x)

    async def main():
        async with omni.AsyncioRuntime(graphs=[g]) as rt:
            assert trio.lowlevel.in_trio_run()  # the guest run is alive in this thread
            assert await rt.run(g, x=5) == 5
            assert events == ["enter"]
        # The done callback fired: no trio run is left in this thread, instances exited.
        assert not trio.lowlevel.in_trio_run()
        assert events == ["enter", "exit"]
        with pytest.raises(RuntimeError, match="closed"):
            await rt.run(g, x=1)
        async with omni.AsyncioRuntime() as again:  # a new guest run may start
            return await again.run(g, x=6)

    assert asyncio.run(main()) == 6
    assert events == ["enter", "exit", "enter", "exit"]


def test_a_call_still_running_when_the_runtime_closes_fails_with_runtime_error():
    async def main():
        started = asyncio.Event()

        @omni.node
        async def hang(x: int) -> int:
            started.set()  # same thread: asyncio objects are safe to touch from trio here
            await trio.sleep_forever()
            return x

        async with omni.AsyncioRuntime() as rt:
            pending = asyncio.create_task(rt.run(hang, x=1))
            await started.wait()
        with pytest.raises(RuntimeError, match="closed while this call was running"):
            await pending
        return pending.cancelled()

    assert asyncio.run(main()) is False


def test_an_exception_in_the_async_with_body_still_shuts_trio_down():
    async def main():
        with pytest.raises(KeyError):
            async with omni.AsyncioRuntime() as rt:
                await rt.run(shout, text="x")
                raise KeyError("app bug")
        return trio.lowlevel.in_trio_run()

    assert asyncio.run(main()) is False


def test_a_startup_failure_raises_from_async_with():
    @omni.node
    class Llm:
        def __init__(self):
            raise OSError("no weights")

        async def __call__(self, prompt: str) -> str:
            return prompt

    @omni.graph
    def g(prompt: str):
        return Llm()(prompt)

    async def main():
        with pytest.raises(omni.NodeError, match="no weights") as info:
            async with omni.AsyncioRuntime(graphs=[g]):
                pytest.fail("must not start")
        return info.value.node, trio.lowlevel.in_trio_run()

    assert asyncio.run(main()) == ("Llm", False)


def test_cancelling_a_slow_start_stops_trio_before_raising():
    events: list[str] = []

    @omni.node
    class Slow:
        async def __aenter__(self):
            events.append("starting")
            try:
                await trio.sleep_forever()
            finally:
                events.append("start cancelled")

        async def __aexit__(self, *exc_info):
            events.append("exit")

        async def __call__(self, x: int) -> int:
            return x

    @omni.graph
    def g(x: int):
        return Slow()(x)

    async def main():
        rt = omni.AsyncioRuntime(graphs=[g])

        async def use() -> None:
            async with rt:
                pytest.fail("must not start")

        starting = asyncio.ensure_future(use())
        await until(lambda: events == ["starting"], "the replica to start")
        with pytest.raises(TimeoutError):  # times out now, in the middle of the start
            await asyncio.wait_for(starting, timeout=0)
        return list(events), trio.lowlevel.in_trio_run(), repr(rt)

    assert asyncio.run(main()) == (["starting", "start cancelled"], False,
                                   "<AsyncioRuntime closed>")


def test_using_it_without_async_with_is_a_clear_error():
    async def main():
        rt = omni.AsyncioRuntime()
        with pytest.raises(RuntimeError, match="not started"):
            await rt.run(shout, text="x")
        with pytest.raises(RuntimeError, match="not started"):
            rt.stream(shout, text="x")
        async with rt:
            pass
        with pytest.raises(RuntimeError, match="only once"):
            async with rt:
                pass

    asyncio.run(main())


def test_omni_run_is_synchronous_for_graphs_and_nodes():
    assert omni.run(shout, text="hi") == "HI"
    assert omni.run(split, text="a b") == {"upper": "A B", "words": ["a", "b"]}
    assert omni.run(upper, text="node") == "NODE"


def test_omni_run_raises_node_and_input_errors():
    with pytest.raises(omni.NodeError) as info:
        omni.run(broken, text="x")
    assert info.value.node == "explode"
    with pytest.raises(omni.InputError):
        omni.run(shout, nope="x")
