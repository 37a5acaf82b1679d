"""The cluster's KV directory: which worker holds which pages, kept current by events.

Routers and workers run a `KVDirectory`: it subscribes to every member's `KVPublisher` (see
`omni.cluster.kv.events`) and keeps one set of keys per member, so `prefix_len` (how much
of a request's prefix a replica holds) costs one set lookup per page. PUB/SUB drops messages
(before a subscription is up, past the high-water mark), so a missed event is never ignored:
a seq gap, an epoch change, a tick ahead of the view or a new member starts a *resync*: the
member's snapshot is fetched in the directory's nursery, events that arrive meanwhile are
buffered, and those after the snapshot's seq are replayed on it. A failed snapshot is retried
with bounded backoff; until one succeeds the member is *stale* (its old view still answers).
Replaying an event already reflected in a snapshot is harmless: an event assigns presence to
keys, it does not toggle it.

The SUB sockets take the process's `Credentials`: CURVE with ZAP when the cluster has a token.
Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import msgspec
import trio
import zmq

from omni.cluster.kv.events import (
    TOPIC,
    KVEvent,
    KVPublisher,
    KVSnapshot,
    SnapshotHeader,
    request_snapshot,
)
from omni.transport.errors import TransportError, WireError
from omni.transport.trio_zmq import Buffer, background_nursery, open_socket
from omni.transport.wire import MAX_CONTROL_BYTES

if TYPE_CHECKING:
    from omni.transport.credentials import Credentials

__all__ = ["KVDirectory", "KVEvent", "KVPublisher", "KVSnapshot", "SnapshotHeader",
           "request_snapshot"]

log = logging.getLogger("omni.transport.kv")

_EVENTS = msgspec.msgpack.Decoder(KVEvent)


class _Member:
    """The directory's view of one member. Why a record: the SUB callback, the resync task
    and the queries all read it; `buffer` holds events that arrive during a resync."""

    def __init__(self, name: str, endpoint: str, max_buffered: int):
        self.name = name
        self.endpoint = endpoint
        self.keys: set[bytes] = set()
        self.epoch: int | None = None
        self.seq = 0
        self.stale = True  # no snapshot yet, or a resync in progress
        self.resyncing = True
        self.buffer: deque[KVEvent] = deque(maxlen=max_buffered)  # overflow: a gap, resync
        self.wanted = trio.Event()
        self.wanted.set()  # a new member starts with a resync
        self.synced = trio.Event()
        self.scope = trio.CancelScope()
        self.last_heard: float | None = None


class KVDirectory:
    """Who holds which pages; ``async with KVDirectory(creds, snapshot) as directory``.

    Args:
        creds: the process's `Credentials` (the SUB sockets connect with its client options).
        snapshot: ``await snapshot(name)`` returns member `name`'s `KVSnapshot` (e.g. through
            `request_snapshot` on its RPC client); it may raise, it is retried.
        snapshot_timeout: seconds one snapshot may take before it counts as failed.
        max_backoff: the longest wait between failed snapshots (from 50 ms, doubling).
        max_buffered: events kept per member during a resync (the oldest go first: a gap,
            so one more resync).

    Each member gets its own SUB socket (one owner task each, see `trio_zmq`): connecting
    and disconnecting then never touches a socket another task owns, and an event can only
    come from the endpoint it was added with.
    """

    def __init__(self, creds: Credentials, snapshot: Callable[[str], Awaitable[KVSnapshot]],
                 *, snapshot_timeout: float = 10.0, max_backoff: float = 5.0,
                 max_buffered: int = 10_000):
        self._creds = creds
        self._snapshot = snapshot
        self._snapshot_timeout = snapshot_timeout
        self._max_backoff = max_backoff
        self._max_buffered = max_buffered
        self._members: dict[str, _Member] = {}
        self._nursery: trio.Nursery | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._counts = dict.fromkeys(("events", "ticks", "gaps", "epoch_changes", "resyncs",
                                      "resync_failures", "dropped"), 0)

    async def __aenter__(self) -> KVDirectory:
        async with contextlib.AsyncExitStack() as stack:
            self._nursery = await stack.enter_async_context(background_nursery())
            self._stack = stack.pop_all()
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        stack, self._stack, self._nursery = self._stack, None, None
        assert stack is not None
        return await stack.__aexit__(*exc_info)

    # -- membership ----------------------------------------------------------------------------

    def add_member(self, name: str, pub_endpoint: str) -> None:
        """Subscribe to `name`'s publisher and resync it at once. Adding a known member again
        with another endpoint replaces it; with the same endpoint, resyncs it."""
        if self._nursery is None:
            raise TransportError(f"{self!r} is not running (use `async with`)")
        old = self._members.get(name)
        if old is not None and old.endpoint == pub_endpoint:
            self._begin_resync(old)
            return
        if old is not None:
            self.remove_member(name)
        member = self._members[name] = _Member(name, pub_endpoint, self._max_buffered)
        self._nursery.start_soon(self._run_member, member)

    def remove_member(self, name: str) -> None:
        """Forget `name` and its keys and disconnect from it (no-op when unknown)."""
        member = self._members.pop(name, None)
        if member is not None:
            member.scope.cancel()
            member.keys = set()

    def members(self) -> list[str]:
        return list(self._members)

    # -- queries (hot: a router asks per request per replica) ----------------------------------

    def prefix_len(self, name: str, keys: Sequence[bytes]) -> int:
        """How many leading `keys` member `name` holds (0 for an unknown member)."""
        member = self._members.get(name)
        if member is None:
            return 0
        held = member.keys
        for n, key in enumerate(keys):
            if key not in held:
                return n
        return len(keys)

    def holders(self, key: bytes) -> frozenset[str]:
        """The members holding `key`."""
        return frozenset(name for name, m in self._members.items() if key in m.keys)

    def best_source(self, keys: Sequence[bytes], exclude: Iterable[str] = ()
                    ) -> tuple[str | None, int]:
        """The member (not in `exclude`) holding the longest leading run of `keys`, and that
        run's length; ``(None, 0)`` when nobody holds the first key. Ties go to a member
        whose view is fresh, then to the one added first."""
        skip = set(exclude)
        best, best_n, best_stale = None, 0, True
        for name, member in self._members.items():
            if name in skip:
                continue
            n = self.prefix_len(name, keys)
            if n > best_n or (n == best_n and n and best_stale and not member.stale):
                best, best_n, best_stale = name, n, member.stale
        return best, best_n

    def keys(self, name: str) -> frozenset[bytes]:
        """The keys member `name` holds, as far as this directory knows."""
        member = self._members.get(name)
        return frozenset(member.keys) if member is not None else frozenset()

    def is_stale(self, name: str) -> bool:
        """True while `name` has no snapshot yet or is being resynced."""
        member = self._members.get(name)
        return member is None or member.stale

    async def wait_synced(self, name: str) -> None:
        """Until member `name`'s view is fresh (use a timeout around it)."""
        while True:
            member = self._members.get(name)
            if member is None:
                raise KeyError(name)
            if not member.stale:
                return
            await member.synced.wait()

    def stats(self) -> dict[str, Any]:
        """Counters (events, ticks, gaps, epoch_changes, resyncs, resync_failures, dropped)
        and per member: keys, seq, stale and silent_s (since its last message)."""
        now = trio.current_time()
        members = {name: {"keys": len(m.keys), "seq": m.seq, "stale": m.stale,
                          "silent_s": None if m.last_heard is None else now - m.last_heard}
                   for name, m in self._members.items()}
        return {**self._counts, "members": members}

    # -- per member: its SUB socket and its resyncs ---------------------------------------------

    async def _run_member(self, member: _Member) -> None:
        options = {**self._creds.client_options(), zmq.SUBSCRIBE: TOPIC}
        with member.scope:
            async with open_socket(self._creds.ctx, zmq.SUB, connect=member.endpoint,
                                   options=options, max_msg_size=MAX_CONTROL_BYTES,
                                   on_message=partial(self._on_message, member)):
                while True:
                    await member.wanted.wait()
                    member.wanted = trio.Event()
                    await self._resync(member)

    def _on_message(self, member: _Member, frames: list[Buffer]) -> None:
        """In the SUB socket's owner task: apply, buffer, or start a resync. Never raises."""
        try:
            if len(frames) != 2 or bytes(frames[0]) != TOPIC:
                raise WireError("not a KV event")
            event = _EVENTS.decode(frames[1])
            if event.member != member.name:
                raise WireError(f"an event of {event.member!r} from {member.name!r}")
        except (msgspec.MsgspecError, WireError, ValueError, TypeError) as exc:
            self._counts["dropped"] += 1
            log.debug("dropped a KV event from %s: %s", member.name, exc)
            return
        member.last_heard = trio.current_time()
        tick = not event.stored and not event.removed
        self._counts["ticks" if tick else "events"] += 1
        if member.resyncing:
            if not tick:
                member.buffer.append(event)
            return
        if event.epoch != member.epoch:
            self._counts["epoch_changes"] += 1
        elif event.seq <= member.seq:
            return  # already in the view (sent before the snapshot was taken)
        elif not tick and event.seq == member.seq + 1:
            _apply(member, event)
            return
        else:
            self._counts["gaps"] += 1  # an event or a tick beyond what we have: lost ones
        if not tick:
            member.buffer.append(event)
        self._begin_resync(member)

    def _begin_resync(self, member: _Member) -> None:
        if not member.resyncing:
            member.resyncing = member.stale = True
            member.synced = trio.Event()
        member.wanted.set()

    async def _resync(self, member: _Member) -> None:
        """Fetch snapshots until one is consistent with the buffered events, then apply."""
        backoff = 0.05
        while True:
            snap = await self._fetch_snapshot(member)
            if snap is not None and self._install(member, snap):
                self._counts["resyncs"] += 1
                member.resyncing = member.stale = False
                member.synced.set()
                return
            if snap is None:
                self._counts["resync_failures"] += 1
            await trio.sleep(backoff)
            backoff = min(backoff * 2, self._max_backoff)

    async def _fetch_snapshot(self, member: _Member) -> KVSnapshot | None:
        with trio.move_on_after(self._snapshot_timeout):
            try:
                snap = await self._snapshot(member.name)
            except Exception as exc:  # any failure is retried; the view stays stale meanwhile
                log.warning("KV snapshot of %s failed: %r", member.name, exc)
                return None
            if isinstance(snap, KVSnapshot) and snap.member == member.name:
                return snap
            log.warning("KV snapshot of %s: got %r", member.name, type(snap).__name__)
            return None
        log.warning("KV snapshot of %s timed out", member.name)
        return None

    def _install(self, member: _Member, snap: KVSnapshot) -> bool:
        """Take `snap` and replay the buffered events after it; False when they show that
        more was lost (a gap, or a restart since the snapshot): resync again."""
        member.keys = set(snap.keys)
        member.epoch, member.seq = snap.epoch, snap.seq
        buffered, member.buffer = list(member.buffer), deque(maxlen=self._max_buffered)
        if buffered and buffered[-1].epoch != snap.epoch:
            return False  # the publisher restarted after the snapshot (or is an old one)
        for event in buffered:
            if event.epoch != snap.epoch or event.seq <= member.seq:
                continue  # before the snapshot: already in it
            if event.seq != member.seq + 1:
                self._counts["gaps"] += 1
                return False
            _apply(member, event)
        return True

    def __repr__(self) -> str:
        return f"<KVDirectory members={len(self._members)}>"


def _apply(member: _Member, event: KVEvent) -> None:
    member.keys.update(event.stored)
    member.keys.difference_update(event.removed)
    member.seq = event.seq
