"""Remote KV fetch: a worker missing pages that another worker holds gets them from it
instead of recomputing them, when that is faster.

The holder serves the RPC method "kv.fetch" (`serve_kv`): it leases the leading pages asked
for that it still holds and packs them with the mover for the requester's locality (see
`omni.transport.movers`): the tensor itself in the same process, a shared-memory descriptor
on the same machine (its own lease pins the pages until the requester releases it, or it
expires if the requester dies), a checksummed frame between machines.

The requester plugs a `PeerFetcher` into its store (``store.peers = fetcher``): the store's
`prefetch` calls it for the pages it lacks. The fetcher asks the `KVDirectory` who holds the
longest run of them (when it knows of none, the workers that served earlier nodes of the
request being served, `omni.cluster.kv.request_holders`: their pages may be too new for the
directory), estimates the fetch (per-call latency + bytes / bandwidth, learned per
locality) against the caller's cost of recomputing, and fetches. It fails closed: a checksum
mismatch, an expired lease, a vanished peer or a timeout is a miss (logged and counted), never
wrong pages and never an exception.

Importing this module imports torch (through the movers).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from omni.cluster.kv import request_holders
from omni.kv.errors import KVCapacityError
from omni.kv.keys import KeyField
from omni.transport import movers
from omni.transport.errors import TransportError, WireError
from omni.transport.movers import FrameMover, Locality, MoverHeader, choose_mover, unpack
from omni.transport.rpc import Reply
from omni.transport.wire import MAX_PAYLOAD_BYTES

if TYPE_CHECKING:
    from omni.cluster.kv.directory import KVDirectory
    from omni.kv.handle import Lease
    from omni.kv.layout import KVLayout
    from omni.kv.store import KVStore
    from omni.transport.rpc import RPCClient, RPCServer

__all__ = ["FetchReply", "FetchRequest", "PeerFetcher", "make_fetch_handler",
           "make_fetch_handlers", "pages_per_call", "serve_kv"]

log = logging.getLogger("omni.transport.kv")

MAX_FETCH_BYTES = MAX_PAYLOAD_BYTES  # page bytes per call: one frame within the wire limit
MAX_FETCH_PAGES = 16_384  # keys per call: request and header stay well under 1 MiB
# Pages a holder leases on its event loop (about 1 µs each) when they are all in shared memory
# already; a longer run is leased in a worker thread, whose hop then costs little beside it.
INLINE_PAGES = 256


class FetchRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Pages wanted (leading keys first) by process `pid` of host `host_id`."""

    keys: list[KeyField]
    host_id: str
    pid: int


class FetchReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The mover's header for the leading pages the holder had (None: not even the first)."""

    header: MoverHeader | None = None


