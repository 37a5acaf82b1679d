"""The scheduler: runs one request of a compiled `Plan` on trio.

A request owns a nursery. A step starts as soon as its inputs are ready; the task that
finishes a step runs the first newly ready consumer itself and starts a task for each other
one, so a chain of nodes costs one task in all and independent branches run concurrently.
A plan that is a plain chain runs in the caller's task with no nursery at all.

Where class nodes run in other processes (a cluster), a run of steps that each take the one
before as their only argument (`Step.chain`) is one call: the first stage's process runs it
and hands its value straight to the next stage's, and the last stage's value comes back.

A failing step records a `NodeError` on the request and cancels its nursery, so the request's
other tasks stop and the error reaches the caller alone, not in an ExceptionGroup.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

from omni.graph._plan import Plan, Step
from omni.graph._retry import retrying
from omni.graph.balance import CallInfo
from omni.graph.context import CallContext, current
from omni.graph.errors import NodeError, ReplicaLost, RouteError, StageError

__all__ = ["STREAM_BUFFER", "Emit", "run_plan"]

STREAM_BUFFER = 16  # items a stream edge holds before its producer waits (backpressure)

# Receives (output name, value or stream item). It may also have ``nowait(name, item) -> bool``,
# taking a stream item without an await when it has room (False: await it instead).
Emit = Callable[[str, Any], Awaitable[None]]


class Request:
    """The state of one request of one plan. Why a class with slots: it is created per request
    and read by every step. Invariant: `pending[s]` is the number of dependencies of step `s`
    that are not satisfied yet; a step runs exactly once, when it reaches zero."""

    __slots__ = ("edges", "emit", "error", "id", "nursery", "pending", "plan", "runtime",
                 "values")

    def __init__(self, plan: Plan, runtime: Any, request_id: str, values: list[Any],
                 emit: Emit | None):
        self.plan = plan
        self.runtime = runtime
        self.id = request_id
        self.values = values
        self.emit = emit
        self.pending = plan.initial_pending.copy()
        self.edges: list[Any] = [None] * plan.num_edges
        self.error: NodeError | None = None
        self.nursery: trio.Nursery | None = None

    def fail(self, error: NodeError) -> None:
        if self.error is None:
            self.error = error
        if self.nursery is not None:
            self.nursery.cancel_scope.cancel()


async def run_plan(plan: Plan, runtime: Any, request_id: str, values: list[Any],
                   emit: Emit | None = None) -> Any:
    """Run one request; return the plan's output (a value, or a dict of them).

    Raises:
        NodeError: a step failed (`RouteError` for an unknown switch value).
    """
    req = Request(plan, runtime, request_id, values, emit)
    if emit is not None:
        await _emit_inputs(req)
    if plan.sequential:
        done = -1  # the last slot that ran (a chain runs several at once)
        for step in plan.steps:
            if step is not None and step.slot > done:
                done = (await _advance(req, step)).slot
        return plan.outputs(values)
    async with trio.open_nursery() as nursery:
        req.nursery = nursery
        roots = plan.roots
        for slot in roots[1:]:
            nursery.start_soon(_run_from, req, slot)
        if roots:
            await _run_from(req, roots[0])
    if req.error is not None:
        raise req.error
    return plan.outputs(values)


async def _emit_inputs(req: Request) -> None:
    outputs = req.plan.output_slots
    pairs = [("output", outputs)] if isinstance(outputs, int) else outputs.items()
    for name, slot in pairs:
        if req.plan.steps[slot] is None:
            await req.emit(name, req.values[slot])


async def _run_step(req: Request, step: Step) -> Any:
    """Run one step, store its value, emit it; errors become the request's `NodeError`."""
    metrics = req.runtime.metrics if step.node is not None else None
    started = trio.current_time() if metrics is not None else 0.0  # the run's clock
    try:
        value = await _EXECUTORS[step.kind](req, step)
    except NodeError:
        raise
    except Exception as exc:
        raise NodeError(step.name, req.id, exc) from exc
    finally:
        if metrics is not None:
            metrics.node_latency(step.name, trio.current_time() - started)
    await _store(req, step, value)
    return value


async def _store(req: Request, step: Step, value: Any) -> None:
    req.values[step.slot] = value
    if step.outputs and req.emit is not None and step.kind != "stream":
        for name in step.outputs:
            await req.emit(name, value)


