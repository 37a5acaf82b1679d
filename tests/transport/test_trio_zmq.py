"""Trio ZeroMQ sockets: one owner task per socket, any number of tasks sending and receiving
through it, zero-copy large frames, backpressure, clear errors; with either way of waking the
owner (epoll + eventfd, or cancelling its wait).

Real sockets deliver in real time, so these tests bound themselves with `trio.fail_after`
rather than a mock clock (a mock clock would jump while a message is on the wire). The bound
only stops a hang; what a test asserts never depends on how fast the machine is.
"""

from __future__ import annotations

import re

import pytest
import trio
import trio.testing
import zmq

from omni.transport import TransportError, open_socket, wait_sent
from omni.transport.trio_zmq import ZERO_COPY_THRESHOLD
from tests._wait import CAP_S, wait_until

LOOPBACK = "tcp://127.0.0.1:*"
WAKERS = [pytest.param(True, id="epoll"), pytest.param(False, id="cancel")]


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.term()


@pytest.mark.parametrize("use_epoll", WAKERS)
async def test_dealer_router_round_trip_on_an_ephemeral_port(ctx, use_epoll):
    with trio.fail_after(CAP_S):
        async with open_socket(ctx, zmq.ROUTER, bind=LOOPBACK, use_epoll=use_epoll) as router, \
                open_socket(ctx, zmq.DEALER, connect=router.endpoint,
                            use_epoll=use_epoll) as dealer:
            assert router.endpoint.startswith("tcp://127.0.0.1:")
            assert not router.endpoint.endswith("*")
            await dealer.send_multipart([b"hello", b"world"])
            identity, *frames = await router.recv_multipart()
            assert frames == [b"hello", b"world"]
            await router.send_multipart([identity, b"back"])
            assert await dealer.recv_multipart() == [b"back"]
            assert dealer.stats().messages_sent == 1 and dealer.stats().messages_received == 1
            assert "DEALER" in repr(dealer) and "sent=1" in repr(dealer)


@pytest.mark.parametrize("use_epoll", WAKERS)
async def test_two_tasks_sending_concurrently_share_the_one_owner(ctx, use_epoll):
    """The socket-owner rule: tasks never touch the ZeroMQ socket, so concurrent senders are
    safe; every message arrives, in each sender's order."""
    n = 300
    with trio.fail_after(CAP_S):
        async with open_socket(ctx, zmq.ROUTER, bind=LOOPBACK, use_epoll=use_epoll) as router, \
                open_socket(ctx, zmq.DEALER, connect=router.endpoint, send_buffer=4,
                            use_epoll=use_epoll) as dealer:

            async def sender(name: bytes) -> None:
                for i in range(n):
                    await dealer.send_multipart([name, b"%d" % i])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(sender, b"a")
                nursery.start_soon(sender, b"b")
                got: dict[bytes, list[int]] = {b"a": [], b"b": []}
                for _ in range(2 * n):
                    _, name, index = await router.recv_multipart()
                    got[name].append(int(index))
            assert got == {b"a": list(range(n)), b"b": list(range(n))}


