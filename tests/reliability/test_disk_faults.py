"""Faults of the disk tier under a running store: flipped bits, a truncated file, a full disk,
read errors, the directory deleted. Each page a request gets is its own page (equal to
recomputation) or a miss that the request recomputes; the store keeps serving."""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path
from unittest import mock

from hypothesis import given
from hypothesis import strategies as st

from omni.kv.tiers import disk as disk_module
from tests.reliability._support import (
    LAYOUT,
    Tally,
    check_pages,
    fuzz,
    keys_for,
    make_store,
    page_of,
    pages_of,
)

SLOT_DATA = disk_module.HEADER.size + LAYOUT.page_bytes  # the bytes a slot's check covers
KEYS = keys_for(8, extra="disk")  # device 2 + host 2 pages: the first 4 end on disk only
DISK_SLOTS = 16  # room for every page these tests make: nothing is evicted for capacity


def spilled_store(path: Path):
    store = make_store(device=2, host=2, disk=DISK_SLOTS, path=path)
    store.put(KEYS, pages_of(KEYS))
    return store


def disk_only(store) -> list[tuple[bytes, int]]:
    """(key, disk slot) of the pages whose only copy is on disk."""
    out = []
    for key in store.keys():
        placement = store._manager.placement(key)
        if placement.tier is None:
            out.append((key, placement.disk_slot))
    return out


def fetch(store, key: bytes) -> bool:
    """One request for one page: True with its own bytes, False for a miss."""
    with store.acquire([key]) as lease:
        if len(lease):
            check_pages([key], lease.pages())
        return bool(len(lease))


def recompute(store, keys) -> None:
    """What a request does after a miss: compute the pages and put them back."""
    for key in keys:
        if store.match([key]) == 0:
            store.put([key], page_of(key).unsqueeze(0))
    for key in keys:
        assert fetch(store, key)


def test_a_page_with_flipped_bits_is_a_miss_never_served(tmp_path, record):
    tally = Tally()

    @fuzz(200)
    @given(st.integers(0, 3), st.integers(0, SLOT_DATA - 1), st.integers(1, 255))
    def flip(victim_index, offset, mask):
        with spilled_store(tmp_path) as store:
            spilled = disk_only(store)
            assert len(spilled) == 4
            victim, slot = spilled[victim_index]
            disk = store._tiers[-1]
            fd = os.open(disk.path, os.O_RDWR)
            try:
                at = slot * disk.slot_bytes + offset
                byte = os.pread(fd, 1, at)[0]
                os.pwrite(fd, bytes([byte ^ mask]), at)
            finally:
                os.close(fd)
            assert not fetch(store, victim)  # the affected request: a miss
            assert store.stats()["disk"]["corrupt"] == 1
            for key in KEYS:  # every other request: its own page
                if key != victim:
                    assert fetch(store, key)
            recompute(store, KEYS)
            store._manager.check()
            tally("miss")

    flip()
    record("disk.flipped_bits", tries=tally["miss"],
           outcome=f"{tally['miss']}/{tally['miss']} misses (counted corrupt), recomputed; "
                   "the other pages served intact; never a wrong page")


def test_a_truncated_page_file_gives_misses_for_the_cut_pages_only(tmp_path, record):
    tally = Tally()
    file_bytes = DISK_SLOTS * disk_module.DiskTier.slot_bytes_for(LAYOUT)

    @fuzz(100)
    @given(st.integers(0, file_bytes))
    def truncate(length):
        with spilled_store(tmp_path) as store:
            spilled = disk_only(store)
            disk = store._tiers[-1]
            os.truncate(disk.path, length)
            for key, slot in spilled:
                intact = slot * disk.slot_bytes + SLOT_DATA <= length
                assert fetch(store, key) == intact
                tally("hit" if intact else "miss")
            recompute(store, KEYS)

    truncate()
    tries = tally["hit"] + tally["miss"]
    record("disk.truncated", tries=tries,
           outcome=f"{tally['miss']} cut pages were misses, recomputed; {tally['hit']} pages "
                   "before the cut served intact")


FAULTS = ["ok", "enospc", "short", "efbig"]


