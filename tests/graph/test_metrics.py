"""Prometheus metrics: requests, node latency histograms, replicas and KV tiers, over HTTP."""

from __future__ import annotations

import functools
import re
import socket
from typing import Any

import httpx
import pytest
import trio
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

import omni
from omni.graph.metrics import LATENCY_BUCKETS, Metrics
from tests._cli import run_omni


@omni.node
async def double(x: int) -> int:
    if x < 0:
        raise ValueError("negative")
    return 2 * x


@omni.node(replicas=2)
class Add:
    def __init__(self, n: int = 1):
        self.n = n

    async def __call__(self, x: int) -> int:
        store = omni.context().kv
        if store is not None:
            from omni.kv import block_keys

            keys = block_keys(list(range(16 * (x + 1))), page_size=16)
            store.match(keys)
        return x + self.n


@omni.graph
def pipeline(x: int):
    return Add()(double(x))


async def scrape(address: tuple[str, int], path: str = "/metrics") -> tuple[int, str]:
    """The status code and body of one GET over a real socket."""
    async with httpx.AsyncClient() as client:
        reply = await client.get(f"http://{address[0]}:{address[1]}{path}")
    return reply.status_code, reply.text


def sample(body: str, name: str, **labels: str) -> float:
    for line in body.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
            if all(found.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name} {labels} in:\n{body}")


async def test_metrics_count_requests_latencies_replicas_and_kv() -> None:
    from omni.kv import KVLayout

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, page_size=16)
    async with omni.Runtime(metrics_port=0, kv=layout) as rt:
        assert rt.metrics_address[0] == "127.0.0.1"
        for x in range(5):
            assert await rt.run(pipeline, x=x) == 2 * x + 1
        with pytest.raises(omni.NodeError):
            await rt.run(pipeline, x=-1)
        status, body = await scrape(rt.metrics_address)
    assert status == 200
    assert sample(body, "omni_requests_total", graph="pipeline", outcome="ok") == 5
    assert sample(body, "omni_requests_total", graph="pipeline", outcome="failed") == 1
    assert sample(body, "omni_node_latency_seconds_count", node="double") == 6
    assert sample(body, "omni_node_latency_seconds_count", node="Add") == 5
    assert sample(body, "omni_node_latency_seconds_bucket", node="Add", le="+Inf") == 5
    assert sample(body, "omni_replica_calls_total", node="Add", replica="0", outcome="ok") + \
        sample(body, "omni_replica_calls_total", node="Add", replica="1", outcome="ok") == 5
    assert sample(body, "omni_kv_misses_total", tier="device") >= 4
    assert sample(body, "omni_kv_pages", tier="host") == 0
    assert "# TYPE omni_node_latency_seconds histogram" in body


async def test_other_paths_are_not_found() -> None:
    async with omni.Runtime(metrics_port=0) as rt:
        status, _ = await scrape(rt.metrics_address, "/secrets")
    assert status == 404


def test_omni_run_serves_metrics_and_reports_a_taken_port() -> None:
    done = run_omni("run", "examples/hello.py", "--input", "text=hi there", "--metrics-port",
                    "0")
    assert done.returncode == 0, done.stderr
    assert re.search(r"metrics at http://127\.0\.0\.1:\d+/metrics", done.stderr)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_omni("run", "examples/hello.py", "--input", "text=hi", "--metrics-port",
                        str(port))
    assert done.returncode == 2
    assert done.stderr.strip().startswith(f"error: cannot serve metrics on port {port}")


@omni.node(replicas=2)
class Slow:
    async def __call__(self, x: int) -> int:
        await trio.sleep(0.03)  # longer than the 0.025 s bucket (the autojump clock's time)
        return x


def families(body: str) -> dict[str, Any]:
    """The scrape as prometheus_client's parser reads it, by family name."""
    return {f.name: f for f in text_string_to_metric_families(body)}


def value(family: Any, sample_name: str, **labels: str) -> float:
    found = [s.value for s in family.samples if s.name == sample_name and s.labels == labels]
    assert len(found) == 1, (sample_name, labels, family.samples)
    return found[0]


