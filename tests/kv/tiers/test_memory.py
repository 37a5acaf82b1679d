"""Memory tiers: `MemoryTier` and its device / host forms (CPU here; CUDA when present)."""

from __future__ import annotations

import errno
import logging
import os

import pytest
import torch

from omni import _shm as shm_module
from omni._shm import Segment, shm_directory
from omni.kv.layout import KVLayout
from omni.kv.tiers.device import DeviceTier
from omni.kv.tiers.host import HostTier
from omni.kv.tiers.memory import RESERVE_STEP, MemoryTier, slots_for

KEY = bytes(16)


def _pages(layout: KVLayout, n: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((n, *layout.page_shape), generator=generator).to(layout.dtype)


@pytest.fixture
def host(layout: KVLayout, store_id: str):
    tier = HostTier.create(layout, 8, store_id)
    yield tier
    tier.close()


def test_slots_for_counts_whole_pages_and_refuses_less_than_one() -> None:
    assert slots_for(10_000, 4096, "host") == 2
    with pytest.raises(ValueError, match=r"tier 'host' holds no page: capacity 100 B < page "
                                         r"size 4096 B"):
        slots_for(100, 4096, "host")


def test_write_then_read_into_round_trips(host: HostTier, layout: KVLayout) -> None:
    pages = _pages(layout, 3)
    for slot, page in zip((5, 0, 7), pages, strict=True):
        host.write(slot, page, KEY)
    out = torch.empty(layout.page_shape, dtype=layout.dtype)
    for slot, page in zip((5, 0, 7), pages, strict=True):
        assert host.read_into(slot, out, KEY) is True
        assert torch.equal(out, page)


def test_write_accepts_non_contiguous_pages(host: HostTier, layout: KVLayout) -> None:
    page = _pages(layout, 1)[0]
    strided = page.transpose(0, 2).contiguous().transpose(0, 2)
    assert not strided.is_contiguous()
    host.write(1, strided, KEY)
    assert torch.equal(host.view(1), page)


def test_gather_of_consecutive_slots_is_a_view_of_the_pool(host: HostTier,
                                                           layout: KVLayout) -> None:
    host.write(2, _pages(layout, 1)[0], KEY)
    batch = host.gather([2, 3, 4])
    assert batch.shape == (3, *layout.page_shape)
    assert batch.data_ptr() == host.view(2).data_ptr()
    batch[0].zero_()  # mutating the view changes the tier
    assert host.view(2).abs().sum().item() == 0


def test_gather_of_scattered_slots_is_a_copy_in_the_given_order(host: HostTier,
                                                                layout: KVLayout) -> None:
    pages = _pages(layout, 2)
    host.write(6, pages[0], KEY)
    host.write(1, pages[1], KEY)
    batch = host.gather([6, 1])
    assert torch.equal(batch, pages)
    batch.zero_()  # a copy: the tier keeps its pages
    assert torch.equal(host.view(6), pages[0])
    assert host.gather([3, 2]).data_ptr() != host.view(3).data_ptr()
    assert host.gather([]).shape == (0, *layout.page_shape)


def test_view_is_the_slot_itself(host: HostTier, layout: KVLayout) -> None:
    host.view(3).fill_(1.0)
    out = torch.empty(layout.page_shape, dtype=layout.dtype)
    host.read_into(3, out, KEY)
    assert out.eq(1.0).all()


def test_wrong_shape_or_dtype_is_refused_naming_both(host: HostTier, layout: KVLayout) -> None:
    with pytest.raises(ValueError, match=r"expects a page of shape \(2, 2, 4, 2, 8\) "
                                         r"torch.float16, got \(2, 2, 4, 2, 4\) torch.float16"):
        host.write(0, torch.zeros(2, 2, 4, 2, 4, dtype=torch.float16), KEY)
    with pytest.raises(ValueError, match=r"got .* torch.float32"):
        host.write(0, torch.zeros(layout.page_shape, dtype=torch.float32), KEY)
    with pytest.raises(ValueError, match="destination"):
        host.read_into(0, torch.zeros(layout.page_shape, dtype=torch.bfloat16), KEY)


def test_slots_outside_the_tier_are_refused(host: HostTier, layout: KVLayout) -> None:
    page = _pages(layout, 1)[0]
    for slot in (-1, 8):
        with pytest.raises(IndexError, match=f"no slot {slot}"):
            host.write(slot, page, KEY)
    with pytest.raises(IndexError):
        host.gather([0, 8])


def test_host_tier_lives_in_its_stores_arena_at_slot_offsets(host: HostTier, layout: KVLayout,
                                                             store_id: str) -> None:
    """Another process attaching the arena finds slot s at `offset(s)`."""
    assert host.arena_name == f"omni-{store_id}-host"
    page = _pages(layout, 1, seed=3)[0]
    host.write(5, page, KEY)
    with Segment.attach(host.arena_name, writable=False) as other:
        seen = other.tensor(host.offsets([5])[0], layout.page_shape, layout.dtype)
        assert torch.equal(seen, page)
    assert host.offsets([5])[0] == 5 * layout.page_bytes


def test_cpu_device_tier_is_backed_by_a_device_arena(layout: KVLayout, store_id: str) -> None:
    tier = DeviceTier.create(layout, 4, store_id, device="cpu")
    assert tier.arena_name == f"omni-{store_id}-device"
    assert (shm_directory() / tier.arena_name).exists()
    page = _pages(layout, 1)[0]
    tier.write(3, page, KEY)
    assert torch.equal(tier.gather([3])[0], page)
    assert repr(tier).startswith("<DeviceTier device slots=4 page=512B cpu arena=omni-")
    tier.close()
    tier.close()  # idempotent
    assert not (shm_directory() / f"omni-{store_id}-device").exists()
    with pytest.raises(ValueError, match="closed"):
        tier.view(0)


def test_memory_tier_without_arena_and_its_errors(layout: KVLayout, store_id: str) -> None:
    """A plain pool has no arena; no slot or an arena too small is refused."""
    tier = MemoryTier("device", layout, 2, arena=None, device="cpu")
    assert tier.arena_name is None
    tier.write(1, _pages(layout, 1)[0], KEY)
    with pytest.raises(ValueError, match="holds no page"):
        MemoryTier("host", layout, 0, arena=None, device="cpu")
    with pytest.raises(ValueError, match="holds no page"):
        HostTier.create(layout, 0, store_id)
    with Segment.create(f"omni-{store_id}-host", 100) as small, \
            pytest.raises(ValueError, match="smaller than 2 pages"):
        MemoryTier("host", layout, 2, arena=small, device="cpu")


def _held(tier: MemoryTier) -> int:
    return os.stat(tier.arena.path).st_blocks * 512


def test_a_fresh_tier_holds_one_step_and_reserves_more_as_slots_are_needed(
        layout: KVLayout, store_id: str) -> None:
    step = RESERVE_STEP // layout.page_bytes
    tier = HostTier.create(layout, 8 * step, store_id)  # 32 MiB of 512-byte pages
    try:
        assert tier.reserved_slots == step and _held(tier) <= RESERVE_STEP
        assert f"reserved={step}" in repr(tier)
        first = _pages(layout, 1, seed=1)[0]
        tier.write(0, first, KEY)
        with pytest.raises(IndexError, match=f"slot {step} lies beyond its reserved memory"):
            tier.view(step)
        assert tier.reserve(step) is True
        assert tier.reserved_slots == 2 * step
        assert RESERVE_STEP < _held(tier) <= 2 * RESERVE_STEP
        tier.write(step, _pages(layout, 1, seed=2)[0], KEY)
        assert torch.equal(tier.view(0), first)  # written before the growth: intact
    finally:
        tier.close()


def test_a_tier_without_room_to_grow_says_so_once_with_the_fix(
        layout: KVLayout, store_id: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    step = RESERVE_STEP // layout.page_bytes
    tier = DeviceTier.create(layout, 4 * step, store_id, device="cpu")
    try:
        def full(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(shm_module.os, "posix_fallocate", full)
        with caplog.at_level(logging.WARNING, logger="omni.kv"):
            assert tier.reserve(step) is False
            assert tier.reserve(step) is False
            assert tier.reserve(step - 1) is True  # reserved already
        assert tier.reserved_slots == step
        [line] = [r.getMessage() for r in caplog.records]
        assert line.startswith(f"KV device tier: no room left in {shm_directory()}, so it holds "
                               f"{step} pages (4.0 MiB) of the {4 * step} (16.0 MiB) configured")
        assert "--shm-size" in line and "--kv-device" in line
    finally:
        tier.close()


def test_a_tier_that_cannot_reserve_its_first_step_is_not_made(
        layout: KVLayout, store_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(shm_module.os, "posix_fallocate", full)
    with pytest.raises(OSError, match=f"cannot reserve {RESERVE_STEP} B for shared memory "
                                      f"'omni-{store_id}-host'.*--shm-size"):
        HostTier.create(layout, 4 * RESERVE_STEP // layout.page_bytes, store_id)
    assert not (shm_directory() / f"omni-{store_id}-host").exists()


@pytest.mark.gpu
def test_cuda_device_tier_round_trips_through_the_pinned_host_tier(layout: KVLayout,
                                                                   store_id: str) -> None:
    device = DeviceTier.create(layout, 4, store_id)
    host = HostTier.create(layout, 4, store_id)
    try:
        assert device.pool.is_cuda and device.arena_name is None
        assert host.arena is not None and host.arena.pinned
        pages = _pages(layout, 2).cuda()
        device.write(0, pages[0], KEY)
        device.write(1, pages[1], KEY)
        assert device.gather([0, 1]).data_ptr() == device.view(0).data_ptr()
        host.write(2, device.view(1), KEY)  # device -> pinned host, complete on return
        assert torch.equal(host.view(2), pages[1].cpu())
        out = torch.empty(layout.page_shape, dtype=layout.dtype, device="cuda")
        assert host.read_into(2, out, KEY)  # pinned host -> device
        assert torch.equal(out, pages[1])
    finally:
        device.close()
        host.close()
