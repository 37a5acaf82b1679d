"""`omni.Runtime`: deploys replicas, runs requests, streams their outputs (trio)."""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import trio

from omni.graph._outbox import Outbox
from omni.graph._plan import Plan
from omni.graph.balance import Pool, PoolStats
from omni.graph.context import CallContext
from omni.graph.dsl import Graph, Node, NodeClass
from omni.graph.errors import NodeError, lost_midway
from omni.graph.hosting import host_replica
from omni.graph.progress import Progress
from omni.graph.scheduler import run_plan

__all__ = ["ResultStream", "Runtime", "RuntimeStats"]


@dataclass(frozen=True, slots=True)
class RuntimeStats:
    """A snapshot of a runtime: request counts and every pool's replicas."""

    requests_started: int
    requests_completed: int
    requests_failed: int
    requests_in_flight: int
    pools: tuple[PoolStats, ...]


class Runtime:
    """Runs graphs. ``async with omni.Runtime() as rt: await rt.run(graph, **inputs)``.

    Args:
        graphs: graphs (or nodes) whose replicas are built when the runtime starts; a graph
            that is not listed is deployed on its first request.
        kv: the process's KV store, reachable from nodes as ``omni.context().kv``: a
            `omni.kv.KVStore` (yours to close), or an `omni.kv.KVConfig` or `KVLayout` from
            which the runtime builds one when it starts and closes it when it stops. With a
            placement, only a store is used here: a config or layout is the placement's.
        placement: where class nodes' replicas live when not in this process: an object
            with ``async run(task_status=...)`` (started with the runtime), ``stop()`` and
            ``async deploy(node) -> Pool``. ``omni.Runtime(cluster=...)`` passes the cluster's
            (`omni.cluster.ClusterLink`); function nodes still run here.
        metrics_port: serve Prometheus metrics at ``http://127.0.0.1:PORT/metrics`` while
            the runtime runs (0: a free port; see `metrics_address`). See `omni.graph.metrics`.
        metrics_host: the interface to serve metrics on.
        metrics: keep the metrics (`Runtime.metrics`, whose ``asgi_app()`` an HTTP server can
            mount) without serving them on a port of their own; implied by `metrics_port`.

    Class nodes get one instance per replica, built in the runtime (``__init__`` sees
    ``omni.context().replica``). An instance that is an async context manager is entered
    when it is built and exited when the runtime closes.
    """

    def __init__(self, *, graphs: tuple[Any, ...] | list[Any] = (), kv: Any = None,
                 placement: Any = None, metrics_port: int | None = None,
                 metrics_host: str = "127.0.0.1", metrics: bool = False):
        self.kv: Any = None
        self.progress = Progress()  # the steps node calls report (`note_progress`)
        self.metrics: Any = None
        self.metrics_address: tuple[str, int] | None = None
        self._metrics_at = (metrics_host, metrics_port)
        self._keep_metrics = metrics or metrics_port is not None
        self._kv_spec = kv
        self.cluster = placement  # named for what it is today: the cluster's placement
        if placement is not None:
            self._kv_spec = kv if hasattr(kv, "acquire") else None  # workers hold the pages
        self._owns_kv = False
        self._node_graphs: dict[int, Graph] = {}
        self._initial = [self._graph_of(g) for g in graphs]
        self._pools: dict[Any, Pool] = {}
        self._deployed: set[int] = set()
        self._deploy_lock = trio.Lock()
        self._ids = itertools.count(1)
        self._started = self._completed = self._failed = 0
        self._closing = trio.Event()
        self._hosts: trio.Nursery | None = None
        self._requests: trio.Nursery | None = None
        self._host_cm: Any = None
        self._request_cm: Any = None

    # -- lifecycle --------------------------------------------------------------------------

    async def __aenter__(self) -> Runtime:
        self.kv, self._owns_kv = _open_kv(self._kv_spec)
        self._host_cm = trio.open_nursery()
        self._hosts = await self._host_cm.__aenter__()
        self._request_cm = trio.open_nursery()
        self._requests = await self._request_cm.__aenter__()
        try:
            if self._keep_metrics:
                await self._start_metrics(*self._metrics_at)
            if self.cluster is not None:
                await self._hosts.start(self.cluster.run)
            for g in self._initial:
                await self.deploy(g)
        except BaseException as exc:
            await self.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self._requests.cancel_scope.cancel()
        try:
            # Raises when a scope around the runtime is cancelled too (Ctrl-C in `omni run`):
            # the requests' Cancelled belongs to it. The hosts' nursery must still be closed.
            await self._request_cm.__aexit__(None, None, None)
        finally:
            self._closing.set()  # the metrics server, if any, shuts down on it
            if self.cluster is not None:
                self.cluster.stop()
            try:
                await self._host_cm.__aexit__(None, None, None)
            finally:
                if self._owns_kv:
                    self.kv.close()

    async def _start_metrics(self, host: str, port: int | None) -> None:
        from omni.graph.metrics import Metrics, serve_metrics

        self.metrics = Metrics(self._collect_metrics)
        if port is None:
            return
        self.metrics_address = await self._hosts.start(functools.partial(
            serve_metrics, self.metrics, port, host=host, shutdown_trigger=self._closing.wait))

    def _collect_metrics(self) -> list[tuple[str, str, str, dict, float]]:
        """What a scrape reads now: replicas' calls, the KV store's tiers and peer bytes."""
        out: list[tuple[str, str, str, dict, float]] = []
        for pool in self._pools.values():
            for r in pool.replicas:
                labels = {"node": pool.name, "replica": r.index, "worker": r.member or ""}
                out.append(("omni_replica_in_flight", "gauge", "Calls running on a replica.",
                            labels, r.in_flight))
                out.append(("omni_replica_calls_total", "counter",
                            "Calls a replica finished, by outcome.",
                            {**labels, "outcome": "ok"}, r.completed))
                out.append(("omni_replica_calls_total", "counter",
                            "Calls a replica finished, by outcome.",
                            {**labels, "outcome": "failed"}, r.failed))
        if self.kv is not None:
            out.extend(_kv_samples(self.kv))
        out.extend(self.progress.samples())
        return out

    def note_progress(self, node: str, request_id: str | None, done: int, total: int) -> None:
        """A node call's steps (`omni.Context.progress`): see `omni.graph.progress`."""
        self.progress.note(node, request_id, done, total)

    # -- deployment -------------------------------------------------------------------------

    def _graph_of(self, target: Any) -> Graph:
        if isinstance(target, Graph):
            return target
        if not isinstance(target, (Node, NodeClass)):
            raise TypeError(f"expected a graph or a node, got {target!r}")
        key = id(target)
        if key not in self._node_graphs:
            self._node_graphs[key] = Graph.of(target)
        return self._node_graphs[key]

    async def deploy(self, target: Any) -> None:
        """Build the replicas a graph needs (done for you on a graph's first request)."""
        plan = self._graph_of(target).plan
        if id(plan) in self._deployed:
            return
        if self._hosts is None:
            raise RuntimeError("the Runtime is not started: use 'async with omni.Runtime() as rt'")
        async with self._deploy_lock:
            for node in plan.nodes:
                if node.options.needs_pool and node.deployment_key not in self._pools:
                    self._pools[node.deployment_key] = await self._build_pool(node)
            self._deployed.add(id(plan))

    async def _build_pool(self, node: Node) -> Pool:
        if self.cluster is not None and node.kind == "class":
            return await self.cluster.deploy(node)
        instances = []
        for index in range(node.options.replicas):
            instances.append(await self._hosts.start(self._host, node, index))
        options = node.options
        return Pool(node.name, instances, balancer=options.balance,
                    concurrency=options.concurrency, max_queue=options.max_queue)

    async def _host(self, node: Node, index: int, task_status: Any = trio.TASK_STATUS_IGNORED
                    ) -> None:
        """Owns one replica's instance for the runtime's lifetime."""
        if node.kind != "class":
            task_status.started(node.target)
            return
        build = functools.partial(node.target, *node.init_args, **node.init_kwargs)
        context = CallContext(request_id=None, node=node.name, replica=index, runtime=self)
        await host_replica(build, context, self._closing,
                           wrap_error=functools.partial(NodeError, node.name, "startup"),
                           task_status=task_status)

    def pool_for(self, node: Node) -> Pool:
        return self._pools[node.deployment_key]

    # -- requests ---------------------------------------------------------------------------

    def _prepare(self, target: Any, inputs: dict[str, Any]) -> tuple[Plan, list[Any], str]:
        if self._requests is None:
            raise RuntimeError("the Runtime is not started: use 'async with omni.Runtime() as rt'")
        plan = target.plan if isinstance(target, Graph) else self._graph_of(target).plan
        values = plan.bind(inputs)
        self._started += 1
        return plan, values, f"req-{next(self._ids)}"

    async def run(self, graph: Any, /, **inputs: Any) -> Any:
        """Run one request and return its output (a value, or a dict for dict-returning graphs).

        Streaming outputs arrive as lists. Raises `InputError` for unknown or missing inputs,
        `NodeError` (or `RouteError`) when a node fails.

        A request that failed because a worker went away while a node's stream on it had
        passed items on (`ReplicaLost`, which the call itself may not retry) is run once more
        from the start: nothing of it has reached the caller, who gets one answer. Its
        function nodes then run twice (as a lost call's node does when it is retried).
        """
        plan, values, request_id = self._prepare(graph, inputs)
        try:
            if id(plan) not in self._deployed:
                await self.deploy(graph)
            try:
                result = await run_plan(plan, self, request_id, values)
            except NodeError as exc:
                if not _rerunnable(exc, inputs):
                    raise
                result = await run_plan(plan, self, f"{request_id}-again", plan.bind(inputs))
        except BaseException:
            self._count(graph, "failed")
            raise
        finally:
            self.progress.forget(request_id)
        self._count(graph, "ok")
        return result

    def _count(self, graph: Any, outcome: str) -> None:
        if outcome == "ok":
            self._completed += 1
        else:
            self._failed += 1
        if self.metrics is not None:
            self.metrics.request_done(getattr(graph, "name", "?"), outcome)

    def stream(self, graph: Any, /, **inputs: Any) -> ResultStream:
        """Run one request; iterate ``(output_name, item)`` as outputs are produced.

        Non-streaming outputs arrive once, streaming ones item by item. Use it as ``async for
        name, item in rt.stream(...)``, or inside ``async with`` to stop the request early.
        """
        plan, values, request_id = self._prepare(graph, inputs)
        return ResultStream(self, graph, plan, values, request_id)

    def stats(self) -> RuntimeStats:
        in_flight = self._started - self._completed - self._failed
        return RuntimeStats(self._started, self._completed, self._failed, in_flight,
                            tuple(p.stats() for p in self._pools.values()))

    def __repr__(self) -> str:
        s = self.stats()
        return (f"<Runtime requests={s.requests_completed}/{s.requests_started} "
                f"failed={s.requests_failed} pools={len(s.pools)}>")