async def _advance(req: Request, step: Step) -> Step:
    """Run `step`, or as much of its chain as runs as one call; return the last step run."""
    if step.chain:
        return await _run_chain(req, step)
    await _run_step(req, step)
    return step


async def _run_from(req: Request, slot: int) -> None:
    steps, pending = req.plan.steps, req.pending
    while True:
        step = steps[slot]
        try:
            step = await _advance(req, step)
        except NodeError as exc:
            req.fail(exc)
            return
        after: int | None = None
        for consumer in step.consumers:
            pending[consumer] -= 1
            if pending[consumer] == 0:
                if after is None:
                    after = consumer
                else:
                    req.nursery.start_soon(_run_from, req, consumer)
        if after is None:
            return
        slot = after


# ---------------------------------------------------------------------------------------------
# Executors, one per step kind


async def _exec_call(req: Request, step: Step) -> Any:
    args, kwargs = step.build_args(req.values, req.edges)
    if not step.in_edges:
        return await _call_node(req, step, args, kwargs)
    try:
        return await _call_node(req, step, args, kwargs)
    finally:
        for edge in step.in_edges:  # tells the producer that nobody reads this edge any more
            req.edges[edge].close()


async def _exec_getitem(req: Request, step: Step) -> Any:
    (value,), _ = step.build_args(req.values, req.edges)
    return value[step.key]


async def _exec_switch(req: Request, step: Step) -> Any:
    args, kwargs = step.build_args(req.values, req.edges)
    return await _run_branch(req, _route(req, step, args[0]), args[1:], kwargs, None)


def _route(req: Request, step: Step, selector: Any) -> Plan:
    try:
        return step.branches[selector]
    except (KeyError, TypeError):
        known = ", ".join(repr(k) for k in step.branches)
        cause = LookupError(f"no branch for {selector!r} (branches: {known})")
        raise RouteError(step.name, req.id, cause) from None


async def _run_branch(req: Request, plan: Plan, args: tuple, kwargs: dict[str, Any],
                      emit: Emit | None) -> Any:
    if not kwargs and len(args) == len(plan.input_names):
        values = [*args, *([None] * (plan.num_slots - len(args)))]
    else:
        bound = plan.signature.bind(*args, **kwargs)
        values = plan.bind(bound.arguments)
    return await run_plan(plan, req.runtime, req.id, values, emit)


async def _exec_stream(req: Request, step: Step) -> list[Any] | None:
    """Run a streaming step: feed stream consumers as items come, collect if anyone needs it."""
    args, kwargs = step.build_args(req.values, req.edges)
    senders = _open_stream_edges(req, step)
    collected: list[Any] | None = [] if step.collect else None
    emit = req.emit if step.outputs else None
    produced = [0]

    async def attempt(number: int) -> None:
        async with _stream_source(req, step, args, kwargs, number) as source:
            await _deliver(source, step, senders, collected, emit, produced)

    # retried only while nothing has been produced: consumers may already have seen an item
    try:
        await retrying(step.node.options if step.node is not None else None, attempt,
                       may_retry=lambda: not produced[0])
    except ReplicaLost as exc:
        if not produced[0]:
            raise
        lost = ReplicaLost(f"{exc}, after {produced[0]} item(s) of its stream had been passed "
                           "on: not retried, a retry would produce them again")
        lost.items_passed = produced[0]
        raise lost from exc
    for send in senders:
        send.close()
    return collected


def _open_stream_edges(req: Request, step: Step) -> list[trio.MemorySendChannel]:
    senders = []
    for consumer, edge in step.stream_edges:
        send, receive = trio.open_memory_channel(STREAM_BUFFER)
        req.edges[edge] = StreamItems(receive)
        senders.append(send)
        req.pending[consumer] -= 1
        if req.pending[consumer] == 0:
            req.nursery.start_soon(_run_from, req, consumer)
    return senders


