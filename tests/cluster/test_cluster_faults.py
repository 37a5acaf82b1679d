"""Faults on a cluster: a worker that stops answering (in this process) or is SIGKILLed (a
real process) mid-request, a worker rejoining, the head restarting, a node failing on a worker.
The driver is the test's own `omni.Runtime(cluster=...)`."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

import omni
from tests._wait import CAP_S, wait_until
from tests.cluster import pipelines as p
from tests.cluster._local import invoke
from tests.cluster._status import Rows
from tests.cluster.conftest import Cluster, LocalCluster


def started(folder: Path) -> list[str]:
    """The "NODE WORKER" lines the slow nodes wrote as they started (in the workers' folder)."""
    path = folder / p.STARTED
    return path.read_text().splitlines() if path.exists() else []


async def fails_over_and_rejoins(
        rt: omni.Runtime, folder: Path, kill_w1: Callable[[], Awaitable[None]],
        wait_members: Callable[[Callable[[Rows], Any], str], Awaitable[Rows]],
        restart_w1: Callable[[], Awaitable[None]]) -> None:
    """Calls in flight on w1 when it dies (`kill_w1`) are retried on w2 (once for a node
    without ``retries``); a stream that had already passed an item on fails, naming the
    worker; the head lists w1 lost; the pool is whole again on w2; w1 restarted
    (`restart_w1`) rejoins and takes replicas back."""
    for node in (p.SlowRetried(), p.SlowOnce(), p.SlowWords()):
        await rt.deploy(node)
        assert {r.member for r in rt.pool_for(node).replicas} == {"w1", "w2"}
    outcomes: dict[str, list] = {"retried": [], "once": [], "words": []}
    firsts: list[str] = []
    failed_at: list[float] = []

    async def call(kind: str, node) -> None:
        try:  # the calls run until released (or CAP_S), so the kill lands mid-call
            outcomes[kind].append(await rt.run(node, seconds=CAP_S))
        except omni.NodeError as exc:
            outcomes[kind].append(exc)

    async def stream(node) -> None:
        items = []
        try:
            async for _, item in rt.stream(node, seconds=CAP_S):
                items.append(item)
                firsts.append(item)
            outcomes["words"].append(items)
        except omni.NodeError as exc:
            failed_at.append(trio.current_time())
            outcomes["words"].append((items, exc))

    async with trio.open_nursery() as nursery:
        for kind, node in (("retried", p.SlowRetried()), ("once", p.SlowOnce())):
            for _ in range(2):  # least_loaded: one call on each worker
                nursery.start_soon(call, kind, node)
        for _ in range(2):
            nursery.start_soon(stream, p.SlowWords())
        running = {f"{node} {worker}" for node in ("SlowRetried", "SlowOnce", "SlowWords")
                   for worker in ("w1", "w2")}
        await wait_until(lambda: running <= set(started(folder)) and len(firsts) == 2,
                         "all six calls running, three on each worker, and both streams' "
                         "first items here")
        await kill_w1()
        killed_at = trio.current_time()
        (folder / p.RELEASE).touch()  # w2's calls, and the retries there, return

    # Every call lost in flight finished on the survivor, with or without `retries`.
    assert outcomes["retried"] == ["w2", "w2"]
    assert outcomes["once"] == ["w2", "w2"]
    # The stream on w1 had passed an item on: it failed, naming the worker, not retried.
    words = outcomes["words"]
    assert ["first", "w2"] in words
    ((items, error),) = [o for o in words if isinstance(o, tuple)]
    assert items == ["first"] and error.node == "SlowWords"
    assert "worker 'w1' stopped answering" in str(error) and "not retried" in str(error)
    assert failed_at[0] >= killed_at  # failed by the kill (how soon: tests/transport)

    # The head noticed too; the rest of the cluster keeps serving.
    members = await wait_members(lambda m: m["w1"]["state"] == "lost", "the head to lose w1")
    assert {name: m["state"] for name, m in members.items()} == {"w2": "up", "w1": "lost"}
    assert await rt.run(p.SlowOnce(), seconds=0) == "w2"

    # The lost replica is replaced on a worker with room: the pool is whole again.
    pool = rt.pool_for(p.SlowOnce())
    await wait_until(lambda: all(r.alive for r in pool.replicas))
    assert {r.member for r in pool.replicas} == {"w2"}

    # A worker restarting with the same name rejoins: the driver moves one replica of each
    # pool crowded on w2 back to it, and new deployments spread over both again.
    await restart_w1()
    for node in (p.SlowRetried(), p.SlowOnce()):
        replicas = rt.pool_for(node).replicas
        await wait_until(lambda r=replicas: sorted(x.member for x in r) == ["w1", "w2"])
    await rt.deploy(p.Shout())
    assert sorted(r.member for r in rt.pool_for(p.Shout()).replicas) == ["w1", "w2"]


async def test_a_worker_that_stops_answering_fails_over_and_rejoins(
        local_cluster: LocalCluster) -> None:
    """A worker gone silent (its sockets closed, no word to anyone): the head and the driver
    find out by heartbeats (every 0.2 s here), and the calls fail over as above."""
    await local_cluster.start(heartbeat=0.2)
    await local_cluster.worker("w1")
    await local_cluster.worker("w2")

    async def restart_w1() -> None:
        await local_cluster.worker("w1")

    async with local_cluster.driver() as rt:
        await fails_over_and_rejoins(rt, local_cluster.folder,
                                     lambda: local_cluster.stop_answering("w1"),
                                     local_cluster.wait_members, restart_w1)


@pytest.mark.proc
async def test_a_sigkilled_worker_fails_over_and_rejoins(cluster: Cluster) -> None:
    """The same with a worker process SIGKILLed: the kernel closes its sockets, its pid and
    payload segments are gone, and a new process (another pid) rejoins under its name."""
    cluster.head()
    w1 = await trio.to_thread.run_sync(cluster.worker, "w1")
    await trio.to_thread.run_sync(cluster.worker, "w2")

    async def kill_w1() -> None:
        w1.popen.kill()

    async def wait_members(predicate: Callable[[Rows], Any], what: str) -> Rows:
        return await trio.to_thread.run_sync(cluster.wait_members, predicate, what)

    async def restart_w1() -> None:
        await trio.to_thread.run_sync(cluster.worker, "w1")

    async with omni.Runtime(cluster=cluster.address, token_file=str(cluster.token)) as rt:
        await fails_over_and_rejoins(rt, cluster.folder, kill_w1, wait_members, restart_w1)
    assert await trio.to_thread.run_sync(w1.wait, CAP_S) == -9  # SIGKILL: it said nothing


async def test_status_lists_no_replicas_on_a_lost_worker(local_cluster: LocalCluster) -> None:
    """A worker hosting replicas stops answering: once the head has it lost, `omni cluster
    status` shows it hosting nothing (its replicas went with it), the survivor its own."""
    await local_cluster.start(heartbeat=0.2)
    await local_cluster.worker("w1")
    await local_cluster.worker("w2")
    async with local_cluster.driver() as rt:
        await rt.deploy(p.Shout())  # two replicas: one on each worker
        await local_cluster.wait_members(
            lambda m: all(m[w]["replicas"] == {"Shout": 1} for w in ("w1", "w2")),
            "both workers' beats to report their replica")
        await local_cluster.stop_answering("w1")
        members = await local_cluster.wait_members(lambda m: m["w1"]["state"] == "lost",
                                                   "the head to lose w1")
        assert members["w1"]["replicas"] == {} and members["w1"]["kv"] == {}
        assert members["w2"]["replicas"]["Shout"] >= 1
        table = await trio.to_thread.run_sync(invoke, "cluster", "status",
                                              local_cluster.address, "--token-file",
                                              str(local_cluster.token))
    assert table.returncode == 0, table.stderr
    (w1,) = [line.split() for line in table.stdout.splitlines() if line.startswith("w1 ")]
    assert w1[1] == "lost" and w1[5:7] == ["-", "-"]  # REPLICAS and KV PAGES


async def test_a_node_error_on_a_worker_names_it(local_cluster: LocalCluster) -> None:
    await local_cluster.start()
    await local_cluster.worker("w1")
    async with local_cluster.driver() as rt:
        with pytest.raises(omni.NodeError) as info:
            await rt.run(p.Fails(), x=3)
        assert info.value.node == "Fails"
        assert "ValueError: no good: 3 (on worker 'w1')" in str(info.value)
        assert await rt.run(p.Shout(), text="still") is not None  # the worker keeps serving


async def test_placement_by_resources_and_by_name(local_cluster: LocalCluster) -> None:
    await local_cluster.start()
    await local_cluster.worker("w1", gpus=1)
    await local_cluster.worker("w2", gpus=0)
    async with local_cluster.driver() as rt:
        out = await rt.run(p.placed, x=21)
        assert out == {"gpu": {"x": 42, "worker": "w1"}, "pinned": "w2"}
        # a second GPU replica does not fit anywhere: a clear startup error
        with pytest.raises(omni.NodeError, match=r"no worker can host .*gpu=1"):
            await rt.deploy(_second_gpu_node())


def _second_gpu_node():
    @omni.node(resources={"gpu": 1})
    class AnotherGpu:
        async def __call__(self, x: int) -> int:
            return x

    return AnotherGpu()


async def test_the_head_restarting_is_rejoined(local_cluster: LocalCluster,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """The head ends at once (as killed) and a new one starts at the same address knowing
    nobody: the workers register again by themselves and graphs run on both."""
    caplog.set_level(logging.INFO, logger="omni.cluster")
    await local_cluster.start()
    workers = [await local_cluster.worker("w1"), await local_cluster.worker("w2")]
    address = local_cluster.address
    await local_cluster.stop_head()
    head = await local_cluster.start(bind=address)  # the same address, a new head
    assert head.members() == []
    await local_cluster.wait_members(lambda m: set(m) == {"w1", "w2"}
                                     and all(v["state"] == "up" for v in m.values()),
                                     "both workers up with the new head")
    # Each worker is registered with the new head and beats to it; one that said it lost the
    # head says it has it back (a quick restart may be noticed only as "registering again").
    await wait_until(lambda: all(w.link.connected and w.link.head_epoch == head.epoch
                                 for w in workers), "both workers beating to the new head")
    said = [r.getMessage() for r in caplog.records if r.name == "omni.cluster"]
    lost = [i for i, line in enumerate(said) if "not answering" in line]
    back = [i for i, line in enumerate(said) if "answers again" in line]
    assert len(back) == len(lost) and all(b > a for a, b in zip(lost, back, strict=True)), said
    async with local_cluster.driver() as rt:
        results = [await rt.run(p.shout, text="after restart") for _ in range(2)]
    assert {r["shout"]["worker"] for r in results} == {"w1", "w2"}
