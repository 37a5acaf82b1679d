"""Movers: pages arrive byte-identical by each locality's mover, and anything that does not
add up (checksum, layout, size, process, host, lease) is refused, never returned."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import msgspec
import pytest
import torch
import xxhash
import zmq

from omni.kv import KVLayout, KVStore, TierConfig, block_keys
from omni.transport import movers
from omni.transport.errors import TransportError, WireError
from omni.transport.movers import (
    FrameHeader,
    FrameMover,
    MoverHeader,
    PageBatch,
    SameProcessHeader,
    SameProcessMover,
    SharedMemoryHeader,
    SharedMemoryMover,
    choose_mover,
    host_id,
    locality,
    mover_for,
    unpack,
)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float16)
OTHER = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=8, dtype=torch.float16)
HEADERS = msgspec.msgpack.Decoder(MoverHeader)


def random_pages(n: int, layout: KVLayout = LAYOUT, seed: int = 0) -> torch.Tensor:
    """[n, *page_shape] pages of random bytes (every bit pattern, NaNs included)."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * layout.page_bytes,), dtype=torch.uint8, generator=generator)
    return raw.view(layout.dtype).view(n, *layout.page_shape)


def batch(n: int, layout: KVLayout = LAYOUT, **kwargs) -> PageBatch:
    keys = block_keys(range(n * layout.page_size), layout.page_size)
    return PageBatch(tuple(keys), random_pages(n, layout), **kwargs)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.fixture
def store() -> Iterator[KVStore]:
    with KVStore(LAYOUT, [TierConfig("device", 16 * LAYOUT.page_bytes),
                          TierConfig("host", 16 * LAYOUT.page_bytes)]) as s:
        yield s


def stored(store: KVStore, n: int = 3) -> tuple[list[bytes], torch.Tensor]:
    keys = block_keys(range(n * LAYOUT.page_size), LAYOUT.page_size, extra=(b"model",))
    pages = random_pages(n, seed=7)
    store.put(keys, pages)
    return keys, pages


# -- same process --------------------------------------------------------------------------


def test_same_process_hands_over_the_tensor_itself() -> None:
    source = batch(3)
    mover = SameProcessMover(LAYOUT)
    header, frames = mover.pack(source)
    assert frames == [] and len(msgspec.msgpack.encode(header)) < 256
    with mover.unpack(HEADERS.decode(msgspec.msgpack.encode(header)), frames) as got:
        assert got.pages() is source.pages and got.keys == source.keys
    with pytest.raises(TransportError, match="taken already"):
        mover.unpack(header, [])  # one hand-off per pack
    assert mover.stats().pages_out == 3 and mover.stats().pages_in == 3
    assert mover.stats().refused == 1


@pytest.mark.parametrize("change", [{"pid": os.getpid() + 1}, {"process_nonce": "0" * 16}])
def test_same_process_refuses_an_id_from_another_process(change: dict) -> None:
    mover = SameProcessMover(LAYOUT)
    header, _ = mover.pack(batch(2))
    with pytest.raises(WireError, match="means nothing here"):
        mover.unpack(msgspec.structs.replace(header, **change), [])
    assert len(mover.unpack(header, [])) == 2  # the real one is still there


def test_same_process_entries_nobody_takes_expire() -> None:
    mover = SameProcessMover(LAYOUT, ttl=0)
    header, _ = mover.pack(batch(1))
    mover.pack(batch(1))  # sweeps the first
    assert header.object_id not in movers._registry.entries
    with pytest.raises(TransportError, match="expired"):
        mover.unpack(header, [])


def test_same_process_copies_a_leases_pages_out_of_the_store(store: KVStore) -> None:
    keys, pages = stored(store)
    with store.acquire(keys) as lease:
        header, frames = SameProcessMover(LAYOUT).pack(lease)
        tier_storage = lease.page(0).untyped_storage().data_ptr()
    got = SameProcessMover(LAYOUT).unpack(header, frames).pages()
    assert same_bytes(got, pages)
    assert got.untyped_storage().data_ptr() != tier_storage  # the lease has ended: not a view


# -- frames --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32,
                                   torch.float8_e4m3fn])
def test_frames_round_trip_byte_identical(dtype: torch.dtype) -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=dtype)
    source = batch(5, layout)
    mover = FrameMover(layout)
    header, frames = mover.pack(source)
    assert header.nbytes == 5 * layout.page_bytes and len(frames) == 1
    got = mover.unpack(HEADERS.decode(msgspec.msgpack.encode(header)), [bytes(frames[0])])
    assert same_bytes(got.pages(), source.pages) and got.keys == source.keys


