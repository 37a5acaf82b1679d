"""Replicated class nodes through a real Runtime: instances, binding, slots, balancing, queues."""

from collections import Counter

import pytest
import trio
import trio.testing

import omni
from omni.graph.balance import PowerOfTwo


def pool_stats(rt: omni.Runtime, name: str):
    """The one pool named `name` in the runtime's stats."""
    (stats,) = [p for p in rt.stats().pools if p.name == name]
    return stats


async def run_x(rt: omni.Runtime, target, x: int) -> None:
    """One request with input `x` (for `nursery.start_soon`, which passes no keywords)."""
    await rt.run(target, x=x)


# -- instances ----------------------------------------------------------------------------------


async def test_each_replica_gets_one_instance_built_once_when_the_runtime_starts():
    built: list[int] = []

    @omni.node(replicas=3)
    class Llm:
        def __init__(self):
            built.append(omni.context().replica)

        async def __call__(self, prompt: str) -> str:
            return prompt

    @omni.graph
    def g(prompt: str):
        return Llm()(prompt)

    async with omni.Runtime(graphs=[g]) as rt:
        assert sorted(built) == [0, 1, 2]
        for i in range(6):
            assert await rt.run(g, prompt=f"p{i}") == f"p{i}"
    assert sorted(built) == [0, 1, 2]


async def test_a_graph_not_listed_is_deployed_once_on_its_first_requests():
    built: list[int] = []

    @omni.node(replicas=2)
    class Llm:
        def __init__(self):
            built.append(omni.context().replica)

        async def __call__(self, prompt: str) -> str:
            await trio.sleep(0)
            return prompt.upper()

    @omni.graph
    def g(prompt: str):
        return Llm()(prompt)

    async with omni.Runtime() as rt:
        assert built == []
        results = {}

        async def one(i: int) -> None:
            results[i] = await rt.run(g, prompt=f"p{i}")

        async with trio.open_nursery() as nursery:  # concurrent first requests
            for i in range(5):
                nursery.start_soon(one, i)
        assert results == {i: f"P{i}" for i in range(5)}
        assert sorted(built) == [0, 1]


async def test_context_replica_is_the_replica_index_in_init_and_in_calls():
    @omni.node(replicas=3, balance="round_robin")
    class Who:
        def __init__(self):
            ctx = omni.context()
            assert ctx.request_id is None
            self.built_as = ctx.replica

        async def __call__(self, x: int) -> tuple[int, int, str]:
            ctx = omni.context()
            return self.built_as, ctx.replica, ctx.node

    async with omni.Runtime() as rt:
        seen = [await rt.run(Who(), x=i) for i in range(6)]
    assert seen == [(i % 3, i % 3, "Who") for i in range(6)]


async def test_a_function_node_with_replicas_runs_on_numbered_lanes():
    @omni.node(replicas=2, concurrency=1)
    async def lane(x: int) -> int | None:
        return omni.context().replica

    async with omni.Runtime() as rt:
        assert [await rt.run(lane, x=i) for i in range(4)] == [0, 1, 0, 1]
        assert pool_stats(rt, "lane").replicas == ((0, 0, 2, 0), (0, 0, 2, 0))


async def test_different_constructor_arguments_make_separate_deployments():
    built: list[str] = []

    @omni.node(replicas=2)
    class Llm:
        def __init__(self, model: str = "tiny"):
            built.append(model)
            self.model = model

        async def __call__(self, prompt: str) -> str:
            return f"{self.model}:{prompt}"

    @omni.graph
    def g(prompt: str):
        return {"x": Llm(model="x")(prompt), "default": Llm()(prompt)}

    async with omni.Runtime(graphs=[g]) as rt:
        assert await rt.run(g, prompt="hi") == {"x": "x:hi", "default": "tiny:hi"}
        assert sorted(built) == ["tiny", "tiny", "x", "x"]
        assert [p.name for p in rt.stats().pools] == ["Llm", "Llm"]


