"""Values cross to workers as they are, and large ones move like KV pages: through shared
memory on one host, as chunked frames between hosts, with no size cap but the setting's.
Workers run in this process (each with a payload mover of its own, as a process has), except
where what one process leaves mapped, or a CUDA IPC handle, is what the test checks.
(A worker SIGTERMed leaves no payload segment: tests/cluster/test_cluster_cli.py.)"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch
import trio

import omni
from omni._shm import shm_directory
from omni.transport.movers import payload_mover
from tests._wait import CAP_S, wait_until
from tests.cluster import value_nodes as v
from tests.cluster.conftest import Cluster, LocalCluster

# Seconds between the driver's pings to a worker in the tests that move values past 64 MiB.
# Why not the default (0.5 s, lost after 3 unanswered): a ping shares the connection with the
# 64 MiB chunks, and here the driver and the worker share one process too; on a machine at full
# load (the suite on xdist) a pong can wait behind the chunks past 1.5 s and the worker is taken
# for lost mid-transfer. These tests are about the bytes; noticing a lost worker is tested in
# test_cluster_faults.py.
BIG_VALUES_HEARTBEAT = 3.0


def leased() -> int:
    return payload_mover().stats()["leased"]


async def test_dataclasses_tensors_and_streams_arrive_as_they_left(
        local_cluster: LocalCluster) -> None:
    await local_cluster.start()
    await local_cluster.worker("w1")
    frame = v.Frame(3, np.arange(12, dtype=np.int32).reshape(3, 4), ("x", "y"))
    latent = torch.arange(24.0).reshape(4, 6).t()  # not contiguous: strides are kept
    async with local_cluster.driver() as rt:
        out = await rt.run(v.Inspect(), frame=frame, latent=latent)
        assert out["types"] == ("Frame", "tuple")
        assert type(out["frame"]) is v.Frame and out["frame"].tags == ("x", "y")
        assert (out["frame"].pixels == frame.pixels).all()
        assert out["stride"] == latent.stride() == out["latent"].stride()
        assert torch.equal(out["latent"], latent)
        totals = [item async for _, item in rt.stream(v.tally, count=5)]
        assert totals == [sum(i * 256 * 256 for i in range(k + 1)) for k in range(5)]


async def test_a_stream_item_that_cannot_travel_fails_its_request_only(
        local_cluster: LocalCluster) -> None:
    await local_cluster.start()
    await local_cluster.worker("w1")
    async with local_cluster.driver() as rt:
        with trio.fail_after(CAP_S):
            with pytest.raises(omni.NodeError, match="cannot travel"):
                await rt.run(v.count, bad=True)
            assert await rt.run(v.count, bad=False) == 2  # the runtime and worker go on


async def test_a_stream_failing_after_its_items_fails_its_request_every_time(
        local_cluster: LocalCluster) -> None:
    """The worker records the failure before the stream's end is seen: the driver never
    takes the end for a clean one (20 runs: the two used to race)."""
    await local_cluster.start()
    await local_cluster.worker("w1")
    async with local_cluster.driver() as rt:
        for x in range(20):
            with trio.fail_after(CAP_S), pytest.raises(omni.NodeError,
                                                       match="broke after one item"):
                await rt.run(v.BreaksAfterOne(), x=x)


async def test_values_past_the_old_frame_limit_cross_both_ways(local_cluster: LocalCluster,
                                                            monkeypatch) -> None:
    await local_cluster.start()
    worker = await local_cluster.worker("w1")
    big = np.random.default_rng(0).integers(0, 255, (64 << 20) + 4096, dtype=np.uint8)
    async with local_cluster.driver(heartbeat=BIG_VALUES_HEARTBEAT) as rt:
        back = await rt.run(v.Echo(), value=big)  # through shared memory, both ways
        assert np.array_equal(back, big)
        assert worker.mover.stats()["shm_in"] >= 1
        assert payload_mover().stats()["shm_in"] >= 1 and leased() >= 1
        del back
        gc.collect()
        with trio.fail_after(CAP_S):  # a reply of the worker's brings the lease back
            while leased():
                await rt.run(v.Echo(), value=np.zeros(4))
        monkeypatch.setattr(payload_mover(), "shm", False)  # as between hosts: a transfer
        transfers_out = payload_mover().stats()["transfers_out"]
        transfers_in = worker.mover.stats()["transfers_in"]
        back = await rt.run(v.Echo(), value=big)
        assert np.array_equal(back, big)
        stats = payload_mover().stats()
        assert stats["transfers_out"] == transfers_out + 1 and stats["transfers"] == 0
        assert worker.mover.stats()["transfers_in"] == transfers_in + 1


async def test_a_node_whose_values_cannot_cross_is_refused_at_deploy(
        local_cluster: LocalCluster) -> None:
    await local_cluster.start()
    await local_cluster.worker("w1")
    async with local_cluster.driver() as rt:
        with pytest.raises(omni.NodeError) as caught:
            await rt.deploy(v.TakesACallback())
        message = str(caught.value)
        assert "TakesACallback" in message and "parameter 'on_done'" in message
        assert "callable" in message


def worker_payloads(pid: int) -> tuple[list[str], int]:
    """Worker `pid`'s own payload segments, and the bytes of other processes' payload
    segments it maps (from /proc: what the worker's memory holds, as `ps` would see it)."""
    own = [p for p in os.listdir(shm_directory()) if p.startswith(f"omni-pay-{pid}-")]
    mapped = 0
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and "/omni-pay-" in fields[5] \
                    and f"/omni-pay-{pid}-" not in fields[5]:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                mapped += end - start
    return own, mapped


@pytest.mark.proc
async def test_a_worker_lets_go_of_the_payloads_of_drivers_that_finished(cluster: Cluster
                                                                          ) -> None:
    """Each driver sends and gets back 1 MiB arrays through shared memory and keeps the last
    result; once it has finished, the worker holds none of its segments and maps none of
    the driver's (it used to keep one leased segment per finished driver, and its mappings
    of their segments), and what the driver kept is still whole."""
    cluster.head()
    worker = await trio.to_thread.run_sync(cluster.worker, "w1")
    pid = worker.pid
    kept = []
    for number in range(3):
        async with omni.Runtime(cluster=cluster.address, token_file=str(cluster.token)) as rt:
            for i in range(4):
                back = await rt.run(v.Echo(), value=np.full(1 << 20, number * 4 + i, np.uint8))
            own, mapped = worker_payloads(pid)
            assert own and mapped >= 1 << 20  # in use while the driver runs
        kept.append(back)
        await wait_until(lambda: worker_payloads(pid) == ([], 0),
                         f"worker to let go of driver {number}'s payloads")
    assert [int(k[0]) for k in kept] == [3, 7, 11] and all((k == k[0]).all() for k in kept)


@pytest.mark.gpu
@pytest.mark.proc  # a CUDA IPC handle opens only in another process
async def test_cuda_tensors_cross_to_a_worker_of_this_host_by_ipc_handle(cluster: Cluster) -> None:
    cluster.head()
    await trio.to_thread.run_sync(cluster.worker, "w1")
    latent = torch.randn(256, 256, device="cuda")
    async with omni.Runtime(cluster=cluster.address, token_file=str(cluster.token)) as rt:
        frames_out = payload_mover().stats()["frames_out"]
        out = await rt.run(v.OnDevice(), value=latent)
        assert out["device"].startswith("cuda") and out["doubled"].is_cuda
        assert torch.equal(out["doubled"], latent * 2)
        assert payload_mover().stats()["frames_out"] == frames_out  # no byte went as a frame


async def test_between_hosts_values_over_one_chunk_move_in_chunks_every_way(
        local_cluster: LocalCluster, monkeypatch) -> None:
    """Arguments, results, stream items and stream-argument items of more than one 64 MiB
    frame travel as transfers over TCP (as between hosts), whole and in order."""
    monkeypatch.setenv("OMNI_IPC", "0")  # w1 serves, and the driver reaches it, over TCP only
    monkeypatch.setattr(payload_mover(), "shm", False)
    await local_cluster.start()
    await local_cluster.worker("w1", shm=False)
    nbytes = (64 << 20) + 4096
    big = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    assert local_cluster.worker_named("w1").ipc == ""  # no Unix socket: TCP with CURVE
    async with local_cluster.driver(heartbeat=BIG_VALUES_HEARTBEAT) as rt:
        with trio.fail_after(CAP_S * 2):
            before = payload_mover().stats()
            back = await rt.run(v.Echo(), value=big)  # pushed to w1, pulled back
            assert np.array_equal(back, big)
            del back
            items = [item async for _, item in rt.stream(v.bounce, count=2, nbytes=nbytes)]
            assert [(len(a), int(a[0]), int(a[-1])) for a in items] == [
                (nbytes, 1, 1), (nbytes, 2, 2)]
            after = payload_mover().stats()
            assert after["transfers_out"] - before["transfers_out"] == 3  # 1 argument, 2 fed
            assert after["transfers_in"] - before["transfers_in"] == 3  # 1 result, 2 streamed
            assert after["transfers"] == 0 and after["shm_in"] == before["shm_in"]
