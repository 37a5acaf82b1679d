"""``python -m cli`` as a real process, for the tests marked ``proc`` (those whose behaviour the
operating system decides: signals, exit codes, a killed process, memory shared between two).

Its stdout and stderr are read line by line in threads, so its pipes never fill: a test waits
for a ready line (``omni cluster head at ...``) or for its exit, never for a length of time.
"""

from __future__ import annotations

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

__all__ = ["START_S", "CliProcess"]

START_S = 60.0  # seconds a process may take to print its ready line (it may import torch)


class CliProcess:
    """``python -m cli ARGS`` in `cwd` (`env`: its whole environment, None: this process's;
    `program`: what runs instead of ``-m cli``, e.g. a benchmark's script), its stdout and
    stderr lines kept in `out` and `err` as they come. The benchmarks in perf/ start their
    processes with it too."""

    def __init__(self, args: list[str], cwd: Path, env: Mapping[str, str] | None = None, *,
                 program: Sequence[str] = ("-m", "cli")):
        self.args = args
        env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
        self.popen = subprocess.Popen([sys.executable, *program, *args], cwd=cwd, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True)
        self.pid = self.popen.pid
        self.terminated = False  # a SIGTERM was sent
        self._lines: queue.Queue[str | None] = queue.Queue()  # stdout; None once it ends
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
                self._lines.put(line)
        if sink is self.out:
            self._lines.put(None)

    def wait_line(self, pattern: str, timeout: float = START_S) -> re.Match[str]:
        """The first stdout line (not yet waited for) matching `pattern`.

        Raises:
            AssertionError: the process ended, or `timeout` passed, without one (the message
                shows what it printed).
        """
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:  # its stdout closed: it has exited
                self._lines.put(None)
                break
            match = re.search(pattern, line)
            if match:
                return match
        raise AssertionError(f"'{' '.join(self.args[:2])}' printed no {pattern!r}: "
                             f"{self.describe()}")

    def describe(self) -> str:
        """Its exit status (if any), stdout and the end of its stderr, for failure messages."""
        status = self.popen.poll()
        return (f"{'running' if status is None else f'exit {status}'}; stdout: "
                f"{''.join(self.out)!r}; stderr: {''.join(self.err)[-2000:]!r}")

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            self.terminated |= sig == signal.SIGTERM

    def wait(self, timeout: float = 60.0) -> int:
        """The exit status, once the process has exited and `out` and `err` hold every line."""
        status = self.popen.wait(timeout)
        for pump in self._pumps:
            pump.join(timeout)
        return status

    def stop(self) -> None:
        """SIGTERM (unless it was sent already: a second one ends an Omni command at once,
        cutting its cleanup short), then SIGKILL if it has not exited within 10 s."""
        if not self.terminated:
            self.signal(signal.SIGTERM)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)
