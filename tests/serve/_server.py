"""`omni serve` as a real subprocess on an OS-chosen loopback port, for the serving tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests._wait import wait_until_sync

ROOT = Path(__file__).resolve().parents[2]
READY = "omni serve: http://"


@dataclass
class Server:
    """A running ``omni serve``: its URL, process and what it wrote on stderr so far."""

    process: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    url: str = ""

    def stderr(self) -> str:
        return "".join(self.lines)

    def stop(self, signum: int = signal.SIGTERM) -> int:
        """Send `signum` (unless it exited already) and wait for the exit; the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signum)
        return self.wait()

    def wait(self) -> int:
        """Wait for the exit (a generous cap); the exit code."""
        wait_until_sync(lambda: self.process.poll() is not None, "omni serve to exit")
        return self.process.returncode


@contextmanager
def running(file: str | Path, *args: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    """``omni serve FILE --port 0 ARGS...`` until the block ends (then SIGTERM, and a check
    that it exited)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "cli", "serve", str(file), "--port", "0", *args], cwd=ROOT,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    server = Server(process)
    reader = threading.Thread(target=_collect, args=(process, server.lines), daemon=True)
    reader.start()
    try:
        wait_until_sync(lambda: any(READY in line for line in server.lines)
                        or process.poll() is not None, "omni serve's startup line")
        ready = [line for line in server.lines if READY in line]
        assert ready, f"omni serve did not start:\n{server.stderr()}"
        server.url = ready[0].split()[2]
        yield server
    finally:
        server.stop()
        reader.join(timeout=10)


def _collect(process: subprocess.Popen, lines: list[str]) -> None:
    for line in process.stderr:
        lines.append(line)
