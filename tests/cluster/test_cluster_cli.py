"""`omni cluster start/join/status` and graphs across workers. The commands run in this process
(typer's runner) against a cluster in this process; real processes only where the operating
system decides what happens: a worker's exit on SIGTERM, a setting read from the environment a
process starts with."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import trio

import omni
from omni._shm import shm_directory
from omni.transport.security import create_token_file
from tests._wait import CAP_S
from tests.cluster import pipelines as p
from tests.cluster import value_nodes as v
from tests.cluster._local import invoke
from tests.cluster.conftest import ROOT, Cluster, LocalCluster

PIPELINES = str(ROOT / "tests" / "cluster" / "pipelines.py")


async def test_workers_join_and_status_shows_them(local_cluster: LocalCluster) -> None:
    await local_cluster.start()
    address, token = local_cluster.address, str(local_cluster.token)
    assert local_cluster.token.stat().st_mode & 0o777 == 0o600  # created private
    await local_cluster.worker("w1", gpus=1, kv_host="64MiB")
    await local_cluster.worker("w2")
    done = await trio.to_thread.run_sync(invoke, "cluster", "status", address, "--token-file",
                                         token, "--json")
    assert done.returncode == 0, done.stderr
    members = {m["name"]: m for m in json.loads(done.stdout)["members"]}
    assert set(members) == {"w1", "w2"}
    assert members["w1"]["state"] == "up" and members["w1"]["resources"]["gpu"] == 1
    assert members["w1"]["kv_capacity_bytes"] == {"host": 64 << 20}
    table = await trio.to_thread.run_sync(invoke, "cluster", "status", address, "--token-file",
                                          token)
    assert table.returncode == 0, table.stderr
    assert "2 worker(s) up" in table.stdout
    assert [line.split()[0] for line in table.stdout.splitlines()[2:]] == ["w1", "w2"]


async def test_status_without_workers_names_the_join_command_with_its_token_file(
        local_cluster: LocalCluster) -> None:
    """As the README runs them: every command given the same relative ``--token-file``."""
    await local_cluster.start()
    table = await trio.to_thread.run_sync(invoke, "cluster", "status", local_cluster.address,
                                          "--token-file", "cluster.token")
    assert table.returncode == 0, table.stderr
    assert (f"no workers: start one with `omni cluster join {local_cluster.address} "
            "--token-file cluster.token`") in table.stdout


async def test_a_graph_runs_across_workers(local_cluster: LocalCluster) -> None:
    await local_cluster.start()
    await local_cluster.worker("w1")
    await local_cluster.worker("w2")
    async with local_cluster.driver() as rt:
        results = [await rt.run(p.shout, text="hello big world") for _ in range(4)]
    assert all(r["words"] == "hello|big|world" for r in results)  # a stream came back
    assert all(r["shout"]["text"] == "HELLO BIG WORLD!" for r in results)
    # Shout's two replicas were placed on both workers; round robin used both.
    assert {r["shout"]["worker"] for r in results} == {"w1", "w2"}
    assert [r["shout"]["replica"] for r in results] == [0, 1, 0, 1]


@pytest.mark.proc
async def test_sigterm_leaves_cleanly(cluster: Cluster) -> None:
    """A worker process SIGTERMed while a driver holds a value it sent: it tells the head it
    leaves (listed as gone, not lost), says so, exits 143, and unlinks its payload segments;
    the value the driver holds stays whole. (Its ``--gpus``/``--kv-host`` reach the head.)"""
    cluster.head()
    w1 = await trio.to_thread.run_sync(cluster.worker, "w1", "--gpus", "1", "--kv-host", "64MiB")
    w1_row = (await trio.to_thread.run_sync(cluster.members))["w1"]
    assert w1_row["resources"]["gpu"] == 1 and w1_row["kv_capacity_bytes"] == {"host": 64 << 20}
    async with omni.Runtime(cluster=cluster.address, token_file=str(cluster.token)) as rt:
        kept = await rt.run(v.Echo(), value=np.ones(1 << 20))  # held: its lease stays open
        await trio.to_thread.run_sync(cluster.worker, "w2")
        theirs = f"omni-pay-{w1.pid}-"
        assert [f for f in os.listdir(shm_directory()) if f.startswith(theirs)]
        w1.signal(signal.SIGTERM)
        assert await trio.to_thread.run_sync(w1.wait, CAP_S) == 143  # 128 + SIGTERM
        assert "'w1' left the cluster" in "".join(w1.out)
        assert [line.strip() for line in w1.err] == ["error: terminated"]
        assert not [f for f in os.listdir(shm_directory()) if f.startswith(theirs)]
        assert kept.sum() == 1 << 20  # what arrived stays valid after its producer left
        members = await trio.to_thread.run_sync(
            cluster.wait_members, lambda m: "w1" not in m, "the head to drop w1")
        assert list(members) == ["w2"]  # left, not lost


async def test_a_join_with_the_wrong_token_is_refused(local_cluster: LocalCluster,
                                                      tmp_path: Path) -> None:
    await local_cluster.start()
    wrong = tmp_path / "wrong" / "cluster.token"
    create_token_file(wrong)
    done = await trio.to_thread.run_sync(
        invoke, "cluster", "join", local_cluster.address, "--token-file", str(wrong), "--name",
        "intruder", "--timeout", "60")  # refused long before
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1
    assert "refused this token" in done.stderr
    assert "intruder" not in json.dumps(local_cluster.members())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_head_is_one_line(tmp_path: Path) -> None:
    token = tmp_path / "cluster.token"
    create_token_file(token)
    address = f"tcp://127.0.0.1:{free_port()}"
    for args in (("cluster", "join", address, "--timeout", "0.5"),
                 ("cluster", "status", address, "--timeout", "0.5"),
                 ("run", PIPELINES, "shout", "--cluster", address, "--input", "text=x")):
        done = invoke(*args, "--token-file", str(token))
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr.count("\n") == 1 and "no cluster head answers" in done.stderr


@contextmanager
def terminated_after(seconds: float) -> Iterator[None]:
    """SIGTERM this process if the block is still running after `seconds`: a command that
    should fail at once but serves instead then stops (exit 143) rather than hang the test."""
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def test_an_address_in_use_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        with terminated_after(CAP_S):
            done = invoke("cluster", "start", "--bind", address, "--token-file",
                          str(tmp_path / "cluster.token"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == f"error: cannot bind {address}: address already in use"


def test_bad_addresses_and_missing_tokens_are_one_line(tmp_path: Path) -> None:
    token = str(tmp_path / "cluster.token")
    done = invoke("cluster", "join", "nowhere", "--token-file", token)
    assert done.returncode == 2 and "not a cluster address: 'nowhere'" in done.stderr
    done = invoke("cluster", "status", "tcp://127.0.0.1:9", "--token-file", token)
    assert done.returncode == 2 and "no token file at" in done.stderr


@pytest.mark.proc
def test_a_payload_setting_that_is_not_a_size_is_one_line(cluster: Cluster) -> None:
    """A process reads ``OMNI_PAYLOAD_*`` from the environment it starts with: a worker and a
    driver started with a bad one stop at once, with one line (before looking for a head)."""
    create_token_file(cluster.token)
    address = f"tcp://127.0.0.1:{free_port()}"
    joining = cluster.start("cluster", "join", address, "--token-file", str(cluster.token),
                            env={"OMNI_PAYLOAD_MAX": "lots"})
    running = cluster.start("run", PIPELINES, "shout", "--input", "text=hi", "--cluster",
                            address, "--token-file", str(cluster.token),
                            env={"OMNI_PAYLOAD_MAX": "lots"})
    for proc in (joining, running):
        assert proc.wait(CAP_S) == 2, proc.describe()
        assert [line.strip() for line in proc.err] == [
            "error: OMNI_PAYLOAD_MAX='lots': not a size: 'lots' (try e.g. 512MiB, 8GiB, 4096)"]
