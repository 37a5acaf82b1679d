"""Class nodes that each take only the one before run as one chain: the driver sends the
first stage's worker a notice, each worker sends its result straight to the next stage's, and
the last one sends the chain's value to the driver (`omni.cluster.chains`). The workers run in
this process (see `LocalCluster`); each call a worker serves is recorded with its place in its
chain (`CallHead.stage`)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import trio

from omni.cluster import worker as worker_module
from omni.cluster.errors import RemoteNodeError, WorkerLost
from omni.graph.errors import NodeError
from tests._wait import CAP_S, wait_until
from tests.cluster import chain_nodes as c
from tests.cluster import hop_nodes as h
from tests.cluster.conftest import LocalCluster
from tests.cluster.test_direct_hops import expected


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Each node call the workers serve, on their event loops or lanes: (worker, stage, stages
    after it)."""
    calls: list[tuple[str, int, int]] = []
    original = worker_module.Worker._enter_call

    def record(self, hosted, head):
        calls.append((self.name, head.stage, len(head.then)))
        return original(self, hosted, head)

    monkeypatch.setattr(worker_module.Worker, "_enter_call", record)
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
        # the driver sent w1 alone a notice; w1 sent w2 one, w2 sent w3 one, and w3 the
        # chain's end to the driver: nothing answered, nothing came back through w1 or w2
        chains = rt.cluster.chains
        assert (chains.ended, chains.late) == (5, 0)
        # (to its RPC endpoint, not its lane: the nodes are async, their stages run on the
        # event loop, which a lane would only reach one hop later)
        for name in ("w1", "w2", "w3"):
            worker = local_cluster.worker_named(name)
            assert worker.lane.stats().received == 0
            assert sum(server.stats().notices for server in worker._servers) == 5
    assert served == [("w1", 0, 2), ("w2", 1, 1), ("w3", 2, 0)] * 5


async def test_a_chain_may_come_back_to_a_worker_it_went_through(
        local_cluster: LocalCluster, served: list[tuple[str, int, int]]) -> None:
    await three_workers(local_cluster)
    async with local_cluster.driver() as rt:
        results = {}

        async def request(x: int) -> None:
            results[x] = await rt.run(c.back, x=x)

        async with trio.open_nursery() as nursery:
            for x in range(20, 36):
                nursery.start_soon(request, x)
        assert results == {x: x + 1 for x in range(20, 36)}
        assert rt.cluster.chains.ended == 16
    assert sorted(served) == sorted([("w1", 0, 2), ("w2", 1, 1), ("w1", 2, 0)] * 16)
    assert not local_cluster.worker_named("w1")._chains


@pytest.mark.parametrize("graph, nodes", [
    (c.line, ("AddOne", "Double", "Negate")),
    (c.sync_line, ("SyncAddOne", "SyncDouble", "SyncNegate"))],  # on the workers' lanes
    ids=["async", "sync"])
async def test_a_later_stage_that_fails_fails_its_own_node(
        local_cluster: LocalCluster, served: list[tuple[str, int, int]], graph,
        nodes: tuple[str, ...]) -> None:
    await three_workers(local_cluster)
    async with local_cluster.driver() as rt:
        with pytest.raises(NodeError) as caught:
            await rt.run(graph, x=12)  # the second stage gets 13
        assert caught.value.node == nodes[1]
        assert isinstance(caught.value.cause, RemoteNodeError)
        assert caught.value.cause.member == "w2"
        assert caught.value.cause.remote_type == "ValueError"
        assert "13 is not doubled here" in str(caught.value)
        # the worker's traceback, down to the stage's raising line
        assert 'raise ValueError("13 is not doubled here")' in caught.value.cause.remote_traceback
        assert await rt.run(graph, x=1) == -4  # the next request is not affected
        # each stage's pool counted both calls (the failed chain as failed at every stage it
        # was queued on, the one after the failure included) and holds none
        pools = {p.name: p.replicas for p in rt.stats().pools}
        assert pools == {name: ((0, 0, 1, 1),) for name in nodes}
        assert local_cluster.worker_named("w2").load().failed == 1
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
    """w2 stops answering while its stage runs: the driver ends the chain as broken by it,
    and the request runs again from the start once w2's replica is placed anew (by the same
    name)."""
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


