"""`omni cluster start/join/status` and `omni run --cluster` with real processes on loopback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from tests.cluster.conftest import ROOT, Cluster

PIPELINES = str(ROOT / "tests" / "cluster" / "pipelines.py")


def test_workers_join_and_status_shows_them(cluster: Cluster) -> None:
    cluster.head()
    assert cluster.token.stat().st_mode & 0o777 == 0o600  # created private
    cluster.worker("w1", "--gpus", "1", "--kv-host", "64MiB")
    cluster.worker("w2")
    members = {m["name"]: m for m in cluster.status()["members"]}
    assert set(members) == {"w1", "w2"}
    assert members["w1"]["state"] == "up" and members["w1"]["resources"]["gpu"] == 1
    assert members["w1"]["kv_capacity_bytes"] == {"host": 64 << 20}
    table = cluster.cli("cluster", "status", cluster.address, "--token-file",
                        str(cluster.token))
    assert table.returncode == 0
    assert "2 worker(s) up" in table.stdout
    assert [line.split()[0] for line in table.stdout.splitlines()[2:]] == ["w1", "w2"]


def test_status_without_workers_names_the_join_command_with_its_token_file(
        cluster: Cluster) -> None:
    """As the README runs them: every command given the same relative ``--token-file``."""
    cluster.head()
    table = cluster.cli("cluster", "status", cluster.address, "--token-file", "cluster.token")
    assert table.returncode == 0, table.stderr
    assert (f"no workers: start one with `omni cluster join {cluster.address} --token-file "
            "cluster.token`") in table.stdout


def test_a_graph_runs_across_workers(cluster: Cluster) -> None:
    cluster.head()
    cluster.worker("w1")
    cluster.worker("w2")
    done = cluster.cli("run", PIPELINES, "shout", "--cluster", cluster.address,
                       "--token-file", str(cluster.token), "--input", "text=hello big world",
                       "--requests", "4", "--json")
    assert done.returncode == 0, done.stderr
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(results) == 4
    assert all(r["words"] == "hello|big|world" for r in results)  # a stream came back
    assert all(r["shout"]["text"] == "HELLO BIG WORLD!" for r in results)
    # Shout's two replicas were placed on both workers; round robin used both.
    assert {r["shout"]["worker"] for r in results} == {"w1", "w2"}
    assert [r["shout"]["replica"] for r in results] == [0, 1, 0, 1]


def test_sigterm_leaves_cleanly(cluster: Cluster) -> None:
    cluster.head()
    worker = cluster.worker("w1")
    cluster.worker("w2")
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 143  # 128 + SIGTERM, after leaving cleanly
    assert "'w1' left the cluster" in "".join(worker.out)
    assert [line.strip() for line in worker.err] == ["error: terminated"]
    members = cluster.wait_status(lambda m: "w1" not in m)["members"]
    assert [m["name"] for m in members] == ["w2"]  # left, not lost


def test_a_join_with_the_wrong_token_is_refused(cluster: Cluster, tmp_path: Path) -> None:
    cluster.head()
    wrong = tmp_path / "wrong" / "cluster.token"
    from omni.transport.security import create_token_file

    create_token_file(wrong)
    done = cluster.cli("cluster", "join", cluster.address, "--token-file", str(wrong),
                       "--name", "intruder", "--timeout", "60")  # refused long before
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1
    assert "refused this token" in done.stderr
    assert "intruder" not in json.dumps(cluster.status())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_head_is_one_line(cluster: Cluster) -> None:
    from omni.transport.security import create_token_file

    create_token_file(cluster.token)
    address = f"tcp://127.0.0.1:{free_port()}"
    for args in (("cluster", "join", address, "--timeout", "0.5"),
                 ("cluster", "status", address, "--timeout", "0.5"),
                 ("run", PIPELINES, "shout", "--cluster", address, "--input", "text=x")):
        done = cluster.cli(*args, "--token-file", str(cluster.token))
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr.count("\n") == 1 and "no cluster head answers" in done.stderr


def test_an_address_in_use_is_one_line(cluster: Cluster) -> None:
    cluster.head()
    done = cluster.cli("cluster", "start", "--bind", cluster.address, "--token-file",
                       str(cluster.token))
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: cannot bind {cluster.address}: address already in use"


def test_bad_addresses_and_missing_tokens_are_one_line(cluster: Cluster) -> None:
    done = cluster.cli("cluster", "join", "nowhere", "--token-file", str(cluster.token))
    assert done.returncode == 2 and "not a cluster address: 'nowhere'" in done.stderr
    done = cluster.cli("cluster", "status", "tcp://127.0.0.1:9", "--token-file",
                       str(cluster.token))
    assert done.returncode == 2 and "no token file at" in done.stderr


def test_a_payload_setting_that_is_not_a_size_is_one_line(cluster: Cluster) -> None:
    cluster.head()
    env = {**os.environ, "OMNI_PAYLOAD_MAX": "lots"}
    for args in (["cluster", "join", cluster.address, "--token-file", str(cluster.token)],
                 ["run", PIPELINES, "shout", "--input", "text=hi", "--cluster",
                  cluster.address, "--token-file", str(cluster.token)]):
        done = subprocess.run([sys.executable, "-m", "cli", *args], cwd=cluster.folder, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().splitlines() == [
            "error: OMNI_PAYLOAD_MAX='lots': not a size: 'lots' (try e.g. 512MiB, 8GiB, 4096)"]
