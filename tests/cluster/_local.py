"""A cluster in the test's own process: an `omni.cluster.Head` and `omni.cluster.Worker`s,
each built and run as ``omni cluster start`` / ``omni cluster join`` build and run them, in one
trio nursery, on loopback ports the OS picks; the driver is the test's ``omni.Runtime``.

Each member has its own `Credentials` (ZeroMQ context, CURVE authenticator) from the one token
file, and each worker its own `PayloadMover`, as its own process would: values between the
driver and a worker still go through shared-memory segments (or transfers), leased and released
across the link. What differs from processes: every member answers on the same event loop, and
a worker "dies" by having its scope cancelled (`stop_answering`): its sockets close and it says
nothing to the head, as a killed process would.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from typer.testing import CliRunner

import omni
from cli.main import app
from omni.cluster import HEARTBEAT_S, ClusterLink, Head, KVTiers, Worker
from omni.graph import runtime as graph_runtime
from omni.transport.credentials import Credentials
from omni.transport.movers import PayloadMover
from omni.transport.security import ensure_token_file
from tests._wait import CAP_S, wait_until
from tests.cluster._status import Rows, rows

__all__ = ["LocalCluster", "invoke"]


@dataclass
class _Hosted:
    """A member running in the cluster's nursery: cancel `scope` to end it; `ended` is set once
    it has (its sockets closed, its context destroyed)."""

    member: Any
    endpoint: str
    scope: trio.CancelScope
    ended: trio.Event


class LocalCluster:
    """A head (`start`) and workers (`worker`) in `nursery`, with one token file in `folder`;
    `heartbeat`: seconds between the members' heartbeats (the product's default unless `start`
    is given another): a worker that stops answering is lost after 3 of them."""

    def __init__(self, nursery: trio.Nursery, folder: Path):
        self.folder = folder
        self.token = folder / "cluster.token"
        self.heartbeat = HEARTBEAT_S
        self.address: str | None = None
        self._nursery = nursery
        self._head: _Hosted | None = None
        self._workers: dict[str, _Hosted] = {}

    @property
    def head(self) -> Head:
        assert self._head is not None, "start the head first"
        return self._head.member

    def worker_named(self, name: str) -> Worker:
        return self._workers[name].member

    async def start(self, *, bind: str = "tcp://127.0.0.1:*",
                    heartbeat: float | None = None) -> Head:
        """Start the head as ``omni cluster start`` does (the token file made 0600 if there
        is none); `bind`: its address (a port of the OS's choice by default)."""
        if heartbeat is not None:
            self.heartbeat = heartbeat
        ensure_token_file(self.token)
        self._head = await self._nursery.start(self._host, lambda creds: Head(
            creds, bind, heartbeat_interval=self.heartbeat))
        self.address = self._head.endpoint
        return self.head

    async def stop_head(self) -> None:
        """End the head as a killed one ends: at once, telling nobody."""
        assert self._head is not None
        self._head.scope.cancel()
        await self._head.ended.wait()

    async def worker(self, name: str, *, gpus: int = 0, kv_host: str = "64MiB",
                     shm: bool = True) -> Worker:
        """Start worker `name` as ``omni cluster join --name NAME --gpus GPUS --kv-host
        KV_HOST`` does, and return once it is registered (the head lists it as up).
        `shm=False`: it sends every buffer as frames, as ``OMNI_PAYLOAD_SHM=0`` makes a
        worker process do."""
        assert self.address is not None, "start the head first"
        address = self.address

        def make(creds: Credentials) -> Worker:
            worker = Worker(name, address, creds, host="127.0.0.1",
                            resources={"cpu": 2.0, "memory": float(8 << 30), "gpu": float(gpus)},
                            kv=KVTiers(host=kv_host), heartbeat_interval=self.heartbeat)
            worker.mover = PayloadMover(shm=shm)  # its own, as a process of its own has
            return worker

        hosted = self._workers[name] = await self._nursery.start(self._host, make)
        return hosted.member

    async def stop_answering(self, name: str) -> None:
        """Worker `name` stops at once without telling anyone (no leave, no undeploy): its
        sockets close and heartbeats to it go unanswered, as with a killed worker process."""
        hosted = self._workers[name]
        hosted.scope.cancel()
        await hosted.ended.wait()

    async def _host(self, make: Callable[[Credentials], Any], *,
                    task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        ended = trio.Event()
        try:
            with trio.CancelScope() as scope, \
                    Credentials.from_token_file(self.token) as creds:
                member = make(creds)
                try:
                    async with trio.open_nursery() as nursery:
                        endpoint = await nursery.start(member.run)
                        task_status.started(_Hosted(member, endpoint, scope, ended))
                finally:
                    if isinstance(member, Worker):
                        member.mover.close()  # what the process's exit would unlink
        finally:
            ended.set()

    # -- what the head knows -------------------------------------------------------------------

    def members(self) -> Rows:
        """The head's members as ``omni cluster status --json`` rows, by name."""
        return rows(self.head.members())

    async def wait_members(self, predicate: Callable[[Rows], Any], what: str,
                           cap: float = CAP_S) -> Rows:
        """Until `predicate(members)` holds; those members."""
        await wait_until(lambda: predicate(self.members()), what, cap=cap, poll=0.02)
        return self.members()

    # -- the driver -------------------------------------------------------------------------

    def driver(self, *, heartbeat: float | None = None, kv: Any = None,
               **options: Any) -> graph_runtime.Runtime:
        """``omni.Runtime(cluster=ADDRESS, token_file=TOKEN, kv=KV, **options)``; with
        `heartbeat`, the runtime that makes, its cluster link pinging the workers every
        `heartbeat` seconds rather than the default's (`omni.Runtime` has no such option)."""
        if heartbeat is None:
            return omni.Runtime(cluster=self.address, token_file=str(self.token), kv=kv,
                                **options)
        link = ClusterLink(self.address, token_file=self.token,
                           kv_layout=getattr(kv, "layout", kv), heartbeat_interval=heartbeat)
        return graph_runtime.Runtime(kv=kv, placement=link, **options)


def invoke(*args: str) -> subprocess.CompletedProcess[str]:
    """``omni ARGS`` run in this process (typer's `CliRunner`, in the current folder): its exit
    code and output. A command that handles signals (``start``, ``join`` once it serves,
    ``run``) runs only in the main thread; one that does not may run in a worker thread
    (``trio.to_thread.run_sync``) while the cluster serves on the test's event loop. What a
    graph file it loads adds to ``sys.path`` and ``sys.modules`` is undone, as a new process
    would start without it."""
    path, modules = list(sys.path), set(sys.modules)
    try:
        result = CliRunner().invoke(app, list(args), catch_exceptions=False, prog_name="omni")
    finally:
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            if name.startswith("_omni_file_"):
                del sys.modules[name]
    return subprocess.CompletedProcess(["omni", *args], result.exit_code, result.stdout,
                                       result.stderr)
