"""Fixtures for the serving tests: ``omni serve`` as a real subprocess on a loopback port the
OS chooses.

`serve(file, *args)` starts ``python -m cli serve FILE --port 0 ARGS`` in a temporary folder
and returns its URL, read from the one line the command prints on stderr once it listens.
The processes a module started stop at the end of the module (the fixture is module-scoped:
each start imports torch, seconds on a small machine): SIGTERM, then the test fails unless
each exits 0 (its drain finished) within the cap.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
START_CAP_S = 180.0  # importing torch and building engines on a loaded 2-core machine
STOP_CAP_S = 60.0
_URL = re.compile(r"omni serve: (http://\S+)")


class Server:
    """One ``omni serve`` process and the file its stderr goes to (a file, not a pipe: a
    pipe nobody reads would fill and stall the server)."""

    def __init__(self, file: str, args: tuple[str, ...], folder: Path, number: int):
        self.log = folder / f"serve-{number}.stderr"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
            "NO_COLOR": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        with open(self.log, "wb") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "cli", "serve", str(file), "--port", "0", *args],
                cwd=folder, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=err)

    def url(self) -> str:
        """The URL once the server listens; fails naming its stderr if it exits first."""
        deadline = time.monotonic() + START_CAP_S
        while time.monotonic() < deadline:
            match = _URL.search(self.stderr())
            if match:
                return match[1]
            if self.process.poll() is not None:
                pytest.fail(f"omni serve exited {self.process.returncode} before listening:"
                            f"\n{self.stderr()}")
            time.sleep(0.05)
        pytest.fail(f"omni serve printed no URL within {START_CAP_S:g} s:\n{self.stderr()}")

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int | None:
        """SIGTERM and wait; the exit status, or None (then killed) past the cap."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=STOP_CAP_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return None


@pytest.fixture(scope="module")
def serve() -> Iterator[Callable[..., str]]:
    """``serve(file, *args) -> url``: ``omni serve FILE --port 0 ARGS`` started for this
    module; stopped at its end, each process required to exit 0."""
    servers: list[Server] = []
    with tempfile.TemporaryDirectory(prefix="omni-serve-") as folder:

        def start(file: str | Path, *args: str) -> str:
            server = Server(str(file), args, Path(folder), len(servers))
            servers.append(server)
            return server.url()

        try:
            yield start
        finally:
            results = [(server, server.stop()) for server in servers]
        failed = [f"exit {status}:\n{server.stderr()}" for server, status in results
                  if status != 0]
        assert not failed, "omni serve did not stop cleanly: " + "\n".join(failed)
