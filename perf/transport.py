"""Transport: trio ZeroMQ sockets and RPC against blocking pyzmq over TCP loopback, and KV
pages over shared memory against TCP.

Three claims, each measured against its baseline in the same run, between two processes (this
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
3. Shared memory. 64 MiB of KV pages fetched from a child process's `KVStore` with the
   "kv.fetch" RPC (`serve_kv`): as a descriptor of the store's shared memory
   (`SharedMemoryMover`, what a requester on the same machine gets, over the Unix socket a
   cluster member on the holder's host is reached by) against the same pages as one
   checksummed frame over TCP loopback (`FrameMover`, what a remote requester gets).
   Seconds from the request to pages in this process, every byte read once; target: shared
   memory ≥ 20× faster.

Usage: ``python perf/transport.py [--quick] [--out PATH.json] [--plot PATH.png]``;
``--profile`` instead runs the RPC round trips under cProfile in both processes and writes
the two reports to stderr (no JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
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
from perf._common import Samples, claim, environment, plot_bars, profile_report, write_json

__all__ = ["Params", "main", "measure"]

LATENCY_TARGET = 2.0  # RPC round trip at most this many times the blocking one
THROUGHPUT_TARGET = 0.8  # trio sockets at least this fraction of raw pyzmq
SHARED_MEMORY_TARGET = 20.0  # a shared-memory KV fetch at least this many times faster than TCP
REMOTE_HOST = "another-host"  # a host id that is not this machine's: the holder sends frames
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
    kv_fetches: int = 5  # KV fetches of `total_bytes` per shared-memory sample (their median)
    quick: bool = False

    @classmethod
    def small(cls) -> Params:
        """Sizes for a smoke run (a few seconds)."""
        return cls(repeats=3, round_trips=300, total_bytes=16 * MIB, transfers=1, kv_fetches=1,
                   quick=True)


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


async def _serve_trio(profile: bool = False) -> None:
    """A trio ROUTER on the same protocol and an `RPCServer`; prints both endpoints, serves
    until stdin closes (with `profile`, then writes its cProfile report to stderr)."""
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
    async with server, open_socket(None, zmq.ROUTER, bind=LOOPBACK) as sock, \
            trio.open_nursery() as nursery:
        print(sock.endpoint, server.endpoint, flush=True)
        nursery.start_soon(_echo_raw, sock, frames)
        profiler = cProfile.Profile() if profile else None
        if profiler is not None:
            profiler.enable()
        await trio.to_thread.run_sync(sys.stdin.read)
        if profiler is not None:
            profiler.disable()
            sys.stderr.write("== the server (child process)\n" + profile_report(profiler, 25))
        nursery.cancel_scope.cancel()


async def _echo_raw(sock: Any, frames: dict[int, bytes]) -> None:
    """Serve the raw-socket protocol on a trio ROUTER."""
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


def _kv_pages(total_bytes: int) -> tuple[Any, list[bytes]]:
    """The layout (512 KiB pages: 8 layers x 16 tokens x 8 heads x 128 fp16) and the keys of
    `total_bytes` of pages, the same in both processes."""
    import torch

    from omni.kv import KVLayout, block_keys

    layout = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, page_size=16,
                      dtype=torch.float16)
    tokens = total_bytes // layout.page_bytes * layout.page_size
    return layout, block_keys(range(tokens), layout.page_size, extra=("perf/transport",))


async def _serve_kv(total_bytes: int) -> None:
    """A `KVStore` whose one tier, host memory, is shared memory, holding `total_bytes` of
    random pages, served by "kv.fetch" (`serve_kv`) over TCP and over a Unix socket, as a
    cluster member serves it (the Unix socket for members on its host: `endpoint_for`);
    prints both endpoints, serves until stdin closes, then closes the store (which unlinks
    its shared memory: not killed for that)."""
    import torch

    from omni.cluster.kv.peers import serve_kv
    from omni.cluster.membership import unix_endpoint
    from omni.kv import KVStore, TierConfig

    layout, keys = _kv_pages(total_bytes)
    raw = torch.randint(0, 256, (len(keys) * layout.page_bytes,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(0))
    with KVStore(layout, [TierConfig("host", 2 * total_bytes)]) as store:
        store.put(keys, raw.view(layout.dtype).view(len(keys), *layout.page_shape))
        del raw
        servers = [RPCServer(LOOPBACK), RPCServer(unix_endpoint("perf-kv"))]
        for server in servers:
            serve_kv(server, store)
        async with servers[0], servers[1]:
            print(*(server.endpoint for server in servers), flush=True)
            await trio.to_thread.run_sync(sys.stdin.read)


def _start_child(kind: str, *args: str) -> tuple[subprocess.Popen[str], list[str]]:
    proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, *args], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().split()


def _stop_child(proc: subprocess.Popen[str], grace: float = 0.0) -> None:
    """Close its stdin (a child that watches it exits cleanly), kill it after `grace` s."""
    assert proc.stdin is not None
    proc.stdin.close()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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


async def kv_fetch(client: RPCClient, layout: Any, keys: list[bytes], host: str
                   ) -> tuple[float, float, int]:
    """One "kv.fetch" of `keys` as a requester on `host` (ours: shared memory; another: a
    frame): seconds until the pages are usable here (a frame's checksum verified, shared
    memory mapped), seconds until every byte has been read once too, and the bytes' sum."""
    import torch

    from omni.cluster.kv.peers import FetchReply, FetchRequest
    from omni.transport.movers import unpack

    start = time.perf_counter()
    reply = await client.call_with_payload(
        "kv.fetch", FetchRequest(keys, host, os.getpid()), result_type=FetchReply)
    with unpack(reply.body.header, reply.payload, layout) as received:
        usable = time.perf_counter()
        if len(received) != len(keys):
            raise RuntimeError(f"fetched {len(received)} of {len(keys)} pages")
        # Every byte read once, page by page (views of the frame or of the shared memory);
        # summed as int64 words: a uint8 sum is many times slower in torch.
        total = sum(int(received.page(i).view(torch.int64).sum()) for i in range(len(keys)))
        if not received.valid():  # shared memory: the lease ended while we read
            raise RuntimeError("the shared-memory lease ended during the read")
        end = time.perf_counter()
    return usable - start, end - start, total