_KV_COUNTERS = {"hits": "Lookups that found a page in this tier.",
                "misses": "Lookups that found no page.",
                "evictions": "Pages evicted from this tier.",
                "promotions": "Pages moved up into this tier.",
                "demotions": "Pages moved down out of this tier.",
                "corrupt": "Pages dropped because their checksum failed."}


def _kv_samples(store: Any) -> list[tuple[str, str, str, dict, float]]:
    out: list[tuple[str, str, str, dict, float]] = []
    stats = store.stats()
    for tier, counters in stats.items():
        if tier in ("leases", "peers"):
            continue
        out.append(("omni_kv_pages", "gauge", "Pages held per tier.", {"tier": tier},
                    counters["pages"]))
        out.append(("omni_kv_capacity_pages", "gauge", "Pages a tier can hold.",
                    {"tier": tier}, counters["capacity"]))
        for name, help_ in _KV_COUNTERS.items():
            out.append((f"omni_kv_{name}_total", "counter", help_, {"tier": tier},
                        counters.get(name, 0)))
    leases = stats.get("leases", {})
    out.append(("omni_kv_pinned_pages", "gauge", "Pages pinned by leases.", {},
                leases.get("pinned_pages", 0)))
    peers = getattr(store, "peers", None)
    if peers is not None and hasattr(peers, "stats"):
        for locality, counts in peers.stats().get("by_locality", {}).items():
            out.append(("omni_kv_peer_bytes_total", "counter",
                        "KV bytes fetched from peers, by mover locality.",
                        {"locality": locality}, counts.get("bytes", 0)))
    return out


