"""A store whose device tier is on a GPU, above a page-locked host tier and a disk: pages moved
between them in batches (`batched_copies`: one wait per store operation, not per page) keep
their bytes, with two threads at once, checked against the pages as they were put. Skipped
without CUDA (tests/conftest.py)."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
import torch

from omni.kv import KVLayout, KVStore, TierConfig

pytestmark = pytest.mark.gpu

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.float16)


def page_of(key: bytes) -> torch.Tensor:
    """The page stored under `key`: random values drawn from the key."""
    gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
    return torch.randn(LAYOUT.page_shape, generator=gen).to(LAYOUT.dtype)


def make_store(tmp_path: Path) -> KVStore:
    pb = LAYOUT.page_bytes
    return KVStore(LAYOUT, [TierConfig("device", 8 * pb), TierConfig("host", 16 * pb),
                            TierConfig("disk", 128 * pb, path=tmp_path)], device="cuda")


def check_leased(store: KVStore, keys: list[bytes]) -> int:
    with store.acquire(keys) as lease:
        pages = lease.pages().cpu()
        for i, key in enumerate(lease.keys):
            assert torch.equal(pages[i], page_of(key)), f"page {i} of {len(lease)} changed"
        return len(lease)


def test_pages_promoted_and_demoted_in_batches_keep_their_bytes(tmp_path: Path) -> None:
    keys = [random.Random(i).randbytes(16) for i in range(48)]
    with make_store(tmp_path) as store:
        for start in range(0, 48, 6):  # from the GPU and from page-locked host memory
            batch = keys[start:start + 6]
            pages = torch.stack([page_of(k) for k in batch])
            store.put(batch, pages.cuda() if start % 12 else pages.pin_memory())
        stats = store.stats()
        assert stats["host"]["pages"] > 0 and stats["disk"]["pages"] > 0
        rng = random.Random(0)
        for _ in range(40):
            start = rng.randrange(0, 40)
            assert check_leased(store, keys[start:start + rng.randrange(1, 8)]) > 0
        moved = store.stats()
        assert moved["device"]["promotions"] + moved["host"]["promotions"] > 40
        assert moved["host"]["demotions"] > 40


def test_a_pinned_source_changed_after_put_returns_leaves_the_stored_page(
        tmp_path: Path) -> None:
    key = bytes(range(16))
    source = page_of(key)[None].pin_memory()
    with make_store(tmp_path) as store:
        store.put([key], source)
        source.fill_(0)  # put waited for its copy: the store's page is the one given
        assert check_leased(store, [key]) == 1


def test_two_threads_moving_pages_through_every_tier_keep_their_bytes(tmp_path: Path) -> None:
    """One thread leases pages (host -> device promotions, device -> host demotions, waited for
    once per lease) while another prefetches pages from the disk into the host tier (CPU copies
    into host slots, which must wait for the other thread's pending GPU copies)."""
    keys = [random.Random(1000 + i).randbytes(16) for i in range(64)]
    errors: list[BaseException] = []
    with make_store(tmp_path) as store:
        for start in range(0, 64, 8):
            store.put(keys[start:start + 8],
                      torch.stack([page_of(k) for k in keys[start:start + 8]]).cuda())

        def leasing(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(60):
                    start = rng.randrange(0, 58)
                    check_leased(store, keys[start:start + rng.randrange(1, 7)])
            except BaseException as exc:
                errors.append(exc)

        def prefetching(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(60):
                    start = rng.randrange(0, 56)
                    store._prefetch_sync(keys[start:start + 8])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=leasing, args=(1,)),
                   threading.Thread(target=prefetching, args=(2,))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not errors, errors[0]
        assert all(check_leased(store, keys[i:i + 4]) == 4 for i in range(0, 64, 4))
