"""Prometheus metrics of a runtime: ``omni.Runtime(metrics_port=P)`` and ``omni run
--metrics-port P`` serve them at ``http://127.0.0.1:P/metrics``.

What is counted where it happens: requests by graph and outcome, and each node's latency (a
histogram, observed by the scheduler). What is read when scraped: replicas' calls in flight and
done, and the KV store's pages, hits, misses, evictions, promotions and demotions per tier, and
the bytes fetched from peers per mover locality. The text format is Prometheus' exposition
format 0.0.4; the server is a small trio HTTP/1.1 responder (one request per connection),
bound to loopback unless told otherwise.
"""

from __future__ import annotations

import bisect
import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import trio

__all__ = ["LATENCY_BUCKETS", "Metrics", "serve_metrics"]

log = logging.getLogger("omni.metrics")

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0, 30.0)
MAX_REQUEST_BYTES = 8192
READ_TIMEOUT_S = 5.0


class _Histogram:
    __slots__ = ("buckets", "count", "sum")

    def __init__(self) -> None:
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.count += 1
        self.sum += seconds


class Metrics:
    """The counters a runtime keeps, and their rendering.

    Args:
        collect: called at each scrape; returns extra samples as (name, type, help, labels,
            value) tuples (what the runtime reads from its pools and KV store).
    """

    def __init__(self, collect: Callable[[], list[tuple[str, str, str, dict, float]]]
                 | None = None):
        self._requests: dict[tuple[str, str], int] = defaultdict(int)
        self._latency: dict[str, _Histogram] = defaultdict(_Histogram)
        self._collect = collect

    def request_done(self, graph: str, outcome: str) -> None:
        self._requests[(graph, outcome)] += 1

    def node_latency(self, node: str, seconds: float) -> None:
        self._latency[node].observe(seconds)

    def render(self) -> str:
        """All metrics in Prometheus' text format."""
        lines: list[str] = []
        _header(lines, "omni_requests_total", "counter", "Requests finished, by outcome.")
        for (graph, outcome), n in sorted(self._requests.items()):
            lines.append(f"omni_requests_total{_labels(graph=graph, outcome=outcome)} {n}")
        _header(lines, "omni_node_latency_seconds", "histogram",
                "Wall time of one node call (queueing for a replica included).")
        for node, h in sorted(self._latency.items()):
            cumulative = 0
            for bound, n in zip((*LATENCY_BUCKETS, float("inf")), h.buckets, strict=True):
                cumulative += n
                le = "+Inf" if bound == float("inf") else repr(bound)
                lines.append(f"omni_node_latency_seconds_bucket{_labels(node=node, le=le)} "
                             f"{cumulative}")
            lines.append(f"omni_node_latency_seconds_sum{_labels(node=node)} {h.sum!r}")
            lines.append(f"omni_node_latency_seconds_count{_labels(node=node)} {h.count}")
        if self._collect is not None:
            seen: set[str] = set()
            for name, kind, help_, labels, value in self._collect():
                if name not in seen:
                    seen.add(name)
                    _header(lines, name, kind, help_)
                lines.append(f"{name}{_labels(**labels)} {value!r}")
        return "\n".join(lines) + "\n"


def _header(lines: list[str], name: str, kind: str, help_: str) -> None:
    lines.append(f"# HELP {name} {help_}")
    lines.append(f"# TYPE {name} {kind}")


def _labels(**labels: Any) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


async def serve_metrics(metrics: Metrics, port: int, *, host: str = "127.0.0.1",
                        task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``GET /metrics`` until cancelled; `task_status.started((host, port))` once bound.

    Raises:
        OSError: the port cannot be bound (in use, not allowed).
    """
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()[:2]
    log.info("metrics at http://%s:%d/metrics", *bound)
    task_status.started(bound)
    await trio.serve_listeners(lambda stream: _respond(stream, metrics), listeners)


async def _respond(stream: trio.SocketStream, metrics: Metrics) -> None:
    async with stream:
        request = b""
        with trio.move_on_after(READ_TIMEOUT_S):
            while b"\r\n\r\n" not in request and len(request) < MAX_REQUEST_BYTES:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    break
                request += chunk
        line = request.split(b"\r\n", 1)[0].split()
        if len(line) >= 2 and line[0] == b"GET" and line[1].split(b"?")[0] == b"/metrics":
            status, body = "200 OK", metrics.render().encode()
            kind = "text/plain; version=0.0.4; charset=utf-8"
        else:
            status, body, kind = "404 Not Found", b"try GET /metrics\n", "text/plain"
        head = (f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n").encode()
        try:
            await stream.send_all(head + body)
        except trio.BrokenResourceError:
            pass  # the scraper left
