"""Rebalancing on a real cluster: a worker that joins takes one of the replicas crowded on
another, while requests keep flowing; the moved replica's calls in flight finish where they
started, and only then is it undeployed. The driver is this test's `omni.Runtime`."""

from __future__ import annotations

from pathlib import Path

import trio

import omni
from tests._wait import CAP_S, wait_until
from tests.cluster import rebalance_nodes as n
from tests.cluster.conftest import Cluster


async def test_a_joining_worker_takes_a_replica_and_no_request_fails(cluster: Cluster,
                                                                     tmp_path: Path) -> None:
    cluster.head()
    cluster.worker("w1")
    release = tmp_path / "release"
    async with omni.Runtime(cluster=cluster.address, token_file=str(cluster.token)) as rt:
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

            await trio.to_thread.run_sync(cluster.worker, "w2")
            await wait_until(lambda: sorted(r.member for r in pool.replicas) == ["w1", "w2"])
            await wait_until(lambda: "w2" in flowed)  # new calls reach the new worker

            # The moved replica still runs its held call on w1: it is not undeployed yet.
            status = await trio.to_thread.run_sync(lambda: cluster.wait_status(
                lambda m: m["w2"]["replicas"] == {"Spread": 1}, timeout=CAP_S))
            replicas = {m["name"]: m["replicas"] for m in status["members"]}
            assert replicas == {"w1": {"Spread": 2}, "w2": {"Spread": 1}}
            assert held == []

            release.touch()
            await wait_until(lambda: len(held) == 2)
            await trio.to_thread.run_sync(lambda: cluster.wait_status(
                lambda m: m["w1"]["replicas"] == {"Spread": 1}, timeout=CAP_S))
            stop.set()

        assert held == ["w1", "w1"]  # both held calls finished where they started
        failures = [f for f in flowed if isinstance(f, Exception)]
        assert failures == [] and len(flowed) > 0
        assert set(flowed) == {"w1", "w2"}
        assert await rt.run(node) in ("w1", "w2")  # the pool keeps serving
