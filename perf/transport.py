"""Transport: trio ZeroMQ sockets and RPC against blocking pyzmq, over TCP loopback.

Two claims, each measured against its baseline in the same run, between two processes (this
one, the client, and a server child process per side):

1. Latency. Sequential round trips of a small message: `RPCClient.call` to an `RPCServer`
   (and, for reference, a raw trio `Socket` DEALER to a trio ROUTER echo), against a blocking
   pyzmq DEALER to a blocking ROUTER echo. Median µs per round trip; target: RPC ≤ 2× blocking.
2. Throughput. 64 MiB of payload in 1 MiB frames sent by the server child to this process
   (4 times per sample): trio `Socket`s on both ends (zero-copy sends and receives; the
   sender queues with `send_multipart_nowait` and awaits only for outbox room, the receiver
   drains with `recv_multipart_nowait` after each await: the bulk idioms), against blocking
   pyzmq with ``copy=False`` on both ends. GiB/s; target ≥ 0.8× raw pyzmq. RPC calls
   returning the frames as payload are reported too: one frame per call (concurrent
   calls), and all frames in one call (one multipart message).

Usage: ``python perf/transport.py [--quick] [--out PATH.json] [--plot PATH.png]``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import trio
import zmq

if __package__ in (None, ""):  # run as a script: make `perf` and `omni` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from omni.transport import Reply, RPCClient, RPCServer, open_socket
from perf._common import Samples, claim, environment, plot_bars, write_json

__all__ = ["Params", "main", "measure"]

LATENCY_TARGET = 2.0  # RPC round trip at most this many times the blocking one
THROUGHPUT_TARGET = 0.8  # trio sockets at least this fraction of raw pyzmq
MIB = 1 << 20
LOOPBACK = "tcp://127.0.0.1:*"


@dataclass(frozen=True, slots=True)
class Params:
    """The sizes of one run (`quick` shrinks them for a smoke run)."""

    repeats: int = 9
    round_trips: int = 2_000
    message_bytes: int = 64
    frame_bytes: int = MIB
    total_bytes: int = 64 * MIB
    transfers: int = 4  # transfers of `total_bytes` per throughput sample (steadier figures)
    quick: bool = False

    @classmethod
    def small(cls) -> Params:
        """Sizes for a smoke run (a few seconds)."""
        return cls(repeats=3, round_trips=300, total_bytes=16 * MIB, transfers=1, quick=True)


# ---------------------------------------------------------------------------------------------
# The server children. Protocol on the raw sockets: [b"echo", data] is echoed back;
# [b"bulk", count, size] is answered by `count` messages of one `size`-byte frame each.


def _bulk_frame(size: int) -> bytes:
    return bytes(range(256)) * (size // 256) + bytes(size % 256)  # immutable: safe zero-copy


def serve_blocking() -> None:
    """A blocking pyzmq ROUTER; prints its endpoint, serves until stdin closes."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.bind(LOOPBACK)
    print(sock.last_endpoint.decode(), flush=True)
    frames: dict[int, bytes] = {}
    while True:
        identity, op, *args = sock.recv_multipart()
        if op == b"echo":
            sock.send_multipart([identity, op, *args])
        else:
            count, size = int(args[0]), int(args[1])
            if size not in frames:
                frames[size] = _bulk_frame(size)
            for _ in range(count):
                sock.send_multipart([identity, frames[size]], copy=False)


async def _serve_trio() -> None:
    """A trio ROUTER on the same protocol and an `RPCServer`; prints both endpoints."""
    frames: dict[int, bytes] = {}

    async def echo(body: bytes) -> bytes:
        return body

    async def bulk(body: tuple[int, int]) -> Reply:
        count, size = body
        if size not in frames:
            frames[size] = _bulk_frame(size)
        return Reply(None, [frames[size]] * count)

    server = RPCServer(LOOPBACK)
    server.register("echo", echo)
    server.register("bulk", bulk)
    async with server, open_socket(None, zmq.ROUTER, bind=LOOPBACK) as sock:
        print(sock.endpoint, server.endpoint, flush=True)
        async for identity, op, *args in sock:
            if op == b"echo":
                await sock.send_multipart([identity, op, *args])
                continue
            count, size = int(args[0]), int(args[1])
            if size not in frames:
                frames[size] = _bulk_frame(size)
            for _ in range(count):  # the bulk idiom: queue, and wait only for outbox room
                try:
                    sock.send_multipart_nowait([identity, frames[size]])
                except trio.WouldBlock:
                    await sock.send_multipart([identity, frames[size]])
            await trio.lowlevel.checkpoint()


