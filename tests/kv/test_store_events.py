"""Store events and the peer hook: listeners hear every page that enters or leaves the store
(and nothing else), replaying the events gives `keys()`, and `prefetch` asks `peers` for the
pages it lacks."""

from __future__ import annotations

import logging
import os
import random
import threading
from collections.abc import Sequence

import pytest
import torch
import trio

from omni.kv import KVCapacityError, KVLayout, KVStore, TierConfig, block_keys
from omni.kv.peers import PeerSource
from omni.kv.tiers import DiskTier
from omni.kv.tiers import disk as disk_module

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, page_size=4, dtype=torch.float16)
PAGE = LAYOUT.page_bytes
SLOT = DiskTier.slot_bytes_for(LAYOUT)


def keys_and_pages(n: int, seed: int = 0) -> tuple[list[bytes], torch.Tensor]:
    tokens = list(range(seed * 1000, seed * 1000 + n * LAYOUT.page_size))
    keys = block_keys(tokens, LAYOUT.page_size, extra=("events",))
    gen = torch.Generator().manual_seed(seed)
    return keys, torch.randn((n, *LAYOUT.page_shape), generator=gen).to(LAYOUT.dtype)


def make_store(tmp_path, device=2, host=2, disk=0) -> KVStore:
    tiers = [TierConfig("device", device * PAGE), TierConfig("host", host * PAGE)]
    if disk:
        tiers.append(TierConfig("disk", disk * SLOT, path=tmp_path / "kv"))
    return KVStore(LAYOUT, tiers)


class Recorder:
    """A listener that keeps every event and the set they replay to."""

    def __init__(self) -> None:
        self.events: list[tuple[list[bytes], list[bytes]]] = []
        self.keys: set[bytes] = set()

    def __call__(self, stored: list[bytes], removed: list[bytes]) -> None:
        assert not set(stored) & set(removed)
        self.events.append((list(stored), list(removed)))
        self.keys.update(stored)
        self.keys.difference_update(removed)


def test_put_reports_new_keys_only(tmp_path):
    keys, pages = keys_and_pages(3)
    with make_store(tmp_path, device=4, host=4) as store:
        rec = Recorder()
        store.add_listener(rec)
        store.put(keys[:2], pages[:2])
        store.put(keys, pages)  # two already there: only the third is new
        assert rec.events == [(keys[:2], []), ([keys[2]], [])]
        assert sorted(store.keys()) == sorted(keys)


def test_moves_between_tiers_are_not_events_eviction_from_the_last_is(tmp_path):
    keys, pages = keys_and_pages(6)
    with make_store(tmp_path, device=2, host=2, disk=3) as store:
        rec = Recorder()
        store.add_listener(rec)
        store.put(keys[:4], pages[:4])  # keys 0, 1 demoted to host: no event
        assert rec.events == [(keys[:4], [])]
        store.put(keys[4:], pages[4:])  # 0, 1 go to disk, 2, 3 to host: still in the store
        assert rec.events[-1] == (keys[4:], [])
        with store.acquire(keys[:1]) as lease:  # up from disk, 2 down to it: moves, no event
            assert len(lease) == 1
        assert len(rec.events) == 2
        more, more_pages = keys_and_pages(4, seed=1)
        store.put(more, more_pages)  # the disk is full: its victims leave the store
        stored, removed = rec.events[-1]
        assert stored == more and removed and not set(removed) & set(store.keys())
        assert rec.keys == set(store.keys())
        store._manager.check()


def test_without_disk_an_eviction_from_host_is_a_removal(tmp_path):
    keys, pages = keys_and_pages(5)
    with make_store(tmp_path, device=2, host=2) as store:
        rec = Recorder()
        store.add_listener(rec)
        store.put(keys, pages)  # five pages, room for four: the oldest goes
        assert rec.events == [(keys[1:], [])]  # put and evicted in one operation: no event
        store.put([keys[0]], pages[:1])
        assert rec.events[-1] == ([keys[0]], [keys[1]])


def test_discard_reports_removals_and_keeps_pinned_pages(tmp_path):
    keys, pages = keys_and_pages(3)
    with make_store(tmp_path, device=4, host=4) as store:
        store.put(keys, pages)
        rec = Recorder()
        store.add_listener(rec)
        with store.acquire(keys[:1]):
            assert store.discard(keys) == 2  # keys[0] is leased: it stays
        assert rec.events == [([], keys[1:])]
        assert store.keys() == [keys[0]]
        assert store.discard(keys[1:]) == 0 and len(rec.events) == 1  # absent: no event


def test_a_page_dropped_as_corrupt_is_a_removal(tmp_path, caplog):
    keys, pages = keys_and_pages(3)
    with make_store(tmp_path, device=1, host=1, disk=4) as store:
        store.put(keys, pages)  # keys[0] is on disk only
        rec = Recorder()
        store.add_listener(rec)
        placement = store._manager.placement(keys[0])
        disk = store._tiers[2]
        offset = placement.disk_slot * disk.slot_bytes + disk_module.HEADER.size + 10
        fd = os.open(disk.path, os.O_RDWR)
        try:
            os.pwrite(fd, b"\xff\x00\xff", offset)
        finally:
            os.close(fd)
        with caplog.at_level(logging.WARNING, logger="omni.kv"), store.acquire(keys) as lease:
            assert len(lease) == 0
        assert rec.events == [([], [keys[0]])]
        assert keys[0] not in store.keys()


