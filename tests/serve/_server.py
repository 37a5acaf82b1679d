"""``omni serve`` as a real subprocess on a loopback port the OS chooses.

A `Server` runs ``python -m cli serve FILE --port 0 ARGS`` in a folder of its own, its
stderr going to a file there (a pipe nobody reads would fill and stall the server); its URL
is read from the one line the command prints once it listens. `running` is the same as a
context manager for a test of its own; the `serve` fixture (conftest.py) shares servers
across a module. A test using either starts a process and is marked ``proc``: kept for what
only a real process shows (a real signal and exit status, a client in another process); the
app itself is tested in process (`tests.serve._inproc`).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import trio

from tests._wait import wait_until_sync

ROOT = Path(__file__).resolve().parents[2]
START_CAP_S = 180.0  # importing torch and building engines on a loaded 2-core machine
STOP_CAP_S = 60.0
_URL = re.compile(r"omni serve: (http://\S+)")


class Server:
    """One ``omni serve`` process and the file its stderr goes to."""

    def __init__(self, file: str | Path, args: tuple[str, ...], folder: Path, number: int = 0,
                 env: dict[str, str] | None = None):
        self.log = folder / f"serve-{number}.stderr"
        self.url = ""  # set by `running` once it listens
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
            "NO_COLOR": "1", "PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
        with open(self.log, "wb") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "cli", "serve", str(file), "--port", "0", *args],
                cwd=folder, env=environment, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=err)

    def wait_url(self) -> str:
        """The URL once the server listens; fails naming its stderr if it exits first."""

        def listening() -> bool:
            if self.process.poll() is not None:
                pytest.fail(f"omni serve exited {self.process.returncode} before listening:"
                            f"\n{self.stderr()}")
            return _URL.search(self.stderr()) is not None

        wait_until_sync(listening, f"omni serve to print its URL ({self.log})",
                        cap=START_CAP_S, poll=0.05)
        return _URL.search(self.stderr())[1]

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, signum: int = signal.SIGTERM) -> int | None:
        """Send `signum` (unless it exited already) and wait; the exit status, or None (then
        killed) past the cap."""
        if self.process.poll() is None:
            self.process.send_signal(signum)
        return self.wait()

    def wait(self) -> int | None:
        """Wait for the exit; the status, or None (then killed) past the cap."""
        try:
            return self.process.wait(timeout=STOP_CAP_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return None


@contextmanager
def running(file: str | Path, *args: str, env: dict[str, str] | None = None
            ) -> Iterator[Server]:
    """A server until the block ends (then SIGTERM); `server.url` is set."""
    with tempfile.TemporaryDirectory(prefix="omni-serve-") as folder:
        server = Server(file, args, Path(folder), env=env)
        try:
            server.url = server.wait_url()
            yield server
        finally:
            server.stop()


async def idle_connection(url: str) -> trio.SocketStream:
    """A keep-alive connection to the server at `url` that has had one answer (``GET
    /health``, read whole) and now waits for a next request."""
    where = urlsplit(url)
    stream = await trio.open_tcp_stream(where.hostname, where.port)
    await stream.send_all(b"GET /health HTTP/1.1\r\nHost: omni\r\n\r\n")
    received = b""
    while b"\r\n\r\n" not in received:
        received += await stream.receive_some()
    head, _, body = received.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += await stream.receive_some()
    assert head.startswith(b"HTTP/1.1 200") and b"connection: close" not in head.lower(), head
    return stream
