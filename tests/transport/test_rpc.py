"""RPC over ROUTER/DEALER: calls round-trip and multiplex, time out, cancel their handler,
carry remote errors by name, survive garbage, refuse oversize messages, move payload frames
byte-identical, and notice a server that stops answering heartbeats.

Everything runs on loopback with ephemeral ports. Real sockets deliver in real time, so the
time-dependent tests use short real heartbeat intervals and timeouts (a mock clock that
autojumps would jump while a message is on the wire and time calls out before the server saw
them). None of them asserts how fast something happened: a test waits for a condition (capped
only against a hang), counts heartbeats rather than seconds, or checks a lower bound that trio's
clock guarantees (a timeout never fires early). Where a test needs "the peer is NOT declared
gone", the heartbeat window is wide against the work done in it, and the comment says why.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import random
import re
import threading

import msgspec
import pytest
import trio
import zmq

from omni.transport import (
    PeerGone,
    Reply,
    RPCClient,
    RPCError,
    RPCServer,
    RPCTimeout,
    TransportError,
    WireError,
    WireLimits,
    wire,
)
from tests._wait import CAP_S, wait_until


class Point(msgspec.Struct):
    x: int
    y: int


async def add(p: Point) -> Point:
    return Point(p.x + p.y, p.x * p.y)


async def echo(body):
    return body


async def fail(body):
    raise ValueError(f"no good: {body}")


async def echo_payload(body, payload):
    return Reply({"frames": len(payload)}, list(reversed(payload)))


def make_server(**kwargs) -> RPCServer:
    server = RPCServer(**kwargs)
    server.register("add", add)
    server.register("echo", echo)
    server.register("fail", fail)
    server.register("payload", echo_payload, with_payload=True)
    return server


async def serve_until_cancelled(server, stop, stopped=None,
                                task_status=trio.TASK_STATUS_IGNORED):
    """Run `server` until `stop` is cancelled: a peer that goes silent on demand; `stopped`
    (an Event) is set once its socket is closed."""
    try:
        with stop:
            async with server:
                task_status.started(server.endpoint)
                await trio.sleep_forever()
    finally:
        if stopped is not None:
            stopped.set()


async def test_a_call_round_trips_a_struct_body_into_the_handlers_type():
    with trio.fail_after(CAP_S):
        async with make_server() as server, RPCClient(server.endpoint) as client:
            assert await client.call("add", Point(3, 4), result_type=Point) == Point(7, 12)
            assert await client.call("echo", {"a": [1, 2.5, "x", b"y", None]}) == {
                "a": [1, 2.5, "x", b"y", None]}
            assert await client.call("echo") is None
            stats = client.stats()
            assert (stats.calls, stats.completed, stats.in_flight) == (3, 3, 0)


async def test_many_concurrent_calls_are_multiplexed_on_one_socket():
    rng = random.Random(0)
    delays = [rng.random() * 0.02 for _ in range(200)]

    async def slow_double(i: int) -> int:
        await trio.sleep(delays[i])  # replies come back out of order
        return 2 * i

    server = RPCServer()
    server.register("double", slow_double)
    results: dict[int, int] = {}
    with trio.fail_after(CAP_S):
        async with server, RPCClient(server.endpoint) as client:

            async def one(i: int) -> None:
                results[i] = await client.call("double", i)

            async with trio.open_nursery() as nursery:
                for i in range(len(delays)):
                    nursery.start_soon(one, i)
            assert client.stats().in_flight == 0 and server.stats().in_flight == 0
    assert results == {i: 2 * i for i in range(len(delays))}


async def test_a_call_past_its_timeout_raises_rpc_timeout_and_cancels_the_handler():
    started, cancelled = trio.Event(), trio.Event()

    async def forever(body):
        started.set()
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    server = make_server()
    server.register("forever", forever)
    with trio.fail_after(CAP_S):
        async with server, RPCClient(server.endpoint) as client:
            start = trio.current_time()
            with pytest.raises(RPCTimeout, match=r"'forever' timed out after 0\.2 s"):
                await client.call("forever", timeout=0.2)
            assert trio.current_time() - start >= 0.2
            await cancelled.wait()  # the Cancel reached the server
            assert started.is_set() and client.stats().timeouts == 1
            assert await client.call("echo", 1, timeout=CAP_S) == 1


async def test_cancelling_the_caller_cancels_the_server_handler():
    started, cancelled = trio.Event(), trio.Event()

    async def forever(body):
        started.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            cancelled.set()
            raise

    server = make_server()
    server.register("forever", forever)
    with trio.fail_after(CAP_S):
        async with server, RPCClient(server.endpoint) as client:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.call, "forever")
                await started.wait()
                nursery.cancel_scope.cancel()
            await cancelled.wait()
            await wait_until(lambda: server.stats().cancelled == 1)
            assert server.stats().in_flight == 0 and client.stats().cancelled == 1
            assert await client.call("echo", "still serving") == "still serving"


async def test_a_handler_exception_is_an_rpc_error_by_name_and_the_server_keeps_serving():
    with trio.fail_after(CAP_S):
        async with make_server() as server, RPCClient(server.endpoint) as client:
            with pytest.raises(RPCError) as info:
                await client.call("fail", 42)
            assert info.value.remote_type == "ValueError"
            assert info.value.remote_message == "no good: 42"
            assert info.value.method == "fail"
            assert await client.call("echo", 5) == 5
            assert server.stats().failed == 1 and server.stats().completed == 1


async def test_an_unknown_method_or_a_body_of_the_wrong_type_is_an_rpc_error():
    with trio.fail_after(CAP_S):
        async with make_server() as server, RPCClient(server.endpoint) as client:
            with pytest.raises(RPCError, match="UnknownMethod: no method 'nope'"):
                await client.call("nope")
            with pytest.raises(RPCError) as info:
                await client.call("add", "not a point")
            assert info.value.remote_type == "WireError"
            assert server.stats().unknown_method == 1


async def test_garbage_frames_from_a_raw_dealer_are_counted_and_dropped():
    garbage = [
        [b"\x00\x01\x02 not msgpack"],
        [b""],
        [msgspec.msgpack.encode([wire.PROTOCOL_VERSION, ["req", "id?", 3]])],  # wrong shape
        [msgspec.msgpack.encode([wire.PROTOCOL_VERSION, ["reboot", 1]])],  # unknown kind
        [msgspec.msgpack.encode([99, ["hb", 1]])],  # another version
        [wire.encode(wire.Response(1))],  # a reply has no business arriving at a server
        [b"\xff" * 10, b"payload"],
    ]
    with trio.fail_after(CAP_S):
        async with make_server() as server, RPCClient(server.endpoint) as client:
            raw = zmq.Context.instance().socket(zmq.DEALER)
            raw.linger = 0
            raw.connect(server.endpoint)
            try:
                for frames in garbage:
                    raw.send_multipart(frames)
                await wait_until(lambda: server.stats().dropped == len(garbage))
            finally:
                raw.close()
            assert await client.call("echo", "fine") == "fine"
            rejected = server.stats().wire
            assert (rejected.rejected_malformed, rejected.rejected_unknown,
                    rejected.rejected_version) == (4, 1, 1)


async def test_oversize_messages_are_refused_on_both_sides():
    limits = WireLimits(max_control_bytes=4096)
    with trio.fail_after(CAP_S):
        async with make_server(limits=limits) as server, \
                RPCClient(server.endpoint, limits=limits) as client:
            with pytest.raises(WireError, match="control message limit"):
                await client.call("echo", b"x" * 5000)  # refused before it is sent
            raw = zmq.Context.instance().socket(zmq.DEALER)
            raw.linger = 0
            raw.connect(server.endpoint)
            try:
                raw.send(b"\x92\x01" + b"\x00" * 5000)
                await wait_until(lambda: server.stats().wire.rejected_oversize == 1)
            finally:
                raw.close()
            assert await client.call("echo", b"x" * 1000) == b"x" * 1000


async def test_a_reply_with_too_many_payload_frames_is_dropped_by_the_client():
    """A hostile server cannot make a client hold any number of frames: the reply is dropped
    and its call times out; a later honest reply gets through."""
    limits = WireLimits(max_payload_frames=4)
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        with trio.fail_after(CAP_S):
            async with RPCClient(f"tcp://127.0.0.1:{port}", limits=limits,
                                 heartbeat_interval=None) as client:
                async def serve(frames_after: int) -> None:
                    request = None
                    while type(request) is not wire.Request:  # skip the last call's Cancel
                        await wait_until(lambda: router.poll(0), "a request")
                        identity, control = router.recv_multipart()[:2]
                        request = wire.decode(control)
                    reply = [identity, wire.encode(wire.Response(request.id))]
                    router.send_multipart(reply + [b"x"] * frames_after)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(serve, 5)
                    with pytest.raises(RPCTimeout):
                        await client.call("echo", "hi", timeout=0.5)
                # The call timed out whether or not the reply had arrived by then: wait for it.
                await wait_until(lambda: client.stats().dropped == 1)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(serve, 4)
                    reply = await client.call_with_payload("echo", "hi", timeout=5)
                assert len(reply.payload) == 4
    finally:
        router.close()


async def test_payload_frames_round_trip_byte_identical_including_zero_copy_ones():
    rng = random.Random(1)
    big = rng.randbytes(3 << 20)  # > 64 KiB: sent and received without a copy
    frames = [b"", b"small", big, memoryview(bytearray(b"view" * 100))]
    with trio.fail_after(CAP_S):
        async with make_server() as server, RPCClient(server.endpoint) as client:
            reply = await client.call_with_payload("payload", None, payload=frames)
            assert reply.body == {"frames": 4}
            assert [bytes(f) for f in reply.payload] == [bytes(f) for f in reversed(frames)]
            assert isinstance(reply.payload[1], memoryview)  # the big one, zero-copy
            assert await client.call("payload", payload=[b"a"]) == {"frames": 1}


async def test_too_many_requests_in_flight_are_refused_as_server_busy():
    release = trio.Event()

    async def wait(body):
        await release.wait()
        return body

    server = RPCServer(max_in_flight=2)
    server.register("wait", wait)
    with trio.fail_after(CAP_S):
        async with server, RPCClient(server.endpoint) as client:
            async with trio.open_nursery() as nursery:
                for i in range(2):
                    nursery.start_soon(client.call, "wait", i)
                await wait_until(lambda: server.stats().in_flight == 2)
                with pytest.raises(RPCError, match="ServerBusy"):
                    await client.call("wait", 3)
                release.set()
            assert server.stats().busy == 1


async def test_a_silent_server_fails_in_flight_calls_with_peer_gone():
    """A call in flight fails with PeerGone once the server has been silent for three beats,
    and new calls fail at once, without being sent, while it stays gone."""
    interval = 0.2  # the window (0.6 s) is wide against the in-process pongs that keep it open
    started = trio.Event()

    async def forever(body):
        started.set()
        await trio.sleep_forever()

    server = make_server()
    server.register("forever", forever)
    stop = trio.CancelScope()
    run_server = functools.partial(serve_until_cancelled, server, stop)

    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            endpoint = await nursery.start(run_server)
            async with RPCClient(endpoint, heartbeat_interval=interval) as client:
                async with trio.open_nursery() as calls:
                    assert await client.call("echo", 1) == 1  # answered: the peer is alive
                    await wait_until(lambda: server.stats().heartbeats >= 3)  # beats answered
                    assert client.peer_alive
                    async def stop_when_started():
                        await started.wait()
                        stop.cancel()
                    calls.start_soon(stop_when_started)
                    with pytest.raises(PeerGone) as gone:
                        await client.call("forever")
                # Declared only after three intervals of silence (trio's clock, a lower bound).
                assert gone.value.silent_for >= 3 * interval - 1e-9
                assert not client.peer_alive and client.stats().peer_gone == 1
                sent = client.stats().calls
                with pytest.raises(PeerGone):  # new calls fail at once while it is gone
                    await client.call("echo", 2)
                assert client.stats().calls == sent  # refused before it was sent


def _raw_router(ready: list, stop: threading.Event) -> None:
    """A raw ROUTER in a thread (its answers come whatever the caller's event loop does) that
    answers heartbeats and echoes."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.linger = 0
    ready.append(f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}")
    try:
        while not stop.is_set():
            if not sock.poll(10):
                continue
            identity, control, *_ = sock.recv_multipart()
            msg = wire.decode(control)
            if type(msg) is wire.Heartbeat:
                sock.send_multipart([identity, control])
            elif type(msg) is wire.Request:
                sock.send_multipart([identity, wire.encode(wire.Response(msg.id, msg.body))])
    finally:
        sock.close()


async def test_a_stall_in_the_callers_own_process_is_not_taken_for_a_gone_server(mock_clock):
    """While this process's event loop is blocked (a long copy, a loaded machine) it sends no
    pings: the silence that follows is its own, so a server that answers is not declared gone.

    The stall starts as a reply arrives (no ping unanswered) and lasts longer than the three
    intervals of silence that would do for a gone peer: the clock jumps while no task runs,
    which is what a blocked event loop looks like from inside. After it the client may send
    two more pings before a third unanswered one would count: that leaves the router 0.6 s
    to answer one ping, a margin a loaded machine does not eat.
    """
    mock_clock.rate = 1  # real time passes as well: the router answers on real sockets
    interval, ready, stop = 0.3, [], threading.Event()
    thread = threading.Thread(target=_raw_router, args=(ready, stop), daemon=True)
    thread.start()
    try:
        with trio.fail_after(CAP_S):
            await wait_until(lambda: ready)
            async with RPCClient(ready[0], heartbeat_interval=interval) as client:
                assert await client.call("echo", 1) == 1
                mock_clock.jump(4 * interval)  # the event loop stalls, right after a reply
                pings = client.stats().heartbeats_sent
                # the heartbeat task looks after the stall and pings again
                await wait_until(lambda: client.stats().heartbeats_sent > pings)
                assert await client.call("echo", 2) == 2
                assert client.peer_alive and client.stats().peer_gone == 0
    finally:
        stop.set()
        thread.join(5)


async def test_detection_takes_three_intervals_of_silence_and_a_few_pings():
    """A stopped server is declared gone after three intervals of silence, and no later than a
    ping or two after the third one it left unanswered. The upper bound is counted in pings,
    not seconds: a loaded machine sends fewer pings in a stall, never more."""
    interval = 0.1
    server = make_server()
    stop, stopped = trio.CancelScope(), trio.Event()
    run_server = functools.partial(serve_until_cancelled, server, stop, stopped)

    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            endpoint = await nursery.start(run_server)
            async with RPCClient(endpoint, heartbeat_interval=interval) as client:
                await client.call("echo", 0)
                await wait_until(lambda: server.stats().heartbeats >= 2)
                stop.cancel()
                await stopped.wait()
                pings_before = client.stats().heartbeats_sent
                await wait_until(lambda: not client.peer_alive)
                # three unanswered after the last answer, one more if the check that follows
                # the third ran late, one more if the last answer was still on its way
                assert client.stats().heartbeats_sent - pings_before <= 3 + 2
                with pytest.raises(PeerGone) as gone:
                    await client.call("echo", 1)
                assert gone.value.silent_for >= 3 * interval - 1e-9
                assert client.stats().peer_gone == 1


async def test_a_slow_handler_on_a_live_server_is_not_mistaken_for_a_gone_peer():
    """A handler busy for longer than the heartbeat window: the server answers pings meanwhile.

    The handler returns once the client has sent six pings during the call, so the call
    outlasts the three-interval window however slow the machine is; with 0.2 s between pings
    a spurious "gone" would need the in-process server's pongs held up for 0.4 s or more.
    """
    interval = 0.2
    clients: list[RPCClient] = []

    async def slow(body):
        pings = clients[0].stats().heartbeats_sent
        await wait_until(lambda: clients[0].stats().heartbeats_sent >= pings + 6)
        return body

    server = make_server()
    server.register("slow", slow)
    with trio.fail_after(CAP_S):
        async with server, RPCClient(server.endpoint, heartbeat_interval=interval) as client:
            clients.append(client)
            assert await client.call("slow", "done") == "done"
            assert client.peer_alive and client.stats().peer_gone == 0


async def test_a_client_recovers_when_a_server_returns_on_the_same_endpoint():
    interval = 0.2  # once back, the server stays "alive" for 0.6 s of silence: the call fits
    with trio.fail_after(CAP_S):
        async with make_server() as first:
            endpoint = first.endpoint
        async with RPCClient(endpoint, heartbeat_interval=interval) as client:
            await wait_until(lambda: not client.peer_alive)
            async with make_server(bind=endpoint):
                await wait_until(lambda: client.peer_alive)
                assert await client.call("echo", "back") == "back"


async def test_binding_an_address_in_use_raises_a_transport_error_naming_it():
    async with make_server() as first:
        message = re.escape(f"{first.endpoint}: address already in use")
        with pytest.raises(TransportError, match=message):
            async with make_server(bind=first.endpoint):
                pass
        assert "RPCServer tcp://127.0.0.1:" in repr(first)


async def test_using_a_client_outside_async_with_raises_transport_error():
    client = RPCClient("tcp://127.0.0.1:1")
    with pytest.raises(TransportError, match="not running"):
        await client.call("echo")
    assert "stopped" in repr(client)


def test_registering_a_method_twice_or_an_undecodable_body_type_is_refused():
    server = make_server()
    with pytest.raises(ValueError, match="already registered"):
        server.register("echo", echo)
    with pytest.raises(ValueError, match="cannot decode"):  # msgspec refuses this union
        server.register("bad", echo, body_type=list[int] | tuple[str, ...])

    class Local(msgspec.Struct):  # not resolvable from the module: say so, never guess Any
        a: int

    async def local(body: Local) -> int:
        return body.a

    with pytest.raises(ValueError, match="pass body_type="):
        server.register("local", local)
    server.register("local", local, body_type=Local)


async def test_stats_and_repr_summarise_the_state():
    with trio.fail_after(CAP_S):
        async with make_server() as server, RPCClient(server.endpoint) as client:
            await client.call("echo", 1)
            with pytest.raises(RPCError):
                await client.call("fail", 1)
            assert repr(client) == (f"<RPCClient {server.endpoint} alive in_flight=0 calls=2 "
                                    "timeouts=0 failed=1>")
            assert repr(server) == (f"<RPCServer {server.endpoint} methods=4 in_flight=0 "
                                    "completed=1 failed=1 dropped=0>")
            assert server.stats().requests == 2 and client.stats().completed == 1


async def test_closing_a_client_fails_calls_still_in_flight_in_other_tasks():
    started = trio.Event()

    async def forever(body):
        started.set()
        await trio.sleep_forever()

    server = make_server()
    server.register("forever", forever)
    with trio.fail_after(CAP_S):
        async with server, trio.open_nursery() as nursery:
            client = RPCClient(server.endpoint)
            async with client:
                async def caller():
                    with pytest.raises(TransportError, match="closed with the call in flight"):
                        await client.call("forever")

                nursery.start_soon(caller)
                await started.wait()


async def test_an_error_in_the_block_of_a_server_or_client_comes_out_as_is():
    with pytest.raises(KeyError):
        async with make_server():
            raise KeyError("server")
    with pytest.raises(KeyError):
        async with RPCClient("tcp://127.0.0.1:1"):
            raise KeyError("client")


async def test_each_request_starts_in_a_fresh_context_on_a_reused_worker():
    """Handlers run on reused worker tasks, yet a context variable one request sets (and
    never resets) is not seen by the next; one set and reset across awaits works."""
    var: contextvars.ContextVar[object] = contextvars.ContextVar("request", default=None)

    async def leak(body):
        seen = var.get()
        var.set(body)  # never reset
        await trio.sleep(0)
        token = var.set("inner")
        await trio.sleep(0)
        var.reset(token)
        return [seen, var.get()]

    server = RPCServer()
    server.register("leak", leak)
    with trio.fail_after(CAP_S):
        async with server, RPCClient(server.endpoint) as client:
            for i in range(3):
                assert await client.call("leak", i) == [None, i]


async def test_a_short_timeout_fires_on_time_behind_longer_ones_and_bad_ones_are_refused():
    async def forever(body):
        await trio.sleep_forever()

    server = RPCServer()
    server.register("forever", forever)
    with trio.fail_after(CAP_S):
        async with server, RPCClient(server.endpoint, timeout=30) as client:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(client.call, "forever", timeout=120))
                await wait_until(lambda: server.stats().in_flight == 1)
                start = trio.current_time()
                with pytest.raises(RPCTimeout):
                    await client.call("forever", timeout=0.1)
                # Never early; and not behind the 120 s call: the 30 s bound is that wide so
                # that a loaded machine cannot reach it, yet a timer stuck behind the longer
                # call would.
                assert 0.1 <= trio.current_time() - start < 30
                nursery.cancel_scope.cancel()
            for bad in (-1, float("nan")):
                with pytest.raises(ValueError, match="timeout"):
                    await client.call("forever", timeout=bad)
            assert client.stats().calls == 2 and client.stats().timeouts == 1
            await wait_until(lambda: server.stats().in_flight == 0)


