"""Failover in the graph layer, in process: a pool whose replicas are all dead makes calls wait
for a replacement (up to its `replace_timeout`), and the scheduler retries once a call lost
with its replica's process (`ReplicaLost`) unless a stream had passed items on. Time is trio's
mock clock: a wait of 30 s takes none."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio

import omni
from omni.graph.balance import CallInfo, NoLiveReplica, Pool
from omni.graph.errors import ReplicaLost
from omni.graph.runtime import Runtime as GraphRuntime

CALL = CallInfo(node="llm", request_id="req-1", args=(), kwargs={})


class Remote:
    """Stands for a replica in another process: it can die (``alive`` False) and calls on it
    then fail with `ReplicaLost`; `calls` counts the calls it received. One that `holds`
    keeps a call asking to be held in flight until it dies."""

    omni_remote = True

    def __init__(self, member: str, *, alive: bool = True, holds: bool = False):
        self.member = member
        self.alive = alive
        self.holds = holds
        self.calls = 0
        self.died = trio.Event()

    def die(self) -> None:
        self.alive = False
        self.died.set()

    async def __call__(self, x: int, hold: bool = False) -> str:
        self.calls += 1
        if not self.alive:
            raise ReplicaLost(f"worker '{self.member}' stopped answering")
        if hold and self.holds:
            await self.died.wait()  # in flight until its process dies
            raise ReplicaLost(f"worker '{self.member}' stopped answering")
        return f"{x} on {self.member}"


async def acquire_member(pool: Pool, out: list[Any]) -> None:
    """Take a slot on `pool` and note the member it was on, or the error."""
    try:
        async with pool.acquire(CALL) as replica:
            out.append(replica.instance.member)
    except NoLiveReplica as exc:
        out.append(exc)


# -- the pool --------------------------------------------------------------------------------


async def test_calls_wait_for_a_replacement_when_every_replica_is_dead(autojump_clock):
    pool = Pool("llm", [Remote("w1", alive=False)], balancer="round_robin", concurrency=1,
                max_queue=8, replace_timeout=30)
    got: list[Any] = []
    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(acquire_member, pool, got)
        await trio.sleep(10)  # a third of the timeout: still waiting, nothing failed
        assert got == [] and pool.stats().waiting_for_replica == 3
        pool.replace(0, Remote("w2"))
    assert got == ["w2", "w2", "w2"]
    assert trio.current_time() == pytest.approx(10)  # served once replaced, not at the timeout
    assert pool.stats().waiting_for_replica == 0


async def test_a_call_fails_after_the_replace_timeout_naming_the_node_and_timeout(
        autojump_clock):
    pool = Pool("llm", [Remote("w1", alive=False), Remote("w3", alive=False)],
                balancer="round_robin", concurrency=1, max_queue=8, replace_timeout=5)
    got: list[Any] = []
    await acquire_member(pool, got)
    (error,) = got
    assert isinstance(error, NoLiveReplica)
    assert error.pool == "llm" and error.waited == 5
    assert str(error) == ("no live replica of 'llm' within the replace timeout of 5 s: its "
                          "workers (w1, w3) are gone and no other could host it")
    assert trio.current_time() == pytest.approx(5)


async def test_a_replace_timeout_of_zero_fails_at_once(autojump_clock):
    pool = Pool("llm", [Remote("w1", alive=False)], balancer="round_robin", concurrency=1,
                max_queue=8, replace_timeout=0)
    got: list[Any] = []
    await acquire_member(pool, got)
    assert isinstance(got[0], NoLiveReplica) and trio.current_time() == 0


def test_a_negative_replace_timeout_is_refused():
    with pytest.raises(ValueError, match="replace_timeout must be >= 0"):
        Pool("llm", ["a"], balancer="round_robin", concurrency=1, max_queue=0,
             replace_timeout=-1)


async def test_calls_queued_on_a_replica_that_dies_move_to_its_replacement(autojump_clock):
    """A call waiting for the slot of a replica whose worker dies is never sent there: it
    waits for the replacement instead (and keeps its one retry for a loss in flight)."""
    dead = Remote("w1")
    pool = Pool("llm", [dead], balancer="round_robin", concurrency=1, max_queue=8,
                replace_timeout=30)
    got: list[Any] = []
    release = trio.Event()

    async def first() -> None:
        async with pool.acquire(CALL) as replica:
            got.append(replica.instance.member)
            await release.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(first)
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(2):
            nursery.start_soon(acquire_member, pool, got)
        await trio.testing.wait_all_tasks_blocked()
        assert pool.replicas[0].queued == 2
        dead.die()
        release.set()  # the call in flight ends; the queued ones find the replica dead
        await trio.testing.wait_all_tasks_blocked()
        assert pool.stats().waiting_for_replica == 2 and pool.replicas[0].queued == 0
        pool.replace(0, Remote("w2"))
    assert got == ["w1", "w2", "w2"]


async def test_a_replica_that_answers_again_serves_the_waiting_calls_on_wake(autojump_clock):
    replica = Remote("w1", alive=False)
    pool = Pool("llm", [replica], balancer="round_robin", concurrency=1, max_queue=8,
                replace_timeout=30)
    got: list[Any] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(acquire_member, pool, got)
        await trio.sleep(3)
        replica.alive = True  # its worker answered again: nothing replaced it
        pool.wake()
    assert got == ["w1"] and trio.current_time() == pytest.approx(3)


async def test_a_live_replica_takes_the_calls_while_the_dead_one_waits_for_repair():
    pool = Pool("llm", [Remote("w1", alive=False), Remote("w2")], balancer="round_robin",
                concurrency=1, max_queue=8)
    got: list[Any] = []
    for _ in range(3):
        await acquire_member(pool, got)
    assert got == ["w2", "w2", "w2"]
    assert repr(pool) == "<Pool llm replicas=2 load=[0+0 0+0] dead=1>"


async def test_a_local_instance_with_an_alive_attribute_is_not_taken_for_dead():
    class Local:
        alive = False  # the user's own attribute
        member = "here"

    got: list[Any] = []
    await acquire_member(Pool("llm", [Local()], balancer="round_robin", concurrency=1,
                              max_queue=0, replace_timeout=0), got)
    assert got == ["here"]


# -- the scheduler: a call lost in flight is retried once, on the replacement ----------------


class Placement:
    """A placement (see `omni.graph.runtime.Runtime`) whose class nodes' replicas are
    `Remote`s: what the cluster's link does, without sockets."""

    def __init__(self, replace_timeout: float = 30):
        self.replace_timeout = replace_timeout
        self.pools: list[Pool] = []
        self._stopped = trio.Event()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await self._stopped.wait()

    def stop(self) -> None:
        self._stopped.set()

    async def deploy(self, node: Any) -> Pool:
        pool = Pool(node.name, [Remote("w1", holds=True)], balancer="round_robin", concurrency=1,
                    max_queue=64, replace_timeout=self.replace_timeout)
        self.pools.append(pool)
        return pool