def _open_kv(spec: Any) -> tuple[Any, bool]:
    """The store a runtime serves with, and whether the runtime owns (closes) it."""
    if spec is None or hasattr(spec, "acquire"):
        return spec, False
    from omni.kv import KVConfig, KVLayout, KVStore  # the KV layer needs torch: load it lazily

    if isinstance(spec, KVLayout):
        return KVStore(spec), True
    if isinstance(spec, KVConfig):
        return spec.build(), True
    raise TypeError(f"kv must be a KVStore, a KVConfig or a KVLayout, got {spec!r}")


_RESULT_BUFFER = 256  # items a ResultStream holds before the request waits for its reader


class _Emitter:
    """What the scheduler hands a request's outputs to: into the stream's outbox, without an
    await while there is room (`nowait`, see `omni.graph.scheduler.Emit`)."""

    __slots__ = ("_outbox",)

    def __init__(self, outbox: Outbox) -> None:
        self._outbox = outbox

    async def __call__(self, name: str, item: Any) -> None:
        await self._outbox.put((name, item))

    def nowait(self, name: str, item: Any) -> bool:
        return self._outbox.put_nowait((name, item))


class ResultStream:
    """The outputs of one request as they are produced: ``(output_name, item)`` pairs."""

    def __init__(self, runtime: Runtime, graph: Any, plan: Plan, values: list[Any],
                 request_id: str):
        self.request_id = request_id
        self._runtime = runtime
        self._graph = graph
        self._plan = plan
        self._values = values
        self._outbox: Outbox | None = None
        self._scope = trio.CancelScope()
        self._error: BaseException | None = None
        self._done = trio.Event()  # the request has ended: its nodes and leases are gone

    def _start(self) -> Outbox:
        self._outbox = Outbox(_RESULT_BUFFER)
        self._runtime._requests.start_soon(self._produce, self._outbox)
        return self._outbox

    async def _produce(self, outbox: Outbox) -> None:
        try:
            await self._produce_into(outbox)
        finally:
            outbox.close()
            self._done.set()

    async def _produce_into(self, outbox: Outbox) -> None:
        rt = self._runtime
        with self._scope:
            try:
                if id(self._plan) not in rt._deployed:
                    await rt.deploy(self._graph)
                await run_plan(self._plan, rt, self.request_id, self._values,
                               _Emitter(outbox))
            except (NodeError, trio.BrokenResourceError) as exc:
                self._error = exc
                rt._count(self._graph, "failed")
                return
            except BaseException:
                rt._count(self._graph, "failed")
                raise
            finally:
                rt.progress.forget(self.request_id)
            rt._count(self._graph, "ok")

    def __aiter__(self) -> AsyncIterator[tuple[str, Any]]:
        return self

    async def __anext__(self) -> tuple[str, Any]:
        outbox = self._outbox or self._start()
        try:
            return await outbox.get()
        except trio.EndOfChannel:
            if isinstance(self._error, NodeError):
                raise self._error from None
            raise StopAsyncIteration from None

    async def batches(self) -> AsyncIterator[list[tuple[str, Any]]]:
        """The same ``(output_name, item)`` pairs, in lists of those that have arrived: for a
        reader of many small items, one await per list instead of one per item."""
        outbox = self._outbox or self._start()
        while True:
            try:
                yield await outbox.get_all()
            except trio.EndOfChannel:
                if isinstance(self._error, NodeError):
                    raise self._error from None
                return

    async def aclose(self) -> None:
        """Stop the request (cancelling its nodes) if it is still running, and wait until it
        has ended. Why wait: once this returns, its nodes are done and every KV lease they
        held is released (a caller may discard or reuse those pages at once)."""
        self._scope.cancel()
        if self._outbox is not None:
            self._outbox.abandon()
            with trio.CancelScope(shield=True):  # cancelled nodes end promptly
                await self._done.wait()

    async def __aenter__(self) -> ResultStream:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()

    def __del__(self) -> None:
        # An abandoned iterator (a `break` without `async with`) must not leave its request
        # blocked on a send forever: cancel it. GC runs this in the trio thread.
        with contextlib.suppress(Exception):  # interpreter shutdown
            self._scope.cancel()


def _rerunnable(exc: NodeError, inputs: dict[str, Any]) -> bool:
    """Whether a request that failed with `exc` may run again: it was lost midway
    (`lost_midway`), and no input is a stream (one that was read cannot be read again)."""
    return lost_midway(exc) and not any(hasattr(v, "__aiter__") for v in inputs.values())
