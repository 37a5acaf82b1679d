"""The scheduler: concurrency, failure isolation, cancellation, timeouts, retries, switch."""

import functools
import threading

import pytest
import trio
import trio.testing

import omni
from tests._wait import CAP_S, wait_until


@omni.node
async def upper(text: str) -> str:
    return text.upper()


@omni.node
async def fail(text: str) -> str:
    raise ValueError(f"bad input {text!r}")


async def test_independent_branches_run_concurrently():
    """Each branch waits for the other to start: only concurrent execution completes."""
    left_started, right_started = trio.Event(), trio.Event()

    @omni.node
    async def left(x: int) -> int:
        left_started.set()
        await right_started.wait()
        return x + 1

    @omni.node
    async def right(x: int) -> int:
        right_started.set()
        await left_started.wait()
        return x + 2

    @omni.node
    async def join(a: int, b: int) -> int:
        return a * b

    @omni.graph
    def g(x: int):
        return join(left(x), right(x))

    async with omni.Runtime() as rt:
        with trio.fail_after(CAP_S):
            assert await rt.run(g, x=1) == 6


async def test_a_node_starts_as_soon_as_its_inputs_are_ready(autojump_clock):
    slow_done = trio.Event()
    order = []

    @omni.node
    async def slow(x: int) -> int:
        await trio.sleep(1)
        order.append("slow")
        slow_done.set()
        return x

    @omni.node
    async def fast(x: int) -> int:
        return x

    @omni.node
    async def after_fast(x: int) -> int:
        assert not slow_done.is_set()
        order.append("after_fast")
        return x

    @omni.graph
    def g(x: int):
        return {"slow": slow(x), "quick": after_fast(fast(x))}

    async with omni.Runtime() as rt:
        assert await rt.run(g, x=1) == {"slow": 1, "quick": 1}
    assert order == ["after_fast", "slow"]


async def test_a_failing_node_fails_only_its_request(autojump_clock):
    @omni.node
    async def maybe_fail(text: str) -> str:
        if text == "bad":
            raise ValueError("no good")
        await trio.sleep(0.01)
        return text

    @omni.graph
    def g(text: str):
        return upper(maybe_fail(text))

    results = {}
    async with omni.Runtime() as rt:
        async def one(text):
            try:
                results[text] = await rt.run(g, text=text)
            except omni.NodeError as exc:
                results[text] = exc

        async with trio.open_nursery() as nursery:
            for text in ["a", "bad", "c"]:
                nursery.start_soon(one, text)
        assert await rt.run(g, text="after") == "AFTER"  # the runtime keeps serving
        stats = rt.stats()
    error = results["bad"]
    assert isinstance(error, omni.NodeError) and not isinstance(error, omni.RouteError)
    assert error.node == "maybe_fail"
    assert error.request_id.startswith("req-")
    assert isinstance(error.cause, ValueError) and error.__cause__ is error.cause
    assert "node 'maybe_fail' failed in request req-" in str(error)
    assert "ValueError: no good" in str(error)
    assert results["a"] == "A" and results["c"] == "C"
    assert (stats.requests_started, stats.requests_completed, stats.requests_failed) == (4, 3, 1)


async def test_a_failure_cancels_the_rest_of_its_request():
    cancelled = []

    @omni.node
    async def forever(text: str) -> str:
        try:
            await trio.sleep_forever()
        finally:
            cancelled.append(text)

    @omni.graph
    def g(text: str):
        return {"a": forever(text), "b": fail(text)}

    async with omni.Runtime() as rt:
        with pytest.raises(omni.NodeError, match="node 'fail'"):
            await rt.run(g, text="x")
    assert cancelled == ["x"]


def waits_forever(started: list[str], finalized: list[str]):
    """A node that notes its input in `started`, waits until cancelled, then notes it in
    `finalized`."""

    @omni.node
    async def wait(text: str) -> str:
        started.append(text)
        try:
            await trio.sleep_forever()
        finally:
            finalized.append(text)

    return wait


async def test_cancelling_a_request_cancels_all_its_nodes():
    started, finalized = [], []
    wait = waits_forever(started, finalized)

    @omni.graph
    def g(text: str):
        return {"a": wait(text), "b": wait(upper(text))}

    async with omni.Runtime() as rt:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(rt.run, g, text="x"))
                await wait_until(lambda: len(started) == 2, "both nodes to start")
                scope.cancel()  # the caller gives up with both nodes running
        assert scope.cancelled_caught
        assert rt.stats().requests_failed == 1
    assert sorted(started) == ["X", "x"] and sorted(finalized) == ["X", "x"]


