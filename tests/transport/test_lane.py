"""Lanes (`omni.transport.lane`): a thread outside the event loop that receives notices over
a Unix socket and sends notices on, to other lanes and to RPC servers' Unix endpoints. Its
handler runs on its own thread; RPC clients (without heartbeats) reach it; what breaks the
format or is not a notice is refused and counted while the lane goes on; a peer that is gone
or stops reading is an error for the sender, never a wait; cancelling `run` ends the thread
and removes the socket file.

Real sockets in a short private folder (a Unix socket path has a 108-byte limit).
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from omni.transport import Codec, RPCClient, RPCServer, TransportError, WireError
from omni.transport import lane as lane_module
from omni.transport.lane import Lane
from omni.transport.unix import encode
from omni.transport.wire import Heartbeat, Request
from tests._wait import CAP_S, wait_until


@asynccontextmanager
async def running(lane: Lane) -> AsyncIterator[Lane]:
    async with trio.open_nursery() as nursery:
        await nursery.start(lane.run)
        yield lane
        nursery.cancel_scope.cancel()


Handled = list[tuple[str, Any, list[bytes], int]]


def recording(handled: Handled, then: Callable[[Request, list], None] | None = None
              ) -> Callable[[Request, list], None]:
    """A handler that records (method, body, payload, thread) and then calls `then`."""
    def handle(msg: Request, payload: list) -> None:
        body = Codec().decode_body(msg.body)
        handled.append((msg.method, body, [bytes(f) for f in payload], threading.get_ident()))
        if then is not None:
            then(msg, payload)
    return handle


def silent_peer(path: Path) -> socket.socket:
    """A Unix socket listening at `path` that reads nothing until the test accepts."""
    peer = socket.socket(socket.AF_UNIX)
    peer.bind(str(path))
    peer.listen()
    return peer


def lane_sending_to(folder: Path, peer: Path, frame: bytes, outcomes: list[str]) -> Lane:
    """A lane that sends `frame` to the peer at `peer` for each notice it gets, noting
    "queued" or the refusal in `outcomes`."""
    def handle(msg: Request, payload: list) -> None:
        try:
            lane.notify(f"unix://{peer}", "stage", payload=[frame])
            outcomes.append("queued")
        except TransportError as exc:
            outcomes.append(str(exc))

    lane = Lane(f"unix://{folder}/lane.sock", handle)
    return lane


async def notices_tried(lane: Lane, count: int, outcomes: list[str]) -> None:
    """Send `lane` `count` notices; return once it tried to send each on."""
    async with RPCClient(lane.endpoint, heartbeat_interval=None) as client:
        for _ in range(count):
            await client.notify("stage")
        await wait_until(lambda: len(outcomes) == count, f"{count} sends tried")


async def test_a_lane_runs_notices_on_its_own_thread_and_sends_on_to_an_rpc_server(folder):
    """An RPC client's notices reach the lane's handler, on a thread that is not the event
    loop's; the handler's own notices reach an RPC server's Unix endpoint, in order."""
    ended: list[tuple[int, list[bytes]]] = []

    def end(body: int, payload: list) -> None:
        ended.append((body, [bytes(f) for f in payload]))

    handled: Handled = []
    server_address = f"unix://{folder}/end.sock"
    lane = Lane(f"unix://{folder}/lane.sock", recording(handled, lambda msg, payload: lane.notify(
        server_address, "end", handled[-1][1] * 10, payload=[*payload, b"lane"])))
    server = RPCServer(server_address)
    server.register("end", end, body_type=int, with_payload=True, inline=True)
    with trio.fail_after(CAP_S):
        async with server, running(lane), RPCClient(lane.endpoint,
                                                    heartbeat_interval=None) as client:
            for i in range(50):
                await client.notify("stage", i, payload=[b"x" * i])
            await wait_until(lambda: len(ended) == 50, "the ends of 50 notices")
            assert ended == [(i * 10, [b"x" * i, b"lane"]) for i in range(50)]
            assert {thread for *_, thread in handled} != {threading.get_ident()}
            assert len({thread for *_, thread in handled}) == 1
            stats = lane.stats()
            assert (stats.received, stats.sent, stats.dropped) == (50, 50, 0)


async def test_two_lanes_pass_notices_back_and_forth(folder):
    """Lane a sends each notice to lane b and b back to a, until the count runs out: each
    writes to the other while the other writes to it, and neither waits on the other."""
    counts: list[int] = []
    a_address, b_address = f"unix://{folder}/a.sock", f"unix://{folder}/b.sock"

    def bounce(lane: Lane, other: str) -> Callable[[Request, list], None]:
        def handle(msg: Request, payload: list) -> None:
            left = lane.codec.decode_body(msg.body, int)
            counts.append(left)
            if left:
                lane.notify(other, "bounce", left - 1, payload=payload)
        return handle

    a = Lane(a_address, lambda msg, payload: a_handle(msg, payload))
    b = Lane(b_address, lambda msg, payload: b_handle(msg, payload))
    a_handle, b_handle = bounce(a, b_address), bounce(b, a_address)
    with trio.fail_after(CAP_S):
        async with running(a), running(b), RPCClient(a_address,
                                                     heartbeat_interval=None) as client:
            for _ in range(20):  # 20 rallies in flight at once, 100 hops each
                await client.notify("bounce", 100, payload=[b"p" * 100_000])
            await wait_until(lambda: len(counts) == 20 * 101, "20 rallies of 100 hops")
    assert sorted(counts) == sorted(list(range(101)) * 20)