class StreamItems:
    """What a node's stream parameter iterates: the items of one stream edge, in order.

    Why not the channel itself: a channel's ``receive`` is a trip through trio's scheduler for
    every item, which for many small items costs more than the items; an item already in the
    edge's buffer is taken at once. The reader still waits (and can be cancelled) whenever the
    buffer is empty, so it yields at least once per `STREAM_BUFFER` items.
    """

    __slots__ = ("_receive",)

    def __init__(self, receive: trio.MemoryReceiveChannel) -> None:
        self._receive = receive

    def __aiter__(self) -> StreamItems:
        return self

    async def __anext__(self) -> Any:
        try:
            return self._receive.receive_nowait()
        except trio.WouldBlock:
            pass
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
        try:
            return await self._receive.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    def close(self) -> None:
        self._receive.close()

    async def aclose(self) -> None:
        await self._receive.aclose()

    def __repr__(self) -> str:
        return f"<stream items, {self._receive.statistics().current_buffer_used} buffered>"


async def _deliver(source: AsyncIterator[Any], step: Step, senders: list, collected: list | None,
                   emit: Emit | None, produced: list[int]) -> None:
    nowait = getattr(emit, "nowait", None)
    async for item in source:
        produced[0] += 1
        for send in list(senders) if senders else ():
            try:
                try:  # with room in the edge's buffer, no trip through the scheduler
                    send.send_nowait(item)
                except trio.WouldBlock:
                    await send.send(item)
            except trio.BrokenResourceError:  # that consumer returned early
                senders.remove(send)
                send.close()
        if collected is not None:
            collected.append(item)
        if emit is not None:
            for name in step.outputs:
                if nowait is None or not nowait(name, item):
                    await emit(name, item)
        if not senders and collected is None and emit is None:
            return  # nobody is listening: stop the producer


@asynccontextmanager
async def _stream_source(req: Request, step: Step, args: tuple, kwargs: dict[str, Any],
                         attempt: int) -> AsyncIterator[AsyncIterator[Any]]:
    if step.branches is not None:  # a switch whose branches stream
        async with _branch_stream(req, step, args, kwargs) as source:
            yield source
        return
    node = step.node
    if not node.options.needs_pool:
        async with _generator(req, step, node.target, None, args, kwargs) as agen:
            yield agen
        return
    pool = req.runtime.pool_for(node)
    async with pool.acquire(CallInfo(step.name, req.id, args, kwargs, attempt)) as replica:
        async with _generator(req, step, replica.instance, replica.index, args, kwargs) as agen:
            yield agen


@asynccontextmanager
async def _generator(req: Request, step: Step, body: Callable[..., Any], replica: int | None,
                     args: tuple, kwargs: dict[str, Any]) -> AsyncIterator[AsyncIterator[Any]]:
    token = current.set(CallContext(request_id=req.id, node=step.name, replica=replica,
                                    runtime=req.runtime))
    agen = body(*args, **kwargs)
    try:
        yield agen
    finally:
        try:
            await agen.aclose()
        finally:
            current.reset(token)


@asynccontextmanager
async def _branch_stream(req: Request, step: Step, args: tuple, kwargs: dict[str, Any]
                         ) -> AsyncIterator[AsyncIterator[Any]]:
    plan = _route(req, step, args[0])
    send, receive = trio.open_memory_channel(0)
    failure: list[NodeError] = []

    async def run_branch() -> None:
        async with send:
            try:
                await _run_branch(req, plan, args[1:], kwargs, lambda _, item: send.send(item))
            except NodeError as exc:
                failure.append(exc)
            except trio.BrokenResourceError:
                pass  # the reader left: nothing more to produce

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_branch)
        async with receive:
            yield receive
        nursery.cancel_scope.cancel()
    if failure:
        raise failure[0]


_EXECUTORS = {"call": _exec_call, "stream": _exec_stream, "getitem": _exec_getitem,
              "switch": _exec_switch}


# ---------------------------------------------------------------------------------------------
# Calling a node: replicas, timeouts, retries


async def _call_node(req: Request, step: Step, args: tuple, kwargs: dict[str, Any]) -> Any:
    node = step.node
    options = node.options
    if node.direct:
        token = current.set(CallContext(request_id=req.id, node=step.name, replica=None,
                                        runtime=req.runtime))  # the fast path
        try:
            if node.is_async:
                return await node.target(*args, **kwargs)
            return await _call_sync(node.target, args, kwargs, options.thread)
        finally:
            current.reset(token)
    return await retrying(options, functools.partial(_attempt, req, step, args, kwargs))


