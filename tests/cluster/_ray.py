"""A real two-node Ray cluster on loopback for the ``--cluster ray`` tests: a head node on
127.0.0.2 (custom resource ``node_a``) and a second node on 127.0.0.3 (``node_b``), started with
``ray start`` as a user starts them, each run on ports of its own and in a temp folder of its
own, and stopped by killing exactly the processes it started (never ``ray stop``, which stops
every Ray cluster of this user on the machine).

Why 127.0.0.2 and .3: Ray turns 127.0.0.1 into the machine's outward address, and two nodes
need two addresses; both are loopback, so nothing leaves the machine. The nodes are started in
a session of their own: every process Ray starts for them (its daemons, the workers and actors
that raylets spawn) stays in it, and the cluster ends by killing that session. The processes
inherit this pytest process's environment: its shared-memory and socket folders
(tests/conftest.py), so that the driver and the actors on this machine agree on them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests._wait import wait_until_sync

__all__ = ["HEAD_IP", "NODE_IP", "RayNodes"]

HEAD_IP, NODE_IP = "127.0.0.2", "127.0.0.3"
RAY = str(Path(sys.executable).with_name("ray"))
# Ray's token authentication stays off for the test cluster whatever this user's ~/.ray holds:
# a local `ray.init()` leaves a token there, and then `ray start --head` turns tokens on while
# `ray start --address` does not send one, so the second node is refused.
RAY_ENV = {"RAY_AUTH_MODE": "disabled"}
ROOT = Path(__file__).resolve().parents[2]


def _client_port() -> list[str]:
    """Where ``ray[client]`` is installed, a head starts Ray Client's server, on port 10001
    unless told: a port of its own, so that clusters started side by side do not collide."""
    if importlib.util.find_spec("grpc") is None:  # what Ray checks for: no client server
        return []
    return [f"--ray-client-server-port={_free_port(HEAD_IP)}"]


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _session_pids(sid: int) -> list[int]:
    """Every process in session `sid` (what the cluster's `ray start` began)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_bytes().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != b"Z":  # the session id; not a zombie
            pids.append(int(entry.name))
    return pids


class RayNodes:
    """The two nodes; `address` is the head's GCS address (what ``RAY_ADDRESS`` takes). Ray's
    object store: `object_store_bytes` per node (its minimum by default: Omni's values do not
    go through it). `add` starts one more node, `remove` kills one added so."""

    def __init__(self, object_store_bytes: int = 100_000_000):
        self.folder = Path(tempfile.mkdtemp(prefix="omni-ray-"))
        self.address = f"{HEAD_IP}:{_free_port(HEAD_IP)}"
        self.sessions: list[int] = []
        self._common = ["--num-cpus=2", f"--object-store-memory={object_store_bytes}",
                        "--disable-usage-stats"]
        head = [RAY, "start", "--head", f"--node-ip-address={HEAD_IP}",
                f"--port={self.address.rpartition(':')[2]}",
                f"--resources={json.dumps({'node_a': 1})}", "--include-dashboard=false",
                f"--dashboard-port={_free_port(HEAD_IP)}",
                f"--dashboard-agent-listen-port={_free_port(HEAD_IP)}",
                *_client_port(),
                f"--temp-dir={self.folder}",
                # a node killed (`remove`) is found dead in ~1.5 s, not Ray's ~15
                "--system-config=" + json.dumps({"health_check_period_ms": 500,
                                                 "health_check_failure_threshold": 3}),
                *self._common]
        # Should this process die without `close` (SIGKILL, a CI timeout), the watchdog
        # kills the cluster's sessions once it is gone: no Ray cluster outlives its tests.
        self._watchdog = subprocess.Popen(
            [sys.executable, "-m", "tests.cluster._ray", str(os.getpid()), str(self.folder)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        try:
            self._run(head, self._node(NODE_IP, {"node_b": 1}))
        except BaseException:
            self.close()
            raise

    def _node(self, ip: str, resources: dict[str, float]) -> list[str]:
        return [RAY, "start", f"--address={self.address}", f"--node-ip-address={ip}",
                f"--resources={json.dumps(resources)}",
                f"--dashboard-agent-listen-port={_free_port(ip)}", *self._common]

    def _run(self, *commands: list[str]) -> int:
        """Run `commands` in turn from one shell in a new session; every process they leave
        running is in that session, whose id (the shell's pid) is returned."""
        script = " && ".join(shlex.join(command) for command in commands)
        proc = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                env={**os.environ, **RAY_ENV})
        self.sessions.append(proc.pid)
        assert self._watchdog.stdin is not None
        self._watchdog.stdin.write(f"{proc.pid}\n")  # a session for it to kill, too
        self._watchdog.stdin.flush()
        output, _ = proc.communicate(timeout=180)
        if proc.returncode != 0:
            raise RuntimeError(f"starting Ray nodes failed:\n{output[-3000:]}")
        return proc.pid

    def add(self, ip: str, resources: dict[str, float]) -> int:
        """Start another node on loopback address `ip`; its session, for `remove`."""
        return self._run(self._node(ip, resources))

    def remove(self, session: int) -> None:
        """Kill every process of a node `add` started (its actors with it)."""
        for pid in _session_pids(session):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_until_sync(lambda: not _session_pids(session), "the Ray node's processes to end")

    def omni_worker_pids(self) -> list[int]:
        """The cluster's ``ray::OmniWorker`` processes (Ray names an actor's process after its
        class)."""
        pids = []
        for session in self.sessions:
            for pid in _session_pids(session):
                try:
                    if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::OmniWorker"):
                        pids.append(pid)
                except OSError:
                    continue
        return pids

    def close(self) -> None:
        """Kill every process of the cluster, then remove its folder (and the watchdog)."""
        for session in self.sessions:
            self.remove(session)
        shutil.rmtree(self.folder, ignore_errors=True)
        self._watchdog.kill()
        self._watchdog.wait()


def _watch(parent: int, folder: str) -> None:
    """The watchdog's life (``python -m tests.cluster._ray PARENT FOLDER``): read session ids
    on stdin; once process `parent` is gone, kill every process of those sessions and remove
    the cluster's `folder`."""
    sessions: set[int] = set()

    def read() -> None:
        for line in sys.stdin:
            sessions.add(int(line))

    threading.Thread(target=read, daemon=True).start()
    while Path(f"/proc/{parent}").exists():
        time.sleep(1)
    for session in list(sessions):
        for pid in _session_pids(session):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    _watch(int(sys.argv[1]), sys.argv[2])
