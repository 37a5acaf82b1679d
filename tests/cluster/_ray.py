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
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from tests._wait import wait_until_sync

__all__ = ["RayNodes", "omni_worker_pids"]

HEAD_IP, NODE_IP = "127.0.0.2", "127.0.0.3"
RAY = str(Path(sys.executable).with_name("ray"))


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


def omni_worker_pids(sid: int) -> list[int]:
    """The ``ray::OmniWorker`` processes of the cluster whose session is `sid` (Ray names an
    actor's process after its class)."""
    pids = []
    for pid in _session_pids(sid):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::OmniWorker"):
                pids.append(pid)
        except OSError:
            continue
    return pids


class RayNodes:
    """The two nodes; `address` is the head's GCS address (what ``RAY_ADDRESS`` takes)."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="omni-ray-"))
        self.address = f"{HEAD_IP}:{_free_port(HEAD_IP)}"
        common = ["--num-cpus=2", "--object-store-memory=100000000", "--disable-usage-stats"]
        head = [RAY, "start", "--head", f"--node-ip-address={HEAD_IP}",
                f"--port={self.address.rpartition(':')[2]}",
                f"--resources={json.dumps({'node_a': 1})}", "--include-dashboard=false",
                f"--dashboard-port={_free_port(HEAD_IP)}",
                f"--dashboard-agent-listen-port={_free_port(HEAD_IP)}",
                f"--temp-dir={self.folder}", *common]
        node = [RAY, "start", f"--address={self.address}", f"--node-ip-address={NODE_IP}",
                f"--resources={json.dumps({'node_b': 1})}",
                f"--dashboard-agent-listen-port={_free_port(NODE_IP)}", *common]
        script = f"{shlex.join(head)} && {shlex.join(node)}"
        # One shell in a new session runs both `ray start`s: every process they leave
        # running is in that session, whose id is the shell's pid.
        proc = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.sid = proc.pid
        try:
            output, _ = proc.communicate(timeout=180)
            if proc.returncode != 0:
                raise RuntimeError(f"starting the Ray cluster failed:\n{output[-3000:]}")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Kill every process of the cluster, then remove its folder."""
        for pid in _session_pids(self.sid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_until_sync(lambda: not _session_pids(self.sid), "the Ray cluster's processes to end")
        shutil.rmtree(self.folder, ignore_errors=True)
