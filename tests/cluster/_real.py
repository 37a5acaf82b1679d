"""Real clusters, for the tests marked ``proc``: a head and workers started as
``omni cluster start`` / ``omni cluster join`` processes on loopback ports the OS picks, stopped
(or killed) when the test ends. A worker started with ``wait=True`` is one the head lists as a
member: a test deploys only on workers that are. The head is asked for its members over RPC
from the test's own process (see `_status`)."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from tests._procs import START_S, CliProcess
from tests._wait import CAP_S, wait_until_sync
from tests.cluster._status import Rows, ask_members

__all__ = ["HEARTBEAT", "ROOT", "Cluster"]

ROOT = Path(__file__).resolve().parents[2]
# Seconds between heartbeats (the product's default): a lost worker is noticed after 3 of them.
# A shorter beat would notice sooner, but a worker starved of CPU for 3 beats on a loaded
# machine would be dropped while alive, and tests that assert no request fails would flip.
HEARTBEAT = 0.5
ADDRESS = re.compile(r"head at (tcp://\S+)")


class Cluster:
    """Starts heads and workers in `folder` with one token file; cleans them all up."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.token = folder / "cluster.token"
        self.procs: list[CliProcess] = []
        self.address: str | None = None

    def start(self, *args: str, cwd: Path | None = None,
              env: dict[str, str] | None = None) -> CliProcess:
        """``python -m cli ARGS`` in the cluster's folder (`env`: settings added to this
        process's environment), stopped with the cluster."""
        proc = CliProcess(list(args), cwd or self.folder,
                          None if env is None else {**os.environ, **env})
        self.procs.append(proc)
        return proc

    def head(self, bind: str = "tcp://127.0.0.1:*") -> CliProcess:
        proc = self.start("cluster", "start", "--bind", bind, "--token-file", str(self.token),
                          "--heartbeat", str(HEARTBEAT))
        self.address = proc.wait_line(ADDRESS.pattern).group(1)
        return proc

    def worker(self, name: str, *extra: str, wait: bool = True,
               env: dict[str, str] | None = None) -> CliProcess:
        """Start worker `name` (`env`: settings added to its environment); with `wait`, return
        once the head lists it as an up member run by this process."""
        assert self.address is not None
        # A generous wait for the head: on a loaded machine its first answer can take seconds.
        timeout = [] if "--timeout" in extra else ["--timeout", str(START_S)]
        proc = self.start("cluster", "join", self.address, "--token-file", str(self.token),
                          "--name", name, "--heartbeat", str(HEARTBEAT), *timeout, *extra,
                          env=env)
        if wait:
            proc.wait_line(r"joined .* as")

            def member(members: Rows) -> bool:
                if proc.popen.poll() is not None:
                    raise AssertionError(f"worker '{name}' exited: {proc.describe()}")
                row = members.get(name)
                return row is not None and row["state"] == "up" and row["pid"] == proc.pid

            self.wait_members(member, f"the head to list worker '{name}' (pid {proc.pid})")
        return proc

    def members(self) -> Rows:
        """The head's members as status rows, by name (`_status.rows`)."""
        assert self.address is not None
        return trio.run(ask_members, self.address, self.token)

    def wait_members(self, predicate: Callable[[Rows], Any], what: str,
                     cap: float = CAP_S) -> Rows:
        """Ask the head until `predicate(members)` holds; those members. In a trio test, run it
        with ``trio.to_thread.run_sync``."""
        seen: list[Rows] = [{}]

        def reached() -> bool:
            seen[0] = self.members()
            return bool(predicate(seen[0]))

        try:
            wait_until_sync(reached, what, cap=cap, poll=0.05)
        except AssertionError as exc:
            raise AssertionError(f"{exc} (the head lists {seen[0]})") from None
        return seen[0]

    def close(self) -> None:
        for proc in self.procs:
            proc.signal(signal.SIGTERM)  # all at once: they stop in parallel
        for proc in self.procs:
            proc.stop()