def test_a_lost_later_stage_is_a_worker_lost_of_that_node() -> None:
    """What the driver makes of a chain broken by a lost worker: the lost stage's
    `WorkerLost`, as a stream that had passed items on."""
    from omni.cluster.remote import Broken

    cause = Broken(2, "w3", "PeerGone", "silent 0.6 s", lost=True).cause()
    assert isinstance(cause, WorkerLost) and cause.member == "w3"
    assert cause.items_passed == 1


async def test_a_request_given_up_on_stops_its_chains_running_stage(
        local_cluster: LocalCluster, served: list[tuple[str, int, int]]) -> None:
    """The driver tells the chain's workers when nobody waits for its end any more: Double's
    call, held on w2, is cancelled there rather than left waiting."""
    await three_workers(local_cluster)
    c.HOLD[8] = trio.Event()  # never set
    async with local_cluster.driver() as rt:
        with trio.move_on_after(CAP_S) as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(rt.run, c.line, x=7))
                await wait_until(lambda: c.RUNNING[0] == 1, "Double holding the call")
                nursery.cancel_scope.cancel()
        assert not scope.cancelled_caught
        await wait_until(lambda: c.RUNNING[0] == 0, "Double's call cancelled on w2")
        assert not local_cluster.worker_named("w2")._chains
        assert await rt.run(c.line, x=1) == -4
    assert [call[0] for call in served] == ["w1", "w2", "w1", "w2", "w3"]


async def test_a_large_value_between_stages_is_let_go_of_once_the_next_stage_took_it(
        local_cluster: LocalCluster) -> None:
    """Make's array (too large to ride with the notice) waits on w1 until w2 took it, and
    not a moment longer: w2 tells w1 so; nothing else ever comes to w1 here."""
    await local_cluster.start()
    w1 = await local_cluster.worker("w1")
    await local_cluster.worker("w2")
    async with local_cluster.driver() as rt:
        for _ in range(3):
            assert await rt.run(h.direct, n=1 << 20) == expected(1 << 20)
            await wait_until(lambda: not w1._kept, "w1 letting go of the array w2 took")


async def test_the_drivers_shared_memory_comes_back_with_the_chains_end(
        local_cluster: LocalCluster) -> None:
    """The first stage's argument travels in the driver's shared memory; the first stage's
    worker releases it, and that goes to the driver with the chain's end (w1 never answers
    anything), so no lease is held once each request is done."""
    await local_cluster.start()
    await local_cluster.worker("w1")
    await local_cluster.worker("w2")
    async with local_cluster.driver() as rt:
        x = np.arange(1 << 17, dtype=np.float32)  # 512 KiB: shared memory, and not kept
        before = rt.cluster.mover.stats()["shm_out"]  # (the process's: earlier tests' too)
        for _ in range(5):
            assert await rt.run(h.scaled, x=x) == 2 * expected(1 << 17)
            assert rt.cluster.mover.stats()["leased"] == 0
        assert rt.cluster.mover.stats()["shm_out"] - before == 5
        assert rt.cluster.chains.ended == 5


