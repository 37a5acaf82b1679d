"""Remote KV fetch: pages fetched from another worker's store are byte-identical to its own,
by each locality's mover; a tampered frame, a vanished peer or a holder that lost the pages
is a miss with nothing stored; the cost model skips a fetch slower than recomputing; the
shared-memory path's lease is given back (or expires)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import trio

from omni.cluster.kv import peers as kv_peers
from omni.cluster.kv import request_holders
from omni.cluster.kv.directory import KVDirectory, KVPublisher, KVSnapshot
from omni.cluster.kv.peers import (
    FetchReply,
    FetchRequest,
    PeerFetcher,
    make_fetch_handler,
    serve_kv,
)
from omni.kv import KVLayout, KVStore, TierConfig, block_keys
from omni.kv.tiers import DiskTier
from omni.transport.credentials import Credentials
from omni.transport.errors import TransportError
from omni.transport.movers import SharedMemoryHeader, host_id, unpack
from omni.transport.rpc import Reply, RPCClient, RPCServer
from omni.transport.security import ClusterToken
from tests._wait import CAP_S, wait_until

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float16)


def make_store(pages: int = 32, disk: Path | None = None, **kwargs) -> KVStore:
    """Two memory tiers of `pages` pages each, and a disk tier at `disk` when given."""
    tiers = [TierConfig("device", pages * LAYOUT.page_bytes),
             TierConfig("host", pages * LAYOUT.page_bytes)]
    if disk is not None:
        tiers.append(TierConfig("disk", 64 * DiskTier.slot_bytes_for(LAYOUT), path=disk))
    return KVStore(LAYOUT, tiers, **kwargs)


def keys_and_pages(n: int, seed: int = 0) -> tuple[list[bytes], torch.Tensor]:
    """Keys and pages of random bytes (every bit pattern, NaNs included)."""
    keys = block_keys(range(seed * 1000, seed * 1000 + n * LAYOUT.page_size), LAYOUT.page_size,
                      extra=("peers",))
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * LAYOUT.page_bytes,), dtype=torch.uint8, generator=gen)
    return keys, raw.view(LAYOUT.dtype).view(n, *LAYOUT.page_shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                              b.contiguous().view(torch.uint8))


@dataclass
class Pair:
    """Worker "a" holds pages and serves them; worker "b" fetches them."""

    src: KVStore
    dst: KVStore
    server: RPCServer
    client: RPCClient
    directory: KVDirectory

    def fetcher(self, **kwargs) -> PeerFetcher:
        clients = {"a": self.client}
        return PeerFetcher(self.directory, clients.get, "b", layout=LAYOUT, **kwargs)

    async def holding(self, keys: list[bytes], pages: torch.Tensor) -> None:
        self.src.put(keys, pages)
        await wait_until(lambda: self.directory.prefix_len("a", keys) == len(keys))


@contextlib.asynccontextmanager
async def pair(server_creds: Credentials, client_creds: Credentials, *,
               handler: Callable | None = None, **store_kwargs) -> AsyncIterator[Pair]:
    with make_store(**store_kwargs) as src, make_store() as dst:
        server = RPCServer(ctx=server_creds.ctx, options=server_creds.server_options())
        if handler is None:
            serve_kv(server, src)
        else:
            server.register("kv.fetch", handler(src), body_type=FetchRequest)
        publishers: dict[str, KVPublisher] = {}

        async def snapshot(name: str) -> KVSnapshot:
            await trio.lowlevel.checkpoint()
            return publishers[name].snapshot()

        async with server, KVPublisher(src, "a", server_creds, tick_interval=0.05) as pub, \
                RPCClient(server.endpoint, ctx=client_creds.ctx,
                          options=client_creds.client_options()) as client, \
                KVDirectory(client_creds, snapshot) as directory:
            publishers["a"] = pub
            directory.add_member("a", pub.endpoint)
            with trio.fail_after(CAP_S):
                await directory.wait_synced("a")
            yield Pair(src, dst, server, client, directory)


@pytest.fixture
def creds():
    with Credentials.insecure() as c:
        yield c


@pytest.mark.parametrize(("requester_host", "locality"),
                         [(None, "same_process"), ("another-machine", "remote")])
async def test_fetched_pages_are_byte_identical(creds, requester_host, locality):
    keys, pages = keys_and_pages(5)
    async with pair(creds, creds) as p:
        await p.holding(keys[:4], pages[:4])
        fetcher = p.fetcher(host_id=requester_host)
        assert await fetcher.fetch(p.dst, keys, recompute_page_s=None) == 4
        with p.dst.acquire(keys) as lease:
            assert len(lease) == 4 and same_bytes(lease.pages(), pages[:4])
        stats = fetcher.stats()
        assert (stats["fetches"], stats["pages"], stats["failures"]) == (1, 4, 0)
        assert stats["by_locality"][locality]["pages"] == 4
        assert stats["bytes"] == 4 * LAYOUT.page_bytes
        assert p.src.stats()["leases"] == {"open": 0, "exported": 0, "pinned_pages": 0}


async def test_the_store_fetches_through_its_peers_when_prefetching(creds):
    keys, pages = keys_and_pages(6)
    async with pair(creds, creds) as p:
        await p.holding(keys, pages)
        p.dst.put(keys[:2], pages[:2])  # b has the first two itself
        p.dst.peers = p.fetcher(host_id="another-machine")
        assert await p.dst.prefetch(keys, recompute_page_s=None) == 6
        with p.dst.acquire(keys) as lease:
            assert same_bytes(lease.pages(), pages)
        assert p.dst.stats()["peers"] == {"fetches": 1, "pages": 4}
        assert p.server.stats().requests == 1


async def test_a_tampered_frame_is_a_miss_and_nothing_is_stored(creds, caplog):
    def tampering(store: KVStore):
        real = make_fetch_handler(store)

        async def handle(request: FetchRequest) -> Reply:
            reply = await real(request)
            frame = bytearray(reply.payload[0])
            frame[len(frame) // 2] ^= 0x01  # one bit, in flight
            return Reply(reply.body, [bytes(frame)])

        return handle

    keys, pages = keys_and_pages(3)
    async with pair(creds, creds, handler=tampering) as p:
        await p.holding(keys, pages)
        fetcher = p.fetcher(host_id="another-machine")
        assert await fetcher.fetch(p.dst, keys, recompute_page_s=None) == 0
        assert p.dst.keys() == [] and p.dst.match(keys) == 0
        assert fetcher.stats()["failures"] == 1 and fetcher.stats()["pages"] == 0
        assert "checksum mismatch" in caplog.text


async def test_the_cost_model_skips_a_fetch_slower_than_recomputing(creds):
    keys, pages = keys_and_pages(4)
    async with pair(creds, creds) as p:
        await p.holding(keys, pages)
        fetcher = p.fetcher(host_id="another-machine")
        assert fetcher.estimate("a", 4) > 1e-6
        assert await fetcher.fetch(p.dst, keys, recompute_page_s=1e-9) == 0
        assert fetcher.stats()["skipped_as_slower"] == 1 and p.server.stats().requests == 0
        assert await fetcher.fetch(p.dst, keys, recompute_page_s=1.0) == 4  # dear: fetch
        links = fetcher.stats()["links"]["remote"]
        assert links["latency_s"] > 0 and links["bandwidth"] > 0


async def test_large_fetches_are_split_into_calls_within_the_limit(creds, monkeypatch):
    monkeypatch.setattr(kv_peers, "MAX_FETCH_BYTES", 2 * LAYOUT.page_bytes)
    keys, pages = keys_and_pages(5)
    async with pair(creds, creds) as p:
        await p.holding(keys, pages)
        fetcher = p.fetcher(host_id="another-machine")
        assert await fetcher.fetch(p.dst, keys, recompute_page_s=None) == 5
        assert p.server.stats().requests == 3 and fetcher.stats()["fetches"] == 3
        with p.dst.acquire(keys) as lease:
            assert same_bytes(lease.pages(), pages)


async def test_a_peer_that_vanished_is_a_miss(creds, caplog):
    keys, pages = keys_and_pages(3)
    async with pair(creds, creds) as p:
        await p.holding(keys, pages)
        gone = RPCServer(ctx=creds.ctx)
        async with gone:
            endpoint = gone.endpoint
        async with RPCClient(endpoint, ctx=creds.ctx) as dead:
            fetcher = PeerFetcher(p.directory, {"a": dead}.get, "b", layout=LAYOUT,
                                  timeout=0.2)
            assert await fetcher.fetch(p.dst, keys, recompute_page_s=None) == 0
        assert "timed out" in caplog.text
        no_client = PeerFetcher(p.directory, lambda name: None, "b", layout=LAYOUT)
        assert await no_client.fetch(p.dst, keys, recompute_page_s=None) == 0
        assert fetcher.stats()["failures"] == 1 and no_client.stats()["failures"] == 1
        assert p.dst.keys() == []


async def test_a_holder_that_lost_the_pages_answers_empty_and_it_is_a_miss(creds):
    keys, pages = keys_and_pages(3)
    with make_store() as empty:
        def serve_empty(store: KVStore):
            return make_fetch_handler(empty)

        async with pair(creds, creds, handler=serve_empty) as p:
            await p.holding(keys, pages)  # the directory says "a" has them; its server not
            fetcher = p.fetcher()
            assert await fetcher.fetch(p.dst, keys, recompute_page_s=None) == 0
            assert fetcher.stats()["empty"] == 1 and p.dst.keys() == []
            assert await fetcher.fetch(p.dst, keys[:0], recompute_page_s=None) == 0


async def test_the_same_machine_path_maps_shared_memory_and_gives_the_lease_back(creds):
    keys, pages = keys_and_pages(3)
    async with pair(creds, creds) as p:  # the default ttl: the lease outlives the test
        await p.holding(keys, pages)
        other_process = FetchRequest(keys, host_id(), os.getpid() + 1)
        reply = await p.client.call_with_payload("kv.fetch", other_process, timeout=CAP_S,
                                                 result_type=FetchReply)
        assert isinstance(reply.body.header, SharedMemoryHeader) and not reply.payload
        assert p.src.stats()["leases"]["exported"] == 1  # pinned for the requester
        with unpack(reply.body.header, reply.payload, LAYOUT) as received:
            assert received.locality == "same_machine"
            assert received.put_into(p.dst) == 3
        assert p.src.stats()["leases"] == {"open": 0, "exported": 0, "pinned_pages": 0}
        with p.dst.acquire(keys) as lease:
            assert same_bytes(lease.pages(), pages)


async def test_a_requester_that_dies_holding_a_descriptor_pins_nothing_past_its_ttl(creds):
    """The lease expires on its own. The ttl (2 s) is long against the one reply between the
    export and the check that it is pinned; the expiry itself is awaited, not timed."""
    keys, pages = keys_and_pages(3)
    async with pair(creds, creds, lease_ttl=2.0) as p:
        await p.holding(keys, pages)
        other_process = FetchRequest(keys, host_id(), os.getpid() + 1)
        reply = await p.client.call_with_payload("kv.fetch", other_process, timeout=CAP_S,
                                                 result_type=FetchReply)
        assert p.src.stats()["leases"]["exported"] == 1
        await wait_until(lambda: p.src.stats()["leases"]["exported"] == 0)
        with pytest.raises(TransportError):
            unpack(reply.body.header, reply.payload, LAYOUT)


async def test_fetch_works_under_curve():
    keys, pages = keys_and_pages(3)
    token = ClusterToken.generate()
    with Credentials(token) as holder_creds, Credentials(token) as requester_creds:
        async with pair(holder_creds, requester_creds) as p:
            await p.holding(keys, pages)
            fetcher = p.fetcher(host_id="another-machine")
            assert await fetcher.fetch(p.dst, keys, recompute_page_s=None) == 3
            with p.dst.acquire(keys) as lease:
                assert same_bytes(lease.pages(), pages)
        assert holder_creds.auth_denied() == 0


async def test_pages_too_new_for_the_directory_come_from_the_requests_earlier_worker(creds):
    """The worker that served an earlier node of the request (`request_holders`, set from
    the call's `kv_from`) is asked when the directory knows no holder yet."""
    keys, pages = keys_and_pages(4)
    async with pair(creds, creds) as p:
        p.src.put(keys, pages)  # no checkpoint since: the directory has not heard of them
        fetcher = p.fetcher(host_id="another-machine")
        assert p.directory.prefix_len("a", keys) == 0
        assert await fetcher.fetch(p.dst, keys, recompute_page_s=None) == 0  # no source
        token = request_holders.set((("b", ""), ("a", "")))  # "b" is this worker: skipped
        try:
            assert await fetcher.fetch(p.dst, keys, recompute_page_s=None) == 4
        finally:
            request_holders.reset(token)
        with p.dst.acquire(keys) as lease:
            assert same_bytes(lease.pages(), pages)
        stats = fetcher.stats()
        assert (stats["no_source"], stats["from_request"], stats["pages"]) == (1, 1, 4)


async def test_a_request_holder_without_the_pages_is_a_miss(creds):
    keys, _ = keys_and_pages(3)
    async with pair(creds, creds) as p:
        fetcher = p.fetcher(host_id="another-machine")
        token = request_holders.set((("a", ""),))
        try:
            assert await fetcher.fetch(p.dst, keys, recompute_page_s=None) == 0
        finally:
            request_holders.reset(token)
        assert (fetcher.stats()["empty"], fetcher.stats()["failures"]) == (1, 0)


async def test_a_request_holder_this_worker_has_not_heard_of_is_connected_to(creds):
    """A worker that has not learnt of the holder from the head yet reaches it at the
    endpoint the call named."""
    keys, pages = keys_and_pages(3)
    async with pair(creds, creds) as p:
        p.src.put(keys, pages)
        clients: dict[str, RPCClient] = {}

        async def connect(name: str, endpoint: str) -> RPCClient:
            assert (name, endpoint) == ("a", p.server.endpoint)
            clients[name] = p.client
            return p.client

        fetcher = PeerFetcher(p.directory, clients.get, "b", layout=LAYOUT,
                              host_id="another-machine", connect=connect)
        token = request_holders.set((("a", p.server.endpoint),))
        try:
            assert await fetcher.fetch(p.dst, keys, recompute_page_s=None) == 3
        finally:
            request_holders.reset(token)
        assert clients == {"a": p.client}
        with p.dst.acquire(keys) as lease:
            assert same_bytes(lease.pages(), pages)


@pytest.mark.parametrize(("on_disk", "inline_pages"), [(False, 256), (True, 256), (False, 2)])
async def test_a_same_machine_fetch_takes_a_worker_thread_only_to_read_pages_up(
        creds, monkeypatch, tmp_path, on_disk, inline_pages):
    """Pages in the shared top tier are leased and described on the event loop (a thread hop
    would cost more than the rest of the fetch); a page on disk is read up, and a run longer
    than `INLINE_PAGES` leased, in a worker thread (the event loop never spends long on
    one fetch)."""
    keys, pages = keys_and_pages(9)
    hops: list[str] = []
    real = trio.to_thread.run_sync

    async def counted(fn, *args, **kwargs):
        hops.append(fn.__name__)
        return await real(fn, *args, **kwargs)

    monkeypatch.setattr(kv_peers.trio.to_thread, "run_sync", counted)
    monkeypatch.setattr(kv_peers, "INLINE_PAGES", inline_pages)
    async with pair(creds, creds, pages=4, disk=tmp_path / "kv") as p:
        await p.holding(keys, pages)  # 4 pages per memory tier: keys[0] is on disk only
        assert p.src._manager.placement(keys[0]).tier is None
        wanted = keys[:3] if on_disk else keys[-3:]  # keys[-3:]: in the top tier
        hops.clear()
        reply = await p.client.call_with_payload(
            "kv.fetch", FetchRequest(wanted, host_id(), os.getpid() + 1), timeout=CAP_S,
            result_type=FetchReply)
        assert isinstance(reply.body.header, SharedMemoryHeader)
        with unpack(reply.body.header, reply.payload, LAYOUT) as received:
            assert received.put_into(p.dst) == 3
        assert hops == (["_pack"] if on_disk or inline_pages < 3 else [])
        with p.dst.acquire(wanted) as lease:
            assert same_bytes(lease.pages(), pages[:3] if on_disk else pages[-3:])