async def test_what_breaks_the_format_or_is_no_notice_is_refused_and_counted(folder):
    handled: Handled = []
    lane = Lane(f"unix://{folder}/lane.sock", recording(handled))
    codec = Codec()
    with trio.fail_after(CAP_S):
        async with running(lane):
            path = str(folder / "lane.sock")
            with socket.socket(socket.AF_UNIX) as bad:  # a message of 10**6 frames
                bad.connect(path)
                bad.sendall(struct.pack("<I", 10**6))
                await wait_until(lambda: lane.stats().broken == 1, "the connection refused")
            with socket.socket(socket.AF_UNIX) as peer:
                peer.connect(path)
                # a call (it wants an answer, which a lane never gives), a heartbeat and
                # bytes that are no message at all are dropped; the notice after them runs
                for frame in (codec.encode(Request(5, "stage", codec.encode_body(1))),
                              codec.encode(Heartbeat(1)), b"\xc1garbage",
                              codec.encode(Request(0, "stage", codec.encode_body(2)))):
                    peer.sendall(b"".join(encode([frame])))
                await wait_until(lambda: len(handled) == 1, "the notice after them")
    assert handled[0][:2] == ("stage", 2)
    assert (lane.stats().received, lane.stats().dropped, lane.stats().broken) == (1, 3, 1)


async def test_a_handler_that_raises_is_counted_and_the_lane_goes_on(folder):
    def handle(msg: Request, payload: list) -> None:
        if lane.codec.decode_body(msg.body, int) == 1:
            raise WireError("one is refused")
        handled.append(msg.method)

    handled: list[str] = []
    lane = Lane(f"unix://{folder}/lane.sock", handle)
    with trio.fail_after(CAP_S):
        async with running(lane), RPCClient(lane.endpoint, heartbeat_interval=None) as client:
            for i in (1, 2):
                await client.notify("stage", i)
            await wait_until(lambda: handled == ["stage"], "the second notice")
    assert (lane.stats().received, lane.stats().dropped) == (2, 1)


async def test_sending_where_nobody_listens_fails_at_once(folder):
    errors: list[str] = []

    def handle(msg: Request, payload: list) -> None:
        try:
            lane.notify(f"unix://{folder}/nobody.sock", "stage", 1)
        except TransportError as exc:
            errors.append(str(exc))

    lane = Lane(f"unix://{folder}/lane.sock", handle)
    with trio.fail_after(CAP_S):
        async with running(lane), RPCClient(lane.endpoint, heartbeat_interval=None) as client:
            await client.notify("stage", 0)
            await wait_until(lambda: errors, "the failed send")
    assert "cannot reach" in errors[0] and "nobody.sock" in errors[0]
    assert lane.stats().unreachable == 1


async def test_a_peer_that_stops_reading_is_an_error_not_a_wait(folder, monkeypatch):
    """What the kernel does not take waits in the lane, up to a bound; past it the send
    fails, and the lane itself never blocks (it goes on handling notices)."""
    monkeypatch.setattr(lane_module, "MAX_PENDING_BYTES", 4 << 20)
    outcomes: list[str] = []
    silent = silent_peer(folder / "silent.sock")
    lane = lane_sending_to(folder, folder / "silent.sock", b"z" * (1 << 20), outcomes)
    with silent, trio.fail_after(CAP_S):
        async with running(lane):
            await notices_tried(lane, 12, outcomes)
    assert outcomes[0] == "queued"
    refused = [o for o in outcomes if o != "queued"]
    assert refused and all("does not read" in o for o in refused)


async def test_hand_to_loop_runs_on_the_event_loops_thread(folder):
    threads: list[int] = []
    lane = Lane(f"unix://{folder}/lane.sock",
                lambda msg, payload: lane.hand_to_loop(
                    lambda: threads.append(threading.get_ident())))
    with trio.fail_after(CAP_S):
        async with running(lane), RPCClient(lane.endpoint, heartbeat_interval=None) as client:
            await client.notify("stage")
            await wait_until(lambda: threads, "the handed-over function")
    assert threads == [threading.get_ident()]


async def test_cancelling_run_ends_the_thread_and_removes_the_socket_file(folder):
    """`run` waits for its thread, so its return is the thread's end."""
    lane = Lane(f"unix://{folder}/lane.sock", lambda msg, payload: None)
    with trio.fail_after(CAP_S):
        async with running(lane):
            assert (folder / "lane.sock").exists()
    assert not (folder / "lane.sock").exists()
    with socket.socket(socket.AF_UNIX) as probe, pytest.raises(FileNotFoundError):
        probe.connect(str(folder / "lane.sock"))


async def test_a_message_begun_is_finished_whatever_the_bound(folder, monkeypatch):
    """A message larger than the bound, to a peer that does not read yet, goes out whole once
    the peer reads (the kernel took its start: refusing the rest would cut the stream); the
    next one, behind it, is refused."""
    from omni.transport.unix import _Parser

    monkeypatch.setattr(lane_module, "MAX_PENDING_BYTES", 1 << 20)
    outcomes: list[str] = []
    late = silent_peer(folder / "late.sock")
    lane = lane_sending_to(folder, folder / "late.sock", bytes(range(256)) * 16384, outcomes)
    with late, trio.fail_after(CAP_S):
        async with running(lane):
            await notices_tried(lane, 2, outcomes)
            reader, _ = await trio.to_thread.run_sync(late.accept)
            with reader:
                parser = _Parser(max_frames=4, max_frame_bytes=8 << 20)
                parsing = parser.message()
                try:
                    view = next(parsing)
                    while True:
                        view = parsing.send(await trio.to_thread.run_sync(reader.recv_into, view))
                except StopIteration as done:
                    frames = done.value
    assert outcomes[0] == "queued" and "does not read" in outcomes[1]
    assert bytes(frames[1]) == bytes(range(256)) * 16384  # the 4 MiB frame, whole