def test_frames_cross_a_real_socket_without_a_copy() -> None:
    """200 pages (100 KiB, above pyzmq's 64 KiB copy threshold) through a PAIR socket."""
    source = batch(200, stable=True)
    ctx = zmq.Context()
    try:
        tx, rx = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        tx.bind("inproc://movers")
        rx.connect("inproc://movers")
        header, frames = FrameMover(LAYOUT).pack(source)
        tracker = tx.send_multipart([msgspec.msgpack.encode(header), *frames], copy=False,
                                    track=True)
        head, *payload = rx.recv_multipart(copy=False)
        with unpack(HEADERS.decode(head.bytes), payload, LAYOUT) as got:
            assert got.locality == "remote"
            assert same_bytes(got.pages(), source.pages)
            # inproc hands the message over by reference: both ends see the sender's memory
            assert got.pages().data_ptr() == source.pages.data_ptr()
        del payload, got
        tracker.wait(5)
        assert tracker.done
        tx.close(linger=0)
        rx.close(linger=0)
    finally:
        ctx.term()


def test_a_stable_batch_is_sent_without_a_copy_and_an_unstable_one_is_copied() -> None:
    stable, unstable = batch(2, stable=True), batch(2)
    _, stable_frames = FrameMover(LAYOUT).pack(stable)
    _, unstable_frames = FrameMover(LAYOUT).pack(unstable)
    before = bytes(unstable_frames[0])
    stable.pages.view(torch.uint8).view(-1)[0] ^= 0xFF
    unstable.pages.view(torch.uint8).view(-1)[0] ^= 0xFF
    assert bytes(stable_frames[0])[0] == stable.pages.view(torch.uint8).view(-1)[0].item()
    assert bytes(unstable_frames[0]) == before  # the caller's write did not reach the frame


@pytest.mark.parametrize("where", [0, 511, 4095])
def test_a_flipped_byte_fails_the_checksum(where: int) -> None:
    mover = FrameMover(LAYOUT)
    header, frames = mover.pack(batch(8))
    corrupt = bytearray(frames[0])
    corrupt[where] ^= 0x01
    with pytest.raises(WireError, match="checksum"):
        mover.unpack(header, [corrupt])
    assert mover.stats().refused == 1


def test_frames_paired_with_another_header_fail_the_checksum() -> None:
    """The checksum covers the keys and the bytes: another message's frames, or a header
    whose keys were changed, are refused."""
    mover = FrameMover(LAYOUT)
    source = batch(2)
    header, frames = mover.pack(source)
    _, other_frames = mover.pack(PageBatch(source.keys, random_pages(2, seed=1)))
    with pytest.raises(WireError, match="checksum"):
        mover.unpack(header, other_frames)
    swapped = msgspec.structs.replace(header, keys=list(reversed(header.keys)))
    with pytest.raises(WireError, match="checksum"):
        mover.unpack(swapped, frames)
    assert len(mover.unpack(header, frames)) == 2


def test_a_header_whose_layout_does_not_fit_the_frames_is_refused() -> None:
    header, frames = FrameMover(LAYOUT).pack(batch(4))
    with pytest.raises(WireError, match="was expected"):  # not the layout this side uses
        FrameMover(OTHER).unpack(header, frames)
    lying = msgspec.structs.replace(header, layout=OTHER.to_spec())
    with pytest.raises(WireError, match="for 4 pages of 1024 B"):  # sizes do not add up
        FrameMover(OTHER).unpack(lying, frames)
    with pytest.raises(WireError, match="2 frames"):
        FrameMover(LAYOUT).unpack(header, [*frames, b""])
    with pytest.raises(WireError, match="frame of 2047 bytes arrived for 2048"):
        FrameMover(LAYOUT).unpack(header, [bytes(frames[0])[:-1]])
    with pytest.raises(WireError, match="not a contiguous buffer"):
        FrameMover(LAYOUT).unpack(header, [None])


def test_headers_decode_as_one_tagged_union_and_bad_keys_fail_to_decode() -> None:
    header, _ = FrameMover(LAYOUT).pack(batch(1))
    assert isinstance(header, FrameHeader)
    assert HEADERS.decode(msgspec.msgpack.encode(header)) == header
    short_key = msgspec.structs.replace(header, keys=[b"x" * 15])
    with pytest.raises(msgspec.ValidationError):
        HEADERS.decode(msgspec.msgpack.encode(short_key))
    with pytest.raises(WireError, match="16 bytes"):
        FrameMover(LAYOUT).unpack(short_key, [])


def test_pack_checks_its_pages() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        FrameMover(LAYOUT).pack(batch(2, OTHER))
    with pytest.raises(ValueError, match="16 bytes"):
        FrameMover(LAYOUT).pack(PageBatch((b"short",), random_pages(1)))
    with pytest.raises(TypeError, match="Lease or a PageBatch"):
        FrameMover(LAYOUT).pack(random_pages(1))