async def test_a_scope_cancelled_around_the_runtime_closes_it_with_requests_in_flight():
    """Ctrl-C in ``omni run``: the scope around the runtime is cancelled while its requests
    run. The runtime still closes each of its nurseries in order (none left open: trio would
    call that a corrupted nursery stack), and the requests' nodes are finalised."""
    started, finalized = [], []
    wait = waits_forever(started, finalized)

    @omni.graph
    def g(text: str):
        return wait(text)

    async def consume(rt: omni.Runtime, text: str) -> None:
        async with rt.stream(g, text=text) as stream:  # its producer is the runtime's
            async for _ in stream:
                pass

    with trio.CancelScope() as outer:
        async with omni.Runtime() as rt, trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(consume, rt, str(i))
            await wait_until(lambda: len(started) == 4, "every request's node to start")
            outer.cancel()
    assert outer.cancelled_caught
    assert sorted(finalized) == ["0", "1", "2", "3"]


async def test_timeout_fails_the_request_with_the_node_named(autojump_clock):
    @omni.node(timeout=2)
    async def sleepy(text: str) -> str:
        await trio.sleep(10)
        return text

    @omni.graph
    def g(text: str):
        return sleepy(text)

    async with omni.Runtime() as rt:
        start = trio.current_time()
        with pytest.raises(omni.NodeError, match=r"node 'sleepy'.*timed out after 2s") as info:
            await rt.run(g, text="x")
    assert isinstance(info.value.cause, TimeoutError)
    assert trio.current_time() - start == pytest.approx(2)


@pytest.mark.parametrize(("retries", "succeeds"), [(2, True), (1, False)])
async def test_idempotent_nodes_are_retried(retries, succeeds):
    attempts = []

    @omni.node(retries=retries, idempotent=True)
    async def flaky(text: str) -> str:
        attempts.append(text)
        if len(attempts) < 3:
            raise ConnectionError("try again")
        return text

    @omni.graph
    def g(text: str):
        return flaky(text)

    async with omni.Runtime() as rt:
        if succeeds:
            assert await rt.run(g, text="x") == "x"
        else:
            with pytest.raises(omni.NodeError, match="try again"):
                await rt.run(g, text="x")
    assert len(attempts) == retries + 1


async def test_timeouts_are_retried_for_idempotent_nodes(autojump_clock):
    attempts = []

    @omni.node(timeout=1, retries=1, idempotent=True)
    async def slow_then_fast(text: str) -> str:
        attempts.append(trio.current_time())
        if len(attempts) == 1:
            await trio.sleep(5)
        return text

    @omni.graph
    def g(text: str):
        return slow_then_fast(text)

    async with omni.Runtime() as rt:
        assert await rt.run(g, text="x") == "x"
    assert len(attempts) == 2


async def test_switch_runs_only_the_chosen_branch():
    ran = []

    @omni.node
    async def kind(text: str) -> str:
        return "short" if len(text) < 5 else "long"

    @omni.node
    async def shorten(text: str) -> str:
        ran.append("shorten")
        return text[:2]

    @omni.node
    async def summarize(text: str) -> str:
        ran.append("summarize")
        return text[:4] + "..."

    @omni.graph
    def g(text: str):
        return omni.switch(kind(text), {"short": shorten, "long": summarize}, text)

    async with omni.Runtime() as rt:
        assert await rt.run(g, text="abc") == "ab"
        assert ran == ["shorten"]
        assert await rt.run(g, text="abcdefgh") == "abcd..."
        assert ran == ["shorten", "summarize"]


async def test_unknown_switch_value_fails_that_request_with_route_error():
    @omni.graph
    def g(kind: str, text: str):
        return omni.switch(kind, {"up": upper}, text)

    async with omni.Runtime() as rt:
        with pytest.raises(omni.RouteError, match=r"no branch for 'down' \(branches: 'up'\)"):
            await rt.run(g, kind="down", text="x")
        with pytest.raises(omni.RouteError, match="no branch for"):
            await rt.run(g, kind=["unhashable"], text="x")
        assert await rt.run(g, kind="up", text="x") == "X"


async def test_switch_branches_may_be_graphs():
    @omni.node
    async def exclaim(text: str) -> str:
        return text + "!"

    @omni.graph
    def loud(text: str):
        return exclaim(upper(text))

    @omni.graph
    def quiet(text: str):
        return exclaim(text)

    @omni.graph
    def g(mode: str, text: str):
        return omni.switch(mode, {"loud": loud, "quiet": quiet}, text)

    async with omni.Runtime() as rt:
        assert await rt.run(g, mode="loud", text="hi") == "HI!"
        assert await rt.run(g, mode="quiet", text="hi") == "hi!"


async def test_a_failure_inside_a_switch_branch_names_the_branch_node():
    @omni.graph
    def g(mode: str, text: str):
        return omni.switch(mode, {"ok": upper, "bad": fail}, text)

    async with omni.Runtime() as rt:
        with pytest.raises(omni.NodeError, match="node 'fail'") as info:
            await rt.run(g, mode="bad", text="x")
    assert not isinstance(info.value, omni.RouteError)


