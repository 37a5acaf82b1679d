"""The `serve` fixture: ``omni serve`` processes shared by one test module (whose tests are
then marked ``proc``: they start a process)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.serve._server import Server


@pytest.fixture(scope="module")
def serve() -> Iterator[Callable[..., str]]:
    """``serve(file, *args) -> url``: ``omni serve FILE --port 0 ARGS`` started for this
    module (each start imports torch: seconds on a small machine); stopped at its end, each
    process required to exit 0 (its drain finished)."""
    servers: list[Server] = []
    with tempfile.TemporaryDirectory(prefix="omni-serve-") as folder:

        def start(file: str | Path, *args: str) -> str:
            server = Server(str(file), args, Path(folder), len(servers))
            servers.append(server)
            return server.wait_url()

        try:
            yield start
        finally:
            results = [(server, server.stop()) for server in servers]
        failed = [f"exit {status}:\n{server.stderr()}" for server, status in results
                  if status != 0]
        assert not failed, "omni serve did not stop cleanly: " + "\n".join(failed)
