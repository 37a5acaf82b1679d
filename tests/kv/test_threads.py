"""The store is thread-safe: compute threads hammer it and every page they read is right."""

import random
import threading

import torch

from omni.kv import KVCapacityError, KVLayout, KVStore, TierConfig
from omni.kv.tiers import DiskTier

LAYOUT = KVLayout(num_layers=1, num_kv_heads=2, head_dim=4, page_size=4, dtype=torch.float32)
SLOT = DiskTier.slot_bytes_for(LAYOUT)  # a disk slot: header + page, 4 KiB aligned
KEYS = [i.to_bytes(16, "little") for i in range(40)]


def page_of(key: bytes) -> torch.Tensor:
    return torch.full(LAYOUT.page_shape, float(int.from_bytes(key, "little")))


def test_many_threads_put_acquire_and_release_without_corruption(tmp_path):
    page = LAYOUT.page_bytes
    store = KVStore(LAYOUT, [TierConfig("device", 12 * page), TierConfig("host", 8 * page),
                             TierConfig("disk", 16 * SLOT, path=tmp_path)])
    errors: list[BaseException] = []
    reads = [0]

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(400):
                keys = rng.sample(KEYS, rng.randint(1, 3))
                if rng.random() < 0.5:
                    store.put(keys, torch.stack([page_of(k) for k in keys]))
                    continue
                try:
                    with store.acquire(keys) as lease:
                        for i, key in enumerate(lease.keys):
                            assert torch.equal(lease.page(i), page_of(key))
                            reads[0] += 1
                except KVCapacityError:
                    pass  # 4 threads x 3 pins can exceed 12 slots: a clear error, no deadlock
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread is stuck (deadlock)"
    assert errors == []
    assert reads[0] > 100
    assert store.stats()["leases"] == {"open": 0, "exported": 0, "pinned_pages": 0}
    store._manager.check()
    store.close()
