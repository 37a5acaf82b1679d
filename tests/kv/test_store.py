"""KVStore: round trips, bad input, capacity, corruption, disk full, leases and prefetch."""

import errno
import logging
import os
import threading

import pytest
import torch
import trio

from omni._shm import shm_directory
from omni.kv import (
    KVCapacityError,
    KVError,
    KVLayout,
    KVStore,
    TierConfig,
    block_keys,
)
from omni.kv.tiers import DiskTier
from omni.kv.tiers import disk as disk_module

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_size=4, dtype=torch.float16)
SLOT = DiskTier.slot_bytes_for(LAYOUT)  # a disk slot: header + page, 4 KiB aligned
PAGE = LAYOUT.page_bytes


def keys_and_pages(n: int, seed: int = 0):
    tokens = list(range(seed * 1000, seed * 1000 + n * LAYOUT.page_size))
    keys = block_keys(tokens, LAYOUT.page_size, extra=("test-model",))
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randn((n, *LAYOUT.page_shape), generator=gen).to(LAYOUT.dtype)
    return keys, pages


def make_store(tmp_path, device=4, host=4, disk=8, **kwargs) -> KVStore:
    tiers = [TierConfig("device", device * PAGE), TierConfig("host", host * PAGE)]
    if disk:
        tiers.append(TierConfig("disk", disk * SLOT, path=tmp_path / "kv"))
    return KVStore(LAYOUT, tiers, **kwargs)


def test_put_match_acquire_round_trip(tmp_path):
    keys, pages = keys_and_pages(3)
    with make_store(tmp_path) as store:
        assert store.put(keys, pages) == 3
        assert store.put(keys, pages) == 0  # already cached: nothing new
        assert store.match(keys) == 3
        with store.acquire(keys) as lease:
            assert len(lease) == 3
            assert torch.equal(lease.pages(), pages)
            assert torch.equal(lease.page(1), pages[1])
        assert store.stats()["leases"] == {"open": 0, "exported": 0, "pinned_pages": 0}


def test_a_lease_gives_one_layer_of_its_pages_in_slot_order_or_not(tmp_path):
    keys, pages = keys_and_pages(4)
    with make_store(tmp_path) as store:
        store.put(keys, pages)  # consecutive slots: each layer's pages are a view
        with store.acquire(keys) as lease:
            for layer in range(LAYOUT.num_layers):
                assert torch.equal(lease.pages(layer), pages[:, layer])
        with store.acquire([keys[2], keys[0], keys[3]]) as lease:  # not in slot order: a copy
            assert torch.equal(lease.pages(1), pages[[2, 0, 3], 1])
            assert torch.equal(lease.pages(), pages[[2, 0, 3]])


def test_match_counts_the_leading_run_only(tmp_path):
    keys, pages = keys_and_pages(4)
    with make_store(tmp_path) as store:
        store.put([keys[0], keys[1], keys[3]], pages[[0, 1, 3]])
        assert store.match(keys) == 2
        assert store.match(keys[2:]) == 0
        assert store.stats()["device"]["misses"] == 2


def test_pages_spill_down_the_tiers_and_come_back_intact(tmp_path):
    keys, pages = keys_and_pages(14)
    with make_store(tmp_path) as store:
        for i in range(14):
            store.put([keys[i]], pages[i:i + 1])
        stats = store.stats()
        assert (stats["device"]["pages"], stats["host"]["pages"]) == (4, 4)
        assert stats["disk"]["pages"] == 6 and stats["disk"]["demotions"] == 6
        with store.acquire(keys[:4]) as lease:  # the oldest: they went all the way to disk
            assert torch.equal(lease.pages(), pages[:4])
        assert store.stats()["device"]["promotions"] == 4