# -- shared memory -------------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import sys, msgspec, torch, xxhash
    from omni.kv import KVLayout
    from omni.transport.movers import MoverHeader, unpack
    header = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=MoverHeader)
    with unpack(header, [], KVLayout.from_spec(header.layout)) as got:
        data = got.pages().contiguous().view(torch.uint8).numpy()
        print(got.locality, len(got), xxhash.xxh3_128_hexdigest(data))
""")


@pytest.mark.proc  # same-host shared memory between two processes
def test_shared_memory_reaches_another_process(store: KVStore) -> None:
    keys, pages = stored(store)
    with store.acquire(keys) as lease:
        header, frames = SharedMemoryMover(LAYOUT).pack(lease)
    assert frames == [] and isinstance(header, SharedMemoryHeader)
    assert len(msgspec.msgpack.encode(header)) < 512  # a handle, not the bytes
    out = subprocess.run([sys.executable, "-c", CHILD], input=msgspec.msgpack.encode(header),
                         capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    expected = xxhash.xxh3_128_hexdigest(pages.contiguous().view(torch.uint8).numpy())
    assert out.stdout.decode().split() == ["same_machine", "3", expected]
    assert store.stats()["leases"] == {"open": 0, "exported": 0, "pinned_pages": 0}


def test_shared_memory_pages_go_into_another_store(store: KVStore) -> None:
    keys, pages = stored(store)
    with store.acquire(keys) as lease:
        header, _ = SharedMemoryMover(LAYOUT).pack(lease)
    with KVStore(LAYOUT, [TierConfig("host", 8 * LAYOUT.page_bytes)]) as other:
        with SharedMemoryMover(LAYOUT).unpack(header, []) as got:
            assert got.valid() and same_bytes(got.page(1), pages[1])
            assert got.put_into(other) == 3
        assert not got.valid()
        with other.acquire(keys) as copy:
            assert same_bytes(copy.pages(), pages)


def test_a_released_shared_memory_lease_is_a_miss(store: KVStore) -> None:
    keys, _ = stored(store)
    with store.acquire(keys) as lease:
        header, _ = SharedMemoryMover(LAYOUT).pack(lease)
    SharedMemoryMover(LAYOUT).unpack(header, []).close()
    with pytest.raises(TransportError, match="gone"):
        SharedMemoryMover(LAYOUT).unpack(header, [])


def test_shared_memory_refuses_another_host_and_mismatched_headers(store: KVStore) -> None:
    keys, _ = stored(store)
    with store.acquire(keys) as lease:
        header, _ = SharedMemoryMover(LAYOUT).pack(lease)
    with pytest.raises(WireError, match="arrived on host"):
        SharedMemoryMover(LAYOUT).unpack(msgspec.structs.replace(header, host="0" * 32), [])
    with pytest.raises(WireError, match="does not match"):
        SharedMemoryMover(LAYOUT).unpack(msgspec.structs.replace(header, keys=keys[:2]), [])
    with pytest.raises(WireError, match="was expected"):
        SharedMemoryMover(OTHER).unpack(header, [])
    with pytest.raises(TypeError, match="pack a Lease"):
        SharedMemoryMover(LAYOUT).pack(batch(1))
    exported = store.stats()["leases"]["exported"]
    with store.acquire(keys) as lease, pytest.raises(ValueError, match="this mover moves"):
        SharedMemoryMover(OTHER).pack(lease)
    assert store.stats()["leases"]["exported"] == exported  # refused before any export


# -- choosing ------------------------------------------------------------------------------


def test_choose_mover_picks_by_locality() -> None:
    here, there = host_id(), "f" * 32
    assert len(here) == 32 and host_id() == here
    assert locality(here, here, True) == "same_process"
    assert locality(here, here, False) == "same_machine"
    assert locality(here, there, False) == "remote"
    with pytest.raises(ValueError, match="another host"):
        locality(here, there, True)
    assert isinstance(choose_mover(here, here, True, layout=LAYOUT), SameProcessMover)
    assert isinstance(choose_mover(here, here, False, layout=LAYOUT), SharedMemoryMover)
    remote = choose_mover(here, there, False, layout=LAYOUT)
    assert isinstance(remote, FrameMover) and remote.layout == LAYOUT
    assert repr(remote) == "<FrameMover out=0 in=0 refused=0>"


def test_a_header_goes_to_its_own_mover() -> None:
    header, frames = SameProcessMover(LAYOUT).pack(batch(1))
    assert isinstance(header, SameProcessHeader)
    assert isinstance(mover_for(header, LAYOUT), SameProcessMover)
    with pytest.raises(WireError, match="cannot unpack a SameProcessHeader"):
        FrameMover(LAYOUT).unpack(header, frames)
    with pytest.raises(WireError, match="no mover"):
        mover_for(LAYOUT.to_spec(), LAYOUT)
    assert len(unpack(header, frames, LAYOUT)) == 1