async def test_the_scrape_parses_with_counts_and_buckets(autojump_clock) -> None:
    async with omni.Runtime(metrics_port=0) as rt:
        for x in range(3):
            assert await rt.run(Slow, x=x) == x
        status, body = await scrape(rt.metrics_address)
    assert status == 200
    parsed = families(body)
    assert not [name for name in parsed if name.endswith("_created")]
    requests = parsed["omni_requests"]
    assert requests.type == "counter"
    assert value(requests, "omni_requests_total", graph="Slow", outcome="ok") == 3
    latency = parsed["omni_node_latency_seconds"]
    assert latency.type == "histogram"
    buckets = {s.labels["le"]: s.value for s in latency.samples
               if s.name.endswith("_bucket") and s.labels["node"] == "Slow"}
    assert list(buckets) == [repr(b) for b in LATENCY_BUCKETS] + ["+Inf"]
    assert [buckets[repr(b)] for b in LATENCY_BUCKETS if b <= 0.025] == [0] * 6
    assert buckets["+Inf"] == value(latency, "omni_node_latency_seconds_count", node="Slow") == 3
    assert value(latency, "omni_node_latency_seconds_sum", node="Slow") >= 3 * 0.03
    calls = parsed["omni_replica_calls"]
    assert sum(s.value for s in calls.samples if s.labels["outcome"] == "ok") == 3


def test_buckets_count_an_observation_at_their_bound() -> None:
    metrics = Metrics()
    for seconds in (0.0005, 0.0006, 0.001, 31.0):
        metrics.node_latency("n", seconds)
    latency = families(metrics.render())["omni_node_latency_seconds"]
    bucket = {s.labels["le"]: s.value for s in latency.samples if s.name.endswith("_bucket")}
    assert (bucket["0.0005"], bucket["0.001"], bucket["30.0"], bucket["+Inf"]) == (1, 3, 3, 4)
    assert value(latency, "omni_node_latency_seconds_sum", node="n") == pytest.approx(31.0021)


async def test_asgi_app_answers_metrics() -> None:
    async with omni.Runtime(metrics_port=0) as rt:
        await rt.run(double, x=1)
        transport = httpx.ASGITransport(app=rt.metrics.asgi_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://omni") as client:
            reply = await client.get("/metrics")
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/plain")
    parsed = families(reply.text)
    assert value(parsed["omni_requests"], "omni_requests_total", graph="double", outcome="ok") == 1


async def test_two_runtimes_keep_separate_registries() -> None:
    async with omni.Runtime(metrics_port=0) as one, omni.Runtime(metrics_port=0) as two:
        assert one.metrics_address != two.metrics_address
        await one.run(double, x=1)
        for x in range(4):
            await two.run(double, x=x)
        bodies = [(await scrape(rt.metrics_address))[1] for rt in (one, two)]
    counts = [value(families(b)["omni_requests"], "omni_requests_total", graph="double",
                    outcome="ok") for b in bodies]
    assert counts == [1, 4]
    assert REGISTRY.get_sample_value("omni_requests_total",
                                     {"graph": "double", "outcome": "ok"}) is None


STEP_GATE: dict[str, trio.Event] = {}


@omni.node
async def stepper(steps: int, fail_at: int) -> int:
    """Reports each of `steps` steps; waits at step 1 while the test holds a gate; fails
    after step `fail_at` (-1: never)."""
    for done in range(1, steps + 1):
        omni.context().progress(done, steps)
        if done == 1 and "held" in STEP_GATE:
            await STEP_GATE["held"].wait()
        if done == fail_at:
            raise ValueError("broke midway")
    return steps


async def test_steps_a_node_reports_show_as_done_and_remaining(autojump_clock) -> None:
    """`omni.Context.progress`: steps done count up; the steps left in calls running show
    while they run and go when their request ends, whether it finished or failed."""
    def read(body: str) -> tuple[float, float, float]:
        parsed = families(body)
        return (value(parsed["omni_node_steps"], "omni_node_steps_total", node="stepper"),
                value(parsed["omni_node_steps_remaining"], "omni_node_steps_remaining",
                      node="stepper"),
                value(parsed["omni_node_calls_stepping"], "omni_node_calls_stepping",
                      node="stepper"))

    async with omni.Runtime(metrics_port=0) as rt:
        assert await rt.run(stepper, steps=4, fail_at=-1) == 4
        assert read((await scrape(rt.metrics_address))[1]) == (4, 0, 0)
        STEP_GATE["held"] = trio.Event()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(rt.run, stepper, steps=10, fail_at=-1))
                await trio.sleep(1)  # the call holds at its first step
                assert read((await scrape(rt.metrics_address))[1]) == (5, 9, 1)
                STEP_GATE["held"].set()
        finally:
            del STEP_GATE["held"]
        with pytest.raises(omni.NodeError, match="broke midway"):
            await rt.run(stepper, steps=6, fail_at=2)
        assert read((await scrape(rt.metrics_address))[1]) == (16, 0, 0)


@pytest.mark.parametrize(("done", "total"), [(3, 2), (-1, 2), (0, 0), (1.5, 2), (True, 2)])
def test_progress_out_of_range_is_refused(done: Any, total: Any) -> None:
    from omni.graph.progress import Progress

    with pytest.raises(ValueError, match="0 <= done <= total"):
        Progress().note("n", "req-1", done, total)
