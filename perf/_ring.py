"""A floor under `payloads.hop_latency`: four processes that do nothing but pass 8 bytes
around a ring of Unix stream sockets (driver -> n1 -> n2 -> n3 -> driver), as the pipeline's
request goes driver -> w1 -> w2 -> w3 -> driver. One request's µs / 3, the median of
`requests` sequential ones: with trio event loops (what Omni's processes run) and with
blocking sockets (no event loop). What a hop costs above the first is Omni's own work; what
the first costs above the second is the event loop's wake-up.

Usage: ``python perf/_ring.py {trio,blocking} [REQUESTS]``; prints one JSON object.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

NODES = 3


def _path(folder: str, i: int) -> str:
    return os.path.join(folder, f"n{i}.sock")


def _listen(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(1)
    return sock


def _connect(path: str) -> socket.socket:
    deadline = time.monotonic() + 30
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _node_blocking(upstream: socket.socket, downstream: socket.socket) -> None:
    while data := upstream.recv(64):
        downstream.sendall(data)


def _node_trio(upstream: socket.socket, downstream: socket.socket) -> None:
    import trio

    async def run() -> None:
        up, down = trio.socket.from_stdlib_socket(upstream), trio.socket.from_stdlib_socket(
            downstream)
        while data := await up.recv(64):
            await down.send(data)

    trio.run(run)


def _node(kind: str, folder: str, i: int) -> None:
    """Node `i`: accept from the one before, pass everything on to the next (0: the driver)."""
    listener = _listen(_path(folder, i))
    print("ready", flush=True)
    upstream, _ = listener.accept()
    downstream = _connect(_path(folder, (i + 1) % (NODES + 1)))
    (_node_trio if kind == "trio" else _node_blocking)(upstream, downstream)


def _drive_blocking(first: socket.socket, back: socket.socket, requests: int) -> list[float]:
    times = []
    for _ in range(requests):
        start = time.perf_counter()
        first.sendall(b"12345678")
        back.recv(64)
        times.append(time.perf_counter() - start)
    return times


def _drive_trio(first: socket.socket, back: socket.socket, requests: int) -> list[float]:
    import trio

    async def run() -> list[float]:
        out, into = trio.socket.from_stdlib_socket(first), trio.socket.from_stdlib_socket(back)
        times = []
        for _ in range(requests):
            start = time.perf_counter()
            await out.send(b"12345678")
            await into.recv(64)
            times.append(time.perf_counter() - start)
        return times

    return trio.run(run)


def measure(kind: str, requests: int = 2000) -> float:
    """µs per hop of the `kind` ring ("trio" or "blocking"): the median request / 3, the
    first tenth of the requests left out (warm-up)."""
    drive: Callable[[socket.socket, socket.socket, int], list[float]] = (
        _drive_trio if kind == "trio" else _drive_blocking)
    with tempfile.TemporaryDirectory(prefix="omni-ring-") as folder:
        nodes: list[subprocess.Popen[str]] = []
        try:
            listener = _listen(_path(folder, 0))
            for i in range(1, NODES + 1):
                node = subprocess.Popen([sys.executable, __file__, "--node", kind, folder,
                                         str(i)], stdout=subprocess.PIPE, text=True)
                nodes.append(node)
                assert node.stdout is not None
                node.stdout.readline()
            first = _connect(_path(folder, 1))
            back, _ = listener.accept()
            times = drive(first, back, requests)
            first.close()  # the ring ends: each node sees its upstream close
        finally:
            for node in nodes:
                try:
                    node.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    node.kill()
                    node.wait()
    return statistics.median(times[requests // 10:]) * 1e6 / NODES


def main(argv: list[str]) -> None:
    if argv[:1] == ["--node"]:
        _node(argv[1], argv[2], int(argv[3]))
        return
    kind = argv[0] if argv else "trio"
    if kind not in ("trio", "blocking"):
        raise SystemExit(f"perf/_ring.py: a ring is 'trio' or 'blocking', not {kind!r}")
    requests = int(argv[1]) if len(argv) > 1 else 2000
    print(json.dumps({"kind": kind, "requests": requests,
                      "us_per_hop": round(measure(kind, requests), 1)}))


if __name__ == "__main__":
    main(sys.argv[1:])
