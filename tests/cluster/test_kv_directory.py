"""The KV directory over real PUB/SUB on loopback: events flow, a lost event (in the middle
or the last one) is caught by a seq gap or a tick and repaired by a resync, a restarted
publisher (new epoch) replaces the old view, failed snapshots are retried while the view is
marked stale, and all of it under CURVE too."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Callable, Iterator

import msgspec
import pytest
import torch
import trio
import zmq

from omni.cluster.kv.directory import (
    KVDirectory,
    KVEvent,
    KVPublisher,
    KVSnapshot,
    request_snapshot,
)
from omni.kv import KVLayout, KVStore, TierConfig, block_keys
from omni.transport.credentials import Credentials
from omni.transport.rpc import RPCClient, RPCServer
from omni.transport.security import ClusterToken
from tests._wait import CAP_S, wait_until

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, page_size=4, dtype=torch.float16)
TICK = 0.05  # fast ticks: a lost last event is noticed at the next tick (the tests wait for
# convergence, however many ticks it takes)


def make_store(pages: int = 64) -> KVStore:
    return KVStore(LAYOUT, [TierConfig("device", pages * LAYOUT.page_bytes)])


def keys_and_pages(n: int, seed: int = 0) -> tuple[list[bytes], torch.Tensor]:
    tokens = range(seed * 1000, seed * 1000 + n * LAYOUT.page_size)
    keys = block_keys(tokens, LAYOUT.page_size, extra=("dir",))
    return keys, torch.full((n, *LAYOUT.page_shape), float(seed), dtype=LAYOUT.dtype)


@pytest.fixture
def creds() -> Iterator[Credentials]:
    with Credentials.insecure() as c:
        yield c


def snapshots_of(publishers: dict[str, KVPublisher]):
    """A directory's snapshot function reading the publishers in this process."""

    async def snapshot(name: str) -> KVSnapshot:
        await trio.lowlevel.checkpoint()
        return publishers[name].snapshot()

    return snapshot


@contextlib.asynccontextmanager
async def one_worker(creds: Credentials, **kwargs
                     ) -> AsyncIterator[tuple[KVStore, KVPublisher, KVDirectory]]:
    """A store, its publisher and a directory that follows it as member "w1"."""
    publishers: dict[str, KVPublisher] = {}
    with make_store() as store:
        async with KVPublisher(store, "w1", creds, tick_interval=TICK) as pub:
            publishers["w1"] = pub
            async with KVDirectory(creds, snapshots_of(publishers), **kwargs) as directory:
                directory.add_member("w1", pub.endpoint)
                with trio.fail_after(CAP_S):
                    await directory.wait_synced("w1")
                await wait_until(lambda: heard(directory, "w1"))  # the subscription is up
                yield store, pub, directory


def heard(directory: KVDirectory, name: str) -> bool:
    return directory.stats()["members"][name]["silent_s"] is not None


def converged(directory: KVDirectory, store: KVStore, name: str = "w1") -> Callable[[], bool]:
    return lambda: (directory.keys(name) == set(store.keys())
                    and not directory.is_stale(name))


async def test_events_flow_into_the_directory(creds):
    keys, pages = keys_and_pages(6)
    async with one_worker(creds) as (store, pub, directory):
        store.put(keys[:4], pages[:4])
        await wait_until(converged(directory, store))
        assert directory.prefix_len("w1", keys) == 4
        assert directory.prefix_len("nobody", keys) == 0
        assert directory.holders(keys[0]) == {"w1"} and directory.holders(keys[5]) == set()
        assert directory.best_source(keys) == ("w1", 4)
        assert directory.best_source(keys, exclude=["w1"]) == (None, 0)
        store.discard(keys[:1])
        await wait_until(lambda: directory.prefix_len("w1", keys) == 0)
        assert directory.keys("w1") == set(keys[1:4])
        stats = directory.stats()
        assert stats["events"] >= 2 and stats["gaps"] == 0 and stats["resyncs"] == 1
        assert stats["members"]["w1"]["keys"] == 3 and pub.stats()["events"] >= 2


async def test_events_from_worker_threads_reach_the_directory(creds):
    async with one_worker(creds) as (store, _, directory):

        def put_some(seed: int) -> None:
            for i in range(8):
                keys, pages = keys_and_pages(1, seed=seed * 100 + i)
                store.put(keys, pages)

        async with trio.open_nursery() as nursery:
            for seed in range(3):
                nursery.start_soon(trio.to_thread.run_sync, put_some, seed)
        await wait_until(converged(directory, store))
        assert len(directory.keys("w1")) == 24


class DropNext:
    """Wraps a publisher's socket so that its next `n` events (not ticks) are lost."""

    def __init__(self, pub: KVPublisher, n: int = 1):
        self.send = pub._sock.send_multipart
        self.left = n
        pub._sock.send_multipart = self

    async def __call__(self, frames, **kwargs):
        event = msgspec.msgpack.decode(frames[1], type=KVEvent)
        if self.left and (event.stored or event.removed):
            self.left -= 1
            await trio.lowlevel.checkpoint()
            return None
        return await self.send(frames, **kwargs)


