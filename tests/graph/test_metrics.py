"""Prometheus metrics: requests, node latency histograms, replicas and KV tiers, over HTTP."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import trio

import omni

ROOT = Path(__file__).resolve().parents[2]


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
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                              .encode())
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    head, _, body = data.decode().partition("\r\n\r\n")
    return int(head.split(" ")[1]), body


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
    done = subprocess.run([sys.executable, "-m", "cli", "run", "examples/hello.py", "--input",
                           "text=hi there", "--metrics-port", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert re.search(r"metrics at http://127\.0\.0\.1:\d+/metrics", done.stderr)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "cli", "run", "examples/hello.py",
                               "--input", "text=hi", "--metrics-port", str(port)], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().startswith(f"error: cannot serve metrics on port {port}")
