"""Hostile descriptors: random fields, another store's arena or lease table, offsets out of
bounds. `open_descriptor` raises `KVLeaseError` and nothing else; what it does open lies inside
the named store's arena, under a live lease of that store."""

from __future__ import annotations

import msgspec
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from omni.kv import KVLeaseError, OpenedPages, PageDescriptor, open_descriptor
from omni.kv.descriptors import LayoutSpec
from omni.kv.handle import forget_mappings
from omni.kv.layout import KVLayout
from omni.transport.errors import TransportError
from omni.transport.movers import SharedMemoryHeader, host_id, unpack
from tests.reliability._support import (
    LAYOUT,
    Tally,
    check_pages,
    fuzz,
    keys_for,
    make_store,
    pages_of,
)

KEYS = keys_for(4, extra="descriptors")
PAGE = LAYOUT.page_bytes


@pytest.fixture
def stores():
    """Two live stores, each with 4 pages leased out to another process (a descriptor)."""
    with make_store(device=8, host=8) as a, make_store(device=8, host=8) as b:
        descriptors = []
        for store in (a, b):
            store.put(KEYS, pages_of(KEYS))
            with store.acquire(KEYS) as lease:
                descriptors.append(lease.descriptor(ttl=600))
        yield (a, b), descriptors
    forget_mappings()


def names(store_id: str) -> list[str]:
    return [f"omni-{store_id}-{t}" for t in ("device", "host", "leases")]


def opened_is_legitimate(d: PageDescriptor, opened: OpenedPages, stores, originals) -> None:
    """What opened is the named store's memory, under one of its live leases, in bounds."""
    store = next(s for s in stores if s.store_id == d.store_id)
    original = originals[stores.index(store)]
    assert (d.lease_slot, d.lease_id) == (original.lease_slot, original.lease_id)
    assert d.arena == f"omni-{d.store_id}-{d.tier}" and d.lease_table == original.lease_table
    page = KVLayout.from_spec(d.layout).page_bytes
    for offset in d.offsets:
        assert isinstance(offset, int) and offset >= 0 and offset + page <= (
            opened._pool.arena.size)


def test_random_descriptor_fields_are_refused_or_stay_in_bounds(stores, record):
    (a, b), originals = stores
    tally = Tally()
    ids = [a.store_id, b.store_id, "0123456789abcdef", "../../etc", "", "ZZ" * 8]
    arena_names = [*names(a.store_id), *names(b.store_id), "../../etc/passwd", "omni-x-host",
                   "/dev/shm/omni", "omni-0123456789abcdef-host"]
    spec = LAYOUT.to_spec()
    sizes = st.one_of(st.integers(-2, 4), st.integers(0, 2 ** 64), st.just(2 ** 40))
    layouts = st.one_of(st.just(spec), st.builds(
        LayoutSpec, sizes, sizes, sizes, sizes,
        st.sampled_from(["float16", "float32", "uint8", "int8", "bfloat16", "complex", ""])))
    offsets = st.lists(st.one_of(
        st.sampled_from([0, PAGE, 3 * PAGE, 7 * PAGE, 8 * PAGE, 1, PAGE - 1, -PAGE]),
        st.integers(-2 ** 63, 2 ** 64)), max_size=6)
    fields = {
        "store_id": st.sampled_from(ids), "tier": st.sampled_from(["device", "host", "disk", ""]),
        "arena": st.sampled_from(arena_names), "offsets": offsets, "layout": layouts,
        "lease_id": st.one_of(st.integers(-1, 8), st.integers(0, 2 ** 64)),
        "lease_slot": st.one_of(st.integers(-1, 4), st.integers(-2 ** 63, 2 ** 63)),
        "lease_table": st.sampled_from(arena_names), "version": st.integers(-1, 3)}

    @fuzz(400)
    @given(st.sampled_from([0, 1]), st.fixed_dictionaries({}, optional=fields))
    def forge(which, changes):
        d = msgspec.structs.replace(originals[which], **changes)
        try:
            opened = open_descriptor(d)
        except KVLeaseError:
            tally("refused")
            return
        opened_is_legitimate(d, opened, [a, b], originals)  # never closed: keeps the lease
        tally("opened")

    forge()
    # The stores' own leases still hold, and their pages are intact.
    for d in originals:
        with open_descriptor(d) as pages:
            check_pages(KEYS, _stack(pages))
    tries = tally["refused"] + tally["opened"]
    record("input.descriptor_fuzz", tries=tries,
           outcome=f"{tally['refused']} refused with KVLeaseError, nothing else raised; "
                   f"{tally['opened']} that named a live lease of a real store opened "
                   "in bounds")