async def test_a_lost_event_is_a_gap_and_a_resync_repairs_the_view(creds):
    keys, pages = keys_and_pages(6)
    async with one_worker(creds) as (store, pub, directory):
        DropNext(pub)
        store.put(keys[:2], pages[:2])  # lost
        await wait_until(lambda: pub.stats()["events"] == 1)
        store.put(keys[2:4], pages[2:4])  # seq 2 arrives where 1 was expected
        await wait_until(converged(directory, store))
        assert directory.keys("w1") == set(keys[:4])
        stats = directory.stats()
        assert stats["gaps"] >= 1 and stats["resyncs"] >= 2


async def test_a_lost_last_event_is_noticed_by_the_next_tick(creds):
    keys, pages = keys_and_pages(3)
    async with one_worker(creds) as (store, pub, directory):
        DropNext(pub)
        store.put(keys, pages)  # lost, and nothing follows it but ticks
        await wait_until(converged(directory, store))
        assert directory.stats()["gaps"] >= 1 and directory.stats()["ticks"] >= 1


async def test_events_during_a_resync_are_replayed_on_the_snapshot(creds):
    keys, pages = keys_and_pages(8)
    gate = trio.Event()
    publishers: dict[str, KVPublisher] = {}
    taken: list[KVSnapshot] = []

    async def slow_snapshot(name: str) -> KVSnapshot:
        snap = publishers[name].snapshot()  # as of now ...
        taken.append(snap)
        await gate.wait()  # ... but it arrives after more events
        return snap

    with make_store() as store:
        async with KVPublisher(store, "w1", creds, tick_interval=TICK) as pub, \
                KVDirectory(creds, slow_snapshot) as directory:
            publishers["w1"] = pub
            store.put(keys[:2], pages[:2])
            directory.add_member("w1", pub.endpoint)
            await wait_until(lambda: taken)
            # The subscription is up (a tick heard): the events below reach the directory.
            # Sent before it is, they would be lost to ZeroMQ's slow joiner, and no event
            # would ever arrive during the resync.
            await wait_until(lambda: heard(directory, "w1"))
            for i in range(2, 8):
                store.put(keys[i:i + 1], pages[i:i + 1])
            store.discard(keys[:1])
            await wait_until(lambda: directory.stats()["events"] >= 1)
            assert directory.is_stale("w1")
            gate.set()
            await wait_until(converged(directory, store))
            assert directory.keys("w1") == set(keys[1:])
            assert len(taken) == 1 or directory.stats()["gaps"] >= 1


async def test_failed_snapshots_are_retried_while_the_view_is_stale(creds):
    keys, pages = keys_and_pages(4)
    publishers: dict[str, KVPublisher] = {}
    failures = [2]

    async def flaky(name: str) -> KVSnapshot:
        if failures[0]:
            failures[0] -= 1
            raise ConnectionError("snapshot refused")
        return publishers[name].snapshot()

    with make_store() as store:
        store.put(keys, pages)
        async with KVPublisher(store, "w1", creds, tick_interval=TICK) as pub, \
                KVDirectory(creds, flaky, max_backoff=0.1) as directory:
            publishers["w1"] = pub
            directory.add_member("w1", pub.endpoint)
            assert directory.is_stale("w1") and directory.prefix_len("w1", keys) == 0
            await wait_until(converged(directory, store))
            stats = directory.stats()
            assert stats["resync_failures"] == 2 and stats["resyncs"] == 1


async def rebind(pub: KVPublisher, endpoint: str) -> KVPublisher:
    """`pub`, bound to `endpoint`, entered once that address is free again (libzmq closes the
    old listener asynchronously); the caller exits it with ``async with``. (Entered outside
    any cancel scope of the wait: the publisher's nursery stays open.)"""
    await wait_until(lambda: _bindable(endpoint), f"{endpoint} free again")
    await pub.__aenter__()
    return _Entered(pub)