def test_an_unchanged_page_is_written_to_disk_once(tmp_path, monkeypatch):
    writes = []
    real_write = disk_module.DiskTier.write

    def counting_write(self, slot, page, key):
        writes.append(key)
        return real_write(self, slot, page, key)

    monkeypatch.setattr(disk_module.DiskTier, "write", counting_write)
    keys, pages = keys_and_pages(9)
    with make_store(tmp_path, device=1, host=1, disk=8) as store:
        store.put(keys, pages)  # 7 pages reach the disk
        for _ in range(3):  # keys[0] goes up to the device and back down, three times
            store.acquire(keys[:1]).release()
            store.put(keys[1:3], pages[1:3])
        assert writes.count(keys[0]) == 1


def test_wrong_page_shape_or_dtype_names_what_is_expected(tmp_path):
    keys, pages = keys_and_pages(2)
    with make_store(tmp_path) as store:
        with pytest.raises(ValueError, match=r"pages must have shape \[2, 2, 2, 4, 2, 4\]"):
            store.put(keys, pages[:, :1])
        with pytest.raises(ValueError, match=r"pages must have dtype torch\.float16"):
            store.put(keys, pages.float())
        with pytest.raises(ValueError, match="a page key is 16 bytes"):
            store.put([b"short", keys[1]], pages)
        assert store.match(keys) == 0  # nothing half-stored


def test_a_tier_smaller_than_a_page_fails_at_construction(tmp_path):
    with pytest.raises(ValueError, match="holds no page"):
        KVStore(LAYOUT, [TierConfig("host", PAGE - 1)])
    with pytest.raises(ValueError, match="unknown KV tier 'gpu'"):
        TierConfig("gpu", "1GiB")
    with pytest.raises(ValueError, match="distinct tiers"):
        KVStore(LAYOUT, [TierConfig("host", PAGE), TierConfig("host", PAGE)])


def test_an_unwritable_disk_path_fails_at_construction(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises((ValueError, PermissionError), match="a-file"):
        KVStore(LAYOUT, [TierConfig("host", PAGE), TierConfig("disk", "1MiB", path=blocker)])


def test_everything_pinned_raises_capacity_error_and_recovers(tmp_path):
    keys, pages = keys_and_pages(3)
    with make_store(tmp_path, device=2, host=1, disk=0) as store:
        store.put(keys[:2], pages[:2])
        lease = store.acquire(keys[:2])
        with pytest.raises(KVCapacityError, match="every page in it is pinned"):
            store.put(keys[2:], pages[2:])
        assert torch.equal(lease.pages(), pages[:2])  # the pinned pages are untouched
        lease.release()
        store.put(keys[2:], pages[2:])
        assert store.match(keys[2:]) == 1


def test_acquiring_more_than_the_top_tier_holds_pins_nothing(tmp_path):
    keys, pages = keys_and_pages(4)
    with make_store(tmp_path, device=2, host=4, disk=0) as store:
        store.put(keys, pages)
        with pytest.raises(KVCapacityError):
            store.acquire(keys)
        assert store.stats()["leases"]["pinned_pages"] == 0


def test_a_corrupted_disk_page_is_a_miss_never_data(tmp_path, caplog):
    keys, pages = keys_and_pages(3)
    with make_store(tmp_path, device=1, host=1, disk=4) as store:
        store.put(keys, pages)  # keys[0] is on disk only
        placement = store._manager.placement(keys[0])
        assert placement.tier is None and placement.disk_slot is not None
        disk = store._tiers[2]
        offset = placement.disk_slot * disk.slot_bytes + disk_module.HEADER.size + 10
        fd = os.open(disk.path, os.O_RDWR)
        try:
            os.pwrite(fd, b"\xff\x00\xff", offset)
        finally:
            os.close(fd)
        with caplog.at_level(logging.WARNING, logger="omni.kv"):
            lease = store.acquire(keys)
        assert len(lease) == 0  # recompute: the prefix stops at the corrupt page
        lease.release()
        assert store.stats()["disk"]["corrupt"] == 1
        assert store.match(keys) == 0
        assert any("verification" in r.message for r in caplog.records)


def test_a_full_disk_drops_pages_and_keeps_serving(tmp_path, monkeypatch):
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_module.os, "pwritev", no_space)
    keys, pages = keys_and_pages(6)
    with make_store(tmp_path, device=2, host=2, disk=4) as store:
        store.put(keys, pages)
        stats = store.stats()
        assert stats["disk"]["write_errors"] == 2 and stats["disk"]["pages"] == 0
        assert store.match(keys) == 0 and store.match(keys[2:]) == 4
        with store.acquire(keys[4:]) as lease:
            assert torch.equal(lease.pages(), pages[4:])
        store.put(*keys_and_pages(2, seed=1))  # more pages keep coming: still serving