def _start_child(kind: str) -> tuple[subprocess.Popen[str], list[str]]:
    proc = subprocess.Popen([sys.executable, __file__, "--serve", kind], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().split()


# ---------------------------------------------------------------------------------------------
# Measurements (client side, this process)


def _median_us(durations: Sequence[float]) -> float:
    return statistics.median(durations) * 1e6


def blocking_latency(sock: zmq.Socket[Any], n: int, data: bytes) -> float:
    """Median µs of `n` blocking round trips."""
    durations = []
    for _ in range(n):
        start = time.perf_counter()
        sock.send_multipart([b"echo", data])
        sock.recv_multipart()
        durations.append(time.perf_counter() - start)
    return _median_us(durations)


async def socket_latency(sock: Any, n: int, data: bytes) -> float:
    """Median µs of `n` round trips through a trio `Socket`."""
    durations = []
    for _ in range(n):
        start = time.perf_counter()
        await sock.send_multipart([b"echo", data])
        await sock.recv_multipart()
        durations.append(time.perf_counter() - start)
    return _median_us(durations)


async def rpc_latency(client: RPCClient, n: int, data: bytes) -> float:
    """Median µs of `n` sequential RPC calls."""
    durations = []
    for _ in range(n):
        start = time.perf_counter()
        await client.call("echo", data)
        durations.append(time.perf_counter() - start)
    return _median_us(durations)


def blocking_throughput(sock: zmq.Socket[Any], p: Params) -> float:
    """GiB/s of `p.transfers` transfers, received zero-copy with blocking pyzmq."""
    count, received = p.total_bytes // p.frame_bytes, 0
    start = time.perf_counter()
    for _ in range(p.transfers):
        sock.send_multipart([b"bulk", b"%d" % count, b"%d" % p.frame_bytes])
        received += sum(len(sock.recv(copy=False)) for _ in range(count))
    elapsed = time.perf_counter() - start
    assert received == p.transfers * p.total_bytes
    return received / elapsed / (1 << 30)


async def socket_throughput(sock: Any, p: Params) -> float:
    """GiB/s of the same transfers through trio `Socket`s."""
    count, received = p.total_bytes // p.frame_bytes, 0
    start = time.perf_counter()
    for _ in range(p.transfers):
        await sock.send_multipart([b"bulk", b"%d" % count, b"%d" % p.frame_bytes])
        remaining = count
        while remaining:  # the bulk idiom: await one message, then drain what is there
            messages = [await sock.recv_multipart()]
            with contextlib.suppress(trio.WouldBlock):
                while len(messages) < remaining:
                    messages.append(sock.recv_multipart_nowait())
            remaining -= len(messages)
            received += sum(len(frame) for (frame,) in messages)
    elapsed = time.perf_counter() - start
    assert received == p.transfers * p.total_bytes
    return received / elapsed / (1 << 30)


async def rpc_throughput(client: RPCClient, p: Params, frames_per_call: int) -> float:
    """GiB/s of the same bytes as replies' payload frames, `frames_per_call` frames per call,
    all the calls of a transfer concurrent."""
    calls, received = p.total_bytes // p.frame_bytes // frames_per_call, 0

    async def one() -> None:
        nonlocal received
        reply = await client.call_with_payload("bulk", (frames_per_call, p.frame_bytes))
        received += sum(len(frame) for frame in reply.payload)

    start = time.perf_counter()
    for _ in range(p.transfers):
        async with trio.open_nursery() as nursery:
            for _ in range(calls):
                nursery.start_soon(one)
    elapsed = time.perf_counter() - start
    assert received == p.transfers * p.total_bytes
    return received / elapsed / (1 << 30)


async def _alternate(measures: dict[str, Callable[[], Awaitable[float]]],
                     repeats: int) -> dict[str, Samples]:
    """Each measure `repeats` times after one warm-up round, reversing the order each round."""
    names = list(measures)
    for name in names:
        await measures[name]()
    values: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            values[name].append(await measures[name]())
    return {name: Samples(tuple(v)) for name, v in values.items()}


async def _measure_all(p: Params, blocking_ep: str, raw_ep: str,
                       rpc_ep: str) -> dict[str, Samples]:
    data = bytes(p.message_bytes)
    count = p.total_bytes // p.frame_bytes
    ctx = zmq.Context.instance()
    bsock = ctx.socket(zmq.DEALER)
    bsock.linger = 0
    bsock.connect(blocking_ep)

    async def blocking_lat() -> float:
        return blocking_latency(bsock, p.round_trips, data)

    async def blocking_tp() -> float:
        return blocking_throughput(bsock, p)

    try:
        async with open_socket(ctx, zmq.DEALER, connect=raw_ep) as sock, \
                RPCClient(rpc_ep, ctx=ctx, timeout=60) as client:
            latency = await _alternate({
                "blocking": blocking_lat,
                "socket": lambda: socket_latency(sock, p.round_trips, data),
                "rpc": lambda: rpc_latency(client, p.round_trips, data)}, p.repeats)
            throughput = await _alternate({
                "blocking": blocking_tp,
                "socket": lambda: socket_throughput(sock, p),
                "rpc": lambda: rpc_throughput(client, p, 1),
                "rpc_one_call": lambda: rpc_throughput(client, p, count)}, p.repeats)
    finally:
        bsock.close(linger=0)
    return {**{f"lat_{k}": v for k, v in latency.items()},
            **{f"tp_{k}": v for k, v in throughput.items()}}


def measure(p: Params) -> dict[str, Any]:
    """Start the server children, run both measurements, return the result dict."""
    (bproc, (blocking_ep,)), (tproc, (raw_ep, rpc_ep)) = (_start_child("blocking"),
                                                          _start_child("trio"))
    try:
        s = trio.run(_measure_all, p, blocking_ep, raw_ep, rpc_ep)
    finally:
        for proc in (bproc, tproc):
            proc.kill()
            proc.wait()
    lat_ratio = s["lat_rpc"].median / s["lat_blocking"].median
    tp_ratio = s["tp_socket"].median / s["tp_blocking"].median
    return {
        "env": {**environment(), "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version()},
        "params": asdict(p),
        "latency": claim(
            unit="us", target=LATENCY_TARGET, measured=s["lat_rpc"],
            baseline=s["lat_blocking"], ratio=lat_ratio, passed=lat_ratio <= LATENCY_TARGET,
            socket=s["lat_socket"].to_json(1),
            socket_ratio=round(s["lat_socket"].median / s["lat_blocking"].median, 3),
            note=f"median µs per round trip of a {p.message_bytes}-byte message, "
                 f"{p.round_trips} sequential calls per run; measured: RPCClient.call to an "
                 "RPCServer in another process; socket: raw trio Socket DEALER to a trio "
                 "ROUTER echo; baseline: blocking pyzmq DEALER to a blocking ROUTER echo; "
                 f"ratio = measured / baseline, target ≤ {LATENCY_TARGET}"),
        "throughput": claim(
            unit="GiB/s", target=THROUGHPUT_TARGET, measured=s["tp_socket"],
            baseline=s["tp_blocking"], ratio=tp_ratio, passed=tp_ratio >= THROUGHPUT_TARGET,
            digits=3, rpc=s["tp_rpc"].to_json(3),
            rpc_ratio=round(s["tp_rpc"].median / s["tp_blocking"].median, 3),
            rpc_one_call=s["tp_rpc_one_call"].to_json(3),
            rpc_one_call_ratio=round(s["tp_rpc_one_call"].median / s["tp_blocking"].median, 3),
            note=f"{p.transfers} x {p.total_bytes // MIB} MiB in {p.frame_bytes // 1024} KiB "
                 "frames from a child process over TCP loopback; measured: trio Sockets on "
                 "both ends (zero-copy, bulk idioms: send_multipart_nowait, "
                 "recv_multipart_nowait); rpc: concurrent calls each returning one frame as "
                 "payload; rpc_one_call: one call returning every frame (one multipart "
                 "message: libzmq delivers it only whole, hence slower); baseline: blocking "
                 f"pyzmq, copy=False both ends; target ratio ≥ {THROUGHPUT_TARGET}"),
        "all_pass": lat_ratio <= LATENCY_TARGET and tp_ratio >= THROUGHPUT_TARGET,
    }


def _plot(result: dict[str, Any], path: str) -> None:
    def samples(d: dict[str, Any]) -> Samples:
        return Samples(tuple(d["runs"]))

    lat, tp = result["latency"], result["throughput"]
    mib = result["params"]["total_bytes"] // MIB
    plot_bars(path, "Omni transport over TCP loopback, two processes", [
        ("round trip (lower is better)", "µs", {"pyzmq": samples(lat["baseline"]),
                                                "Socket": samples(lat["socket"]),
                                                "RPC": samples(lat["measured"])}),
        (f"{mib} MiB in 1 MiB frames", "GiB/s", {"pyzmq": samples(tp["baseline"]),
                                                "Socket": samples(tp["measured"]),
                                                "RPC": samples(tp["rpc"]),
                                                "RPC 1 call": samples(tp["rpc_one_call"])}),
    ])


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    """Parse `argv`, run the benchmark, print (and optionally write and plot) the result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--repeats", type=int, default=None, help="repeats per measurement")
    parser.add_argument("--out", help="also write the JSON here (folders are created)")
    parser.add_argument("--plot", help="write a bar chart (PNG) here")
    parser.add_argument("--serve", choices=["blocking", "trio"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:  # a server child: runs until killed
        serve_blocking() if args.serve == "blocking" else trio.run(_serve_trio)
        return None
    p = Params.small() if args.quick else Params()
    if args.repeats is not None:
        p = replace(p, repeats=args.repeats)
    result = measure(p)
    write_json(result, args.out)
    if args.plot:
        _plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