async def test_workers_survive_a_storm_of_timeouts_and_cancellations():
    rng = random.Random(2)

    async def nap(seconds: float) -> float:
        await trio.sleep(seconds)
        return seconds

    server = RPCServer()
    server.register("nap", nap)
    with trio.fail_after(CAP_S):
        async with server, RPCClient(server.endpoint) as client:

            async def one(seconds: float, timeout: float) -> None:
                with contextlib.suppress(RPCTimeout):
                    assert await client.call("nap", seconds, timeout=timeout) == seconds

            async with trio.open_nursery() as nursery:
                for _ in range(100):
                    nursery.start_soon(one, rng.random() * 0.05, rng.random() * 0.05)
            await wait_until(lambda: server.stats().in_flight == 0)
            s = server.stats()
            assert s.completed + s.cancelled == 100 and client.stats().in_flight == 0
            assert await client.call("nap", 0.0) == 0.0


@pytest.mark.parametrize("kind", ["tcp", "unix"])
async def test_a_notice_runs_its_handler_and_is_never_answered(kind, tmp_path):
    """One-way messages: the handler runs with the body and payload; nothing comes back, not
    even for a handler that raises or a method that does not exist, and calls on the same
    client are not confused by them."""
    got: list[tuple[int, bytes]] = []

    async def note(body: int, payload):  # (handlers run concurrently, as calls' do)
        got.append((body, bytes(payload[0])))
        return "an answer nobody reads"

    bind = "tcp://127.0.0.1:*" if kind == "tcp" else f"unix://{tmp_path}/s.sock"
    server = make_server(bind=bind)
    server.register("note", note, with_payload=True)
    with trio.fail_after(CAP_S):
        async with server, RPCClient(server.endpoint) as client:
            for i in (1, 2):
                await client.notify("note", i, payload=[b"x" * i])
            await client.notify("fail", 0)
            await client.notify("nope", 0)
            await client.notify("note", 3, payload=[b"end"])
            await wait_until(lambda: len(got) == 3, "three notes")
            assert await client.call("echo", 7) == 7  # the only answer
            assert sorted(got) == [(1, b"x"), (2, b"xx"), (3, b"end")]
            stats, sent = server.stats(), client.stats()
            assert (stats.notices, stats.failed, stats.unknown_method) == (5, 1, 1)
            assert (sent.notices, sent.late_replies, sent.dropped, sent.calls) == (5, 0, 0, 1)
            assert stats.in_flight == 0