async def test_two_tasks_receiving_concurrently_each_get_whole_messages(ctx):
    n = 200
    with trio.fail_after(CAP_S):
        async with open_socket(ctx, zmq.ROUTER, bind=LOOPBACK) as router, \
                open_socket(ctx, zmq.DEALER, connect=router.endpoint) as dealer:
            received: list[list[bytes]] = []

            async def receiver() -> None:
                for _ in range(n // 2):
                    received.append(await router.recv_multipart())

            async with trio.open_nursery() as nursery:
                nursery.start_soon(receiver)
                nursery.start_soon(receiver)
                for i in range(n):
                    await dealer.send_multipart([b"%d" % i, b"x" * (i % 7)])
            assert sorted(int(m[1]) for m in received) == list(range(n))
            assert all(m[2] == b"x" * (int(m[1]) % 7) for m in received)


async def test_large_frames_arrive_byte_identical_as_zero_copy_memoryviews(ctx):
    big = bytes(range(256)) * (3 * ZERO_COPY_THRESHOLD // 256 + 1)  # > 64 KiB: zero-copy
    small = b"s" * 100
    with trio.fail_after(CAP_S):
        async with open_socket(ctx, zmq.ROUTER, bind=LOOPBACK) as router, \
                open_socket(ctx, zmq.DEALER, connect=router.endpoint) as dealer:
            tracker = await dealer.send_multipart([small, big, memoryview(big)[1:]], track=True)
            _, got_small, got_big, got_view = await router.recv_multipart()
            await wait_sent(tracker)
            assert tracker.done
    assert type(got_small) is bytes and got_small == small
    assert isinstance(got_big, memoryview) and bytes(got_big) == big
    assert bytes(got_view) == big[1:]


async def test_a_full_inbox_and_outbox_make_senders_wait(ctx):
    """Backpressure: nobody receives, so ZeroMQ reaches its HWMs, the owner stops sending and
    the bounded outbox fills; the next send waits. (inproc: no kernel buffers in between.)"""
    with trio.fail_after(CAP_S):
        async with open_socket(ctx, zmq.PULL, bind="inproc://backpressure", rcvhwm=2,
                               recv_buffer=2) as pull, \
                open_socket(ctx, zmq.PUSH, connect="inproc://backpressure", sndhwm=2,
                            send_buffer=2) as push:
            sent = 0

            async def send_until_it_waits() -> None:
                nonlocal sent
                while True:
                    await push.send_multipart([b"%d" % sent])
                    sent += 1

            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_until_it_waits)
                # Every task blocked (inproc has no I/O thread): the sender waits for room.
                await trio.testing.wait_all_tasks_blocked()
                nursery.cancel_scope.cancel()
            assert 2 <= sent < 20
            assert push.stats().outbox >= 2
            for i in range(sent):  # draining lets everything through, in order
                assert await pull.recv_multipart() == [b"%d" % i]


async def test_an_idle_owner_sleeps_instead_of_spinning(ctx, autojump_clock):
    autojump_clock.rate = 1  # time also passes while tasks run: a busy loop ends the sleep too
    async with open_socket(ctx, zmq.ROUTER, bind=LOOPBACK) as router:
        await trio.sleep(0.2)  # an owner woken by timers or spinning wakes hundreds of times
        assert router.stats().wakeups <= 2


async def test_binding_an_address_in_use_raises_a_transport_error_naming_it(ctx):
    async with open_socket(ctx, zmq.ROUTER, bind=LOOPBACK) as first:
        with pytest.raises(TransportError, match=re.escape(first.endpoint) + ".*already in use"):
            async with open_socket(ctx, zmq.ROUTER, bind=first.endpoint):
                pass


async def test_a_closed_socket_raises_transport_error(ctx):
    async with open_socket(ctx, zmq.DEALER, connect="tcp://127.0.0.1:1") as sock:
        pass
    with pytest.raises(TransportError, match="closed"):
        await sock.send_multipart([b"late"])
    with pytest.raises(TransportError, match="closed"):
        await sock.recv_multipart()
    assert "closed" in repr(sock)


async def test_an_error_in_the_block_comes_out_as_is_not_in_an_exception_group(ctx):
    with pytest.raises(KeyError):
        async with open_socket(ctx, zmq.DEALER, connect="tcp://127.0.0.1:1"):
            raise KeyError("mine")


async def test_on_message_delivers_to_a_callback_instead_of_the_inbox(ctx):
    seen: list[list[bytes]] = []
    with trio.fail_after(CAP_S):
        async with open_socket(ctx, zmq.ROUTER, bind=LOOPBACK,
                               on_message=seen.append) as router, \
                open_socket(ctx, zmq.DEALER, connect=router.endpoint) as dealer:
            for i in range(3):
                dealer.send_multipart_nowait([b"%d" % i])
            await wait_until(lambda: len(seen) >= 3)
    assert [m[1:] for m in seen] == [[b"0"], [b"1"], [b"2"]]


async def test_a_tracked_send_that_never_went_out_raises_when_the_socket_closes(ctx):
    """A bound PUSH with no peer cannot send; closing it must not leave the sender hanging."""
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            async with open_socket(ctx, zmq.PUSH, bind=LOOPBACK) as push:

                async def send_tracked() -> None:
                    with pytest.raises(TransportError, match="closed"):
                        await push.send_multipart([b"nobody listens"], track=True)

                nursery.start_soon(send_tracked)
                await wait_until(lambda: push.stats().outbox == 1)


async def test_a_message_zeromq_refuses_is_dropped_and_counted_not_fatal(ctx):
    with trio.fail_after(CAP_S):
        async with open_socket(ctx, zmq.ROUTER, bind=LOOPBACK,
                               options={zmq.ROUTER_MANDATORY: 1}) as router, \
                open_socket(ctx, zmq.DEALER, connect=router.endpoint) as dealer:
            with pytest.raises(TransportError, match="refused"):
                await router.send_multipart([b"no such peer", b"x"], track=True)
            assert router.stats().send_errors == 1
            await dealer.send_multipart([b"still works"])
            assert (await router.recv_multipart())[1:] == [b"still works"]


async def test_frames_that_are_not_buffers_or_empty_messages_are_refused_at_the_call(ctx):
    async with open_socket(ctx, zmq.DEALER, connect="tcp://127.0.0.1:1") as sock:
        with pytest.raises(TypeError):
            await sock.send_multipart(["text is not bytes"])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="at least one frame"):
            sock.send_multipart_nowait([])
        assert sock.stats().outbox == 0