async def test_the_same_constructor_arguments_share_one_deployment_across_graphs():
    built: list[str] = []

    @omni.node(replicas=2)
    class Llm:
        def __init__(self, model: str = "tiny"):
            built.append(model)

        async def __call__(self, prompt: str) -> str:
            return prompt

    @omni.graph
    def first(prompt: str):
        return Llm(model="x")(Llm(model="x")(prompt))

    @omni.graph
    def second(prompt: str):
        return Llm(model="x")(prompt)

    async with omni.Runtime(graphs=[first, second]) as rt:
        await rt.run(first, prompt="a")
        await rt.run(second, prompt="b")
        assert built == ["x", "x"]
        assert len(rt.stats().pools) == 1
        assert sum(c for _, _, c, _ in pool_stats(rt, "Llm").replicas) == 3


# -- concurrency and balancing ------------------------------------------------------------------


async def test_calls_in_flight_per_replica_never_exceed_its_concurrency(autojump_clock):
    in_flight: Counter[int] = Counter()
    worst: Counter[int] = Counter()

    @omni.node(replicas=2, concurrency=2, balance="least_loaded")
    class Worker:
        async def __call__(self, x: int) -> int:
            me = omni.context().replica
            in_flight[me] += 1
            worst[me] = max(worst[me], in_flight[me])
            await trio.sleep(1)
            in_flight[me] -= 1
            return x

    async with omni.Runtime() as rt:
        async with trio.open_nursery() as nursery:
            for i in range(12):
                nursery.start_soon(run_x, rt, Worker(), i)
        assert trio.current_time() == pytest.approx(3)  # 12 calls / (2 x 2 slots) x 1 s
    assert worst == {0: 2, 1: 2}


async def test_a_class_node_runs_one_call_at_a_time_per_replica_by_default(autojump_clock):
    active, worst = [0], [0]

    @omni.node
    class Single:
        async def __call__(self, x: int) -> int:
            active[0] += 1
            worst[0] = max(worst[0], active[0])
            await trio.sleep(1)
            active[0] -= 1
            return x

    async with omni.Runtime() as rt:
        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(run_x, rt, Single(), i)
        assert trio.current_time() == pytest.approx(4)
    assert worst[0] == 1


async def test_least_loaded_spreads_concurrent_slow_calls_over_all_replicas():
    release = trio.Event()
    where: list[int] = []

    @omni.node(replicas=3, concurrency=4, balance="least_loaded")
    class Slow:
        async def __call__(self, x: int) -> int:
            where.append(omni.context().replica)
            await release.wait()
            return x

    async with omni.Runtime() as rt:
        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(run_x, rt, Slow(), i)
            await trio.testing.wait_all_tasks_blocked()
            assert Counter(where) == {0: 2, 1: 2, 2: 2}
            assert pool_stats(rt, "Slow").replicas == ((2, 0, 0, 0),) * 3
            release.set()
        assert pool_stats(rt, "Slow").replicas == ((0, 0, 2, 0),) * 3


async def test_a_custom_balancer_object_places_the_calls():
    class AlwaysLast:
        def choose(self, replicas, call):
            assert call.node == "Echo"
            return len(replicas) - 1

    @omni.node(replicas=3, balance=AlwaysLast())
    class Echo:
        async def __call__(self, x: int) -> int | None:
            return omni.context().replica

    async with omni.Runtime() as rt:
        assert [await rt.run(Echo(), x=i) for i in range(3)] == [2, 2, 2]
        assert pool_stats(rt, "Echo").balancer.startswith("<")  # the object's own repr


async def test_power_of_two_with_a_seed_is_accepted_as_a_balancer():
    @omni.node(replicas=4, balance=PowerOfTwo(seed=1))
    class Echo:
        async def __call__(self, x: int) -> int | None:
            return omni.context().replica

    async with omni.Runtime() as rt:
        seen = {await rt.run(Echo(), x=i) for i in range(20)}
        assert pool_stats(rt, "Echo").balancer == "PowerOfTwo(seed=1)"
    assert seen <= {0, 1, 2, 3}
    assert len(seen) > 1


