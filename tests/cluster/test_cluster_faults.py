"""Faults on a real cluster: a worker SIGKILLed mid-request, a worker rejoining, the head
restarting. The driver is this test's own `omni.Runtime(cluster=...)`."""

from __future__ import annotations

import json

import pytest
import trio

import omni
from tests._wait import CAP_S, wait_until, wait_until_sync
from tests.cluster import pipelines as p
from tests.cluster.conftest import ROOT, Cluster


def started(cluster: Cluster) -> list[str]:
    """The "NODE WORKER" lines the slow nodes wrote as they started."""
    path = cluster.folder / p.STARTED
    return path.read_text().splitlines() if path.exists() else []


async def test_a_sigkilled_worker_fails_over_and_rejoins(cluster: Cluster) -> None:
    """Calls in flight on a worker that is SIGKILLed are retried on the other one (once for
    a node without ``retries``); a stream that had already passed an item on fails, naming
    the worker; the worker rejoins and takes replicas back."""
    cluster.head()
    w1 = cluster.worker("w1")
    cluster.worker("w2")
    async with omni.Runtime(cluster=cluster.address, token_file=str(cluster.token)) as rt:
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
            await wait_until(lambda: running <= set(started(cluster)) and len(firsts) == 2,
                             "all six calls running, three on each worker, and both streams' "
                             "first items here")
            w1.popen.kill()
            killed_at = trio.current_time()
            (cluster.folder / p.RELEASE).touch()  # w2's calls, and the retries there, return

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
        status = await trio.to_thread.run_sync(
            lambda: cluster.wait_status(lambda m: m["w1"]["state"] == "lost", timeout=CAP_S))
        assert {m["name"]: m["state"] for m in status["members"]} == {"w2": "up", "w1": "lost"}
        assert await rt.run(p.SlowOnce(), seconds=0) == "w2"

        # The lost replica is replaced on a worker with room: the pool is whole again.
        pool = rt.pool_for(p.SlowOnce())
        await wait_until(lambda: all(r.alive for r in pool.replicas))
        assert {r.member for r in pool.replicas} == {"w2"}

        # A worker restarting with the same name rejoins: the driver moves one replica of each
        # pool crowded on w2 back to it, and new deployments spread over both again.
        await trio.to_thread.run_sync(cluster.worker, "w1")
        for node in (p.SlowRetried(), p.SlowOnce()):
            replicas = rt.pool_for(node).replicas
            await wait_until(lambda r=replicas: sorted(x.member for x in r) == ["w1", "w2"])
        await rt.deploy(p.Shout())
        assert sorted(r.member for r in rt.pool_for(p.Shout()).replicas) == ["w1", "w2"]


async def _append(results: list, awaitable) -> None:
    results.append(await awaitable)


async def test_a_node_error_on_a_worker_names_it(cluster: Cluster) -> None:
    cluster.head()
    cluster.worker("w1")
    async with omni.Runtime(cluster=cluster.address, token_file=str(cluster.token)) as rt:
        with pytest.raises(omni.NodeError) as info:
            await rt.run(p.Fails(), x=3)
        assert info.value.node == "Fails"
        assert "ValueError: no good: 3 (on worker 'w1')" in str(info.value)
        assert await rt.run(p.Shout(), text="still") is not None  # the worker keeps serving


async def test_placement_by_resources_and_by_name(cluster: Cluster) -> None:
    cluster.head()
    cluster.worker("w1", "--gpus", "1")
    cluster.worker("w2", "--gpus", "0")
    async with omni.Runtime(cluster=cluster.address, token_file=str(cluster.token)) as rt:
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


def test_the_head_restarting_is_rejoined(cluster: Cluster) -> None:
    head = cluster.head()
    w1 = cluster.worker("w1")
    cluster.worker("w2")
    address = cluster.address
    head.popen.kill()
    head.wait()
    cluster.head(bind=address)  # the same address, a new process that knows nobody
    cluster.wait_status(lambda m: set(m) == {"w1", "w2"}
                        and all(v["state"] == "up" for v in m.values()), timeout=60)
    # A worker that said it lost the head says it has it back (a quick restart may be
    # noticed only as "registering again", without a beat lost in between).
    wait_until_sync(lambda: "not answering" not in "".join(w1.err)
                    or "answers again" in "".join(w1.err),  # its log lines come as they come
                    "w1 to say the head answers again")
    said = "".join(w1.err)
    assert "not answering" not in said or \
        said.index("answers again") > said.index("not answering"), said
    done = cluster.cli("run", str(ROOT / "tests" / "cluster" / "pipelines.py"), "shout",
                       "--cluster", address, "--token-file", str(cluster.token),
                       "--input", "text=after restart", "--json", "-n", "2")
    assert done.returncode == 0, done.stderr
    assert {json.loads(line)["shout"]["worker"] for line in done.stdout.splitlines()} == {
        "w1", "w2"}
