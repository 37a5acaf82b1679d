"""Shared-memory tiers take /dev/shm as pages arrive, and a /dev/shm without room makes a tier
full at what it holds (evicting as a full tier does), never a crash or a wrong page.

The room is limited here by a budget on `os.posix_fallocate` as the arena module sees it;
tests/reliability/test_small_shm.py runs the same under a real 64 MiB tmpfs.
"""

import errno
import logging
import os

import pytest
import torch

from omni import _shm as shm_module
from omni._shm import shm_directory
from omni.kv import KVCapacityError, KVLayout, KVStore, TierConfig, block_keys
from omni.kv.tiers.memory import RESERVE_STEP

MIB = 1 << 20
# 2 layers x K,V x 16 tokens x 4 heads x 32 dims, float32: 32 KiB pages, 128 to a step.
LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=32, page_size=16, dtype=torch.float32)
STEP = RESERVE_STEP // LAYOUT.page_bytes


def keys_for(n: int, start: int = 0) -> list[bytes]:
    tokens = range(start * LAYOUT.page_size, (start + n) * LAYOUT.page_size)
    return block_keys(tokens, LAYOUT.page_size, extra=("shm-growth",))


def page_of(key: bytes) -> torch.Tensor:
    """What recomputing the page of `key` gives: derived from the key alone."""
    seed = int.from_bytes(key[:8], "little") & ((1 << 63) - 1)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.page_shape, generator=generator)


def pages_of(keys: list[bytes]) -> torch.Tensor:
    return torch.stack([page_of(k) for k in keys])


def held(store: KVStore, tier: str) -> int:
    """Bytes of /dev/shm the tier's arena holds."""
    return os.stat(shm_directory() / f"omni-{store.store_id}-{tier}").st_blocks * 512


def test_a_fresh_store_holds_a_step_per_tier_and_grows_as_pages_are_put():
    with KVStore(LAYOUT, [TierConfig("device", 16 * MIB), TierConfig("host", "256MiB")]) as store:
        assert held(store, "device") <= RESERVE_STEP and held(store, "host") <= RESERVE_STEP
        assert store.stats()["host"]["reserved"] == STEP
        keys = keys_for(6 * STEP)  # 24 MiB: the device tier's 16, then 8 in the host tier
        for i in range(0, len(keys), 16):
            store.put(keys[i:i + 16], pages_of(keys[i:i + 16]))
        stats = store.stats()
        assert stats["device"]["reserved"] == stats["device"]["capacity"] == 4 * STEP
        assert stats["host"]["pages"] == 2 * STEP and stats["host"]["reserved"] == 2 * STEP
        assert 2 * RESERVE_STEP <= held(store, "host") < 3 * RESERVE_STEP
        for key in keys:  # the first pages, written before any growth, are intact
            with store.acquire([key]) as lease:
                assert torch.equal(lease.pages()[0], page_of(key))


def test_freed_slots_are_handed_out_lowest_first():
    """A page leaving a slot lets the next page take it before any higher slot: the pages in
    use stay packed at the bottom of the arena, where its memory is reserved."""
    with KVStore(LAYOUT, [TierConfig("device", "64MiB")]) as store:
        keys = keys_for(8)
        store.put(keys, pages_of(keys))
        slots = {k: store._manager.placement(k).slot for k in keys}
        assert sorted(slots.values()) == list(range(8))
        store.discard([keys[5], keys[2]])
        more = keys_for(3, start=100)
        store.put(more, pages_of(more))
        assert [store._manager.placement(k).slot for k in more] == [2, 5, 8]


def _budget(monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    """Let the arenas made from now on reserve `nbytes` in all, as a tmpfs of that size would."""
    real = os.posix_fallocate
    left = [nbytes]

    def fallocate(fd: int, offset: int, length: int) -> None:
        if length > left[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)
        left[0] -= length

    monkeypatch.setattr(shm_module.os, "posix_fallocate", fallocate)


def test_without_room_to_grow_a_tier_evicts_at_what_it_holds_and_says_so_once(
        monkeypatch, caplog):
    _budget(monkeypatch, 8 * MIB + 4 * RESERVE_STEP)  # the lease table, device, host 3 steps
    with KVStore(LAYOUT, [TierConfig("device", 4 * MIB), TierConfig("host", "256MiB")]) as store:
        keys = keys_for(12 * STEP)
        with caplog.at_level(logging.WARNING, logger="omni.kv"):
            for i in range(0, len(keys), 8):
                store.put(keys[i:i + 8], pages_of(keys[i:i + 8]))
        stats = store.stats()
        host = stats["host"]
        assert 2 * STEP < host["reserved"] < host["capacity"]
        assert host["pages"] == host["reserved"] and host["evictions"] > 0
        assert stats["device"]["evictions"] > 0
        [line] = [r.getMessage() for r in caplog.records if "no room left" in r.getMessage()]
        assert line.startswith(f"KV host tier: no room left in {shm_directory()}, so it holds "
                               f"{host['reserved']} pages")
        assert "--shm-size" in line and "--kv-host" in line
        # The most recent pages are all there (LRU), every page there is its own, the others
        # are misses (recomputed).
        recent = keys[-(STEP + host["reserved"]):]
        assert all(store.match([k]) for k in recent)
        for key in keys:
            if store.match([key]):
                with store.acquire([key]) as lease:
                    assert torch.equal(lease.pages()[0], page_of(key))
        # Still serving: new pages go in and come back.
        fresh = keys_for(4, start=5000)
        store.put(fresh, pages_of(fresh))
        with store.acquire(fresh) as lease:
            assert torch.equal(lease.pages(), pages_of(fresh))
        assert store.stats()["host"]["reserved"] == host["reserved"]


def test_a_tier_that_cannot_grow_and_is_all_pinned_names_the_pages_it_holds(monkeypatch):
    with KVStore(LAYOUT, [TierConfig("device", "256MiB")]) as store:
        _budget(monkeypatch, 0)  # a /dev/shm full right after the store started
        keys = keys_for(STEP)
        store.put(keys, pages_of(keys))
        with store.acquire(keys), pytest.raises(KVCapacityError, match=rf"full \({STEP} pages\)"):
            store.put(keys_for(1, start=STEP), pages_of(keys_for(1, start=STEP)))