async def test_a_worker_that_cannot_reach_the_driver_refuses_its_deployment(
        local_cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain's end goes from a worker to the driver: a worker that cannot reach the driver
    says so when the driver deploys a replica there, rather than leave chains hanging."""
    from omni.cluster import chains as chains_module

    monkeypatch.setattr(worker_module, "DRIVER_REACH_S", 0.5)
    closed = trio.socket.socket()
    await closed.bind(("127.0.0.1", 0))  # a port nothing listens on
    nowhere = f"tcp://127.0.0.1:{closed.getsockname()[1]}"
    real = chains_module.WorkerAddress
    monkeypatch.setattr(chains_module, "WorkerAddress",
                        lambda name, rpc, ipc, host: real(name, nowhere, "", host))
    await three_workers(local_cluster)
    with closed, pytest.raises(NodeError, match=f"cannot reach its driver at {nowhere}"):
        async with local_cluster.driver() as rt:
            await rt.run(c.line, x=1)


async def test_a_stage_its_worker_has_no_room_for_fails_its_request(
        local_cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker runs at most `max_in_flight` handlers; a chain's stage past that is refused
    there (nobody could be answered: it is a notice), and the chain ends as broken by it.
    Double holds its calls: three chains fit on w2 (one running, two waiting for it), the
    other three are refused there, or on w1 if they came too close together."""
    from omni.cluster import membership
    from omni.transport.rpc import RPCServer

    monkeypatch.setattr(membership, "RPCServer", functools.partial(RPCServer, max_in_flight=3))
    await three_workers(local_cluster)
    xs = range(20, 26)
    held = [c.HOLD.setdefault(x + 1, trio.Event()) for x in xs]
    results: dict[int, int | NodeError] = {}
    async with local_cluster.driver() as rt:
        async def request(x: int) -> None:
            try:
                results[x] = await rt.run(c.line, x=x)
            except NodeError as exc:
                results[x] = exc

        async with trio.open_nursery() as nursery:
            for x in xs:
                nursery.start_soon(request, x)
            await wait_until(lambda: len(results) == 3, "three requests refused")
            for event in held:
                event.set()
    refused = {x: r for x, r in results.items() if isinstance(r, NodeError)}
    assert len(refused) == 3
    assert all("ServerBusy" in str(r) for r in refused.values())
    assert {x: r for x, r in results.items() if x not in refused} == {
        x: -2 * (x + 1) for x in xs if x not in refused}


async def test_a_chains_end_waits_out_a_driver_that_seems_gone(
        local_cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last stage's worker takes the driver for gone (as when the driver's event loop
    stalls past its heartbeats): it sends the chain's end once the driver answers again,
    rather than drop it and leave the request waiting for good."""
    from omni.transport import PeerGone, RPCClient

    refusals = [2]  # the first two tries find the driver gone
    original = RPCClient.notify

    async def notify(self, method, body=None, *, payload=()):
        if method == "chain.end" and refusals[0]:
            refusals[0] -= 1
            raise PeerGone(self.endpoint, 2.0)
        return await original(self, method, body, payload=payload)

    monkeypatch.setattr(RPCClient, "notify", notify)
    await three_workers(local_cluster, heartbeat=0.05)
    async with local_cluster.driver(heartbeat=0.05) as rt:
        with trio.fail_after(CAP_S):
            assert await rt.run(c.line, x=1) == -4
        assert refusals == [0] and rt.cluster.chains.ended == 1


async def test_chains_between_hosts_go_over_tcp_both_ways(
        local_cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Unix sockets (as between hosts) the stages' notices and the chain's end go
    over TCP with CURVE, the driver's end listening on the address it reaches the head from;
    a value too large to ride with a notice is still taken from the worker that made it."""
    monkeypatch.setenv("OMNI_IPC", "0")
    await local_cluster.start()
    for name in ("w1", "w2", "w3"):
        await local_cluster.worker(name)
    async with local_cluster.driver() as rt:
        address = rt.cluster.chains.address
        assert address.ipc == "" and address.rpc.startswith("tcp://127.0.0.1:")
        for x in range(3):
            assert await rt.run(c.line, x=x) == -2 * (x + 1)
        assert await rt.run(h.direct, n=1 << 20) == expected(1 << 20)
        await wait_until(lambda: not local_cluster.worker_named("w1")._kept, "w1 let go")
        assert rt.cluster.chains.ended == 4