@omni.node
class Model:
    def __call__(self, x: int, hold: bool = False) -> str:  # runs as `Remote` here
        raise AssertionError("replaced by the placement")


async def test_requests_in_flight_and_queued_when_a_worker_dies_all_succeed(autojump_clock):
    placement = Placement()
    async with GraphRuntime(placement=placement, graphs=[Model()], kv=None) as rt:
        pool = placement.pools[0]
        lost = pool.replicas[0].instance
        results: dict[int, Any] = {}

        async def request(i: int) -> None:
            results[i] = await rt.run(Model(), x=i, hold=True)

        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(request, i)
            await trio.testing.wait_all_tasks_blocked()
            assert lost.calls == 1 and pool.replicas[0].queued == 19
            lost.die()  # request 0 is lost in flight; the others wait in the queue
            await trio.sleep(2)  # the repair takes a while: requests wait, none fails
            assert results == {} and pool.stats().waiting_for_replica == 20
            pool.replace(0, Remote("w2"))
    assert results == {i: f"{i} on w2" for i in range(20)}
    assert lost.calls == 1  # only the call in flight ever reached the dead replica


async def test_a_call_lost_twice_fails_naming_the_worker(autojump_clock):
    placement = Placement()
    async with GraphRuntime(placement=placement, graphs=[Model()], kv=None) as rt:
        pool = placement.pools[0]

        async def lose_in_flight() -> None:
            for member in ("w2", "w3"):
                await trio.testing.wait_all_tasks_blocked()
                pool.replicas[0].instance.die()
                pool.replace(0, Remote(member, holds=True))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lose_in_flight)
            with pytest.raises(omni.NodeError) as caught:
                await rt.run(Model(), x=1, hold=True)
    assert caught.value.node == "Model"
    assert isinstance(caught.value.cause, ReplicaLost)
    assert "worker 'w2' stopped answering" in str(caught.value)


