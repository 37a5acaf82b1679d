"""A chain's stages of synchronous class nodes run on their workers' lanes
(`omni.transport.lane`): the driver sends the first stage to its worker's lane, each lane runs
its stage on its own thread and sends the value on to the next one's, the last one the chain's
end to the driver; none of it goes through a worker's event loop. An async node's stage goes
to its worker's RPC endpoint, as before lanes; a stage a lane cannot run there and then (no
free slot, an argument kept elsewhere) goes from the lane to the event loop, and the chain
goes on. The workers run in this process (`LocalCluster`), but
for a worker killed mid-stage (real processes); each synchronous call records its thread
(`chain_nodes.THREADS`)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import trio

import omni
from tests._wait import CAP_S, wait_until
from tests.cluster import chain_nodes as c
from tests.cluster.conftest import Cluster, LocalCluster
from tests.cluster.pipelines import RELEASE, STARTED


@pytest.fixture(autouse=True)
def fresh() -> None:
    c.THREADS.clear()
    c.SYNC_HOLD.clear()
    c.SYNC_RUNNING[:] = [0, 0]


async def three_workers(local_cluster: LocalCluster) -> None:
    await local_cluster.start()
    for name in ("w1", "w2", "w3"):
        await local_cluster.worker(name)


def notices(local_cluster: LocalCluster, name: str) -> tuple[int, int]:
    """What worker `name` got: (notices on its lane, notices its RPC servers ran)."""
    worker = local_cluster.worker_named(name)
    return (worker.lane.stats().received,
            sum(server.stats().notices for server in worker._servers))


async def test_a_synchronous_chain_runs_on_the_workers_lanes(
        local_cluster: LocalCluster) -> None:
    await three_workers(local_cluster)
    async with local_cluster.driver() as rt:
        for x in range(5):
            assert await rt.run(c.sync_line, x=x) == -2 * (x + 1)
        assert (rt.cluster.chains.ended, rt.cluster.chains.late) == (5, 0)
        for name in ("w1", "w2", "w3"):
            assert notices(local_cluster, name) == (5, 0)
            assert local_cluster.worker_named(name).load().requests == 5
    loop = threading.get_ident()  # the event loop's thread: the workers' too, here
    threads = {node: {t for n, t in c.THREADS if n == node} for node, _ in c.THREADS}
    assert [n for n, _ in c.THREADS] == ["SyncAddOne", "SyncDouble", "SyncNegate"] * 5
    assert all(len(ts) == 1 for ts in threads.values())  # one lane each, for good
    assert len(set.union(*threads.values()) | {loop}) == 4


@pytest.mark.parametrize("graph", [c.mixed_line, c.wide_line], ids=["async", "wide"])
async def test_a_stage_no_lane_runs_goes_straight_to_its_workers_event_loop(
        local_cluster: LocalCluster, graph) -> None:
    """The middle stage is async (Double), or may run two calls at once (SyncWide) where a
    lane runs one: its notice goes to w2's RPC endpoint, not through its lane, and its call
    runs on the event loop (in as many threads as the node allows)."""
    await three_workers(local_cluster)
    async with local_cluster.driver() as rt:
        for x in range(4):
            assert await rt.run(graph, x=x) == -2 * (x + 1)
    assert notices(local_cluster, "w1") == (4, 0)
    assert notices(local_cluster, "w2") == (0, 4)
    assert notices(local_cluster, "w3") == (4, 0)


async def test_a_stage_whose_slot_is_taken_waits_for_it_on_the_event_loop(
        local_cluster: LocalCluster) -> None:
    """SyncDouble runs one call at a time (its concurrency, 1 by default). While a plain
    call of it holds its slot, a chain's stage of it cannot run on the lane: it goes to the
    event loop, waits there for the slot, and runs once the call is done."""
    await three_workers(local_cluster)
    hold = c.SYNC_HOLD[8] = threading.Event()
    results: dict[str, int] = {}
    async with local_cluster.driver() as rt:
        async def plain() -> None:
            results["plain"] = await rt.run(c.sync_double, x=8)

        async def chain() -> None:
            results["chain"] = await rt.run(c.sync_line, x=1)

        async with trio.open_nursery() as nursery:
            try:
                nursery.start_soon(plain)
                await wait_until(lambda: c.SYNC_RUNNING[0] == 1, "the plain call holding")
                nursery.start_soon(chain)
                await wait_until(lambda: notices(local_cluster, "w2") == (1, 1),
                                 "the chain's stage handed to w2's event loop")
                assert c.SYNC_RUNNING[0] == 1  # it waits for the slot
            finally:
                hold.set()
    assert results == {"plain": 16, "chain": -4}
    assert c.SYNC_RUNNING[1] == 1


@pytest.mark.parametrize("elements", [1 << 10, 1 << 17, 1 << 19])
async def test_values_large_and_small_travel_between_lanes_and_nothing_stays_leased(
        local_cluster: LocalCluster, elements: int) -> None:
    """4 KiB rides with the notices; 512 KiB comes from the driver in shared memory, mapped
    on w1's lane, and goes to w2 with the notice; 2 MiB is kept on w1 for w2, which takes it
    from its event loop. Every lease and kept value is let go of after each request."""
    await local_cluster.start()
    w1 = await local_cluster.worker("w1")
    await local_cluster.worker("w2")
    x = np.arange(elements, dtype=np.float32)
    async with local_cluster.driver() as rt:
        for _ in range(3):
            assert await rt.run(c.sync_scaled, x=x) == 2 * float(x.sum(dtype=np.float64))
            assert rt.cluster.mover.stats()["leased"] == 0
            await wait_until(lambda: not w1._kept, "w1 letting go of what w2 took")
        assert rt.cluster.chains.ended == 3


@pytest.mark.proc
async def test_a_worker_killed_while_its_lane_runs_a_stage_is_lost_and_the_request_runs_again(
        cluster: Cluster) -> None:
    """Real worker processes: w2 is SIGKILLed while its lane runs SyncNap's stage. The driver
    finds w2 gone by its heartbeats and ends the chain as broken by it; the request runs
    again from its first stage once a new w2 has joined, and returns what it should."""
    cluster.head()
    workers = {name: await trio.to_thread.run_sync(cluster.worker, name)
               for name in ("w1", "w2", "w3")}
    w2 = workers["w2"]
    started = cluster.folder / STARTED
    result: list[int] = []
    async with omni.Runtime(cluster=cluster.address, token_file=str(cluster.token)) as rt:
        async def request() -> None:
            result.append(await rt.run(c.napping_line, x=7))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(request)
            await wait_until(lambda: started.exists() and "SyncNap w2" in started.read_text(),
                             "SyncNap running on w2's lane")
            w2.popen.kill()
            await trio.to_thread.run_sync(
                cluster.wait_members, lambda m: m.get("w2", {}).get("state") != "up",
                "the head to find w2 lost")
            (cluster.folder / RELEASE).touch()  # the next SyncNap returns at once
            await trio.to_thread.run_sync(cluster.worker, "w2")
    assert result == [-16]
    assert started.read_text().splitlines() == ["SyncNap w2", "SyncNap w2"]
    assert await trio.to_thread.run_sync(w2.wait, CAP_S) == -9
