"""``--cluster ray`` on a real two-node Ray cluster on loopback (`_ray.RayNodes`): Omni's workers
run as ``OmniWorker`` actors that Ray places (one per node), restarts and owns; Omni's data
plane carries the values. The driver is this process (``omni run`` invoked in it, or an
``omni.Runtime``), or a real ``omni serve`` process for the ``openai`` client."""

from __future__ import annotations

import base64
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
import ray
import trio

import omni
from omni._shm import shm_directory
from omni.cluster.ray import RayCluster
from omni.transport.movers import payload_mover
from tests._wait import wait_until, wait_until_sync
from tests.cluster import ray_graphs as g
from tests.cluster._local import invoke
from tests.cluster._ray import HEAD_IP, NODE_IP, RayNodes
from tests.cluster.conftest import ROOT
from tests.cluster.test_image_families_cluster import check_split
from tests.cluster.test_showcase_cluster import DIALOGUE, check_showcase_pipelines
from tests.reliability._serve_failover import GRAPH as FAILOVER_GRAPH
from tests.reliability._serve_failover import replies_survive_a_killed_worker
from tests.serve._server import Server

pytestmark = pytest.mark.proc
HELLO = ROOT / "examples" / "hello.py"
THIRD_IP = "127.0.0.4"  # a Ray node that joins while a driver runs


def shared_memory() -> set[str]:
    return {p.name for p in shm_directory().iterdir()}


def workers_shared_memory(before: set[str]) -> set[str]:
    """What is in the shared-memory folder now and was not `before`, but this process's own
    payload segments (its pid is in their names): what workers left."""
    return {name for name in shared_memory() - before if f"-{os.getpid()}-" not in name}


@pytest.fixture(scope="module")
def ray_nodes() -> Iterator[RayNodes]:
    nodes = RayNodes()
    try:
        yield nodes
    finally:
        nodes.close()


@pytest.fixture
def ray_address(ray_nodes: RayNodes, monkeypatch: pytest.MonkeyPatch) -> str:
    """The cluster's address in ``RAY_ADDRESS``, where ``--cluster ray`` looks for it."""
    monkeypatch.setenv("RAY_ADDRESS", ray_nodes.address)
    return ray_nodes.address


def test_the_showcase_pipelines_give_the_same_bytes_under_cluster_ray(
        ray_address: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = shared_memory()
    check_showcase_pipelines(tmp_path, monkeypatch, "--cluster", "ray")
    # the workers' KV stores and payload segments went with them
    wait_until_sync(lambda: not workers_shared_memory(before), "the workers' shared memory")


async def test_a_pinned_node_lands_on_its_ray_node_and_big_values_cross_omnis_data_plane(
        ray_address: str) -> None:
    cluster = RayCluster("ray")
    async with omni.Runtime(cluster=cluster) as rt:
        assert sorted(cluster.actors) == sorted(
            f"ray-{a.node_id[:8]}" for a in cluster.actors.values())  # one per Ray node
        assert len(cluster.actors) == 2
        array = np.random.default_rng(0).integers(0, 255, 256 * g.MIB, dtype=np.uint8)
        before = payload_mover().stats()
        receipt = await rt.run(g.ship, shipment=g.Shipment("crate", array, 64 * g.MIB))
        after = payload_mover().stats()
        # while its replica is hosted, Ray's accounting has node_b taken too
        free = await trio.to_thread.run_sync(ray.available_resources)
        assert free.get("node_b", 0) == 0 and free.get("node_a") == 1
    assert receipt.node_ip == NODE_IP  # the Ray node started with node_b, not the driver's
    assert receipt.label == "crate" and receipt.digest == g.digest(array)
    assert receipt.reply.nbytes == 64 * g.MIB and bool((receipt.reply == 7).all())
    # both ways through Omni's movers (shared memory on this machine), not Ray's object store
    assert after["bytes_out"] - before["bytes_out"] >= 256 * g.MIB
    assert after["bytes_in"] - before["bytes_in"] >= 64 * g.MIB


async def test_a_killed_omni_worker_loses_no_request_and_ray_restarts_it(
        ray_nodes: RayNodes, ray_address: str) -> None:
    shm_before = shared_memory()
    ours = os.getpid()
    cluster = RayCluster("ray")
    results: list[list] = []
    async with omni.Runtime(cluster=cluster) as rt:
        async def call(i: int) -> None:
            results.append(await rt.run(g.where, i=i))

        seen = [await rt.run(g.where, i=-k) for k in range(1, 9)]  # both replicas answer
        victim = next(r for r in seen if r[0] == NODE_IP)  # the one on the second Ray node
        small = g.Shipment("small", np.zeros(8, np.uint8), 8)
        pinned = await rt.run(g.ship, shipment=small)  # node_b's: on the victim, held in Ray
        assert pinned.pid == victim[1]
        async with trio.open_nursery() as nursery:
            for i in range(60):
                nursery.start_soon(call, i)
                if i == 10:
                    os.kill(victim[1], signal.SIGKILL)  # mid-run: calls are on it
                await trio.sleep(0.01)
        assert sorted(r[2] for r in results) == list(range(60))  # every request answered

        # Ray restarts the actor; the driver hands it the token, it joins again and a
        # replica is placed on it: it serves again, as a new process on the same node.
        async def serves_again() -> bool:
            node, pid, _ = await rt.run(g.where, i=0)
            return node == NODE_IP and pid != victim[1]

        await wait_until(serves_again, "the restarted OmniWorker to serve", poll=0.1)
        # the pinned replica is back on it: what the dead process held in Ray was freed
        again = await rt.run(g.ship, shipment=small)
        assert again.node_ip == NODE_IP and again.pid not in (victim[1], ours)
        restarted = {a.pid for a in cluster.actors.values()}
        assert victim[1] not in restarted and len(restarted) == 2
    await wait_until(lambda: not ray_nodes.omni_worker_pids(),
                     "no ray::OmniWorker process left after the driver", poll=0.1)
    await wait_until(lambda: not workers_shared_memory(shm_before),
                     "the workers' shared memory to be gone", poll=0.1)


async def test_a_ray_node_that_joins_gets_an_omni_worker_and_takes_replicas(
        ray_nodes: RayNodes, ray_address: str) -> None:
    cluster = RayCluster("ray")
    async with omni.Runtime(cluster=cluster) as rt:
        assert len(cluster.actors) == 2
        node = await trio.to_thread.run_sync(ray_nodes.add, THIRD_IP, {"node_c": 1})
        try:
            await wait_until(lambda: len(cluster.actors) == 3 and all(
                a.endpoint for a in cluster.actors.values()), "an OmniWorker on the new node",
                poll=0.1)
            assert await rt.run(g.on_node_c, i=1) == THIRD_IP
        finally:
            await trio.to_thread.run_sync(ray_nodes.remove, node)
        # Ray finds the node dead (its raylet gone) and the driver drops its worker
        await wait_until(lambda: len(cluster.actors) == 2, "the gone node's worker dropped",
                         poll=0.1)


def test_omni_serve_on_cluster_ray_answers_the_openai_client(
        ray_nodes: RayNodes, ray_address: str, tmp_path: Path) -> None:
    """A real ``omni serve --cluster ray`` process, the official client, text and speech; on
    SIGTERM the server ends cleanly and its OmniWorker actors with it."""
    server = Server(DIALOGUE, ("--cluster", "ray"), tmp_path)
    try:
        server.url = server.wait_url()
        assert len(ray_nodes.omni_worker_pids()) == 2  # one actor per Ray node
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        reply = client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "Say something"}],
            max_tokens=6, temperature=0, modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "wav"})
    finally:
        status = server.stop()
    message = reply.choices[0].message
    assert message.content and reply.usage.completion_tokens > 0
    assert base64.b64decode(message.audio.data)[:4] == b"RIFF"
    assert status == 0, server.stderr()
    assert "SIGTERM received" not in server.stderr()  # Ray's C++ handler was not in the way
    wait_until_sync(lambda: not ray_nodes.omni_worker_pids(),
                    "the server's OmniWorker actors to end with it")


