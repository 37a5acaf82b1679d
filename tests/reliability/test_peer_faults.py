"""Faulty peers: one that stops answering, one that replies garbage, one whose replies carry
other keys' pages or were damaged in flight. A fetch from them is a miss with nothing stored
(the requester recomputes); pages a fetch does store are exactly their keys' pages; the
requester keeps serving and fetches from healthy peers."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import msgspec
import trio
import zmq
from hypothesis import given
from hypothesis import strategies as st

from omni.cluster.kv.peers import FetchReply, FetchRequest, PeerFetcher, make_fetch_handler
from omni.transport import RPCClient, RPCServer, wire
from omni.transport.movers import FrameHeader, FrameMover, PageBatch, SameProcessHeader
from omni.transport.rpc import Reply
from tests._wait import CAP_S, wait_until
from tests.reliability._support import (
    LAYOUT,
    Tally,
    check_pages,
    fuzz,
    keys_for,
    make_store,
    pages_of,
)

KEYS = keys_for(8, extra="peers")


@dataclass
class OneHolder:
    """A directory that says `member` holds every key (what `PeerFetcher` asks of it)."""

    member: str = "a"

    def best_source(self, keys, exclude=()) -> tuple[str | None, int]:
        return (self.member, len(keys)) if self.member not in exclude else (None, 0)


def fetcher_for(client: Any, **kwargs: Any) -> PeerFetcher:
    return PeerFetcher(OneHolder(), {"a": client}.get, "b", layout=LAYOUT,
                       host_id="another-machine", **kwargs)


def stored_pages_are_their_own(store) -> int:
    """Every page the requester holds is its key's own (and one it asked for)."""
    keys = store.keys()
    for key in keys:
        with store.acquire([key]) as lease:
            check_pages([key], lease.pages())
    return len(keys)


async def serve_until(server: RPCServer, stop: trio.CancelScope,
                      task_status=trio.TASK_STATUS_IGNORED) -> None:
    with stop:
        async with server:
            task_status.started(server.endpoint)
            await trio.sleep_forever()


async def test_a_peer_that_stops_answering_is_a_miss(record):
    tally = Tally()
    with make_store(16, 16) as holder, make_store(16, 16) as requester:
        holder.put(KEYS, pages_of(KEYS))
        real = make_fetch_handler(holder)
        for _ in range(5):
            requester.discard(requester.keys())
            stalled = trio.Event()

            async def fetch(request: FetchRequest, stalled=stalled) -> Reply:
                if request.keys[0] == KEYS[4]:  # mid-call, the peer goes silent
                    stalled.set()
                    await trio.sleep_forever()
                return await real(request)

            server, stop = RPCServer(), trio.CancelScope()
            server.register("kv.fetch", fetch, body_type=FetchRequest)
            async with trio.open_nursery() as nursery:
                endpoint = await nursery.start(serve_until, server, stop)
                # Beats 0.2 s apart: the live server's pongs keep it "alive" through the
                # first fetch however loaded the machine; a fetch timeout no beat can lose to.
                async with RPCClient(endpoint, heartbeat_interval=0.2) as client:
                    fetcher = fetcher_for(client, timeout=CAP_S)
                    assert await fetcher.fetch(requester, KEYS[:4], recompute_page_s=None) == 4

                    async def silence(stalled=stalled, stop=stop) -> None:
                        await stalled.wait()
                        stop.cancel()

                    nursery.start_soon(silence)
                    assert await fetcher.fetch(requester, KEYS[4:], recompute_page_s=None) == 0
                    # 3 missed beats ended the call, not the timeout
                    assert (client.stats().peer_gone, client.stats().timeouts) == (1, 0)
                    assert await fetcher.fetch(requester, KEYS[4:], recompute_page_s=None) == 0
                    assert fetcher.stats()["failures"] == 2
                    tally("miss", 2)
            assert requester.match(KEYS) == 4 and stored_pages_are_their_own(requester) == 4
            requester.put(KEYS[4:], pages_of(KEYS[4:]))  # the requester recomputes
            assert stored_pages_are_their_own(requester) == 8
        # A peer silent from the start: a ROUTER that never reads.
        silent = zmq.Context.instance().socket(zmq.ROUTER)
        silent.linger = 0
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        try:
            async with RPCClient(f"tcp://127.0.0.1:{port}", heartbeat_interval=0.05) as client:
                requester.discard(requester.keys())
                assert await fetcher_for(client).fetch(requester, KEYS,
                                                       recompute_page_s=None) == 0
                assert requester.keys() == []
                tally("miss")
        finally:
            silent.close()
    record("peer.silent", tries=tally["miss"],
           outcome=f"{tally['miss']}/{tally['miss']} fetches were misses, noticed within 3 "
                   "heartbeats (PeerGone), nothing stored; the requester recomputed and "
                   "kept serving")


