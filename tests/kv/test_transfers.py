"""Disk I/O runs outside the store's lock: with a disk write or read parked, other threads'
`match`, `acquire` and `stats` complete, and what they see of the page in transit is what
`omni.kv.manager` documents. The disk is parked at the system call (`os.pwritev`/`os.preadv`)
on an Event, so each test knows the transfer is still in flight: no test waits on a clock."""

from __future__ import annotations

import errno
import threading

import pytest
import torch

from omni.kv import KVError, KVLayout, KVStore, TierConfig
from omni.kv.tiers import DiskTier
from tests.kv._gates import CAP, Gate, Worker

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, page_size=2, dtype=torch.float32)
SLOT = DiskTier.slot_bytes_for(LAYOUT)
KEYS = [bytes([i + 1]) * 16 for i in range(8)]


def page_of(key: bytes) -> torch.Tensor:
    """The page a key stands for: recomputable, so every read has an oracle."""
    return torch.full(LAYOUT.page_shape, float(key[0]) + 0.25)


def make_store(tmp_path, device: int, host: int, disk: int) -> KVStore:
    pages = LAYOUT.page_bytes
    return KVStore(LAYOUT, [TierConfig("device", device * pages),
                            TierConfig("host", host * pages),
                            TierConfig("disk", disk * SLOT, path=tmp_path)])


def put(store: KVStore, *keys: bytes) -> None:
    for key in keys:
        store.put([key], page_of(key)[None])


def assert_serves(store: KVStore, key: bytes) -> None:
    with store.acquire([key]) as lease:
        assert len(lease) == 1 and torch.equal(lease.page(0), page_of(key))


def park(gate: Gate, worker: Worker) -> None:
    worker.start()
    assert gate.parked.wait(CAP), "the disk call was never made"


def test_match_acquire_and_stats_complete_while_a_disk_write_is_parked(tmp_path):
    k = KEYS
    with make_store(tmp_path, device=2, host=2, disk=4) as store:
        put(store, *k[:4])  # device: k2 k3, host: k0 k1
        gate = Gate("pwritev")
        with gate.patch():
            writer = Worker(lambda: put(store, k[4]))  # k0 is demoted to disk: parks
            park(gate, writer)
            assert store.match(k[:4]) == 4
            assert_serves(store, k[3])  # resident on the device
            stats = store.stats()
            assert stats["leases"] == {"open": 0, "exported": 0, "pinned_pages": 0}
            assert store.match([k[4]]) == 0  # its put waits on the write: not there yet
            assert store._manager.placement(k[0]).tier == "host"
            assert_serves(store, k[0])  # the page being written: served from memory
            assert not gate.returned and writer.is_alive()  # all while the write is parked
            gate.go.set()
            writer.finish()
        assert store.match(k[:5]) == 5
        for key in k[:5]:
            assert_serves(store, key)
        assert store.stats()["disk"]["write_errors"] == 0
        store._manager.check()


def test_two_threads_wanting_a_page_on_disk_cause_one_read(tmp_path):
    k = KEYS
    with make_store(tmp_path, device=2, host=1, disk=4) as store:
        put(store, *k[:4])  # device: k2 k3, host: k1, disk: k0
        assert store._manager.placement(k[0]).tier is None
        gate = Gate("preadv")
        waits = threading.Event()
        real_wait = store._moved.wait

        def wait(*args):  # counts a thread waiting for a transfer to commit
            waits.set()
            return real_wait(*args)

        store._moved.wait = wait
        with gate.patch():
            first = Worker(lambda: store.acquire([k[0]]))
            park(gate, first)
            assert store.match(k[:4]) == 4  # on its way up: still in the store
            assert store._manager.placement(k[0]).tier is None  # not resident before it lands
            assert_serves(store, k[3])
            second = Worker(lambda: store.acquire([k[0]]))
            second.start()
            assert waits.wait(CAP)  # the second waits for the first's read
            assert not gate.returned and first.is_alive()
            gate.go.set()
            leases = [first.finish(), second.finish()]
        assert gate.calls == 1  # one read for both
        for lease in leases:
            assert len(lease) == 1 and torch.equal(lease.page(0), page_of(k[0]))
        assert store._manager.placement(k[0]).pins == 2
        for lease in leases:
            lease.release()
        assert store.stats()["leases"]["pinned_pages"] == 0
        store._manager.check()


def test_a_page_discarded_while_it_is_written_is_gone_and_its_disk_slot_freed(tmp_path):
    k = KEYS
    with make_store(tmp_path, device=1, host=2, disk=2) as store:
        put(store, *k[:3])  # device: k2, host: k0 k1
        gate = Gate("pwritev")
        with gate.patch():
            writer = Worker(lambda: put(store, k[3]))  # k0 is written to disk: parks
            park(gate, writer)
            assert store.discard([k[0]]) == 1
            assert store.match([k[0]]) == 0
            gate.go.set()
            writer.finish()
        assert store.match([k[0]]) == 0 and k[0] not in store.keys()
        # k0's reserved slot went back, and k2 went to the host, which had room again
        assert store.stats()["disk"]["pages"] == 0
        for key in k[1:4]:
            assert_serves(store, key)
        store._manager.check()


def test_a_failed_write_keeps_the_page_readable_until_it_is_rolled_back(tmp_path):
    k = KEYS
    with make_store(tmp_path, device=1, host=2, disk=2) as store:
        put(store, *k[:3])  # device: k2, host: k0 k1
        gate = Gate("pwritev", fail=errno.ENOSPC)
        with gate.patch():
            writer = Worker(lambda: put(store, k[3]))  # k0's write parks, then fails
            park(gate, writer)
            assert_serves(store, k[0])  # moved up meanwhile: the write uses its own copy
            assert not gate.returned
            gate.go.set()
            writer.finish()
        stats = store.stats()
        assert stats["disk"]["write_errors"] == 1
        for key in k[:4]:  # nothing wrong served, whatever was kept
            if store.match([key]):
                assert_serves(store, key)
        assert store.match([k[3]]) == 1
        store._manager.check()


def test_close_waits_for_a_write_in_flight_and_its_put_fails_cleanly(tmp_path):
    k = KEYS
    store = make_store(tmp_path, device=1, host=1, disk=2)
    put(store, k[0], k[1])
    data_file = store._tiers[-1].path
    gate = Gate("pwritev")
    with gate.patch():
        writer = Worker(lambda: put(store, k[2]))
        park(gate, writer)
        closer = Worker(store.close)
        closer.start()
        with pytest.raises(KVError):  # the store is closed to new work at once ...
            for _ in range(10 ** 6):
                store.match([k[1]])
        assert data_file.exists() and not gate.returned  # ... and its file kept for the write
        gate.go.set()
        closer.finish()
        with pytest.raises(KVError):
            writer.finish()
    assert gate.calls == 1 and not data_file.exists()