async def test_the_lost_call_retry_does_not_use_up_the_nodes_retries():
    attempts: list[str] = []

    @omni.node(retries=1, idempotent=True)
    class Flaky:
        async def __call__(self, x: int) -> int:
            attempts.append("lost" if not attempts else "boom" if len(attempts) == 1 else "ok")
            if attempts[-1] == "lost":
                raise ReplicaLost("worker 'w1' stopped answering")
            if attempts[-1] == "boom":
                raise ValueError("boom")
            return x

    async with omni.Runtime() as rt:
        assert await rt.run(Flaky(), x=3) == 3
    assert attempts == ["lost", "boom", "ok"]


async def test_a_node_without_retries_is_retried_once_when_lost_and_not_when_it_raises():
    calls: list[int] = []

    @omni.node
    class Once:
        async def __call__(self, x: int) -> int:
            calls.append(x)
            if x == 1 and len(calls) == 1:
                raise ReplicaLost("worker 'w1' stopped answering")
            if x == 2:
                raise ValueError("no good")
            return x

    async with omni.Runtime() as rt:
        assert await rt.run(Once(), x=1) == 1
        with pytest.raises(omni.NodeError, match="no good"):
            await rt.run(Once(), x=2)
    assert calls == [1, 1, 2]


async def test_a_stream_lost_before_its_first_item_is_retried_and_after_one_fails_clearly():
    starts: list[int] = []

    @omni.node
    class Words:
        async def __call__(self, n: int) -> AsyncIterator[str]:
            starts.append(n)
            if len(starts) == 1:
                raise ReplicaLost("worker 'w1' stopped answering")
            yield "one"
            if n == 2:
                raise ReplicaLost("worker 'w2' stopped answering")
            yield "two"

    async with omni.Runtime() as rt:
        assert [item async for _, item in rt.stream(Words(), n=1)] == ["one", "two"]
        items: list[str] = []
        with pytest.raises(omni.NodeError) as caught:
            async for _, item in rt.stream(Words(), n=2):
                items.append(item)
    assert starts == [1, 1, 2] and items == ["one"]
    message = str(caught.value)
    assert "worker 'w2' stopped answering, after 1 item(s) of its stream had been passed on" \
        in message and "not retried" in message


async def test_a_request_whose_stream_was_lost_mid_way_runs_again_once_for_run():
    """`rt.run` hands nothing over before the end: a request whose node's stream was lost
    after passing items on runs again from the start, and its caller gets one answer."""
    lose = [True, False, True, True]  # per start of the stream: lost after its first item?
    starts: list[bool] = []

    @omni.node
    class Words:
        async def __call__(self, n: int) -> AsyncIterator[str]:
            starts.append(lose[len(starts)])
            yield "one"
            if starts[-1]:
                raise ReplicaLost(f"worker 'w{len(starts)}' stopped answering")
            yield "two"

    @omni.node
    async def join(words: AsyncIterator[str]) -> str:
        return " ".join([w async for w in words])

    @omni.graph
    def sentence(n: int):
        return join(Words()(n))

    async with omni.Runtime() as rt:
        assert await rt.run(sentence, n=1) == "one two"
        assert len(starts) == 2
        with pytest.raises(omni.NodeError, match="worker 'w4' stopped answering, after 1"):
            await rt.run(sentence, n=2)  # lost in its run again too: fails
    assert len(starts) == 4
