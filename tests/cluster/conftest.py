"""Real clusters for tests: a head and workers started through the CLI as subprocesses, on
loopback ports the OS picks, stopped (or killed) when the test ends. A worker started with
``wait=True`` is one the head lists as a member: a test deploys only on workers that are."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from perf._procs import START_S, CliProcess, wait_members

ROOT = Path(__file__).resolve().parents[2]
# Seconds between heartbeats (the product's default): a lost worker is noticed after 3 of them.
# A shorter beat would notice sooner, but a worker starved of CPU for 3 beats on a loaded
# machine would be dropped while alive, and tests that assert no request fails would flip.
HEARTBEAT = 0.5
ADDRESS = re.compile(r"tcp://[0-9.]+:\d+")


class Cluster:
    """Starts heads and workers in `folder` with one token file; cleans them all up."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.token = folder / "cluster.token"
        self.procs: list[CliProcess] = []
        self.address: str | None = None

    def start(self, *args: str, cwd: Path | None = None,
              env: dict[str, str] | None = None) -> CliProcess:
        proc = CliProcess(list(args), cwd or self.folder,
                          None if env is None else {**os.environ, "PYTHONUNBUFFERED": "1", **env})
        self.procs.append(proc)
        return proc

    def head(self, bind: str = "tcp://127.0.0.1:*") -> CliProcess:
        proc = self.start("cluster", "start", "--bind", bind, "--token-file", str(self.token),
                          "--heartbeat", str(HEARTBEAT))
        self.address = proc.wait_line(r"head at (tcp://\S+)").group(1)
        return proc

    def worker(self, name: str, *extra: str, wait: bool = True,
               env: dict[str, str] | None = None) -> CliProcess:
        """Start worker `name` (`env`: settings added to its environment); with `wait`, return
        once the head lists it as a member."""
        assert self.address is not None
        # A generous wait for the head: on a loaded machine its first answer can take seconds.
        timeout = [] if "--timeout" in extra else ["--timeout", str(START_S)]
        proc = self.start("cluster", "join", self.address, "--token-file", str(self.token),
                          "--name", name, "--heartbeat", str(HEARTBEAT), *timeout, *extra,
                          env=env)
        if wait:
            proc.wait_line(r"joined .* as")
            self.wait_members({name: proc})
        return proc

    def wait_members(self, workers: dict[str, CliProcess], timeout: float = 60.0) -> dict:
        """Until the head lists each of `workers` (name -> process) as an up member."""
        assert self.address is not None
        return wait_members(self.address, self.token, workers, cwd=self.folder,
                            timeout=timeout)

    def cli(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cli", *args], cwd=self.folder,
                              capture_output=True, text=True, timeout=timeout)

    def status(self) -> dict:
        done = self.cli("cluster", "status", self.address, "--token-file", str(self.token),
                        "--json", timeout=30)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def wait_status(self, predicate, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            status = self.status()
            if predicate({m["name"]: m for m in status["members"]}):
                return status
            if time.monotonic() > deadline:
                raise AssertionError(f"cluster never reached the state: {status}")
            time.sleep(0.2)

    def close(self) -> None:
        for proc in self.procs:
            proc.signal(signal.SIGTERM)  # all at once: they stop in parallel
        for proc in self.procs:
            proc.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()