async def test_a_bulk_consumer_drains_the_inbox_without_awaiting_each_message(ctx):
    with trio.fail_after(CAP_S):
        async with open_socket(ctx, zmq.ROUTER, bind=LOOPBACK) as router, \
                open_socket(ctx, zmq.DEALER, connect=router.endpoint) as dealer:
            for i in range(10):
                dealer.send_multipart_nowait([b"%d" % i])
            got = [await router.recv_multipart()]

            def took_all() -> bool:
                try:
                    got.append(router.recv_multipart_nowait())
                except trio.WouldBlock:
                    pass
                return len(got) == 10

            await wait_until(took_all)
            assert [m[1] for m in got] == [b"%d" % i for i in range(10)]
            with pytest.raises(trio.WouldBlock):
                router.recv_multipart_nowait()


@pytest.mark.parametrize("use_epoll", WAKERS)
async def test_a_send_with_nothing_queued_goes_straight_out_without_waking_the_owner(
        ctx, use_epoll):
    """Direct sends: a ping-pong wakes each owner once per message received, not also once
    per message sent (the old two hops per send)."""
    n = 200
    with trio.fail_after(CAP_S):
        async with open_socket(ctx, zmq.ROUTER, bind=LOOPBACK, use_epoll=use_epoll) as router, \
                open_socket(ctx, zmq.DEALER, connect=router.endpoint,
                            use_epoll=use_epoll) as dealer:
            for i in range(n):
                await dealer.send_multipart([b"%d" % i])
                identity, message = await router.recv_multipart()
                router.send_multipart_nowait([identity, message])
                assert await dealer.recv_multipart() == [b"%d" % i]
            for sock in (dealer, router):
                stats = sock.stats()
                assert stats.messages_sent == stats.messages_received == n
                assert stats.wakeups < 1.5 * n


@pytest.mark.parametrize("use_epoll", WAKERS)
async def test_messages_arriving_while_tasks_send_directly_are_never_missed(ctx, use_epoll):
    """A direct send may consume the FD signal the parked owner waits for; the sender reads
    EVENTS after it and wakes the owner, so traffic both ways at once never stalls."""
    n = 500
    with trio.fail_after(CAP_S):
        async with open_socket(ctx, zmq.PAIR, bind=LOOPBACK, use_epoll=use_epoll) as a, \
                open_socket(ctx, zmq.PAIR, connect=a.endpoint, use_epoll=use_epoll) as b:
            await b.send_multipart([b"hello"])  # connected both ways before the streams
            assert await a.recv_multipart() == [b"hello"]

            async def send(sock, tag: bytes) -> None:
                for i in range(n):
                    sock.send_multipart_nowait([tag, b"%d" % i])
                    if i % 7 == 0:
                        await trio.sleep(0)

            async def receive(sock, tag: bytes) -> None:
                for i in range(n):
                    assert await sock.recv_multipart() == [tag, b"%d" % i]

            async with trio.open_nursery() as nursery:
                for sock, peer, tag in ((a, b, b"a"), (b, a, b"b")):
                    nursery.start_soon(send, sock, tag)
                    nursery.start_soon(receive, peer, tag)
