"""RPC over Unix sockets (``unix://PATH``), the same-host path between drivers and workers:
calls round-trip and multiplex, large frames arrive intact and in order through a full socket
buffer, a client reaches a server that binds later or comes back, a peer that breaks the
format is disconnected without harming others, and the socket file goes with the server.

Real sockets in a short private folder (a Unix socket path has a 108-byte limit); one test
runs the server in another process.
"""

from __future__ import annotations

import os
import random
import socket
import struct
import subprocess
import sys
import textwrap

import pytest
import trio

from omni.transport import PeerGone, Reply, RPCClient, RPCServer, TransportError
from tests._wait import CAP_S, wait_until


async def echo(body):
    return body


async def reverse_payload(body, payload):
    return Reply(len(payload), list(reversed(payload)))


def make_server(address: str, **kwargs) -> RPCServer:
    server = RPCServer(address, **kwargs)
    server.register("echo", echo)
    server.register("payload", reverse_payload, with_payload=True)
    return server


async def test_calls_round_trip_and_multiplex_over_a_unix_socket(folder):
    address = f"unix://{folder}/s.sock"
    results = {}
    with trio.fail_after(CAP_S):
        async with make_server(address) as server, RPCClient(address) as client:
            assert server.endpoint == address
            assert await client.call("echo", {"a": [1, "x", None]}) == {"a": [1, "x", None]}

            async def one(i: int) -> None:
                results[i] = await client.call("echo", i)

            async with trio.open_nursery() as nursery:
                for i in range(500):
                    nursery.start_soon(one, i)
            assert server.stats().completed == 501
    assert results == {i: i for i in range(500)}


async def test_large_frames_arrive_intact_and_in_order_past_the_socket_buffer(folder):
    """Frames far larger than the kernel's socket buffer are written in pieces by the
    writer task; concurrent calls must neither interleave nor reorder their bytes."""
    rng = random.Random(7)
    address = f"unix://{folder}/s.sock"
    payloads = [[rng.randbytes(rng.choice([10, 70_000, 3 << 20])) for _ in range(3)]
                for _ in range(12)]
    replies = {}
    with trio.fail_after(CAP_S):
        async with make_server(address) as server, RPCClient(address) as client:

            async def one(i: int) -> None:
                replies[i] = await client.call_with_payload("payload", None,
                                                            payload=payloads[i])

            async with trio.open_nursery() as nursery:
                for i in range(len(payloads)):
                    nursery.start_soon(one, i)
            assert server.stats().dropped == 0
    for i, frames in enumerate(payloads):
        assert replies[i].body == 3
        assert [bytes(f) for f in replies[i].payload] == list(reversed(frames))
        assert all(isinstance(f, memoryview) == (len(f) >= 65536) for f in replies[i].payload)


async def test_a_client_reaches_a_server_that_binds_after_it_and_one_that_comes_back(folder):
    address = f"unix://{folder}/s.sock"
    # Until the server binds, the client hears nothing: with 0.5 s between pings it waits
    # 1.5 s before it gives up, far more than binding takes even on a loaded machine.
    with trio.fail_after(CAP_S):
        async with RPCClient(address, heartbeat_interval=0.5) as client:
            async with trio.open_nursery() as nursery:
                early = []

                async def call_early() -> None:
                    early.append(await client.call("echo", "queued"))

                nursery.start_soon(call_early)
                await wait_until(lambda: client.stats().calls == 1)  # sent before the bind
                async with make_server(address):
                    await wait_until(lambda: early == ["queued"])
            await wait_until(lambda: not client.peer_alive)
            with pytest.raises(PeerGone):
                await client.call("echo", "nobody")
            async with make_server(address):
                await wait_until(lambda: client.peer_alive)
                assert await client.call("echo", "back") == "back"


async def test_a_peer_that_breaks_the_format_is_cut_off_and_others_are_served(folder):
    address = f"unix://{folder}/s.sock"
    path = str(folder / "s.sock")
    bad = [
        struct.pack("<I", 0),  # no frames
        struct.pack("<I", 1 << 20),  # more frames than the limit
        struct.pack("<IQ", 1, 1 << 40),  # a frame over the size limit
        struct.pack("<IQ", 1, 100) + b"cut short",  # the peer leaves mid-message
    ]
    with trio.fail_after(CAP_S):
        async with make_server(address) as server, RPCClient(address) as client:
            for message in bad:
                raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                raw.connect(path)
                raw.sendall(message)
                raw.shutdown(socket.SHUT_WR)
                raw.settimeout(CAP_S)
                assert await trio.to_thread.run_sync(raw.recv, 1) == b""  # cut off
                raw.close()
            garbage = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            garbage.connect(path)
            garbage.sendall(struct.pack("<IQ", 1, 5) + b"\xffjunk")  # frames, not msgpack
            await wait_until(lambda: server.stats().dropped == 1)
            garbage.close()
            assert await client.call("echo", "fine") == "fine"


async def test_the_socket_file_goes_with_the_server_and_a_stale_one_is_replaced(folder):
    address = f"unix://{folder}/s.sock"
    path = folder / "s.sock"
    async with make_server(address):
        assert path.exists()
        with pytest.raises(TransportError, match="address already in use"):
            async with make_server(address):
                pass
    assert not path.exists()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))  # bound, never listening: what a killed process leaves behind
    stale.close()
    with trio.fail_after(CAP_S):
        async with make_server(address), RPCClient(address) as client:
            assert await client.call("echo", 1) == 1


@pytest.mark.proc  # a Unix socket between two processes
async def test_a_server_in_another_process(folder):
    address = f"unix://{folder}/s.sock"
    code = textwrap.dedent(f"""
        import trio
        from omni.transport import RPCServer
        async def shout(body):
            return body.upper()
        async def main():
            server = RPCServer({address!r})
            server.register("shout", shout)
            async with server:
                print("ready", flush=True)
                await trio.sleep_forever()
        trio.run(main)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        with trio.fail_after(CAP_S):
            async with RPCClient(address) as client:
                assert await client.call("shout", "same host") == "SAME HOST"
                proc.kill()
                await wait_until(lambda: not client.peer_alive)
    finally:
        proc.kill()
        proc.wait()
    assert (folder / "s.sock").exists()  # a killed server leaves its file: the next replaces it
    os.unlink(folder / "s.sock")


async def test_remove_stale_takes_the_files_nobody_listens_on_and_leaves_live_ones(folder):
    from omni.transport.unix import remove_stale

    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(folder / "w-1-dead.sock"))
    dead.close()
    (folder / "w-2-other.txt").write_text("not a socket")
    async with make_server(f"unix://{folder}/w-3-live.sock"):
        assert remove_stale(folder, "w-*.sock") == 1
        assert sorted(p.name for p in folder.iterdir()) == ["w-2-other.txt", "w-3-live.sock"]