def _stack(pages: OpenedPages) -> torch.Tensor:
    return torch.stack(list(pages))


def test_a_descriptor_naming_another_arena_is_refused(stores, record):
    (a, b), (da, db) = stores
    forged = {
        "b's arena": {"arena": f"omni-{b.store_id}-host"},
        "b's device arena as host": {"arena": f"omni-{b.store_id}-device"},
        "b's lease table": {"lease_table": f"omni-{b.store_id}-leases"},
        "b's store id": {"store_id": b.store_id},
        "b's whole store, a's lease": {"store_id": b.store_id, "arena": db.arena,
                                       "lease_table": db.lease_table},
        "a's host arena for device pages": {"arena": f"omni-{a.store_id}-host"},
        "a store that does not exist": {"store_id": "0123456789abcdef",
                                        "arena": "omni-0123456789abcdef-device",
                                        "lease_table": "omni-0123456789abcdef-leases"},
        "a path": {"arena": "../../../etc/passwd"},
        "a path as lease table": {"lease_table": "/etc/passwd"},
        "the lease table as pages": {"arena": f"omni-{a.store_id}-leases"},
        "a disk tier": {"tier": "disk", "arena": f"omni-{a.store_id}-disk"},
    }
    for what, change in forged.items():
        d = msgspec.structs.replace(da, **change)
        with pytest.raises(KVLeaseError):
            open_descriptor(d)
        header = SharedMemoryHeader(LAYOUT.to_spec(), list(KEYS), host_id(), d)
        with pytest.raises(TransportError):  # through the mover: a miss for the fetch
            unpack(header, [], LAYOUT)
        assert what
    for d in (da, db):  # the real ones still open, their own pages
        with open_descriptor(d) as pages:
            check_pages(KEYS, _stack(pages))
    record("input.descriptor_other_arena", tries=len(forged),
           outcome=f"{len(forged)}/{len(forged)} refused (KVLeaseError; a miss through the "
                   "mover), the real descriptors still open their own pages")


def test_a_descriptor_with_offsets_out_of_bounds_is_refused(stores, record):
    _, (da, _) = stores
    size = 8 * PAGE  # the device arena
    bad = [[size], [size - 1], [size + PAGE], [-PAGE], [-1], [1], [PAGE // 2], [PAGE + 4],
           [0, size], [0, 2 ** 63], [2 ** 64], [0, PAGE, 3 * PAGE + 1], [True], [size - PAGE + 1]]
    for offsets in bad:
        d = msgspec.structs.replace(da, offsets=offsets)
        with pytest.raises(KVLeaseError, match="outside arena"):
            open_descriptor(d)
    header = SharedMemoryHeader(LAYOUT.to_spec(), list(KEYS[:1]), host_id(),
                                msgspec.structs.replace(da, offsets=[size]))
    with pytest.raises(TransportError):
        unpack(header, [], LAYOUT)
    with open_descriptor(da) as pages:
        check_pages(KEYS, _stack(pages))
    record("input.descriptor_out_of_bounds", tries=len(bad) + 1,
           outcome=f"{len(bad) + 1}/{len(bad) + 1} refused (KVLeaseError naming the arena and "
                   "its size; a miss through the mover)")