async def test_prefetch_of_pages_in_memory_counts_hits_and_stops_at_the_first_miss(tmp_path):
    keys, pages = keys_and_pages(4)
    with make_store(tmp_path) as store:
        store.put(keys[:3], pages[:3])
        hits = store.stats()["device"]["hits"]
        assert await store.prefetch(keys) == 3  # keys[3] was never put
        assert store.stats()["device"]["hits"] == hits + 3
        assert await store.prefetch(keys[:1]) == 1  # touches keys[0]: keys[1] is coldest
        store.put(*keys_and_pages(2, seed=1))  # the device tier (4 pages) evicts one
        assert store._manager.placement(keys[1]).tier == "host"
        assert store._manager.placement(keys[0]).tier == "device"


async def test_prefetch_never_waits_on_the_event_loop_for_another_thread_s_store_work(
        tmp_path):
    keys, pages = keys_and_pages(3)
    with make_store(tmp_path) as store:
        store.put(keys, pages)
        ticks = 0
        holding, done = threading.Event(), threading.Event()

        def busy_store() -> None:  # another thread inside the store (a long put, say)
            with store._lock:
                holding.set()
                done.wait(30)

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                if ticks == 50:
                    done.set()
                await trio.sleep(0)

        thread = threading.Thread(target=busy_store)
        thread.start()
        holding.wait(30)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            assert await store.prefetch(keys) == 3  # waited in a worker thread
            nursery.cancel_scope.cancel()
        thread.join()
        assert ticks >= 50  # the event loop ran while the other thread held the store


async def test_prefetch_brings_disk_pages_up_off_the_event_loop(tmp_path):
    keys, pages = keys_and_pages(6)
    with make_store(tmp_path, device=2, host=4, disk=8) as store:
        store.put(keys, pages)
        store.put(keys[2:], pages[2:])  # touch: keys[0:2] become the coldest
        for _ in range(4):
            store.put(*keys_and_pages(1, seed=10 + _))
        assert store._manager.placement(keys[0]).tier is None  # on disk only
        assert await store.prefetch(keys[:2]) == 2
        assert store._manager.placement(keys[0]).tier == "host"
        with store.acquire(keys[:2]) as lease:
            assert torch.equal(lease.pages(), pages[:2])


def test_lfu_policy_keeps_the_frequently_used_page(tmp_path):
    keys, pages = keys_and_pages(3)
    with make_store(tmp_path, device=2, host=2, disk=0, policy="lfu") as store:
        store.put(keys[:2], pages[:2])
        for _ in range(3):
            store.acquire(keys[:1]).release()  # keys[0] is used often, keys[1] once
        store.put(keys[2:], pages[2:])
        assert store._manager.placement(keys[0]).tier == "device"
        assert store._manager.placement(keys[1]).tier == "host"


def test_leases_and_pins_return_to_zero_after_many_requests(tmp_path):
    keys, pages = keys_and_pages(12)
    with make_store(tmp_path, device=4, host=4, disk=8) as store:
        for i in range(300):
            n = 1 + i % 4
            start = (i * 7) % 8
            store.put(keys[start:start + n], pages[start:start + n])
            with store.acquire(keys[start:start + n]) as lease:
                assert torch.equal(lease.pages(), pages[start:start + len(lease)])
        assert store.stats()["leases"] == {"open": 0, "exported": 0, "pinned_pages": 0}
        store._manager.check()