async def test_a_notice_to_a_gone_server_is_refused_with_peer_gone():
    stop = trio.CancelScope()
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            endpoint = await nursery.start(serve_until_cancelled, make_server(), stop)
            async with RPCClient(endpoint, heartbeat_interval=0.05) as client:
                await client.call("echo", 1)
                stop.cancel()
                await wait_until(lambda: not client.peer_alive, "the server declared gone")
                with pytest.raises(PeerGone):
                    await client.notify("echo", 2)


async def test_an_inline_handler_answers_calls_and_notices_like_any_other():
    """A plain function registered inline: run where the message is read; its result, its
    failure and its notices look to the caller as any handler's do."""
    seen: list[int] = []

    def square(x: int) -> int:
        seen.append(x)
        if x < 0:
            raise ValueError(f"{x} is negative")
        return x * x

    def frames(body: int, payload) -> Reply:
        return Reply(body, [bytes(f) * 2 for f in payload])

    server = make_server()
    server.register("square", square, inline=True)
    server.register("frames", frames, body_type=int, with_payload=True, inline=True)
    with trio.fail_after(CAP_S):
        async with server, RPCClient(server.endpoint) as client:
            assert await client.call("square", 7) == 49
            with pytest.raises(RPCError, match="ValueError: -1 is negative"):
                await client.call("square", -1)
            reply = await client.call_with_payload("frames", 3, payload=[b"ab"])
            assert (reply.body, [bytes(f) for f in reply.payload]) == (3, [b"abab"])
            await client.notify("square", 5)
            await wait_until(lambda: seen[-1:] == [5], "the notice handled")
            stats = server.stats()
            assert (stats.completed, stats.failed, stats.notices, stats.in_flight) == (3, 1, 1, 0)