def test_served_replies_in_flight_on_a_killed_omni_worker_are_answered(
        ray_nodes: RayNodes, ray_address: str, tmp_path: Path) -> None:
    """`omni serve --cluster ray`: the OmniWorker hosting the chat graph's node SIGKILLed with
    replies in flight on it; each ran again on the other and came back whole
    (tests/reliability/test_serve_failover.py on a hand-joined cluster)."""
    server = Server(FAILOVER_GRAPH, ("--cluster", "ray"), tmp_path)
    try:
        server.url = server.wait_url()

        def kill(worker: str, pid: int) -> None:
            assert pid in ray_nodes.omni_worker_pids()
            os.kill(pid, signal.SIGKILL)

        try:
            replies_survive_a_killed_worker(server.url, tmp_path, kill)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nthe server said:\n{server.stderr()}") from None
    finally:
        status = server.stop()
    assert status == 0, server.stderr()
    wait_until_sync(lambda: not ray_nodes.omni_worker_pids(),
                    "the server's OmniWorker actors to end with it")


@pytest.mark.parametrize("family", ["z_image", "cosmos3"])
def test_a_familys_two_models_on_two_ray_nodes_paint_the_local_png(
        ray_address: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    """An image family's text or understanding side on one Ray node, its diffusion side on
    the other (by the nodes' custom resources): the local run's PNGs and usage
    (`check_split`)."""
    check_split(tmp_path, monkeypatch, family, f"{family}_split_ray", "--cluster", "ray")


def test_a_node_failing_as_it_starts_on_an_omni_worker_names_its_own_error(
        ray_address: str) -> None:
    """The error reaches the user as the node raised it on its actor, with the worker's name
    (pinned by ``node_b`` to the second Ray node), and its traceback with ``--debug``."""
    graphs = str(ROOT / "tests" / "cluster" / "ray_graphs.py")
    done = invoke("run", graphs, "bad_weights", "--input", "i=1", "--cluster", "ray")
    assert done.returncode == 1, done.stderr
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("error: ")]
    assert line.startswith("error: node 'BadWeights' failed to start on worker 'ray-")
    assert line.endswith(": ValueError: bad weights path"), line
    debug = invoke("run", graphs, "bad_weights", "--input", "i=1", "--cluster", "ray",
                   "--debug")
    assert debug.returncode == 1 and "ExceptionGroup" not in debug.stderr, debug.stderr
    assert 'raise ValueError("bad weights path")' in debug.stderr


def test_no_ray_cluster_is_one_line_naming_the_address(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind((HEAD_IP, 0))
        address = f"{HEAD_IP}:{unused.getsockname()[1]}"
    monkeypatch.setenv("RAY_ADDRESS", address)
    done = invoke("run", str(HELLO), "--input", "text=hi", "--cluster", "ray")
    assert done.returncode == 2
    assert f"no Ray cluster answers at {address}" in done.stderr
    assert "Traceback" not in done.stderr
    done = invoke("run", str(HELLO), "--input", "text=hi", "--cluster", "ray",
                  "--token-file", str(tmp_path / "t"))
    assert done.returncode == 2 and "token file is not used with a Ray cluster" in done.stderr