async def test_many_concurrent_requests_get_their_own_results(autojump_clock):
    @omni.node
    async def jitter(x: int) -> int:
        await trio.sleep((x % 7) / 1000)
        return x

    @omni.node
    async def square(x: int) -> int:
        return x * x

    @omni.graph
    def g(x: int):
        y = jitter(x)
        return {"x": y, "sq": square(y)}

    results = {}
    async with omni.Runtime() as rt:
        async def one(x):
            results[x] = await rt.run(g, x=x)

        async with trio.open_nursery() as nursery:
            for x in range(300):
                nursery.start_soon(one, x)
    assert results == {x: {"x": x, "sq": x * x} for x in range(300)}


async def test_unknown_and_missing_inputs_raise_input_error():
    @omni.graph
    def g(text: str):
        return upper(text)

    async with omni.Runtime() as rt:
        with pytest.raises(omni.InputError, match="graph 'g' has no input 'txt' "
                                                  r"\(inputs: text\)"):
            await rt.run(g, txt="x")
        with pytest.raises(omni.InputError, match="graph 'g' is missing input 'text'"):
            await rt.run(g)


async def test_thread_nodes_run_off_the_event_loop(autojump_clock):
    """A blocking body with thread=True leaves the event loop free for other tasks."""
    release = threading.Event()
    ticks = []

    @omni.node(thread=True)
    def blocking(x: int) -> dict:
        assert release.wait(CAP_S)
        ctx = omni.context()
        return {"thread": threading.get_ident(), "node": ctx.node, "request": ctx.request_id}

    @omni.graph
    def g(x: int):
        return blocking(x)

    async def ticker():
        for _ in range(3):
            ticks.append(1)
            await trio.sleep(0.001)
        release.set()

    async with omni.Runtime() as rt, trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        result = await rt.run(g, x=1)
    assert len(ticks) == 3
    assert result["thread"] != threading.get_ident()
    assert result["node"] == "blocking" and result["request"].startswith("req-")


async def test_context_names_the_request_and_node():
    @omni.node
    async def who(x: int) -> tuple:
        ctx = omni.context()
        return ctx.request_id, ctx.node, ctx.replica, ctx.kv

    @omni.graph
    def g(x: int):
        return who(x)

    async with omni.Runtime() as rt:
        first = await rt.run(g, x=1)
        second = await rt.run(g, x=1)
    assert first[1:] == ("who", None, None)
    assert first[0] != second[0]
    with pytest.raises(RuntimeError, match="only available inside a node"):
        omni.context()


async def test_sync_bodies_without_thread_run_inline():
    @omni.node
    def plus_one(x: int) -> int:
        return x + 1

    @omni.graph
    def g(x: int):
        return plus_one(plus_one(x))

    async with omni.Runtime() as rt:
        assert await rt.run(g, x=1) == 3


def test_omni_run_is_synchronous():
    @omni.graph
    def g(text: str):
        return upper(text)

    assert omni.run(g, text="sync") == "SYNC"


async def test_runtime_repr_summarises_state():
    @omni.graph
    def g(text: str):
        return upper(text)

    async with omni.Runtime() as rt:
        await rt.run(g, text="x")
        assert repr(rt) == "<Runtime requests=1/1 failed=0 pools=0>"


async def test_errors_in_other_tasks_do_not_leak_exception_groups(autojump_clock):
    """Users see one NodeError, never an ExceptionGroup, even with fan-out."""

    @omni.node
    async def slow_ok(text: str) -> str:
        await trio.sleep(0.01)
        return text

    @omni.graph
    def g(text: str):
        return {"a": fail(text), "b": fail(upper(text)), "c": slow_ok(text)}

    async with omni.Runtime() as rt:
        with pytest.raises(omni.NodeError):
            await rt.run(g, text="x")


async def test_runtime_must_be_started():
    @omni.graph
    def g(text: str):
        return upper(text)

    rt = omni.Runtime()
    with pytest.raises(RuntimeError, match="not started"):
        await rt.run(g, text="x")


async def test_nodes_can_be_deployed_and_run_directly():
    async with omni.Runtime(graphs=[upper]) as rt:
        assert await rt.run(upper, text="x") == "X"


async def test_a_failed_lazy_deployment_counts_as_a_failed_request():
    @omni.node
    class Broken:
        def __init__(self):
            raise OSError("weights not found")

        async def __call__(self, text: str) -> str:
            return text

    @omni.graph
    def g(text: str):
        return Broken()(text)

    async with omni.Runtime() as rt:
        with pytest.raises(omni.NodeError, match="weights not found"):
            await rt.run(g, text="x")
        stats = rt.stats()
    assert (stats.requests_failed, stats.requests_in_flight) == (1, 0)


async def test_a_stream_stopped_early_counts_once():
    from collections.abc import AsyncIterator

    @omni.node
    async def endless(n: int) -> AsyncIterator[int]:
        while True:
            yield n
            await trio.sleep(0)

    @omni.graph
    def g(n: int):
        return endless(n)

    async with omni.Runtime() as rt:
        async with rt.stream(g, n=1) as stream:
            async for _ in stream:
                break
        await trio.testing.wait_all_tasks_blocked()
        stats = rt.stats()
    assert (stats.requests_failed, stats.requests_in_flight) == (1, 0)