async def test_an_at_once_function_answers_what_needs_no_waiting_and_passes_on_the_rest():
    """`at_once` runs where the message is read: its result is the reply (the handler never
    runs), its failure the error; when it returns None the handler answers as usual."""
    ran: list[tuple[str, int]] = []

    def now(x: int) -> int | None:
        ran.append(("now", x))
        if x == 13:
            raise ValueError("13 is refused at once")
        return x * 10 if x % 2 == 0 else None

    async def later(x: int) -> int:
        ran.append(("later", x))
        await trio.sleep(0)
        return -x

    server = make_server()
    server.register("work", later, at_once=now)
    with trio.fail_after(CAP_S):
        async with server, RPCClient(server.endpoint) as client:
            assert [await client.call("work", x) for x in (2, 3, 4)] == [20, -3, 40]
            with pytest.raises(RPCError, match="ValueError: 13 is refused at once"):
                await client.call("work", 13)
            stats = server.stats()
            assert (stats.requests, stats.completed, stats.failed) == (4, 3, 1)
    assert ran == [("now", 2), ("now", 3), ("later", 3), ("now", 4), ("now", 13)]


async def test_a_notice_refused_for_lack_of_room_is_handed_to_its_refusal():
    """A server at `max_in_flight` answers a call ServerBusy; a notice has no answer, so the
    method's `refused` gets its body instead (and the handler never runs)."""
    release = trio.Event()
    ran: list[int] = []
    refused: list[int] = []

    async def hold(x: int) -> None:
        ran.append(x)
        await release.wait()

    server = RPCServer(max_in_flight=1)
    server.register("hold", hold, refused=refused.append)
    server.register("echo", echo)
    with trio.fail_after(CAP_S):
        async with server, RPCClient(server.endpoint) as client:
            await client.notify("hold", 1)
            await wait_until(lambda: ran == [1], "the first notice running")
            await client.notify("hold", 2)
            await wait_until(lambda: refused == [2], "the second one refused")
            with pytest.raises(RPCError, match="ServerBusy"):
                await client.call("echo", 3)
            release.set()
            await wait_until(lambda: server.stats().in_flight == 0, "the first one done")
            assert await client.call("echo", 4) == 4
            assert ran == [1] and server.stats().busy == 2
