"""Descriptors: another process maps the same pages (no copy); leases expire and are refused."""

import subprocess
import sys
import textwrap

import msgspec
import pytest
import torch

from omni.kv import (
    KVLayout,
    KVLeaseError,
    KVStore,
    PageDescriptor,
    TierConfig,
    block_keys,
    open_descriptor,
)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_size=4, dtype=torch.float32)

CHILD = textwrap.dedent("""
    import sys, msgspec, torch
    from omni.kv import PageDescriptor, open_descriptor
    desc = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=PageDescriptor)
    pages = open_descriptor(desc)
    print(float(sum(p.sum() for p in pages)))   # what the owner wrote
    pages[0].view(-1)[0] = 42.0                  # a write the owner must see
    if sys.argv[1] == "close":
        pages.close()
    else:
        import os
        pages.renew(0.2)                         # a short lease, then a consumer that dies
        os._exit(0)
""")


def run_child(desc: PageDescriptor, mode: str = "close") -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, mode],
                         input=msgspec.msgpack.encode(desc), capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    return float(out.stdout)


@pytest.fixture
def store():
    with KVStore(LAYOUT, [TierConfig("device", 8 * LAYOUT.page_bytes),
                          TierConfig("host", 8 * LAYOUT.page_bytes)]) as s:
        yield s


def put_pages(store, n=3):
    keys = block_keys(range(n * LAYOUT.page_size), LAYOUT.page_size)
    pages = torch.arange(n * LAYOUT.page_numel, dtype=torch.float32).reshape(
        n, *LAYOUT.page_shape)
    store.put(keys, pages)
    return keys, pages


@pytest.mark.proc  # same-host shared memory, mapped and written by another process
def test_another_process_maps_the_same_memory(store):
    keys, pages = put_pages(store)
    with store.acquire(keys) as lease:
        desc = lease.descriptor()
        assert len(msgspec.msgpack.encode(desc)) < 512  # a handle, not the bytes
        assert run_child(desc) == float(pages.sum())
        assert lease.page(0).view(-1)[0].item() == 42.0  # the child's write, seen here
    stats = store.stats()
    assert stats["leases"] == {"open": 0, "exported": 0, "pinned_pages": 0}


def test_an_exported_lease_outlives_the_local_one(store):
    keys, _ = put_pages(store)
    with store.acquire(keys) as lease:
        desc = lease.descriptor(ttl=30)
    assert store.stats()["leases"]["pinned_pages"] == 3  # the descriptor still pins them
    with open_descriptor(desc) as pages:
        assert pages.valid() and len(pages) == 3
    assert store.stats()["leases"]["pinned_pages"] == 0


@pytest.mark.proc  # a consumer process that dies without giving its lease back
def test_a_crashed_consumer_pins_nothing_after_the_lease_expires(store, lease_clock):
    keys, _ = put_pages(store)
    with store.acquire(keys) as lease:
        desc = lease.descriptor()
    run_child(desc, mode="crash")
    assert store.stats()["leases"]["exported"] == 1
    lease_clock.advance(store.lease_ttl)
    assert store.stats()["leases"] == {"open": 0, "exported": 0, "pinned_pages": 0}


def test_an_expired_descriptor_is_refused(store, lease_clock):
    keys, _ = put_pages(store)
    with store.acquire(keys) as lease:
        desc = lease.descriptor(ttl=0.05)
    lease_clock.advance(0.05)
    with pytest.raises(KVLeaseError, match="expired"):
        open_descriptor(desc)


def test_a_released_descriptor_is_refused(store):
    keys, _ = put_pages(store)
    with store.acquire(keys) as lease:
        desc = lease.descriptor()
    open_descriptor(desc).close()
    with pytest.raises(KVLeaseError, match="unknown or was released"):
        open_descriptor(desc)


@pytest.mark.parametrize("change", [
    {"arena": "omni-0123456789abcdef-host"},          # another store's arena
    {"arena": "../../etc/passwd"},
    {"offsets": [10 ** 9]},                            # out of bounds
    {"offsets": [3]},                                  # misaligned
    {"lease_id": 999},                                 # unknown lease
    {"tier": "disk"},
    {"version": 2},
])
def test_tampered_descriptors_are_refused(store, change):
    keys, _ = put_pages(store)
    with store.acquire(keys) as lease:
        desc = msgspec.structs.replace(lease.descriptor(), **change)
        with pytest.raises(KVLeaseError):
            open_descriptor(desc)


def test_descriptor_round_trips_through_msgpack(store):
    keys, _ = put_pages(store, n=1)
    with store.acquire(keys) as lease:
        desc = lease.descriptor()
    wire = msgspec.msgpack.encode(desc)
    assert msgspec.msgpack.decode(wire, type=PageDescriptor) == desc
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"store_id": 1}), type=PageDescriptor)
    open_descriptor(desc).close()
