"""Running graphs from outside trio: `run` (synchronous) and `AsyncioRuntime` (asyncio).

`AsyncioRuntime` starts trio as a guest of the running asyncio loop (trio's guest mode): both
run in one thread, trio's scheduler driven by asyncio callbacks. Each call crosses over by
scheduling a trio task through the trio token and resolving an asyncio future when it ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import outcome
import trio

from omni.graph.dsl import Graph
from omni.graph.runtime import Runtime

__all__ = ["AsyncioRuntime", "run"]

_END = object()


def run(graph: Any, /, **inputs: Any) -> Any:
    """Run one request synchronously (starts and stops a `Runtime` around it).

    For many requests, open one `Runtime` instead: it keeps replicas alive between requests.
    """

    async def main() -> Any:
        async with Runtime(graphs=[graph]) as rt:
            return await rt.run(graph, **inputs)

    return trio.run(main)


class AsyncioRuntime:
    """`Runtime`'s interface for asyncio applications.

    ``async with omni.AsyncioRuntime() as rt: await rt.run(graph, **inputs)``, or
    ``async for name, item in rt.stream(graph, **inputs)``. Options are `Runtime`'s. One per
    asyncio loop at a time (trio allows one guest run per host loop).
    """

    def __init__(self, **options: Any):
        self._options = options
        self._loop: asyncio.AbstractEventLoop | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._runtime: Runtime | None = None
        self._stop = trio.Event()
        self._done: asyncio.Future[outcome.Outcome] | None = None

    async def __aenter__(self) -> AsyncioRuntime:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._done = loop.create_future()
        started: asyncio.Future[None] = loop.create_future()
        trio.lowlevel.start_guest_run(
            self._trio_main, started,
            run_sync_soon_threadsafe=loop.call_soon_threadsafe,
            done_callback=self._on_done,
            host_uses_signal_set_wakeup_fd=True,
        )
        await asyncio.wait([started, self._done], return_when=asyncio.FIRST_COMPLETED)
        if not started.done():
            self._done.result().unwrap()  # startup failed: raise why
            raise RuntimeError("the trio guest run ended before the runtime started")
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        # The host loop must keep running until trio's done callback fires.
        self._token.run_sync_soon(self._stop.set)
        result = await asyncio.shield(self._done)
        result.unwrap()

    async def _trio_main(self, started: asyncio.Future[None]) -> None:
        async with Runtime(**self._options) as rt, trio.open_nursery() as nursery:
            self._runtime = rt
            self._nursery = nursery
            self._token = trio.lowlevel.current_trio_token()
            started.set_result(None)
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def _on_done(self, result: outcome.Outcome) -> None:
        if not self._done.done():
            self._done.set_result(result)

    @property
    def runtime(self) -> Runtime:
        """The trio `Runtime` inside (for its `stats()`); only call it from trio code."""
        if self._runtime is None:
            raise RuntimeError("the AsyncioRuntime is not started")
        return self._runtime

    async def _call(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        """Run `fn` as a trio task and wait for it from asyncio; cancelling either side
        cancels the other."""
        if self._nursery is None:
            raise RuntimeError("the AsyncioRuntime is not started: use 'async with'")
        loop = self._loop
        future: asyncio.Future[Any] = loop.create_future()
        scope = trio.CancelScope()

        def settle(result: outcome.Outcome) -> None:
            if not future.done():
                if isinstance(result, outcome.Error):
                    future.set_exception(result.error)
                else:
                    future.set_result(result.value)

        async def job() -> None:
            result: outcome.Outcome = outcome.Error(RuntimeError("the runtime closed"))
            try:
                with scope:
                    result = await outcome.acapture(fn)
            finally:
                if isinstance(result, outcome.Error) and isinstance(result.error, trio.Cancelled):
                    result = outcome.Error(asyncio.CancelledError())
                loop.call_soon_threadsafe(settle, result)

        self._token.run_sync_soon(self._nursery.start_soon, job)
        try:
            return await future
        except asyncio.CancelledError:
            self._token.run_sync_soon(scope.cancel)
            raise

    async def run(self, graph: Any, /, **inputs: Any) -> Any:
        """Like `Runtime.run`, awaited from asyncio."""
        _check_inputs(graph, inputs)
        return await self._call(lambda: self._runtime.run(graph, **inputs))

    def stream(self, graph: Any, /, **inputs: Any) -> AsyncioResultStream:
        """Like `Runtime.stream`: ``async for name, item in rt.stream(graph, ...)``."""
        _check_inputs(graph, inputs)
        return AsyncioResultStream(self, graph, inputs)


def _check_inputs(graph: Any, inputs: dict[str, Any]) -> None:
    """Raise `InputError` in the caller's task rather than inside trio."""
    if isinstance(graph, Graph):
        graph.plan.bind(inputs)


class AsyncioResultStream:
    """`ResultStream` seen from asyncio: each item crosses over as one trio task."""

    def __init__(self, owner: AsyncioRuntime, graph: Any, inputs: dict[str, Any]):
        self._owner = owner
        self._graph = graph
        self._inputs = inputs
        self._inner: Any = None

    def __aiter__(self) -> AsyncioResultStream:
        return self

    async def __anext__(self) -> tuple[str, Any]:
        async def step() -> Any:
            if self._inner is None:
                self._inner = self._owner._runtime.stream(self._graph, **self._inputs)
            try:
                return await self._inner.__anext__()
            except StopAsyncIteration:
                return _END

        item = await self._owner._call(step)
        if item is _END:
            raise StopAsyncIteration
        return item

    async def aclose(self) -> None:
        """Stop the request if it is still running."""
        if self._inner is not None:
            await self._owner._call(self._inner.aclose)
