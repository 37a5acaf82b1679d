"""A value that only class nodes take goes from the worker that made it straight to the workers
that take it: the driver never holds its bytes (counted by its payload mover, which every
byte of a value to or from it goes through). The workers run in this process, each with a
payload mover of its own, as a process of its own has."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import trio

from omni.transport.movers import payload_mover
from tests._wait import CAP_S, wait_until
from tests.cluster import hop_nodes as h
from tests.cluster.conftest import LocalCluster

N = 8 << 20  # float32: 32 MiB
MOVED = ("shm_out", "frames_out", "shm_in", "frames_in", "bytes_out", "bytes_in")


def moved() -> dict[str, int]:
    stats = payload_mover().stats()
    return {key: stats[key] for key in MOVED}


def expected(n: int, then: int = 0) -> float:
    return float(n) * (n - 1) / 2 + then


@contextlib.asynccontextmanager
async def gated(rt: Any, n: int) -> AsyncIterator[list[float]]:
    """A request of `h.gated` running while the body runs (w2's call held back by the gate
    until it ends); its result in the list yielded once the body and the request are done."""
    result: list[float] = []
    h.GATE.append(trio.Event())
    try:
        async with trio.open_nursery() as nursery:
            async def request() -> None:
                result.append(await rt.run(h.gated, n=n))

            nursery.start_soon(request)
            yield result
            h.GATE[-1].set()
    finally:
        h.GATE.clear()


async def test_a_value_only_class_nodes_take_goes_worker_to_worker(
        local_cluster: LocalCluster) -> None:
    await local_cluster.start()
    w1 = await local_cluster.worker("w1")
    await local_cluster.worker("w2", shm=False)  # it takes the array over the wire
    async with local_cluster.driver() as rt:
        before = moved()
        assert await rt.run(h.direct, n=N) == expected(N)
        assert moved() == before  # 32 MiB went from w1 to w2, none of it through here
        # the array went with its request: the next call to w1 lets it go, and the next
        # request's array waits there until its own request is done
        gc.collect()
        assert await rt.run(h.direct, n=1 << 20) == expected(1 << 20)
        assert len(w1._kept) <= 1
        # a value the driver needs (the graph's output) comes here as ever
        out = await rt.run(h.returned, n=N)
        assert isinstance(out, np.ndarray) and out.nbytes == 4 * N
        assert moved()["bytes_in"] - before["bytes_in"] >= 4 * N
        gc.collect()
        with trio.fail_after(CAP_S):  # the renewal takes the last release along
            await wait_until(lambda: not w1._kept, "w1 letting go of its kept arrays")


async def test_a_request_whose_kept_value_died_with_its_worker_runs_again(
        local_cluster: LocalCluster) -> None:
    """w1 made the array and dies before w2 took it: w2's call fails as a lost stream does,
    and the request runs again from the start, w1's replacement making the array anew."""
    local_cluster.heartbeat = 0.2
    await local_cluster.start()
    first = await local_cluster.worker("w1")
    await local_cluster.worker("w2")
    async with local_cluster.driver(heartbeat=0.2) as rt, gated(rt, N) as result:
        await wait_until(lambda: first._kept, "w1 keeping the array")
        await local_cluster.stop_answering("w1")
        await local_cluster.wait_members(lambda m: "w1" not in m
                                         or m["w1"]["state"] != "up", "w1 lost")
        await local_cluster.worker("w1")  # the same name joins again
    assert result == [expected(N)]


async def test_a_taker_that_never_finishes_leaves_nothing_once_the_value_is_let_go_of(
        local_cluster: LocalCluster) -> None:
    """A worker that died half-way through taking a value of several chunks leaves the
    holder's send of it behind; letting the value go drops that too."""
    from omni.cluster.remote import Take

    await local_cluster.start()
    w1 = await local_cluster.worker("w1")
    await local_cluster.worker("w2")
    n = 20 << 20  # float32: 80 MiB, two chunks
    async with local_cluster.driver() as rt:
        async with gated(rt, n) as result:
            await wait_until(lambda: w1._kept, "w1 keeping the array")
            (kept, (session, _)), = w1._kept.items()
            await w1._take(Take(session, kept, "ghost"))  # a taker that pulls nothing
            assert w1.mover._sending  # its chunks wait for it
        assert result == [expected(n)]
        gc.collect()
        with trio.fail_after(CAP_S):  # let go of with the renewal: the ghost's send too
            await wait_until(lambda: not w1._kept and not w1.mover._sending,
                             "w1 dropping the value and the unfinished send")