async def _measure_kv(p: Params, tcp: str, unix: str) -> dict[str, Samples]:
    """Alternate fetches over shared memory and over TCP; per sample the median of
    `p.kv_fetches` fetches, in ms."""
    import torch

    layout, keys = _kv_pages(p.total_bytes)
    sums: set[int] = set()
    usable: dict[str, list[float]] = {"shm": [], "tcp": []}
    # The reads on one thread: on a busy machine a second thread's time slices come late, and
    # each per-page sum would wait for its slowest thread (hundreds of ms in all).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        s = await _fetch_alternately(p, tcp, unix, layout, keys, sums, usable)
    finally:
        torch.set_num_threads(threads)
    if len(sums) != 1:
        raise RuntimeError(f"the two paths delivered different bytes (sums {sums})")
    usable_samples = {f"{k}_usable": Samples(tuple(v[1:])) for k, v in usable.items()}
    return {**s, **usable_samples}  # v[0]: the warm-up round's


async def _fetch_alternately(p: Params, tcp: str, unix: str, layout: Any, keys: list[bytes],
                             sums: set[int], usable: dict[str, list[float]]
                             ) -> dict[str, Samples]:
    """The requester on this host over the Unix socket, the remote one over TCP, as a
    cluster's members reach the holder."""
    from omni.transport.movers import host_id

    async with RPCClient(tcp, timeout=60) as remote, RPCClient(unix, timeout=60) as local:
        def fetching(client: RPCClient, host: str, name: str
                     ) -> Callable[[], Awaitable[float]]:
            async def measure() -> float:
                runs = [await kv_fetch(client, layout, keys, host)
                        for _ in range(p.kv_fetches)]
                sums.update(total for _, _, total in runs)
                usable[name].append(statistics.median(ready for ready, _, _ in runs) * 1e3)
                return statistics.median(done for _, done, _ in runs) * 1e3
            return measure

        return await _alternate({"shm": fetching(local, host_id(), "shm"),
                                 "tcp": fetching(remote, REMOTE_HOST, "tcp")}, p.repeats)


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


async def _profile_rpc(p: Params, endpoint: str) -> str:
    async with RPCClient(endpoint, timeout=60) as client:
        await rpc_latency(client, p.round_trips, bytes(p.message_bytes))  # warm-up
        profiler = cProfile.Profile()
        profiler.enable()
        median = await rpc_latency(client, p.round_trips, bytes(p.message_bytes))
        profiler.disable()
    return (f"== the client: {p.round_trips} RPC round trips, median {median:.1f} µs under "
            f"cProfile\n" + profile_report(profiler, 25))


def profile(p: Params) -> None:
    """cProfile `p.round_trips` RPC round trips in both processes; the reports to stderr."""
    proc, (_, rpc_ep) = _start_child("trio", "--profile")
    try:
        sys.stderr.write(trio.run(_profile_rpc, p, rpc_ep))
        sys.stderr.flush()
    finally:
        _stop_child(proc, grace=10)  # it writes its report as it exits