def _bindable(endpoint: str) -> bool:
    """Whether a listener could bind `endpoint` now (as libzmq binds: SO_REUSEADDR)."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, int(port)))
        except OSError:
            return False
    return True


class _Entered:
    def __init__(self, pub: KVPublisher):
        self.pub = pub

    async def __aenter__(self) -> KVPublisher:
        return self.pub

    async def __aexit__(self, *exc_info):
        return await self.pub.__aexit__(*exc_info)


async def test_a_restarted_publisher_with_a_new_epoch_replaces_the_old_view(creds):
    old_keys, old_pages = keys_and_pages(3, seed=1)
    new_keys, new_pages = keys_and_pages(2, seed=2)
    publishers: dict[str, KVPublisher] = {}
    with make_store() as old_store, make_store() as new_store:
        async with KVDirectory(creds, snapshots_of(publishers)) as directory:
            async with KVPublisher(old_store, "w1", creds, tick_interval=TICK) as old:
                publishers["w1"] = old
                directory.add_member("w1", old.endpoint)
                old_store.put(old_keys, old_pages)
                await wait_until(converged(directory, old_store))
                endpoint, old_epoch = old.endpoint, old.epoch
            # The worker restarts empty on the same address: a new epoch, seqs from 1 again.
            async with await rebind(KVPublisher(new_store, "w1", creds, bind=endpoint,
                                                tick_interval=TICK), endpoint) as new:
                assert new.epoch != old_epoch
                publishers["w1"] = new
                new_store.put(new_keys, new_pages)
                await wait_until(converged(directory, new_store))
                assert directory.keys("w1") == set(new_keys)
                assert directory.stats()["epoch_changes"] >= 1


async def test_remove_member_forgets_its_keys_and_ignores_it(creds):
    keys, pages = keys_and_pages(4)
    async with one_worker(creds) as (store, pub, directory):
        store.put(keys[:2], pages[:2])
        await wait_until(converged(directory, store))
        directory.remove_member("w1")
        directory.remove_member("w1")  # idempotent
        assert directory.members() == [] and directory.prefix_len("w1", keys) == 0
        assert directory.holders(keys[0]) == set() and directory.keys("w1") == set()
        events = pub.stats()["events"]
        store.put(keys[2:], pages[2:])
        # Counted, not timed: the event went out and three ticks after it, however slowly.
        await wait_until(lambda: pub.stats()["events"] > events)
        ticks = pub.stats()["ticks"]
        await wait_until(lambda: pub.stats()["ticks"] >= ticks + 3)
        assert directory.members() == [] and "w1" not in directory.stats()["members"]


async def test_best_source_picks_the_longest_run_among_members(creds):
    keys, pages = keys_and_pages(6)
    publishers: dict[str, KVPublisher] = {}
    with make_store() as a, make_store() as b:
        async with KVPublisher(a, "a", creds, tick_interval=TICK) as pa, \
                KVPublisher(b, "b", creds, tick_interval=TICK) as pb, \
                KVDirectory(creds, snapshots_of(publishers)) as directory:
            publishers.update(a=pa, b=pb)
            directory.add_member("a", pa.endpoint)
            directory.add_member("b", pb.endpoint)
            a.put(keys[:2], pages[:2])
            b.put(keys[:5], pages[:5])
            await wait_until(lambda: converged(directory, a, "a")()
                             and converged(directory, b, "b")())
            assert sorted(directory.members()) == ["a", "b"]
            assert directory.best_source(keys) == ("b", 5)
            assert directory.best_source(keys, exclude=("b",)) == ("a", 2)
            assert directory.holders(keys[1]) == {"a", "b"}
            assert directory.holders(keys[4]) == {"b"}


async def test_garbage_and_other_members_events_are_dropped(creds):

    async def never(name: str) -> KVSnapshot:
        await trio.sleep_forever()

    rogue = creds.ctx.socket(zmq.PUB)
    try:
        rogue.bind("tcp://127.0.0.1:*")
        endpoint = rogue.get(zmq.LAST_ENDPOINT).decode()
        async with KVDirectory(creds, never) as directory:
            directory.add_member("w1", endpoint)
            forged = KVEvent("w2", 1, 1, [b"k" * 16], [])

            def sent_and_both_dropped() -> bool:  # sent again until the subscription is up
                rogue.send_multipart([b"omni.kv/1", b"\xc1garbage"])
                rogue.send_multipart([b"omni.kv/1", msgspec.msgpack.encode(forged)])
                return directory.stats()["dropped"] >= 2

            await wait_until(sent_and_both_dropped, poll=0.01)
            assert directory.keys("w1") == set()
    finally:
        rogue.close(linger=0)


async def test_under_curve_events_and_rpc_snapshots_flow():
    keys, pages = keys_and_pages(5)
    token = ClusterToken.generate()
    with Credentials(token) as worker_creds, Credentials(token) as router_creds, \
            make_store() as store:
        store.put(keys[:2], pages[:2])
        server = RPCServer(ctx=worker_creds.ctx, options=worker_creds.server_options())
        async with KVPublisher(store, "w1", worker_creds, tick_interval=TICK) as pub:
            pub.register(server)
            async with server, RPCClient(server.endpoint, ctx=router_creds.ctx,
                                         options=router_creds.client_options()) as client:

                async def snapshot(name: str) -> KVSnapshot:
                    return await request_snapshot(client, timeout=30)

                async with KVDirectory(router_creds, snapshot) as directory:
                    directory.add_member("w1", pub.endpoint)
                    await wait_until(converged(directory, store))
                    assert directory.keys("w1") == set(keys[:2])
                    store.put(keys[2:], pages[2:])
                    await wait_until(converged(directory, store))
                    assert directory.prefix_len("w1", keys) == 5
        assert worker_creds.auth_denied() == 0
