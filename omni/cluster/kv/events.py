"""KV events: what a worker publishes so that the cluster knows which pages it holds.

A worker runs a `KVPublisher`: it listens to its `KVStore` and publishes `KVEvent`s (keys
stored, keys removed) on a PUB socket, numbered by `seq` within an `epoch` (random per start,
so a restarted worker is noticed), plus a *tick* (an event with no keys, carrying the current
seq) every `tick_interval`, so that a lost last event does not go unnoticed for long. It
answers the RPC method "kv.snapshot" with every key it holds and the seq they are as of
(`request_snapshot` asks for it). `omni.cluster.kv.directory.KVDirectory` follows them.

The store calls its listeners from any thread, under its lock: the publisher only queues the
change and wakes its trio task (`TrioToken.run_sync_soon`, no polling), which coalesces what
queued into events. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from typing import TYPE_CHECKING, Any

import msgspec
import trio
import zmq

from omni.kv.keys import KEY_BYTES, KeyField
from omni.transport.errors import TransportError, WireError
from omni.transport.rpc import Reply
from omni.transport.trio_zmq import Socket, background_nursery, open_socket
from omni.transport.wire import MAX_PAYLOAD_BYTES

if TYPE_CHECKING:
    from omni.kv.store import KVStore
    from omni.transport.credentials import Credentials
    from omni.transport.rpc import RPCClient, RPCServer

__all__ = ["KVEvent", "KVPublisher", "KVSnapshot", "SnapshotHeader", "request_snapshot"]

TOPIC = b"omni.kv/1"  # the first frame of every event: SUB filters on it, a new format gets v2
MAX_EVENT_KEYS = 16_384  # keys per event: ~300 KB of msgpack, well under the control limit


class KVEvent(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Keys that entered and left `member`'s store (disjoint lists), number `seq` of `epoch`.

    An event with both lists empty is a tick: it says the publisher's seq is `seq` now."""

    member: str
    epoch: int
    seq: int
    stored: list[KeyField] = []
    removed: list[KeyField] = []


class KVSnapshot(msgspec.Struct, frozen=True):
    """Every key `member` held as of event `seq` of `epoch`."""

    member: str
    epoch: int
    seq: int
    keys: list[bytes]


class SnapshotHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The body of a "kv.snapshot" reply; the keys follow as payload frames of 16-byte keys
    back to back (a big store's keys would not fit in a control message)."""

    member: str
    epoch: int
    seq: int
    count: int


_ENCODER = msgspec.msgpack.Encoder()


async def request_snapshot(client: RPCClient, *, timeout: float | None = None) -> KVSnapshot:
    """Ask a member's RPC server (see `KVPublisher.register`) for its snapshot.

    Raises `TransportError` (`WireError` when the reply does not add up) on failure."""
    reply = await client.call_with_payload("kv.snapshot", timeout=timeout,
                                           result_type=SnapshotHeader)
    header = reply.body
    blob = b"".join(bytes(frame) for frame in reply.payload)
    if header.count < 0 or len(blob) != header.count * KEY_BYTES:
        raise WireError(f"a snapshot of {header.count} keys came with {len(blob)} bytes")
    keys = [blob[i:i + KEY_BYTES] for i in range(0, len(blob), KEY_BYTES)]
    return KVSnapshot(header.member, header.epoch, header.seq, keys)


class KVPublisher:
    """Publishes one store's events; ``async with KVPublisher(store, "w1", creds) as pub``.

    Args:
        store: the worker's store (its listener is removed on exit).
        member: the worker's name in the cluster.
        creds: the process's `Credentials` (the PUB socket binds with its server options).
        bind: the address to bind; `endpoint` is the one bound.
        tick_interval: seconds without an event after which a tick is published.
    """

    def __init__(self, store: KVStore, member: str, creds: Credentials, *,
                 bind: str = "tcp://127.0.0.1:*", tick_interval: float = 1.0):
        if tick_interval <= 0:
            raise ValueError(f"tick_interval must be > 0 seconds, got {tick_interval!r}")
        self.member = member
        self.epoch = secrets.randbits(63)
        self.tick_interval = tick_interval
        self._store = store
        self._creds = creds
        self._bind = bind
        self._seq = 0  # the last seq assigned (the snapshot's seq)
        self._queue: list[tuple[list[bytes], list[bytes]]] = []  # from the store's threads
        self._qlock = threading.Lock()
        self._notified = False  # a wake-up is on its way to the trio side
        self._wake = trio.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._sock: Socket | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._events = self._ticks = 0

    async def __aenter__(self) -> KVPublisher:
        self._token = trio.lowlevel.current_trio_token()
        async with contextlib.AsyncExitStack() as stack:
            self._sock = await stack.enter_async_context(open_socket(
                self._creds.ctx, zmq.PUB, bind=self._bind,
                options=self._creds.server_options()))
            nursery = await stack.enter_async_context(background_nursery())
            stack.callback(self._store.add_listener(self._on_store_change))  # exits first
            nursery.start_soon(self._run)
            self._stack = stack.pop_all()
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        stack, self._stack = self._stack, None
        assert stack is not None
        return await stack.__aexit__(*exc_info)

    @property
    def endpoint(self) -> str:
        """The address the PUB socket is bound to (``*`` resolved)."""
        if self._sock is None or self._sock.endpoint is None:
            raise TransportError(f"{self!r} is not running")
        return self._sock.endpoint

    def snapshot(self) -> KVSnapshot:
        """Every key in the store and the seq they are as of. Changes not yet published are
        in the keys too; they get later seqs, and replaying them on this is harmless."""
        seq = self._seq  # read first: every event up to it is already in the store's keys
        return KVSnapshot(self.member, self.epoch, seq, self._store.keys())

    def register(self, server: RPCServer) -> None:
        """Serve "kv.snapshot" on `server` (the keys go as payload frames)."""
        server.register("kv.snapshot", self._serve_snapshot, body_type=Any)

    async def _serve_snapshot(self, body: Any) -> Reply:
        snap = self.snapshot()
        blob = b"".join(snap.keys)
        frames = [blob[i:i + MAX_PAYLOAD_BYTES] for i in range(0, len(blob), MAX_PAYLOAD_BYTES)]
        return Reply(SnapshotHeader(snap.member, snap.epoch, snap.seq, len(snap.keys)), frames)

    def stats(self) -> dict[str, int]:
        """Events and ticks published, and the current seq."""
        return {"events": self._events, "ticks": self._ticks, "seq": self._seq}

    # -- the store's side: any thread, under the store's lock --------------------------------

    def _on_store_change(self, stored: list[bytes], removed: list[bytes]) -> None:
        with self._qlock:
            self._queue.append((stored, removed))
            if self._notified:
                return
            self._notified = True
        try:  # wake the trio side; no polling
            assert self._token is not None
            self._token.run_sync_soon(self._wake_up)
        except trio.RunFinishedError:
            pass

    def _wake_up(self) -> None:
        self._wake.set()  # the event current when this runs, in the trio thread

    # -- the trio side -------------------------------------------------------------------------

    def _drain(self) -> list[KVEvent]:
        """The queued changes as numbered events: the last word on each key, in chunks."""
        with self._qlock:
            queue, self._queue = self._queue, []
            self._notified = False
        if not queue:
            return []
        last: dict[bytes, bool] = {}
        for stored, removed in queue:
            last.update(dict.fromkeys(stored, True))
            last.update(dict.fromkeys(removed, False))
        items = list(last.items())
        events = []
        for i in range(0, len(items), MAX_EVENT_KEYS):
            chunk = items[i:i + MAX_EVENT_KEYS]
            self._seq += 1
            events.append(KVEvent(self.member, self.epoch, self._seq,
                                  [k for k, present in chunk if present],
                                  [k for k, present in chunk if not present]))
        return events

    async def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        last_sent = trio.current_time()
        while True:
            with trio.move_on_at(last_sent + self.tick_interval):
                await self._wake.wait()
            self._wake = trio.Event()  # before draining: a later change sets the new one
            events = self._drain()
            if not events and trio.current_time() < last_sent + self.tick_interval:
                continue
            if not events:
                self._ticks += 1
                events = [KVEvent(self.member, self.epoch, self._seq)]
            else:
                self._events += len(events)
            for event in events:
                await sock.send_multipart([TOPIC, _ENCODER.encode(event)])
            last_sent = trio.current_time()

    def __repr__(self) -> str:
        return f"<KVPublisher {self.member} seq={self._seq}>"