def measure(p: Params) -> dict[str, Any]:
    """Start the server children, run both measurements, return the result dict."""
    (bproc, (blocking_ep,)), (tproc, (raw_ep, rpc_ep)) = (_start_child("blocking"),
                                                          _start_child("trio"))
    try:
        s = trio.run(_measure_all, p, blocking_ep, raw_ep, rpc_ep)
    finally:
        _stop_child(bproc)
        _stop_child(tproc, grace=10)
    kproc, kv_eps = _start_child("kv", str(p.total_bytes))  # after: torch loads meanwhile
    try:
        kv = trio.run(_measure_kv, p, *kv_eps)
    finally:
        _stop_child(kproc, grace=10)
    lat_ratio = s["lat_rpc"].median / s["lat_blocking"].median
    tp_ratio = s["tp_socket"].median / s["tp_blocking"].median
    shm_ratio = kv["tcp"].median / kv["shm"].median
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
        "shared_memory": claim(
            unit="ms", target=SHARED_MEMORY_TARGET, measured=kv["shm"], baseline=kv["tcp"],
            ratio=shm_ratio, passed=shm_ratio >= SHARED_MEMORY_TARGET, digits=2,
            usable=kv["shm_usable"].to_json(2), baseline_usable=kv["tcp_usable"].to_json(2),
            note=f"ms per fetch of {p.total_bytes // MIB} MiB of KV pages (512 KiB each) from "
                 "a child process's KVStore (host tier: shared memory) by its \"kv.fetch\" "
                 "RPC, from the request until every byte has been read once in this process "
                 "(a sum of each page viewed as int64, on one torch thread), median of "
                 f"{p.kv_fetches} fetches per run; measured: a requester on this machine, "
                 "over the holder's Unix socket as a member of its host (SharedMemoryMover: "
                 "a descriptor, the store's memory mapped here, the mapping kept between "
                 "fetches as open_descriptor does); baseline: a "
                 "requester of another host id (FrameMover: the pages copied out of the "
                 "store, one checksummed frame over TCP loopback, the checksum verified "
                 "here); usable / baseline_usable: until the pages are usable, before the "
                 "read; both paths' sums checked equal; ratio = baseline / measured, target "
                 f"≥ {SHARED_MEMORY_TARGET}"),
        "all_pass": (lat_ratio <= LATENCY_TARGET and tp_ratio >= THROUGHPUT_TARGET
                     and shm_ratio >= SHARED_MEMORY_TARGET),
    }


def _plot(result: dict[str, Any], path: str) -> None:
    def samples(d: dict[str, Any]) -> Samples:
        return Samples(tuple(d["runs"]))

    lat, tp, shm = result["latency"], result["throughput"], result["shared_memory"]
    mib = result["params"]["total_bytes"] // MIB
    plot_bars(path, "Omni transport between two processes", [
        ("round trip (lower is better)", "µs", {"pyzmq": samples(lat["baseline"]),
                                                "Socket": samples(lat["socket"]),
                                                "RPC": samples(lat["measured"])}),
        (f"{mib} MiB in 1 MiB frames", "GiB/s", {"pyzmq": samples(tp["baseline"]),
                                                "Socket": samples(tp["measured"]),
                                                "RPC": samples(tp["rpc"]),
                                                "RPC 1 call": samples(tp["rpc_one_call"])}),
        (f"KV fetch of {mib} MiB (lower is better)", "ms", {
            "TCP frame": samples(shm["baseline"]), "shared memory": samples(shm["measured"])}),
    ])


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    """Parse `argv`, run the benchmark, print (and optionally write and plot) the result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--repeats", type=int, default=None, help="repeats per measurement")
    parser.add_argument("--out", help="also write the JSON here (folders are created)")
    parser.add_argument("--plot", help="write a bar chart (PNG) here")
    parser.add_argument("--profile", action="store_true",
                        help="instead: cProfile RPC round trips in the client and the server "
                             "(reports to stderr)")
    parser.add_argument("--serve", choices=["blocking", "trio", "kv"], help=argparse.SUPPRESS)
    parser.add_argument("kv_bytes", nargs="?", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve == "blocking":  # the server children: blocking runs until killed, the
        serve_blocking()          # others until stdin closes
    elif args.serve is not None:
        trio.run(_serve_kv, args.kv_bytes) if args.serve == "kv" else trio.run(
            _serve_trio, args.profile)
    if args.serve is not None:
        return None
    p = Params.small() if args.quick else Params()
    if args.repeats is not None:
        p = replace(p, repeats=args.repeats)
    if args.profile:
        profile(p)
        return None
    result = measure(p)
    write_json(result, args.out)
    if args.plot:
        _plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