def garbage_replies() -> list[Any]:
    """Each makes the frames of one reply to a request (None: drop it)."""
    codec = wire.Codec()
    mover = FrameMover(LAYOUT)

    def response(req: wire.Request, body: Any, *payload: Any) -> list[Any]:
        return [codec.encode(wire.Response(req.id, codec.encode_body(body))), *payload]

    def frames_for(keys: list[bytes]) -> tuple[FrameHeader, list[Any]]:
        return mover.pack(PageBatch(tuple(keys), pages_of(keys)))

    def asked(req: wire.Request) -> list[bytes]:
        return codec.decode_body(req.body, FetchRequest).keys

    def other_keys(req):
        header, frames = frames_for(keys_for(len(asked(req)), start=500, extra="other"))
        return response(req, FetchReply(header), *frames)

    def relabelled(req):  # honest frames of other pages, the header claims the asked keys
        header, frames = frames_for(keys_for(len(asked(req)), start=500, extra="other"))
        return response(req, FetchReply(msgspec.structs.replace(header, keys=asked(req))),
                        *frames)

    def flipped(req):
        header, frames = frames_for(asked(req))
        frame = bytearray(frames[0])
        frame[len(frame) // 3] ^= 0x10
        return response(req, FetchReply(header), bytes(frame))

    def other_layout(req):
        header, frames = frames_for(asked(req))
        spec = msgspec.structs.replace(header.layout, num_kv_heads=2, head_dim=2)
        return response(req, FetchReply(msgspec.structs.replace(header, layout=spec)), *frames)

    return [
        lambda req: [os.urandom(40)],
        lambda req: [b""],
        lambda req: [msgspec.msgpack.encode([99, ["res", req.id, None]])],
        lambda req: [codec.encode(wire.Response(req.id + 1000, codec.encode_body(None)))],
        lambda req: response(req, [1, 2, 3]),
        lambda req: response(req, {"header": {"kind": "frames", "keys": "no"}}),
        lambda req: response(req, FetchReply(frames_for(asked(req))[0])),  # no frame
        lambda req: response(req, FetchReply(frames_for(asked(req))[0]), b"\x00" * 7),
        lambda req: response(req, FetchReply(SameProcessHeader(
            LAYOUT.to_spec(), asked(req), os.getpid(), "not-this-process", 1))),
        lambda req: [codec.encode(wire.Error(req.id, "KeyError", "lost them"))],
        other_keys, relabelled, flipped, other_layout,
    ]


class GarbagePeer:
    """A ROUTER that answers heartbeats properly and each request with the next reply."""

    def __init__(self, replies: list[Any]):
        self.replies = replies
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.linger = 0
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.answered = 0

    async def run(self) -> None:
        codec = wire.Codec()
        while True:
            await wait_until(lambda: self.sock.poll(0), "a message", cap=math.inf)
            identity, control, *_ = self.sock.recv_multipart()
            msg = codec.decode(control)
            if isinstance(msg, wire.Heartbeat):
                self.sock.send_multipart([identity, codec.encode(msg)])
            elif isinstance(msg, wire.Request):
                reply = self.replies[self.answered](msg)
                self.answered += 1
                self.sock.send_multipart([identity, *reply])


async def test_a_peer_replying_garbage_is_a_miss(record):
    tally = Tally()
    with make_store(16, 16) as requester:
        replies = garbage_replies()
        peer = GarbagePeer([*replies, _honest])  # the last reply is a good one
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(peer.run)
                async with RPCClient(peer.endpoint, heartbeat_interval=0.2) as client:
                    fetcher = fetcher_for(client, timeout=0.5)
                    for _ in replies:
                        assert await fetcher.fetch(requester, KEYS[:4],
                                                   recompute_page_s=None) == 0
                        assert requester.keys() == []
                        tally("miss")
                    assert client.peer_alive  # garbage never took the client down
                    # The honest reply gets all the time it needs (0.5 s is for the dropped).
                    honest = fetcher_for(client, timeout=CAP_S)
                    assert await honest.fetch(requester, KEYS[:4], recompute_page_s=None) == 4
                    assert peer.answered == len(replies) + 1  # each reply was tried
                nursery.cancel_scope.cancel()
        finally:
            peer.sock.close()
        assert stored_pages_are_their_own(requester) == 4
    record("peer.garbage", tries=tally["miss"],
           outcome=f"{tally['miss']}/{tally['miss']} garbage replies were misses (dropped, "
                   "timed out or refused), nothing stored; the same peer's next honest reply "
                   "was fetched")


def _honest(req: wire.Request) -> list[Any]:
    codec = wire.Codec()
    keys = codec.decode_body(req.body, FetchRequest).keys
    header, frames = FrameMover(LAYOUT).pack(PageBatch(tuple(keys), pages_of(keys)))
    return [codec.encode(wire.Response(req.id, codec.encode_body(FetchReply(header)))),
            *frames]


class ReplyingClient:
    """An RPC client whose `kv.fetch` replies are made by a function (through the codec)."""

    def __init__(self, make_reply):
        self.make_reply = make_reply
        self.codec = wire.Codec()

    async def call_with_payload(self, method, body, *, timeout, result_type) -> Reply:
        await trio.lowlevel.checkpoint()
        header, frames = self.make_reply(body)
        raw = self.codec.encode_body(FetchReply(header))
        return Reply(self.codec.decode_body(raw, result_type), frames)


def test_replies_with_other_keys_pages_or_damage_are_refused(record):
    tally = Tally()
    mover = FrameMover(LAYOUT)
    damages = ["none", "flip", "checksum", "nbytes", "layout", "no frame", "two frames",
               "truncated", "padded"]
    choices = ["asked", "prefix", "other", "shuffled", "more", "asked then other", "relabelled"]

    @fuzz(200)
    @given(st.integers(0, 50), st.integers(1, 6), st.sampled_from(choices),
           st.sampled_from(damages), st.integers(0, 10 ** 6))
    def lie(start, n, choice, damage, where):
        asked = keys_for(n, start=start, extra="asked")
        other = keys_for(n, start=start + 1000, extra="other")
        sent = {"asked": asked, "prefix": asked[: max(1, n // 2)], "other": other,
                "shuffled": asked[::-1], "more": asked + other[:1],
                "asked then other": asked[:1] + other[1:], "relabelled": other}[choice]

        def make_reply(request: FetchRequest):
            header, frames = mover.pack(PageBatch(tuple(sent), pages_of(sent)))
            frame = bytearray(frames[0])
            if choice == "relabelled":  # other pages' honest bytes under the asked keys
                header = msgspec.structs.replace(header, keys=asked[: len(sent)])
            if damage == "flip":
                frame[where % len(frame)] ^= 1 << (where % 8)
            elif damage == "checksum":
                header = msgspec.structs.replace(header, checksum=bytes(16))
            elif damage == "nbytes":
                header = msgspec.structs.replace(header, nbytes=header.nbytes + 1)
            elif damage == "layout":
                header = msgspec.structs.replace(header, layout=msgspec.structs.replace(
                    header.layout, page_size=8))
            elif damage == "truncated":
                frame = frame[: where % len(frame)]
            elif damage == "padded":
                frame += b"\x00" * (1 + where % 64)
            frames = {"no frame": [], "two frames": [bytes(frame), b"x"]}.get(
                damage, [bytes(frame)])
            return header, frames

        with make_store(16, 16) as requester:
            fetcher = fetcher_for(ReplyingClient(make_reply))
            got = trio.run(lambda: fetcher.fetch(requester, asked, recompute_page_s=None))
            honest = (damage == "none" and choice != "relabelled"
                      and sent == asked[: len(sent)])
            assert got == (len(sent) if honest else 0)
            assert set(requester.keys()) <= set(asked)
            assert stored_pages_are_their_own(requester) == got  # never another key's bytes
            tally("fetched" if honest else "refused")

    lie()
    tries = tally["fetched"] + tally["refused"]
    record("peer.wrong_pages", tries=tries,
           outcome=f"{tally['refused']} replies with other keys' pages, damage or bad headers "
                   f"were misses with nothing stored; {tally['fetched']} honest ones stored "
                   "their own pages; no page ever stored under another key")