def test_removed_listeners_hear_nothing_and_a_failing_one_breaks_nothing(tmp_path, caplog):
    keys, pages = keys_and_pages(2)
    with make_store(tmp_path) as store:
        rec = Recorder()
        remove = store.add_listener(rec)

        def broken(stored, removed):
            raise RuntimeError("listener bug")

        store.add_listener(broken)
        with caplog.at_level(logging.ERROR, logger="omni.kv"):
            assert store.put(keys[:1], pages[:1]) == 1
        assert rec.events == [([keys[0]], [])]
        assert any("listener failed" in r.message for r in caplog.records)
        remove()
        store.put(keys[1:], pages[1:])
        assert len(rec.events) == 1


def test_a_failed_acquire_still_reports_what_it_evicted(tmp_path):
    keys, pages = keys_and_pages(5)
    with make_store(tmp_path, device=2, host=3) as store:
        for i in range(5):  # device: 3, 4; host: 0, 1, 2 (least recent first)
            store.put(keys[i:i + 1], pages[i:i + 1])
        rec = Recorder()
        store.add_listener(rec)
        # 3 pinned; bringing 0 up pushes 4 into host, which drops 1 from the store; then 2
        # cannot come up (the device holds two pinned pages): the acquire fails half-way.
        with pytest.raises(KVCapacityError):
            store.acquire([keys[3], keys[0], keys[2]])
        assert rec.events == [([], [keys[1]])]
        assert store.stats()["leases"]["pinned_pages"] == 0
        assert set(store.keys()) == set(keys) - {keys[1]}


def test_events_from_many_threads_replay_to_the_stores_keys(tmp_path):
    with make_store(tmp_path, device=4, host=4) as store:
        rec = Recorder()
        store.add_listener(rec)

        def worker(seed: int) -> None:
            keys, pages = keys_and_pages(12, seed=seed)
            for i in range(12):
                store.put(keys[i:i + 1], pages[i:i + 1])
                if i % 3 == 0:
                    store.discard(keys[i // 2:i // 2 + 1])

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert rec.keys == set(store.keys())


@pytest.mark.parametrize("seed", range(3))
def test_model_replaying_events_always_equals_keys(tmp_path, seed):
    """Random puts, leases, prefetch-style promotions and discards on a store that spills
    to a tiny disk: after every operation the replayed events equal `keys()`."""
    rng = random.Random(seed)
    universe, pages = keys_and_pages(16, seed=seed)
    with make_store(tmp_path, device=2, host=2, disk=3) as store:
        rec = Recorder()
        store.add_listener(rec)
        for _ in range(200):
            op = rng.choice(["put", "put", "acquire", "promote", "discard"])
            picked = sorted(rng.sample(range(16), rng.randint(1, 4)))
            keys = [universe[i] for i in picked]
            if op == "put":
                try:
                    store.put(keys, pages[picked])
                except KVCapacityError:
                    pass
            elif op == "acquire":
                with store.acquire(keys):
                    pass
            elif op == "promote":
                store._prefetch_sync(keys)
            else:
                store.discard(keys)
            assert rec.keys == set(store.keys()), op
        store._manager.check()


class DictPeers:
    """A peer source over a dict of pages: what a cluster's fetcher does, minus the wire."""

    def __init__(self, pages: dict[bytes, torch.Tensor]) -> None:
        self.pages = pages
        self.calls: list[tuple[list[bytes], float | None]] = []

    async def fetch(self, store: KVStore, keys: Sequence[bytes], *,
                    recompute_page_s: float | None) -> int:
        self.calls.append((list(keys), recompute_page_s))
        n = 0
        while n < len(keys) and keys[n] in self.pages:
            n += 1
        if n:
            store.put(keys[:n], torch.stack([self.pages[k] for k in keys[:n]]))
        return n


async def test_prefetch_asks_peers_for_the_rest_of_the_prefix(tmp_path):
    keys, pages = keys_and_pages(5)
    with make_store(tmp_path, device=4, host=4) as store:
        store.put(keys[:2], pages[:2])
        peers = DictPeers({k: pages[i] for i, k in enumerate(keys[:4])})
        assert isinstance(peers, PeerSource)
        assert await store.prefetch(keys) == 2  # no peers yet
        store.peers = peers
        assert await store.prefetch(keys, recompute_page_s=0.5) == 4
        assert peers.calls == [(keys[2:], 0.5)]
        with store.acquire(keys) as lease:
            assert len(lease) == 4 and torch.equal(lease.pages(), pages[:4])
        assert await store.prefetch(keys[:4]) == 4 and len(peers.calls) == 1  # all local
        assert store.stats()["peers"] == {"fetches": 1, "pages": 2}


async def test_prefetch_without_peers_is_unchanged_and_stats_say_nothing_of_peers(tmp_path):
    keys, pages = keys_and_pages(3)
    with make_store(tmp_path, device=1, host=1, disk=4) as store:
        store.put(keys, pages)
        assert await store.prefetch(keys) == 3
        assert "peers" not in store.stats()
        with trio.fail_after(1):
            assert await store.prefetch([]) == 0
