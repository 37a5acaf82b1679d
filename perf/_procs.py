"""`omni` CLI subprocesses for benchmarks and tests: a head, workers, a status query.

Their output is collected line by line in threads, so their pipes never fill and a caller can
wait for a ready line (``omni cluster head at ...``) with a timeout. `wait_members` waits until
the head lists given workers as members, before anything is deployed on them.
"""

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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["START_S", "CliProcess", "cluster_status", "wait_members"]

START_S = 60.0  # seconds a subprocess may take to print its ready line (it may import torch)


class CliProcess:
    """``python -m cli ARGS`` in `cwd`, its stdout and stderr lines kept in `out` and `err`
    (`program`: what runs instead of ``-m cli``, e.g. a benchmark's script)."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str] | None = None, *,
                 program: Sequence[str] = ("-m", "cli")):
        self.args = args
        env = {**os.environ, "PYTHONUNBUFFERED": "1"} if env is None else env
        self.popen = subprocess.Popen([sys.executable, *program, *args], cwd=cwd, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.out: list[str] = []
        self.err: list[str] = []
        self._pumps = [threading.Thread(target=self._pump, args=(stream, sink), daemon=True)
                       for stream, sink in ((self.popen.stdout, self.out),
                                            (self.popen.stderr, self.err))]
        for pump in self._pumps:
            pump.start()

    def _pump(self, stream: Any, sink: list[str]) -> None:
        for line in stream:
            sink.append(line)
            if sink is self.out:
                self.lines.put(line)

    def wait_line(self, pattern: str, timeout: float = START_S) -> re.Match[str]:
        """The first stdout line matching `pattern` (RuntimeError if none comes in time)."""
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
        raise RuntimeError(f"'{' '.join(self.args[:2])}' printed no {pattern!r}; stdout: "
                           f"{''.join(self.out)!r}; stderr: {''.join(self.err)[-2000:]!r}")

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def wait(self, timeout: float = 10.0) -> int:
        """The exit status, once the process has exited and `out` and `err` hold every line."""
        status = self.popen.wait(timeout)
        for pump in self._pumps:
            pump.join(timeout)
        return status

    def stop(self) -> None:
        """SIGTERM, then kill if it has not exited within 10 s."""
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)


def cluster_status(address: str, token_file: str | os.PathLike[str], *, cwd: Path,
                   env: dict[str, str] | None = None) -> dict[str, Any]:
    """``omni cluster status ADDRESS --json``, parsed (RuntimeError if it fails)."""
    done = subprocess.run([sys.executable, "-m", "cli", "cluster", "status", address,
                           "--token-file", str(token_file), "--json"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"'omni cluster status' failed ({done.returncode}): {done.stderr}")
    return json.loads(done.stdout)


def wait_members(address: str, token_file: str | os.PathLike[str],
                 workers: Mapping[str, CliProcess], *, cwd: Path,
                 env: dict[str, str] | None = None, timeout: float = START_S) -> dict[str, Any]:
    """Wait until the head lists every worker in `workers` (name -> its ``cluster join``
    process) as an up member run by that process; the last status (`cluster_status`).

    Raises:
        RuntimeError: a worker process exited, or `timeout` seconds passed first (the message
            shows what the head listed).
    """
    deadline = time.monotonic() + timeout
    while True:
        status = cluster_status(address, token_file, cwd=cwd, env=env)
        up = {m["name"]: m["pid"] for m in status["members"] if m["state"] == "up"}
        if all(up.get(name) == proc.popen.pid for name, proc in workers.items()):
            return status
        for name, proc in workers.items():
            if proc.popen.poll() is not None:
                raise RuntimeError(f"worker '{name}' exited ({proc.popen.returncode}): "
                                   f"{''.join(proc.err)[-2000:]!r}")
        if time.monotonic() > deadline:
            seen = {m["name"]: m["state"] for m in status["members"]}
            raise RuntimeError(f"the head did not list {sorted(workers)} as members within "
                               f"{timeout:g} s (it lists {seen})")
        time.sleep(0.2)
