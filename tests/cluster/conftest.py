"""Real clusters for tests: a head and workers started through the CLI as subprocesses, on
loopback ports the OS picks, stopped (or killed) when the test ends."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEARTBEAT = 0.2  # seconds: a lost worker is noticed within 3 of them
START_S = 30.0  # how long a process may take to print its ready line (imports torch)
ADDRESS = re.compile(r"tcp://[0-9.]+:\d+")


class Proc:
    """A CLI subprocess whose output lines are collected in a thread."""

    def __init__(self, args: list[str], cwd: Path):
        self.args = args
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.popen = subprocess.Popen([sys.executable, "-m", "cli", *args], cwd=cwd, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, sink in ((self.popen.stdout, self.out), (self.popen.stderr, self.err)):
            threading.Thread(target=self._pump, args=(stream, sink), daemon=True).start()

    def _pump(self, stream, sink: list[str]) -> None:
        for line in stream:
            sink.append(line)
            if sink is self.out:
                self.lines.put(line)

    def wait_line(self, pattern: str, timeout: float = START_S) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                if self.popen.poll() is not None and self.lines.empty():
                    break
                continue
            match = re.search(pattern, line)
            if match:
                return match
        raise AssertionError(f"{self.args[:2]} printed no {pattern!r}; stdout: "
                             f"{''.join(self.out)!r} stderr: {''.join(self.err)[-2000:]!r}")

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def wait(self, timeout: float = 10.0) -> int:
        return self.popen.wait(timeout)

    def stderr(self) -> str:
        return "".join(self.err)


class Cluster:
    """Starts heads and workers in `folder` with one token file; cleans them all up."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.token = folder / "cluster.token"
        self.procs: list[Proc] = []
        self.address: str | None = None

    def start(self, *args: str, cwd: Path | None = None) -> Proc:
        proc = Proc(list(args), cwd or self.folder)
        self.procs.append(proc)
        return proc

    def head(self, bind: str = "tcp://127.0.0.1:*") -> Proc:
        proc = self.start("cluster", "start", "--bind", bind, "--token-file", str(self.token),
                          "--heartbeat", str(HEARTBEAT))
        self.address = proc.wait_line(r"head at (tcp://\S+)").group(1)
        return proc

    def worker(self, name: str, *extra: str, wait: bool = True) -> Proc:
        assert self.address is not None
        proc = self.start("cluster", "join", self.address, "--token-file", str(self.token),
                          "--name", name, "--heartbeat", str(HEARTBEAT), *extra)
        if wait:
            proc.wait_line(r"joined .* as")
        return proc

    def cli(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cli", *args], cwd=self.folder,
                              capture_output=True, text=True, timeout=timeout)

    def status(self) -> dict:
        done = self.cli("cluster", "status", self.address, "--token-file", str(self.token),
                        "--json", timeout=30)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def wait_status(self, predicate, timeout: float = 15.0) -> dict:
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
            proc.signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.wait(5)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()