async def test_a_balancer_that_returns_a_bad_index_fails_the_request_clearly():
    class Broken:
        def choose(self, replicas, call):
            return 7

    @omni.node(replicas=2, balance=Broken())
    class Echo:
        async def __call__(self, x: int) -> int:
            return x

    async with omni.Runtime() as rt:
        with pytest.raises(omni.NodeError) as info:
            await rt.run(Echo(), x=1)
    assert info.value.node == "Echo"
    assert isinstance(info.value.cause, RuntimeError)
    assert "returned 7, not a replica index" in str(info.value)


# -- backpressure -------------------------------------------------------------------------------


async def test_a_bounded_queue_makes_extra_callers_wait_then_all_complete():
    release = trio.Event()
    done: list[int] = []

    @omni.node(replicas=2, concurrency=1, max_queue=1)
    class Slow:
        async def __call__(self, x: int) -> int:
            await release.wait()
            return x

    @omni.graph
    def g(x: int):
        return Slow()(x)

    async def call(rt: omni.Runtime, i: int) -> None:
        done.append(await rt.run(g, x=i))

    async with omni.Runtime(graphs=[g]) as rt:  # deployed: all callers arrive at once
        async with trio.open_nursery() as nursery:
            for i in range(7):  # capacity: 2 replicas x (1 running + 1 queued)
                nursery.start_soon(call, rt, i)
            await trio.testing.wait_all_tasks_blocked()
            stats = pool_stats(rt, "Slow")
            assert stats.replicas == ((1, 1, 0, 0), (1, 1, 0, 0))
            assert stats.waiting == 3
            release.set()
        stats = pool_stats(rt, "Slow")
        assert sorted(done) == list(range(7))
        assert stats.waiting == 0
        assert sum(c for _, _, c, _ in stats.replicas) == 7


async def test_max_queue_zero_admits_only_running_calls():
    release = trio.Event()

    @omni.node(replicas=1, concurrency=2, max_queue=0)
    class Slow:
        async def __call__(self, x: int) -> int:
            await release.wait()
            return x

    @omni.graph
    def g(x: int):
        return Slow()(x)

    async with omni.Runtime(graphs=[g]) as rt:
        async with trio.open_nursery() as nursery:
            for i in range(5):
                nursery.start_soon(run_x, rt, g, i)
            await trio.testing.wait_all_tasks_blocked()
            stats = pool_stats(rt, "Slow")
            assert (stats.replicas, stats.waiting) == (((2, 0, 0, 0),), 3)
            release.set()
        assert pool_stats(rt, "Slow").replicas == ((0, 0, 5, 0),)


# -- lifecycle ----------------------------------------------------------------------------------


async def test_async_context_manager_instances_are_entered_when_built_and_exited_on_close():
    events: list[tuple[str, int]] = []

    @omni.node(replicas=2)
    class Session:
        def __init__(self):
            self.replica = omni.context().replica
            self.open = False

        async def __aenter__(self):
            await trio.sleep(0)
            self.open = True
            events.append(("enter", self.replica))
            return self

        async def __aexit__(self, *exc_info):
            await trio.sleep(0)  # exiting may await (close a connection, flush a file)
            self.open = False
            events.append(("exit", self.replica))

        async def __call__(self, x: int) -> bool:
            return self.open

    @omni.graph
    def g(x: int):
        return Session()(x)

    async with omni.Runtime(graphs=[g]) as rt:
        assert sorted(events) == [("enter", 0), ("enter", 1)]
        assert await rt.run(g, x=1) is True
        assert not any(kind == "exit" for kind, _ in events)
    assert sorted(events) == [("enter", 0), ("enter", 1), ("exit", 0), ("exit", 1)]


async def test_a_constructor_that_raises_fails_startup_with_the_node_named():
    @omni.node(replicas=2)
    class Llm:
        def __init__(self, model: str = "tiny"):
            if omni.context().replica == 1:
                raise OSError(f"weights for {model!r} not found")

        async def __call__(self, prompt: str) -> str:
            return prompt

    @omni.graph
    def g(prompt: str):
        return Llm()(prompt)

    with pytest.raises(omni.NodeError) as info:
        async with omni.Runtime(graphs=[g]):
            pytest.fail("the runtime must not start")
    assert info.value.node == "Llm"
    assert isinstance(info.value.cause, OSError)
    assert "weights for 'tiny' not found" in str(info.value)


