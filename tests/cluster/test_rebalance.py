"""Rebalancing on a cluster (in this process): a worker that joins takes one of the replicas
crowded on another, while requests keep flowing; the moved replica's calls in flight finish
where they started, and only then is it undeployed. The driver is this test's `omni.Runtime`."""

from __future__ import annotations

from pathlib import Path

import trio

from tests._wait import wait_until
from tests.cluster import rebalance_nodes as n
from tests.cluster.conftest import LocalCluster


async def test_a_joining_worker_takes_a_replica_and_no_request_fails(
        local_cluster: LocalCluster, tmp_path: Path) -> None:
    await local_cluster.start()
    await local_cluster.worker("w1")
    release = tmp_path / "release"
    async with local_cluster.driver() as rt:
        node = n.Spread()
        await rt.deploy(node)
        pool = rt.pool_for(node)
        assert [r.member for r in pool.replicas] == ["w1", "w1"]  # the only worker
        held: list = []
        flowed: list = []
        stop = trio.Event()

        async def hold() -> None:
            held.append(await rt.run(node, until=str(release)))

        async def flow() -> None:
            while not stop.is_set():
                try:
                    flowed.append(await rt.run(node, seconds=0.01))
                except Exception as exc:  # counted: none may fail
                    flowed.append(exc)

        async with trio.open_nursery() as nursery:
            for _ in range(2):  # least_loaded: one held call on each replica
                nursery.start_soon(hold)
            await wait_until(lambda: [r.in_flight for r in pool.replicas] == [1, 1])
            for _ in range(2):
                nursery.start_soon(flow)

            await local_cluster.worker("w2")
            await wait_until(lambda: sorted(r.member for r in pool.replicas) == ["w1", "w2"])
            await wait_until(lambda: "w2" in flowed)  # new calls reach the new worker

            # The moved replica still runs its held call on w1: it is not undeployed yet.
            members = await local_cluster.wait_members(
                lambda m: m["w2"]["replicas"] == {"Spread": 1}, "w2 to host the moved replica")
            replicas = {name: m["replicas"] for name, m in members.items()}
            assert replicas == {"w1": {"Spread": 2}, "w2": {"Spread": 1}}
            assert held == []

            release.touch()
            await wait_until(lambda: len(held) == 2)
            await local_cluster.wait_members(lambda m: m["w1"]["replicas"] == {"Spread": 1},
                                             "w1 to undeploy the moved replica")
            stop.set()

        assert held == ["w1", "w1"]  # both held calls finished where they started
        failures = [f for f in flowed if isinstance(f, Exception)]
        assert failures == [] and len(flowed) > 0
        assert set(flowed) == {"w1", "w2"}
        assert await rt.run(node) in ("w1", "w2")  # the pool keeps serving