def test_closed_store_refuses_work_and_repr_summarises(tmp_path):
    keys, pages = keys_and_pages(1)
    store = make_store(tmp_path)
    store.put(keys, pages)
    assert repr(store) == "<KVStore device=1/4 host=0/4 disk=0/8>"
    store.close()
    store.close()
    assert repr(store) == "<KVStore closed>"
    with pytest.raises(KVError, match="closed"):
        store.match(keys)


def test_disk_files_are_private_and_removed_on_close(tmp_path):
    store = make_store(tmp_path)
    disk = store._tiers[2]
    assert oct(os.stat(disk.directory).st_mode & 0o777) == "0o700"
    assert oct(os.stat(disk.path).st_mode & 0o777) == "0o600"
    store.close()
    assert not os.path.exists(disk.path)


def test_shared_memory_is_removed_on_close(tmp_path):
    store = make_store(tmp_path)
    names = [f"omni-{store.store_id}-{t}" for t in ("device", "host", "leases")]
    shm = set(os.listdir(shm_directory()))
    assert all(n in shm for n in names)
    store.close()
    assert not set(names) & set(os.listdir(shm_directory()))


async def test_trio_can_wait_for_prefetch_while_other_tasks_run(tmp_path):
    keys, pages = keys_and_pages(2)
    ticks = []
    with make_store(tmp_path) as store:
        store.put(keys, pages)

        async def tick():
            ticks.append(1)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(tick)
            assert await store.prefetch(keys) == 2
    assert ticks == [1]


def test_acquire_now_leases_pages_in_the_top_tier_and_declines_the_rest(tmp_path):
    keys, pages = keys_and_pages(6)
    with make_store(tmp_path, device=4, host=4, disk=0) as store:
        store.put(keys[:5], pages[:5])  # the device tier (4 pages) pushed keys[0] to host
        assert store._manager.placement(keys[0]).tier == "host"
        assert store.acquire_now(keys) is None  # keys[0] must move up: a worker thread's job
        assert store.stats()["leases"]["pinned_pages"] == 0
        misses = store.stats()["device"]["misses"]
        with store.acquire_now(keys[1:]) as lease:  # keys[5] was never put
            assert list(lease.keys) == keys[1:5]
            assert torch.equal(lease.pages(), pages[1:5])
            assert store.stats()["leases"]["pinned_pages"] == 4
        assert store.stats()["device"]["misses"] == misses + 1  # counted as `acquire` does
        assert store.stats()["leases"]["pinned_pages"] == 0


def test_acquire_now_leaves_the_store_as_acquire_does(tmp_path):
    """The fast path (one step for the whole run) against the general one, on twin stores:
    the same pages leased, the same hits and misses, the same eviction order after."""
    keys, pages = keys_and_pages(6)
    stores = [make_store(tmp_path / name, device=4, host=4, disk=0) for name in "ab"]
    try:
        for store in stores:
            store.put(keys[:4], pages[:4])
        asked = [keys[2], keys[0], keys[3], keys[5], keys[1]]  # keys[5] absent: a miss
        fast, general = stores[0].acquire_now(asked), stores[1].acquire(asked)
        with fast, general:
            assert list(fast.keys) == list(general.keys) == asked[:3]
            assert torch.equal(fast.pages(), general.pages())
            assert stores[0].stats() == stores[1].stats()
        assert stores[0].stats() == stores[1].stats()
        assert stores[0]._manager.resident(0) == stores[1]._manager.resident(0)
        assert stores[0]._manager.resident(0)[-3:] == asked[:3]  # used last, in that order
    finally:
        for store in stores:
            store.close()


def test_acquire_now_never_waits_for_another_thread_s_store_work(tmp_path):
    keys, pages = keys_and_pages(2)
    with make_store(tmp_path) as store:
        store.put(keys, pages)
        results: list = []
        with store._lock:  # this thread is inside the store (a long put, say)
            other = threading.Thread(target=lambda: results.append(store.acquire_now(keys)))
            other.start()
            other.join(30)
        assert results == [None]
        assert store.stats()["leases"]["pinned_pages"] == 0