async def test_aenter_sees_its_replica_context_and_its_failure_fails_startup_by_name():
    entered: list[tuple] = []

    @omni.node(replicas=2)
    class Engine:
        async def __aenter__(self):
            ctx = omni.context()
            entered.append((ctx.node, ctx.replica, ctx.request_id))
            if ctx.replica == 1:
                raise RuntimeError("no device for replica 1")
            return self

        async def __aexit__(self, *exc_info):
            return None

        async def __call__(self, x: int) -> int:
            return x

    @omni.graph
    def g(x: int):
        return Engine()(x)

    with pytest.raises(omni.NodeError) as info:
        async with omni.Runtime(graphs=[g]):
            pytest.fail("the runtime must not start")
    assert entered == [("Engine", 0, None), ("Engine", 1, None)]
    assert info.value.node == "Engine" and "no device for replica 1" in str(info.value)


async def test_a_constructor_that_raises_on_lazy_deployment_fails_that_request():
    @omni.node
    class Llm:
        def __init__(self):
            raise ValueError("no GPU")

        async def __call__(self, prompt: str) -> str:
            return prompt

    @omni.node
    async def fine(x: int) -> int:
        return x

    async with omni.Runtime() as rt:
        with pytest.raises(omni.NodeError, match="no GPU") as info:
            await rt.run(Llm(), prompt="hi")
        assert info.value.node == "Llm"
        assert await rt.run(fine, x=3) == 3  # the runtime keeps serving


# -- retries and streams ------------------------------------------------------------------------


@pytest.mark.parametrize("balance", ["round_robin", "least_loaded"])
async def test_an_idempotent_retry_moves_on_from_a_failing_replica(balance):
    tried: list[int] = []

    @omni.node(replicas=2, balance=balance, retries=1, idempotent=True)
    class Flaky:
        async def __call__(self, x: int) -> int:
            me = omni.context().replica
            tried.append(me)
            if me == 0:
                raise ConnectionError("replica 0 is broken")
            return x * 10

    async with omni.Runtime() as rt:
        assert [await rt.run(Flaky(), x=i) for i in range(3)] == [0, 10, 20]
        (r0, r1) = pool_stats(rt, "Flaky").replicas
    assert 1 in tried
    assert r0[3] == tried.count(0)  # every call on replica 0 failed ...
    assert r1 == (0, 0, 3, 0)  # ... and replica 1 served every request


async def test_a_streaming_class_node_holds_its_replica_slot_for_the_whole_stream():
    gate = trio.Event()
    order: list[str] = []

    @omni.node
    class Tokens:
        async def __call__(self, text: str):
            for word in text.split():
                order.append(f"{text[0]}:{word}")
                yield word
                await gate.wait()

    @omni.graph
    def g(text: str):
        return Tokens()(text)

    async with omni.Runtime(graphs=[g]) as rt:
        async with trio.open_nursery() as nursery:
            results = {}

            async def run(text: str) -> None:
                results[text] = await rt.run(g, text=text)

            nursery.start_soon(run, "a b")
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(run, "c d")
            await trio.testing.wait_all_tasks_blocked()
            # The first stream is paused after one item; the second waits for its slot.
            assert order == ["a:a"]
            assert pool_stats(rt, "Tokens").replicas == ((1, 1, 0, 0),)
            gate.set()
    assert results == {"a b": ["a", "b"], "c d": ["c", "d"]}
    assert order == ["a:a", "a:b", "c:c", "c:d"]
    assert pool_stats(rt, "Tokens").replicas == ((0, 0, 2, 0),)


async def test_failed_calls_are_counted_per_replica():
    @omni.node(replicas=2)
    class Picky:
        async def __call__(self, x: int) -> int:
            if x < 0:
                raise ValueError("negative")
            return x

    async with omni.Runtime() as rt:
        await rt.run(Picky(), x=1)
        with pytest.raises(omni.NodeError):
            await rt.run(Picky(), x=-1)
        assert pool_stats(rt, "Picky").replicas == ((0, 0, 1, 0), (0, 0, 0, 1))
