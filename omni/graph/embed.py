"""Running graphs from outside trio: `run` (synchronous) and `AsyncioRuntime` (asyncio).

`AsyncioRuntime` starts trio as a guest of the running asyncio loop (trio's guest mode): both
run in one thread, trio's scheduler driven by asyncio callbacks. Each call crosses over by
scheduling a trio task through the trio token and resolving an asyncio future when it ends.
Cancelling the asyncio side cancels the trio task and waits for it to finish, so a node's
cleanup has run by the time the asyncio caller sees its `CancelledError`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import outcome
import trio

from omni.graph.dsl import Graph
from omni.graph.runtime import Runtime, RuntimeStats

__all__ = ["AsyncioResultStream", "AsyncioRuntime", "run"]

_END = object()
_CLOSED = "the AsyncioRuntime is closed"
_CLOSED_DURING_CALL = "the AsyncioRuntime closed while this call was running"

State = Literal["new", "starting", "running", "closing", "closed"]


def run(graph: Any, /, **inputs: Any) -> Any:
    """Run one request synchronously (starts and stops a `Runtime` around it).

    `graph` is a graph or a node. For many requests, open one `Runtime` instead: it keeps
    replicas alive between requests.

    Raises:
        InputError: unknown or missing inputs; NodeError: a node failed.
    """
    target = graph if isinstance(graph, Graph) else Graph.of(graph)
    target.plan.bind(inputs)  # an InputError needs no event loop

    async def main() -> Any:
        async with Runtime(graphs=[target]) as rt:
            return await rt.run(target, **inputs)

    return trio.run(main)


class AsyncioRuntime:
    """`Runtime`'s interface for asyncio applications.

    ``async with omni.AsyncioRuntime() as rt: await rt.run(graph, **inputs)``, or
    ``async for name, item in rt.stream(graph, **inputs)``. Options are `Runtime`'s. One per
    asyncio loop at a time (trio allows one guest run per thread), and each is started once.
    Leaving ``async with`` stops trio and waits for its run to end; calls still running then
    fail with `RuntimeError`.
    """

    runtime_class: Any = Runtime  # what it runs: `omni.AsyncioRuntime` runs `omni.Runtime`

    def __init__(self, **options: Any):
        self._options = options
        self._state: State = "new"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._runtime: Runtime | None = None
        self._stop = trio.Event()
        self._startup_scope = trio.CancelScope()
        self._done: asyncio.Future[outcome.Outcome] | None = None

    # -- lifecycle --------------------------------------------------------------------------

    async def __aenter__(self) -> AsyncioRuntime:
        if self._state != "new":
            raise RuntimeError("an AsyncioRuntime can be started only once; make a new one")
        if trio.lowlevel.in_trio_run():
            raise RuntimeError("trio already runs in this thread: one AsyncioRuntime per event "
                               "loop at a time, and none inside trio")
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._done = loop.create_future()
        started: asyncio.Future[None] = loop.create_future()
        trio.lowlevel.start_guest_run(
            self._trio_main, started,
            run_sync_soon_threadsafe=loop.call_soon_threadsafe,
            run_sync_soon_not_threadsafe=loop.call_soon,
            done_callback=self._on_done,
            host_uses_signal_set_wakeup_fd=True,
        )
        self._state = "starting"
        try:
            await asyncio.wait([started, self._done], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # given up on: stop trio, and let it end first
            self._run_in_trio(self._startup_scope.cancel)
            self._run_in_trio(self._stop.set)
            await self._wait_done()
            raise
        if not started.done():
            self._done.result().unwrap()  # startup failed: raise why
            raise RuntimeError("the trio guest run ended before the runtime started")
        self._state = "running"
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self._state = "closing"
        self._run_in_trio(self._stop.set)
        await self._wait_done()  # the host loop must keep running until trio's done callback
        self._done.result().unwrap()

    async def _trio_main(self, started: asyncio.Future[None]) -> None:
        self._token = trio.lowlevel.current_trio_token()
        with self._startup_scope:  # cancelled only when the asyncio side abandons the start
            async with self.runtime_class(**self._options) as rt, \
                    trio.open_nursery() as nursery:
                self._runtime = rt
                self._nursery = nursery
                started.set_result(None)
                await self._stop.wait()
                nursery.cancel_scope.cancel()

    def _on_done(self, result: outcome.Outcome) -> None:
        self._state = "closed"
        self._nursery = None
        if not self._done.done():
            self._done.set_result(result)

    def _run_in_trio(self, fn: Callable[[], object]) -> None:
        """Run `fn` in trio soon; nothing to do once the trio run has ended."""
        if self._token is None:  # trio has not run a step yet: it will see the change
            fn()
            return
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(fn)

    async def _wait_done(self) -> None:
        """Wait for trio's done callback, even through cancellation (re-raised after)."""
        cancelled = False
        while not self._done.done():
            try:
                await asyncio.shield(self._done)
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError

    # -- calls ------------------------------------------------------------------------------

    @property
    def runtime(self) -> Runtime:
        """The trio `Runtime` inside. Its synchronous methods (`stats()`) may be called from
        asyncio (same thread); await its coroutines only from trio code."""
        if self._runtime is None:
            raise RuntimeError("the AsyncioRuntime is not started: use 'async with'")
        return self._runtime

    def stats(self) -> RuntimeStats:
        """The inner runtime's `RuntimeStats` (safe from asyncio: trio runs in this thread)."""
        return self.runtime.stats()

    def _check_running(self) -> tuple[Runtime, trio.Nursery]:
        if self._state in ("closing", "closed"):
            raise RuntimeError(_CLOSED)
        if self._state != "running" or self._nursery is None or self._runtime is None:
            raise RuntimeError("the AsyncioRuntime is not started: use 'async with'")
        return self._runtime, self._nursery

    async def _call(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        """Run `fn` as a trio task and wait for it from asyncio. Cancelling the asyncio side
        cancels the trio task and waits until it has ended."""
        _, nursery = self._check_running()
        loop = self._loop
        future: asyncio.Future[Any] = loop.create_future()  # the call's outcome
        finished: asyncio.Future[None] = loop.create_future()  # the trio task has ended
        scope = trio.CancelScope()

        async def job() -> None:
            result: outcome.Outcome = outcome.Error(RuntimeError(_CLOSED_DURING_CALL))
            try:
                with scope:
                    result = await _capture(fn)
            finally:
                loop.call_soon_threadsafe(_settle, future, finished, result)

        def spawn() -> None:
            try:
                nursery.start_soon(job)
            except RuntimeError:  # the nursery closed meanwhile: the runtime is closing
                _settle(future, finished, outcome.Error(RuntimeError(_CLOSED)))

        try:
            self._token.run_sync_soon(spawn)
        except trio.RunFinishedError:
            raise RuntimeError(_CLOSED) from None
        try:
            return await future
        except asyncio.CancelledError:
            if not finished.done():
                self._run_in_trio(scope.cancel)
                try:
                    await asyncio.shield(finished)
                except asyncio.CancelledError:
                    pass  # cancelled again: stop waiting for trio's cleanup
            raise

    async def run(self, graph: Any, /, **inputs: Any) -> Any:
        """Like `Runtime.run`, awaited from asyncio.

        Raises:
            InputError: unknown or missing inputs (before anything runs in trio).
            NodeError: a node failed. RuntimeError: the AsyncioRuntime is not running.
        """
        runtime, _ = self._check_running()
        _check_inputs(runtime, graph, inputs)
        return await self._call(lambda: runtime.run(graph, **inputs))

    def stream(self, graph: Any, /, **inputs: Any) -> AsyncioResultStream:
        """Like `Runtime.stream`: ``async for name, item in rt.stream(graph, ...)``; use it in
        ``async with`` to stop the request when leaving early.

        Raises:
            InputError: unknown or missing inputs, here rather than on the first item.
        """
        runtime, _ = self._check_running()
        _check_inputs(runtime, graph, inputs)
        return AsyncioResultStream(self, graph, inputs)

    def __repr__(self) -> str:
        inner = f" {self._runtime!r}" if self._runtime is not None else ""
        return f"<AsyncioRuntime {self._state}{inner}>"


def _check_inputs(runtime: Runtime, graph: Any, inputs: dict[str, Any]) -> None:
    """Raise `InputError` (or `TypeError` for a target that is no graph) in the caller's
    asyncio task rather than inside trio. `_graph_of` is synchronous and cached per node."""
    runtime._graph_of(graph).plan.bind(inputs)


async def _capture(fn: Callable[[], Awaitable[Any]]) -> outcome.Outcome:
    """`fn`'s outcome; trio cancellation is not captured but raised, for its scope to catch."""
    try:
        return outcome.Value(await fn())
    except BaseException as exc:
        if isinstance(exc, trio.Cancelled) or (
                isinstance(exc, BaseExceptionGroup) and exc.split(trio.Cancelled)[1] is None):
            raise
        return outcome.Error(exc)


def _settle(future: asyncio.Future[Any], finished: asyncio.Future[None],
            result: outcome.Outcome) -> None:
    if not future.done():  # a cancelled caller's future is done already
        if isinstance(result, outcome.Error):
            future.set_exception(result.error)
        else:
            future.set_result(result.value)
    if not finished.done():
        finished.set_result(None)


class AsyncioResultStream:
    """`ResultStream` seen from asyncio: each item crosses over as one trio task."""

    def __init__(self, owner: AsyncioRuntime, graph: Any, inputs: dict[str, Any]):
        self._owner = owner
        self._graph = graph
        self._inputs = inputs
        self._inner: Any = None
        self._closed = False

    def __aiter__(self) -> AsyncioResultStream:
        return self

    async def __anext__(self) -> tuple[str, Any]:
        if self._closed:
            raise StopAsyncIteration

        async def step() -> Any:
            if self._inner is None:
                self._inner = self._owner.runtime.stream(self._graph, **self._inputs)
            try:
                return await self._inner.__anext__()
            except StopAsyncIteration:
                return _END

        item = await self._owner._call(step)
        if item is _END:
            self._closed = True
            raise StopAsyncIteration
        return item

    async def aclose(self) -> None:
        """Stop the request if it is still running; iteration ends."""
        if self._closed:
            return
        self._closed = True
        if self._inner is not None and self._owner._state == "running":
            await self._owner._call(self._inner.aclose)

    async def __aenter__(self) -> AsyncioResultStream:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()
