"""Prometheus metrics of a runtime: ``omni.Runtime(metrics_port=P)`` and ``omni run
--metrics-port P`` serve them at ``http://127.0.0.1:P/metrics``; `Metrics.asgi_app()` is the
same endpoint for an HTTP server to mount.

What is counted where it happens: requests by graph and outcome, and each node's latency (a
histogram, observed by the scheduler). What is read when scraped: replicas' calls in flight and
done, and the KV store's pages, hits, misses, evictions, promotions and demotions per tier, and
the bytes fetched from peers per mover locality. Built on ``prometheus_client`` (one registry
per `Metrics`, so that several runtimes in a process keep their own counts) and served by
hypercorn's trio worker, bound to loopback unless told otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import hypercorn.config
import hypercorn.trio
import trio
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.asgi import make_asgi_app
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["LATENCY_BUCKETS", "Metrics", "serve_metrics"]

log = logging.getLogger("omni.metrics")

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0, 30.0)
GRACEFUL_TIMEOUT_S = 1.0  # a scrape takes milliseconds: the runtime's exit need not wait longer

Sample = tuple[str, str, str, dict[str, Any], float]  # (name, "gauge"|"counter", help, labels, v)
_FAMILIES = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}


class Metrics:
    """The metrics a runtime keeps, in a registry of their own.

    Args:
        collect: called at each scrape; returns the values read then as (name, kind, help,
            labels, value) tuples, kind "gauge" or "counter" (a counter's name ends in
            ``_total``): what the runtime reads from its pools and KV store.

    Attributes:
        registry: the `prometheus_client.CollectorRegistry` holding them all (never the
            process-wide default one).
    """

    def __init__(self, collect: Callable[[], list[Sample]] | None = None):
        self.registry = CollectorRegistry(auto_describe=False)
        self._requests = Counter("omni_requests", "Requests finished, by outcome.",
                                 ["graph", "outcome"], registry=None)
        self._latency = Histogram(
            "omni_node_latency_seconds",
            "Wall time of one node call (queueing for a replica included).",
            ["node"], buckets=LATENCY_BUCKETS, registry=None)
        self._latency_of: dict[str, Any] = {}  # node -> its histogram child (the hot path)
        self.registry.register(_WithoutCreated(self._requests, self._latency))
        if collect is not None:
            self.registry.register(_ReadAtScrape(collect))

    def request_done(self, graph: str, outcome: str) -> None:
        """Count one finished request of `graph` ("ok" or "failed")."""
        self._requests.labels(graph, outcome).inc()

    def node_latency(self, node: str, seconds: float) -> None:
        """Observe one call of `node` that took `seconds`."""
        child = self._latency_of.get(node)
        if child is None:
            child = self._latency_of[node] = self._latency.labels(node)
        child.observe(seconds)

    def render(self) -> str:
        """All metrics in Prometheus' text format (0.0.4)."""
        return generate_latest(self.registry).decode()

    def asgi_app(self) -> Callable[..., Awaitable[None]]:
        """An ASGI app answering HTTP requests with these metrics (prometheus_client's: it
        serves whatever path it is mounted at, in the format the scraper's Accept asks for)."""
        return make_asgi_app(registry=self.registry)


class _WithoutCreated(Collector):
    """The counted metrics, less prometheus_client's ``*_created`` series: why: those are a
    start timestamp per label set that Omni's scrape never had; without them it keeps
    exactly the series, names and labels it always had."""

    def __init__(self, *metrics: Counter | Histogram) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        for metric in self._metrics:
            for family in metric.collect():  # built afresh on each call: ours to trim
                family.samples = [s for s in family.samples
                                  if s.name != family.name + "_created"]
                yield family


class _ReadAtScrape(Collector):
    """The values read when scraped, grouped into one family per name: why: the runtime
    lists samples as it walks its pools and tiers (a name's samples need not be adjacent),
    while the exposition format wants each family's samples together."""

    def __init__(self, collect: Callable[[], list[Sample]]) -> None:
        self._collect = collect

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for name, kind, help_, labels, value in self._collect():
            family = families.get(name)
            if family is None:
                family = families[name] = _FAMILIES[kind](name, help_, labels=list(labels))
            family.add_metric([str(v) for v in labels.values()], value)
        yield from families.values()


async def serve_metrics(metrics: Metrics, port: int, *, host: str = "127.0.0.1",
                        shutdown_trigger: Callable[[], Awaitable[Any]] | None = None,
                        task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``GET /metrics`` (404 elsewhere) until `shutdown_trigger()` returns or this is
    cancelled; `task_status.started((host, port))` once bound (port 0: one the OS chose).

    Raises:
        OSError: the port cannot be bound (in use, not allowed).
    """
    config = hypercorn.config.Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.errorlog = logging.getLogger("omni.metrics.http")
    config.graceful_timeout = GRACEFUL_TIMEOUT_S
    app = _metrics_only(metrics.asgi_app())
    reporter = _BoundReporter(task_status)
    try:
        await hypercorn.trio.serve(app, config, task_status=reporter,
                                   shutdown_trigger=shutdown_trigger or trio.sleep_forever)
    except BaseExceptionGroup as group:  # hypercorn binds inside its nurseries
        if reporter.bound is not None:
            raise
        raise _lone(group, OSError) or group from None


class _BoundReporter:
    """Stands for the caller's task status before hypercorn: why: hypercorn reports the
    addresses it bound as URLs, the caller wants ``(host, port)``, and an error before that
    report is a bind error, to raise as the OSError it is rather than in hypercorn's groups."""

    def __init__(self, task_status: Any) -> None:
        self._task_status = task_status
        self.bound: tuple[str, int] | None = None

    def started(self, binds: list[str]) -> None:
        where = urlsplit(binds[0])
        self.bound = (where.hostname or "", where.port or 0)
        log.info("metrics at http://%s:%d/metrics", *self.bound)
        self._task_status.started(self.bound)


def _lone(group: BaseExceptionGroup, kind: type[BaseException]) -> BaseException | None:
    """The one exception of `kind` a (nested) group holds alone, else None."""
    while isinstance(group, BaseExceptionGroup) and len(group.exceptions) == 1:
        group = group.exceptions[0]
    return group if isinstance(group, kind) else None


def _metrics_only(metrics_app: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    """The ASGI app `serve_metrics` serves: `metrics_app` at /metrics, 404 elsewhere, and the
    lifespan protocol answered (hypercorn asks for it)."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
        elif scope["type"] == "http" and scope["path"] == "/metrics":
            await metrics_app(scope, receive, send)
        elif scope["type"] == "http":
            await send({"type": "http.response.start", "status": 404,
                        "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"try GET /metrics\n"})
        else:  # a websocket: refused
            await send({"type": "websocket.close"})

    return app