def pages_per_call(layout: KVLayout) -> int:
    """How many pages one fetch call carries at most (0: a page exceeds the frame limit)."""
    return min(MAX_FETCH_BYTES // layout.page_bytes, MAX_FETCH_PAGES)


def make_fetch_handler(store: KVStore, *, host_id: str | None = None
                       ) -> Callable[[FetchRequest], Awaitable[Reply]]:
    """The "kv.fetch" handler over `store` (`serve_kv` registers it). `host_id` is this
    machine's id as requesters see it (default `movers.host_id()`)."""
    return make_fetch_handlers(store, host_id=host_id)[1]


def make_fetch_handlers(store: KVStore, *, host_id: str | None = None
                        ) -> tuple[Callable[[FetchRequest], Reply | None],
                                   Callable[[FetchRequest], Awaitable[Reply]]]:
    """`make_fetch_handler`'s handler, and before it its plain function for
    `RPCServer.register`'s ``at_once``: the reply where the request is read when it needs no
    waiting (a descriptor of pages in shared memory already), else None."""
    local = host_id if host_id is not None else movers.host_id()
    limit = pages_per_call(store.layout)

    def mover_for(request: FetchRequest) -> Any:
        same_process = request.host_id == local and request.pid == os.getpid()
        return choose_mover(local, request.host_id, same_process, layout=store.layout)

    def reply_now(keys: list[bytes], mover: Any) -> Reply | None:
        if mover.locality != "same_machine" or len(keys) > INLINE_PAGES:
            return None
        packed = _share_now(store, mover, keys)
        return None if packed is None else Reply(FetchReply(packed[0]), packed[1])

    def at_once(request: FetchRequest) -> Reply | None:
        return reply_now(request.keys[:limit], mover_for(request))

    async def fetch(request: FetchRequest) -> Reply:
        keys, mover = request.keys[:limit], mover_for(request)
        reply = reply_now(keys, mover)
        if reply is not None:
            return reply
        header, frames = await trio.to_thread.run_sync(_pack, store, mover, keys)
        return Reply(FetchReply(header), frames)

    return at_once, fetch


def _share_now(store: KVStore, mover: Any, keys: list[bytes]
               ) -> tuple[MoverHeader | None, list] | None:
    """A shared-memory descriptor of the leading pages (at most `INLINE_PAGES`), on the event
    loop, when they are in the store's shared top tier already: no copy and nothing to wait
    for, where a worker thread's hop would cost more than the rest of the fetch. None when a
    page must be read up or moved, or the top tier cannot be shared: `_pack` in a worker
    thread then."""
    lease = store.acquire_now(keys)
    return None if lease is None else _pack_lease(store, mover, lease, frames=False)


def _pack(store: KVStore, mover: Any, keys: list[bytes]) -> tuple[MoverHeader | None, list]:
    """Lease the leading pages present (reading them up from disk: a worker thread), pack
    them, and release the lease: a frame or a same-process hand-off is a private copy, a
    shared-memory descriptor holds a lease of its own."""
    if not keys:
        return None, []
    try:
        lease: Lease = store.acquire(keys)
    except KVCapacityError as exc:  # the holder cannot lend them now: the requester recomputes
        log.info("kv.fetch: cannot lease pages: %s", exc)
        return None, []
    return _pack_lease(store, mover, lease, frames=True)


def _pack_lease(store: KVStore, mover: Any, lease: Lease, *, frames: bool
                ) -> tuple[MoverHeader | None, list] | None:
    """Pack `lease`'s pages with `mover`, then release it. Where `mover` cannot share them
    (a top tier in GPU memory, say), as frames when `frames` (a copy: off the event loop),
    else None."""
    with lease:
        if not len(lease):
            return None, []
        try:
            return mover.pack(lease)
        except TransportError as exc:
            if not frames:
                return None
            log.debug("kv.fetch: %s; sending frames", exc)
            return FrameMover(store.layout).pack(lease)


def serve_kv(server: RPCServer, store: KVStore, *, host_id: str | None = None) -> None:
    """Serve "kv.fetch" from `store` on `server` (see `make_fetch_handler`): pages in shared
    memory already are answered where the request is read (`RPCServer.register`'s
    ``at_once``), the rest in a task of its own."""
    at_once, fetch = make_fetch_handlers(store, host_id=host_id)
    server.register("kv.fetch", fetch, body_type=FetchRequest, at_once=at_once)


# Rough first guesses, refined by every fetch: per-call latency (s) and bandwidth (B/s).
INITIAL_LINKS: dict[Locality, tuple[float, float]] = {
    "same_process": (100e-6, 10e9), "same_machine": (300e-6, 5e9), "remote": (1e-3, 1e9)}
EWMA = 0.3  # weight of the newest measurement


@dataclass
class _Link:
    """The cost model of one locality: seconds = latency + bytes / bandwidth."""

    latency: float
    bandwidth: float

    def estimate(self, nbytes: int, calls: int) -> float:
        return calls * self.latency + nbytes / self.bandwidth

    def observe(self, nbytes: int, seconds: float) -> None:
        """Fold in one call: what the bandwidth does not explain is latency, and the rest
        of the time (at least a tenth) went to moving the bytes."""
        latency = max(seconds - nbytes / self.bandwidth, 0.0)
        self.latency += EWMA * (latency - self.latency)
        moving = max(seconds - self.latency, seconds * 0.1, 1e-9)
        self.bandwidth += EWMA * (nbytes / moving - self.bandwidth)


class PeerFetcher:
    """Fetches pages other members hold; implements `omni.kv.peers.PeerSource`.

    Args:
        directory: who holds which pages.
        client_for: the RPC client of a member (None when there is none, e.g. it left).
        local_member: this worker's name (never fetched from).
        layout: the pages' layout (this store's).
        host_id: this machine's id as holders see it (default `movers.host_id()`).
        timeout: seconds one fetch call may take (and storing its pages as long again).
        connect: ``await connect(name, endpoint)``, a client to a member not followed yet
            (one named by the request, `request_holders`); None: only followed members.
    """

    def __init__(self, directory: KVDirectory, client_for: Callable[[str], RPCClient | None],
                 local_member: str, *, layout: KVLayout, host_id: str | None = None,
                 timeout: float = 10.0,
                 connect: Callable[[str, str], Awaitable[RPCClient]] | None = None):
        self.directory = directory
        self.client_for = client_for
        self.local_member = local_member
        self.layout = layout
        self.host_id = host_id if host_id is not None else movers.host_id()
        self.timeout = timeout
        self.connect = connect
        self._links = {loc: _Link(*guess) for loc, guess in INITIAL_LINKS.items()}
        self._member_locality: dict[str, Locality] = {}  # learned from their replies
        self._counts = dict.fromkeys(("fetches", "pages", "bytes", "failures", "empty",
                                      "skipped_as_slower", "no_source", "from_request"), 0)
        self._by_locality = {loc: dict.fromkeys(("fetches", "pages", "bytes", "failures"), 0)
                             for loc in INITIAL_LINKS}

    def estimate(self, member: str, pages: int) -> float:
        """Seconds to fetch `pages` pages from `member` (its locality once known, else
        remote: the dearest guess)."""
        link = self._links[self._member_locality.get(member, "remote")]
        limit = max(pages_per_call(self.layout), 1)
        return link.estimate(pages * self.layout.page_bytes, math.ceil(pages / limit))

    async def fetch(self, store: KVStore, keys: Sequence[bytes], *,
                    recompute_page_s: float | None) -> int:
        """Bring the longest run of leading `keys` some member holds into `store`, unless
        recomputing (`recompute_page_s` per page; None: unknown) is faster. Returns how many
        leading keys are in `store` now. Never raises (but for cancellation)."""
        keys = list(keys)
        member, n = self.directory.best_source(keys, exclude=(self.local_member,))
        if member is None or n == 0:  # the directory may not have heard yet: ask the request's
            member, n = await self._request_holder(len(keys))
        limit = pages_per_call(self.layout)
        if member is None or n == 0 or limit == 0:
            self._counts["no_source"] += 1
            return 0
        if recompute_page_s is not None and self.estimate(member, n) >= recompute_page_s * n:
            self._counts["skipped_as_slower"] += 1
            return 0
        locality = self._member_locality.get(member, "remote")
        client = self.client_for(member)
        if client is None:
            self._fail(member, locality, "no RPC client")
            return 0
        got = 0
        for start in range(0, n, limit):
            chunk = keys[start:start + limit]
            try:
                with trio.fail_after(2 * self.timeout):  # the call's, then the put's
                    moved = await self._fetch_chunk(client, member, store, chunk)
            except Exception as exc:  # fail closed: a miss (TooSlowError included)
                self._fail(member, self._member_locality.get(member, locality), repr(exc))
                break
            got += moved
            if moved < len(chunk):
                break
        return store.match(keys[:got]) if got else 0

    async def _request_holder(self, n: int) -> tuple[str | None, int]:
        """The latest worker that served the current request (it is asked for all `n`
        pages: it sends the leading ones it holds), connected to first if this worker has not
        heard of it yet; or (None, 0)."""
        for member, endpoint in request_holders.get():
            if member == self.local_member:
                continue
            if self.client_for(member) is None and self.connect is not None and endpoint:
                try:
                    await self.connect(member, endpoint)
                except TransportError as exc:
                    log.warning("cannot reach %s at %s for KV pages: %s", member, endpoint,
                                exc)
                    continue
            if self.client_for(member) is not None:
                self._counts["from_request"] += 1
                return member, n
        return None, 0

    async def _fetch_chunk(self, client: RPCClient, member: str, store: KVStore,
                           chunk: list[bytes]) -> int:
        began = time.perf_counter()
        reply = await client.call_with_payload(
            "kv.fetch", FetchRequest(chunk, self.host_id, os.getpid()), timeout=self.timeout,
            result_type=FetchReply)
        header = reply.body.header
        if header is None:  # it no longer holds them: the directory will hear of it
            self._counts["empty"] += 1
            return 0
        with unpack(header, reply.payload, self.layout) as received:
            if list(received.keys) != chunk[:len(received)]:
                raise WireError(f"{member} sent pages of other keys than asked")
            await trio.to_thread.run_sync(received.put_into, store)
            locality = received.locality
        pages = len(received)
        nbytes = pages * self.layout.page_bytes
        self._links[locality].observe(nbytes, time.perf_counter() - began)
        self._member_locality[member] = locality
        for counts in (self._counts, self._by_locality[locality]):
            counts["fetches"] += 1
            counts["pages"] += pages
            counts["bytes"] += nbytes
        return pages

    def _fail(self, member: str, locality: Locality, why: str) -> None:
        self._counts["failures"] += 1
        self._by_locality[locality]["failures"] += 1
        log.warning("KV fetch from %s failed (a miss, recomputed): %s", member, why)

    def stats(self) -> dict[str, Any]:
        """Counters (fetches, pages, bytes, failures, empty, skipped_as_slower, no_source,
        from_request: sources found through the request's earlier workers),
        the same by locality, and each locality's learned latency_s and bandwidth (B/s)."""
        links = {loc: {"latency_s": link.latency, "bandwidth": link.bandwidth}
                 for loc, link in self._links.items()}
        return {**self._counts, "by_locality": {k: dict(v) for k, v in
                                                self._by_locality.items()}, "links": links}

    def __repr__(self) -> str:
        c = self._counts
        return (f"<PeerFetcher {self.local_member} fetches={c['fetches']} pages={c['pages']} "
                f"failures={c['failures']}>")