async def _attempt(req: Request, step: Step, args: tuple, kwargs: dict[str, Any],
                   attempt: int) -> Any:
    node = step.node
    if not node.options.needs_pool:
        token = current.set(CallContext(request_id=req.id, node=step.name, replica=None,
                                        runtime=req.runtime))
        try:
            return await _apply(node, node.target, args, kwargs)
        finally:
            current.reset(token)
    pool = req.runtime.pool_for(node)
    async with pool.acquire(CallInfo(step.name, req.id, args, kwargs, attempt)) as replica:
        return await _call_replica(req, step, replica, args, kwargs)


async def _call_replica(req: Request, step: Step, replica: Any, args: tuple,
                        kwargs: dict[str, Any]) -> Any:
    token = current.set(CallContext(request_id=req.id, node=step.name, replica=replica.index,
                                    runtime=req.runtime, keep=step.keep))
    try:
        return await _apply(step.node, replica.instance, args, kwargs)
    finally:
        current.reset(token)


async def _run_chain(req: Request, first: Step) -> Step:
    """Run `first` and as many steps of its chain as have a replica with room now, as one
    call where its replica can take one; the last step that ran holds the value. No stage
    holds a slot here: each queues on its replica's process, which holds calls to the node's
    concurrency (so that consecutive stages of different requests overlap, and no chain waits
    for a slot while holding another). Metrics record each stage's own time as its process
    saw it."""
    metrics = req.runtime.metrics
    started = trio.current_time() if metrics is not None else 0.0
    stages = (first, *first.chain)
    args, kwargs = first.build_args(req.values, req.edges)
    try:
        value, ran, seconds = await retrying(first.node.options, functools.partial(
            _attempt_chain, req, stages, args, kwargs))
    except StageError as exc:
        raise NodeError(stages[exc.stage].name, req.id, exc.cause) from exc.cause
    except NodeError:
        raise
    except Exception as exc:
        raise NodeError(first.name, req.id, exc) from exc
    if metrics is not None:
        total = trio.current_time() - started
        later = seconds[1:ran] if seconds else []
        metrics.node_latency(first.name, max(total - sum(later), 0.0))
        for step, took in zip(stages[1:ran], later, strict=True):
            metrics.node_latency(step.name, took)
    last = stages[ran - 1]
    await _store(req, last, value)
    return last


async def _attempt_chain(req: Request, stages: tuple[Step, ...], args: tuple,
                         kwargs: dict[str, Any], attempt: int
                         ) -> tuple[Any, int, list[float] | None]:
    """One attempt of a chain: (the last stage's value, the stages that ran, each stage's
    seconds where the chain ran as one call)."""
    first = stages[0]
    pool = req.runtime.pool_for(first.node)
    if getattr(pool.replicas[0].instance, "omni_chain", None) is None:  # replicas here
        return await _attempt(req, first, args, kwargs, attempt), 1, None
    replica = await pool.queue_on(CallInfo(first.name, req.id, args, kwargs, attempt))
    queued = [(pool, replica)]
    failed = True
    try:
        for step in stages[1:]:
            step_pool = req.runtime.pool_for(step.node)
            other = step_pool.queue_now(CallInfo(step.name, req.id, (), {}, attempt))
            if other is None:
                break
            queued.append((step_pool, other))
        if len(queued) > 1:
            value, seconds = await replica.instance.omni_chain(
                req.id, args, kwargs, [r.instance for _, r in queued[1:]],
                keep=stages[len(queued) - 1].keep)
            result = value, len(queued), seconds
        else:
            result = await _call_replica(req, first, replica, args, kwargs), 1, None
        failed = False
        return result
    finally:
        for stage_pool, stage_replica in queued:
            stage_pool.leave_queue(stage_replica, failed=failed)


async def _apply(node: Any, body: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    if node.is_async or getattr(body, "omni_remote", False):  # a replica on a cluster worker
        return await body(*args, **kwargs)
    return await _call_sync(body, args, kwargs, node.options.thread)


async def _call_sync(body: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
                     thread: bool) -> Any:
    if thread:
        # Not abandoned on cancel: a thread cannot be interrupted, and its replica slot stays
        # taken until it returns, so a timeout is reported once the body has finished.
        return await trio.to_thread.run_sync(functools.partial(body, *args, **kwargs))
    return body(*args, **kwargs)
