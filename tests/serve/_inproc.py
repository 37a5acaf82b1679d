"""``omni serve``'s app in this process, built as the command builds it.

`served` loads a graph file (`cli._load.load_module`), starts an `omni.Runtime` on its graphs
with the command's options (the file's ``KV_LAYOUT``, metrics kept) and builds the app with
`omni.serve.build_app`; a test drives it through httpx's ASGI transport: no socket, no
process, no interpreter start. That transport hands the app's whole response back at once,
so a test whose behaviour is the connection (a client going away mid-reply, a drain that
closes idle connections and refuses new ones, a stream read as it comes) uses `listening`:
`omni.serve.serve` itself, on a loopback port the OS picks, inside the test's own trio run.

The environment a graph file reads at import (``OMNI_MODEL``, ``OMNI_TEST_GATE``) is the
test's: set it (`monkeypatch.setenv`) before entering either; each loads the file afresh.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import trio

import omni
from cli._kv import kv_config
from cli._load import graphs_to_serve, load_module
from omni.serve import DRAIN_TIMEOUT_S, GuardState, build_app, serve

__all__ = ["Listening", "Served", "listening", "listening_in_a_thread", "served"]

TIMEOUT_S = 120.0  # a client's cap; reached only by a broken run
THREAD_CAP_S = 180.0  # for the server thread to listen, then to end: a broken run's cap


@dataclass
class Served:
    """The app on its runtime; clients reach it through the ASGI transport."""

    app: Any
    runtime: Any
    graphs: dict[str, Any]
    state: GuardState

    def http(self, **headers: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app),
                                 base_url="http://omni", headers=headers, timeout=TIMEOUT_S)

    def openai(self, key: str = "unused") -> openai.AsyncOpenAI:
        """The official async client, its requests going to the app."""
        return openai.AsyncOpenAI(base_url="http://omni/v1", api_key=key, max_retries=0,
                                  timeout=TIMEOUT_S, http_client=self.http())


@dataclass
class Listening:
    """`omni.serve.serve` answering on `url`; `stop` starts its drain (what SIGTERM does to
    ``omni serve``), `stopped` is set once it returned (the drain over, connections closed)."""

    url: str
    state: GuardState
    stop: trio.Event
    stopped: trio.Event

    def http(self, **headers: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=TIMEOUT_S)

    def openai(self, key: str = "unused") -> openai.AsyncOpenAI:
        """The official async client with its own HTTP stack, over the loopback."""
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0,
                                  timeout=TIMEOUT_S)


@contextmanager
def _graphs(file: str | Path, names: tuple[str, ...]) -> Iterator[tuple[Any, dict[str, Any]]]:
    """The file's module (loaded afresh) and the graphs to serve (`names`, else every one);
    ``sys.path`` as it was once the block ends."""
    path = list(sys.path)
    try:
        module = load_module(str(file))
        yield module, graphs_to_serve(module, names, str(file))
    finally:
        sys.path[:] = path


@asynccontextmanager
async def _runtime(file: str | Path, names: tuple[str, ...]) -> AsyncIterator[
        tuple[Any, dict[str, Any]]]:
    """The runtime ``omni serve FILE`` starts (no --kv-* options, metrics kept)."""
    with _graphs(file, names) as (module, graphs):
        kv = kv_config(module, str(file), device=None, host=None, disk=None)
        async with omni.Runtime(graphs=list(graphs.values()), kv=kv, metrics=True) as rt:
            yield rt, graphs


@asynccontextmanager
async def served(file: str | Path, *names: str, state: GuardState | None = None,
                 **policies: Any) -> AsyncIterator[Served]:
    """The app serving `names` of `file` (every graph when none); `policies`: `build_app`'s
    ``media``, ``files`` and ``chat``."""
    state = state or GuardState()
    async with _runtime(file, names) as (rt, graphs):
        yield Served(build_app(rt, graphs, state, **policies), rt, graphs, state)


@asynccontextmanager
async def listening(file: str | Path, *names: str, state: GuardState | None = None,
                    drain_timeout: float = DRAIN_TIMEOUT_S,
                    **policies: Any) -> AsyncIterator[Listening]:
    """`serve` on 127.0.0.1, a port the OS picks, until the block ends: then it is stopped
    (unless the test did) and drains; a block that raises cancels it instead."""
    state = state or GuardState()
    async with _runtime(file, names) as (rt, graphs), trio.open_nursery() as nursery:
        stop, stopped = trio.Event(), trio.Event()

        async def run(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            try:
                await serve(rt, graphs, stop, port=0, state=state, drain_timeout=drain_timeout,
                            on_ready=lambda url: task_status.started(url), **policies)
            finally:
                stopped.set()

        url = await nursery.start(run)
        try:
            yield Listening(url, state, stop, stopped)
        except BaseException:
            nursery.cancel_scope.cancel()
            raise
        stop.set()


@contextmanager
def listening_in_a_thread(file: str | Path, *names: str, **options: Any) -> Iterator[str]:
    """`listening` in a thread of this process with a trio run of its own, for a test that
    is not itself a trio one (a browser driven by selenium's blocking calls); its URL.
    Stopped (drained) and joined as the block ends."""
    started: queue.Queue[Any] = queue.Queue()

    async def run() -> None:
        async with listening(file, *names, **options) as server:
            started.put((server.url, trio.lowlevel.current_trio_token(), server.stop))
            await server.stopped.wait()

    def main() -> None:
        try:
            trio.run(run)
        except BaseException as exc:
            started.put(exc)  # read only when it failed before listening
            raise

    thread = threading.Thread(target=main, name=f"serve {Path(file).name}", daemon=True)
    thread.start()
    first = started.get(timeout=THREAD_CAP_S)
    if isinstance(first, BaseException):
        raise first
    url, token, stop = first
    try:
        yield url
    finally:
        trio.from_thread.run_sync(stop.set, trio_token=token)
        thread.join(THREAD_CAP_S)
        assert not thread.is_alive(), f"the server of {file} did not stop"
