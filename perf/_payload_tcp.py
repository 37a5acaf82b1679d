"""The TCP-path driver of `perf/payloads.py`, a child process started with
``OMNI_PAYLOAD_SHM=0 OMNI_IPC=0`` (`TCP_SETTINGS`, as is the worker it calls, ``wtcp``): no
shared memory, no Unix socket, so payloads take the path they take between hosts even though
both processes share this machine.

It times, alternating round by round (one untimed warm-up round first), a call of the
``SizeTcp`` node with a float32 array of each size (GiB/s = bytes / seconds of the call; the
child asks for a plaintext data plane (`PLAINTEXT`), which ``wtcp``, encrypted, overrules),
the same call of ``SizeTcpPlain`` on ``wtcp_plain`` (plaintext at both ends), and
two raw pyzmq baselines: that of `perf/transport.py`, a blocking DEALER receiving one frame of
the same size, zero-copy on both ends, from that benchmark's blocking ROUTER child over TCP
loopback (unencrypted), and the same pair with CURVE encryption (``pyzmq_curve``), as Omni's
TCP sockets have: a ROUTER child of this file (``--serve-curve``, ``curve_server`` with its own
key pair, printing its endpoint and public key) and a DEALER with its own key pair and the
server's public key. It prints one JSON object on stdout: per size, the runs of each side or
the error that stopped it.

Usage: ``python perf/_payload_tcp.py ADDRESS TOKEN_FILE SIZE [SIZE ...] --repeats N
[--seed S]`` (sizes in bytes); ``python perf/_payload_tcp.py --serve-curve`` is the CURVE
server child (it serves until killed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import trio
import zmq

if __package__ in (None, ""):  # run as a script: make `perf` and `omni` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import omni
from perf import _payload_nodes as nodes
from perf._payload_measures import error_text
from perf._payload_support import BlockingThread

ROOT = Path(__file__).resolve().parent.parent
# What keeps a payload off the same-host paths: shared memory, and Unix sockets.
TCP_SETTINGS = {"OMNI_PAYLOAD_SHM": "0", "OMNI_IPC": "0"}
# The child and worker wtcp_plain ask for a plaintext data plane; wtcp answers encrypted.
PLAINTEXT = {"OMNI_DATA_PLANE": "plaintext"}
GIB = 1 << 30
CALL_TIMEOUT_S = 120.0


def _label(size: int) -> str:
    return str(size)


def _pyzmq(sock: zmq.Socket[Any], size: int) -> float:
    """GiB/s of one frame of `size` bytes from the blocking ROUTER (perf/transport.py)."""
    from perf.transport import Params, blocking_throughput

    return blocking_throughput(sock, Params(frame_bytes=size, total_bytes=size, transfers=1))


def serve_curve() -> None:
    """The CURVE baseline's server: `perf/transport.py`'s blocking ROUTER (the same protocol,
    the same zero-copy sends) with ``curve_server`` on and a fresh key pair; prints its
    endpoint and its public key on one line, serves until killed. No ZAP handler: libzmq then
    accepts any client key, as the handshake and the encryption are what is measured."""
    from perf.transport import LOOPBACK, _bulk_frame

    public, secret = zmq.curve_keypair()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    sock.bind(LOOPBACK)
    print(sock.last_endpoint.decode(), public.decode(), flush=True)
    frames: dict[int, bytes] = {}
    while True:
        identity, op, *args = sock.recv_multipart()
        if op == b"echo":
            sock.send_multipart([identity, op, *args])
            continue
        count, size = int(args[0]), int(args[1])
        if size not in frames:
            frames[size] = _bulk_frame(size)
        for _ in range(count):
            sock.send_multipart([identity, frames[size]], copy=False)


def _server(args: list[str], servers: list[subprocess.Popen[str]]) -> list[str]:
    """Start a baseline server child (added to `servers`, which are killed at the end); the
    words of its first line (its endpoint, and its public key for CURVE)."""
    proc = subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    servers.append(proc)
    assert proc.stdout is not None
    return proc.stdout.readline().split()


async def measure(address: str, token: str, sizes: list[int], repeats: int,
                  seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    values = {size: rng.standard_normal(size // 4, dtype=np.float32) for size in sizes}
    servers: list[subprocess.Popen[str]] = []
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    curve_sock = ctx.socket(zmq.DEALER)
    curve_sock.linger = 0
    for zsock in (sock, curve_sock):  # a refused handshake: an error, not a hang
        zsock.rcvtimeo = int(CALL_TIMEOUT_S * 1000)
    thread = BlockingThread("pyzmq")
    sides_names = ("omni", "omni_plaintext", "pyzmq", "pyzmq_curve")
    runs: dict[str, dict[str, list[float]]] = {side: {} for side in sides_names}
    errors: dict[str, dict[str, str]] = {side: {} for side in sides_names}
    try:
        (plain_ep,) = _server([str(ROOT / "perf" / "transport.py"), "--serve", "blocking"],
                              servers)
        sock.connect(plain_ep)
        try:  # the CURVE baseline: if it cannot start, it alone is missing (its errors)
            curve_ep, server_key = _server([str(Path(__file__).resolve()), "--serve-curve"],
                                           servers)
            curve_sock.curve_publickey, curve_sock.curve_secretkey = zmq.curve_keypair()
            curve_sock.curve_serverkey = server_key.encode()
            curve_sock.connect(curve_ep)
        except Exception as exc:
            for size in sizes:
                errors["pyzmq_curve"][_label(size)] = (f"the CURVE server did not start: "
                                                       f"{error_text(exc)}")
        async with omni.Runtime(cluster=address, token_file=token) as rt:
            await rt.deploy(nodes.SizeTcp)
            await rt.deploy(nodes.SizeTcpPlain)

            async def omni_gib_s(size: int, node: Any = nodes.SizeTcp) -> float:
                start = time.perf_counter()
                try:
                    with trio.fail_after(CALL_TIMEOUT_S):
                        out = await rt.run(node, value=values[size])
                except trio.TooSlowError:
                    raise RuntimeError(f"no result within {CALL_TIMEOUT_S:g} s: the call "
                                       "hung (trio.TooSlowError)") from None
                elapsed = time.perf_counter() - start
                if out != size:
                    raise RuntimeError(f"the node saw {out} bytes, not {size}")
                return size / elapsed / GIB

            async def omni_plaintext_gib_s(size: int) -> float:
                return await omni_gib_s(size, nodes.SizeTcpPlain)

            async def pyzmq_gib_s(size: int) -> float:
                return await thread.run(lambda: _pyzmq(sock, size))

            async def pyzmq_curve_gib_s(size: int) -> float:
                return await thread.run(lambda: _pyzmq(curve_sock, size))

            sides = {"omni": omni_gib_s, "omni_plaintext": omni_plaintext_gib_s,
                     "pyzmq": pyzmq_gib_s, "pyzmq_curve": pyzmq_curve_gib_s}
            order = [(side, size) for size in sizes for side in sides]
            for r in range(-1, repeats):  # -1: the warm-up round
                for side, size in order if r % 2 == 0 else reversed(order):
                    if _label(size) in errors[side]:
                        continue
                    try:
                        value = await sides[side](size)
                    except Exception as exc:  # recorded; this side of this size stops
                        errors[side][_label(size)] = error_text(exc)
                        continue
                    if r >= 0:
                        runs[side].setdefault(_label(size), []).append(value)
    finally:
        thread.close()
        sock.close()
        curve_sock.close()
        ctx.term()
        for server in servers:
            server.kill()
            server.wait()
    return {"runs": runs, "errors": errors,
            "env": {name: os.environ.get(name) for name in {**TCP_SETTINGS, **PLAINTEXT}}}


def main() -> None:
    if sys.argv[1:] == ["--serve-curve"]:
        serve_curve()
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address")
    parser.add_argument("token")
    parser.add_argument("sizes", nargs="+", type=int)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        result = trio.run(measure, args.address, args.token, args.sizes, args.repeats,
                          args.seed)
    except Exception as exc:  # reported to the parent, which records it in the claim
        result = {"error": error_text(exc)}
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
