"""Class nodes that each take only the one before run as one chain: the driver calls the
first stage's worker, each worker sends its result straight to the next stage's, and the last
value comes back through them. The workers run in this process (see `LocalCluster`); each
call a worker serves is recorded with its place in its chain (`CallHead.stage`)."""

from __future__ import annotations

import pytest
import trio

from omni.cluster import worker as worker_module
from omni.cluster.errors import RemoteNodeError, WorkerLost
from omni.graph.errors import NodeError
from tests._wait import wait_until
from tests.cluster import chain_nodes as c
from tests.cluster.conftest import LocalCluster


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Each node call the workers serve: (worker, stage, stages after it)."""
    calls: list[tuple[str, int, int]] = []
    original = worker_module.Worker._call

    async def record(self, head, payload):
        calls.append((self.name, head.stage, len(head.then)))
        return await original(self, head, payload)

    monkeypatch.setattr(worker_module.Worker, "_call", record)
    c.HOLD.clear()
    c.RUNNING[:] = [0, 0]
    return calls


async def three_workers(local_cluster: LocalCluster, heartbeat: float | None = None) -> None:
    if heartbeat is not None:
        local_cluster.heartbeat = heartbeat
    await local_cluster.start()
    for name in ("w1", "w2", "w3"):
        await local_cluster.worker(name)


async def test_each_stage_goes_from_worker_to_worker(
        local_cluster: LocalCluster, served: list[tuple[str, int, int]]) -> None:
    await three_workers(local_cluster)
    async with local_cluster.driver() as rt:
        for x in range(5):
            assert await rt.run(c.line, x=x) == -2 * (x + 1)
    # the driver called w1 alone; w1 called w2, and w2 called w3
    assert served == [("w1", 0, 2), ("w2", 1, 1), ("w3", 2, 0)] * 5


async def test_a_later_stage_that_fails_fails_its_own_node(
        local_cluster: LocalCluster, served: list[tuple[str, int, int]]) -> None:
    await three_workers(local_cluster)
    async with local_cluster.driver() as rt:
        with pytest.raises(NodeError) as caught:
            await rt.run(c.line, x=12)  # Double gets 13
        assert caught.value.node == "Double"
        assert isinstance(caught.value.cause, RemoteNodeError)
        assert caught.value.cause.member == "w2"
        assert caught.value.cause.remote_type == "ValueError"
        assert "13 is not doubled here" in str(caught.value)
        assert await rt.run(c.line, x=1) == -4  # the next request is not affected
        # each stage's pool counted both calls (the failed chain as failed at every stage it
        # was queued on: the first one ran, the error came back through it) and holds none
        pools = {p.name: p.replicas for p in rt.stats().pools}
        assert pools == {name: ((0, 0, 1, 1),) for name in ("AddOne", "Double", "Negate")}
    assert [call[0] for call in served] == ["w1", "w2", "w1", "w2", "w3"]


async def test_a_stage_runs_no_more_calls_at_once_than_its_concurrency(
        local_cluster: LocalCluster, served: list[tuple[str, int, int]]) -> None:
    """The driver holds only the first stage's slot: a later stage's calls queue on its
    worker, which lets one in at a time (Double's concurrency is 1, the default)."""
    await three_workers(local_cluster)
    results: dict[int, int] = {}
    async with local_cluster.driver() as rt:
        async def request(x: int) -> None:
            results[x] = await rt.run(c.line, x=x)

        async with trio.open_nursery() as nursery:
            for x in range(20, 36):
                nursery.start_soon(request, x)
    assert results == {x: -2 * (x + 1) for x in range(20, 36)}
    assert c.RUNNING == [0, 1]
    assert sum(1 for call in served if call[1] == 0) == 16  # each request one chain


async def test_a_request_whose_later_stage_lost_its_worker_runs_again(
        local_cluster: LocalCluster, served: list[tuple[str, int, int]]) -> None:
    """w2 stops answering while its stage runs: w1's call to it fails as lost, and the
    request runs again from the start once w2's replica is placed anew (by the same name)."""
    await three_workers(local_cluster, heartbeat=0.2)
    c.HOLD[8] = trio.Event()  # x = 7: Double gets 8 and waits, on the first w2
    result: list[int] = []
    async with local_cluster.driver(heartbeat=0.2) as rt:
        async def request() -> None:
            result.append(await rt.run(c.line, x=7))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(request)
            await wait_until(lambda: c.RUNNING[0] == 1, "Double holding the call")
            await local_cluster.stop_answering("w2")
            await local_cluster.wait_members(lambda m: "w2" not in m
                                             or m["w2"]["state"] != "up", "w2 lost")
            await local_cluster.worker("w2")
        assert result == [-16]
    # it ran again from its first stage (as a chain, or stage by stage while w2's replica
    # was still being placed)
    assert [call[0] for call in served].count("w1") == 2


async def test_a_lost_later_stage_is_a_worker_lost_of_that_node() -> None:
    """What the driver makes of a chain broken by a lost worker (parsed from the error's
    message): the lost stage's `WorkerLost`, as a stream that had passed items on."""
    from omni.cluster.remote import ChainBroken

    broken = ChainBroken.parse(str(ChainBroken(2, "w3", "PeerGone", "silent 0.6 s", True)))
    cause = broken.cause()
    assert broken.fields[0] == 2
    assert isinstance(cause, WorkerLost) and cause.member == "w3"
    assert cause.items_passed == 1