def failing_writes(pattern: list[str], tally: Tally):
    """A `pwritev` that fails by `pattern` (cycled): ENOSPC, EFBIG, or a torn short write."""
    real = os.pwritev
    calls = iter(range(10 ** 6))

    def pwritev(fd, buffers, offset):
        fault = pattern[next(calls) % len(pattern)]
        tally(fault)
        if fault == "ok":
            return real(fd, buffers, offset)
        if fault == "short":  # the header and half the page reach the disk
            header, payload = buffers
            return real(fd, [header, memoryview(payload)[: len(payload) // 2]], offset)
        raise OSError(errno.ENOSPC if fault == "enospc" else errno.EFBIG, os.strerror(
            errno.ENOSPC if fault == "enospc" else errno.EFBIG))

    return mock.patch.object(disk_module.os, "pwritev", pwritev)


def test_a_full_disk_drops_pages_and_the_store_keeps_serving(tmp_path, record):
    tally = Tally()
    keys = keys_for(12, extra="full")

    @fuzz(100)
    @given(st.lists(st.sampled_from(FAULTS), min_size=1, max_size=10))
    def full(pattern):
        with make_store(device=2, host=2, disk=DISK_SLOTS, path=tmp_path) as store:
            before = tally["ok"]
            with failing_writes(pattern, tally):
                for key in keys:  # each put past the memory tiers demotes a page to disk
                    store.put([key], page_of(key).unsqueeze(0))
            writes = 8
            failed = writes - (tally["ok"] - before)
            assert store.stats()["disk"]["write_errors"] == failed
            missing = [k for k in keys if not fetch(store, k)]
            assert len(missing) == failed  # each failed write lost exactly its own page
            recompute(store, keys)  # the disk has room again: everything is served
            store._manager.check()
            tally("request", len(keys))

    full()
    faults = tally["enospc"] + tally["short"] + tally["efbig"]
    record("disk.full", tries=faults,
           outcome=f"{faults} failed writes ({tally['enospc']} ENOSPC, {tally['efbig']} EFBIG, "
                   f"{tally['short']} short): each dropped its page (a miss, recomputed); "
                   f"{tally['request']} requests served, none a wrong page")


def test_read_errors_are_misses_not_failures(tmp_path, record):
    tally = Tally()
    real = os.preadv

    @fuzz(50)
    @given(st.sets(st.integers(0, 3), min_size=1))
    def eio(bad):
        with spilled_store(tmp_path) as store:
            spilled = disk_only(store)
            failing = {spilled[i][1] for i in bad}
            slot_bytes = store._tiers[-1].slot_bytes

            def preadv(fd, buffers, offset):
                if offset // slot_bytes in failing:
                    raise OSError(errno.EIO, os.strerror(errno.EIO))
                return real(fd, buffers, offset)

            with mock.patch.object(disk_module.os, "preadv", preadv):
                for key, slot in spilled:
                    assert fetch(store, key) == (slot not in failing)
                    tally("miss" if slot in failing else "hit")
            recompute(store, KEYS)

    eio()
    record("disk.read_error", tries=tally["miss"],
           outcome=f"{tally['miss']} failed reads were misses (page dropped, recomputed); "
                   f"{tally['hit']} other disk pages served intact")


def test_the_kv_directory_deleted_under_a_running_store(tmp_path, record):
    tally = Tally()
    more = keys_for(6, start=100, extra="more")
    for round_ in range(12):
        root = tmp_path / f"kv-{round_}"
        with spilled_store(root) as store:
            folder = store._tiers[-1].directory
            shutil.rmtree(root)
            if round_ % 2:  # and someone puts a folder with a garbage file in its place
                folder.mkdir(parents=True)
                (folder / disk_module.DATA_FILE).write_bytes(os.urandom(1 << 16))
            for key in more[: round_ % 6 + 1]:  # more pages go to disk: the open file
                store.put([key], page_of(key).unsqueeze(0))
            for key in KEYS + more:
                held = store.match([key]) == 1
                assert fetch(store, key) == held  # present pages are served intact
                tally("hit" if held else "absent")
            recompute(store, KEYS)
        if round_ % 2:
            shutil.rmtree(root)
        assert not root.exists()  # closing neither failed nor put the folder back
        with spilled_store(root) as again:  # a new store makes it anew, private
            assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
            recompute(again, KEYS)
        tally("round")
    record("disk.dir_deleted", tries=tally["round"],
           outcome=f"the store kept serving from its open file ({tally['hit']} pages intact, "
                   "a garbage file put in its place never read); close succeeds; a new "
                   "store recreates the folder 0700")
