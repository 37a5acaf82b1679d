"""`DiskTier`: checksummed page slots in one file; anything not intact reads as a miss."""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
from pathlib import Path

import pytest
import torch
import xxhash

from omni.kv.layout import KVLayout
from omni.kv.tiers import disk as disk_module
from omni.kv.tiers.disk import HEADER, DiskTier, default_directory

KEY_A = bytes(range(16))
KEY_B = bytes(range(1, 17))


def _page(layout: KVLayout, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(layout.page_shape, generator=generator).to(layout.dtype)


@pytest.fixture
def tier(layout: KVLayout, store_id: str, tmp_path: Path):
    disk = DiskTier.create(layout, 8, tmp_path, store_id)
    yield disk
    disk.close()


def _out(layout: KVLayout) -> torch.Tensor:
    return torch.full(layout.page_shape, 9.0, dtype=layout.dtype)


def test_directory_is_0700_file_is_0600_and_sparse(tier: DiskTier, layout: KVLayout,
                                                   store_id: str, tmp_path: Path) -> None:
    assert tier.directory == tmp_path / f"store-{store_id}"
    assert tier.path == tier.directory / "pages.bin"
    assert stat.S_IMODE(os.stat(tier.directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tier.path).st_mode) == 0o600
    assert tier.slot_bytes == 4096  # 48-byte header + 512-byte page, rounded up
    info = os.stat(tier.path)
    assert info.st_size == 8 * 4096 and info.st_blocks == 0  # pre-sized, nothing allocated


def test_round_trip_of_random_pages_in_any_slot_order(tier: DiskTier, layout: KVLayout) -> None:
    pages = {slot: _page(layout, slot) for slot in (7, 0, 3, 1)}
    for slot, page in pages.items():
        tier.write(slot, page, bytes([slot]) * 16)
    tier.flush()
    out = _out(layout)
    for slot, page in pages.items():
        assert tier.read_into(slot, out, bytes([slot]) * 16)
        assert torch.equal(out, page)


def test_bfloat16_pages_and_non_contiguous_destinations(layout: KVLayout, store_id: str,
                                                        tmp_path: Path) -> None:
    """Dtypes numpy lacks go through as raw bytes; a strided `out` is filled via a temporary."""
    bf16 = KVLayout(2, 2, 8, 4, dtype=torch.bfloat16)
    disk = DiskTier.create(bf16, 2, tmp_path, store_id)
    page = _page(bf16, 5)
    disk.write(1, page, KEY_A)
    strided = torch.empty((8, 2, 4, 2, 2), dtype=torch.bfloat16).permute(4, 1, 2, 3, 0)
    assert strided.shape == bf16.page_shape and not strided.is_contiguous()
    assert disk.read_into(1, strided, KEY_A)
    assert torch.equal(strided, page)
    disk.close()


def test_flipped_payload_byte_reads_as_a_miss_with_a_warning(
        tier: DiskTier, layout: KVLayout, caplog: pytest.LogCaptureFixture) -> None:
    tier.write(2, _page(layout, 1), KEY_A)
    fd = os.open(tier.path, os.O_RDWR)
    offset = 2 * tier.slot_bytes + HEADER.size + 100
    os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0x01]), offset)
    os.close(fd)
    with caplog.at_level(logging.WARNING, logger="omni.kv"):
        assert tier.read_into(2, _out(layout), KEY_A) is False
    assert "slot 2" in caplog.text and "checksum mismatch" in caplog.text


def test_truncated_file_reads_as_a_miss(tier: DiskTier, layout: KVLayout) -> None:
    tier.write(5, _page(layout, 1), KEY_A)
    os.truncate(tier.path, 5 * tier.slot_bytes + HEADER.size + 10)
    assert tier.read_into(5, _out(layout), KEY_A) is False


def test_header_naming_another_key_reads_as_a_miss(tier: DiskTier, layout: KVLayout,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    tier.write(4, _page(layout, 1), KEY_B)
    with caplog.at_level(logging.WARNING, logger="omni.kv"):
        assert tier.read_into(4, _out(layout), KEY_A) is False
    assert KEY_B.hex() in caplog.text


def test_never_written_slot_reads_as_a_miss(tier: DiskTier, layout: KVLayout) -> None:
    assert tier.read_into(6, _out(layout), KEY_A) is False


def test_torn_write_reads_as_a_miss(tier: DiskTier, layout: KVLayout) -> None:
    """A new page's header landed but only half its payload: the old bytes no longer match."""
    tier.write(3, _page(layout, 1), KEY_A)
    new = _page(layout, 2)
    payload = new.reshape(-1).view(torch.uint8).numpy().tobytes()
    header = HEADER.pack(disk_module.MAGIC, KEY_B, len(payload), xxhash.xxh3_128_digest(payload))
    fd = os.open(tier.path, os.O_RDWR)
    os.pwrite(fd, header + payload[: len(payload) // 2], 3 * tier.slot_bytes)
    os.close(fd)
    assert tier.read_into(3, _out(layout), KEY_B) is False
    assert tier.read_into(3, _out(layout), KEY_A) is False


def test_disk_full_raises_oserror_from_write(tier: DiskTier, layout: KVLayout,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC is simulated by replacing `os.pwritev` as the disk module sees it."""
    def full(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(disk_module.os, "pwritev", full)
    with pytest.raises(OSError) as info:
        tier.write(0, _page(layout, 1), KEY_A)
    assert info.value.errno == errno.ENOSPC


def test_short_write_raises_oserror_and_leaves_a_miss(tier: DiskTier, layout: KVLayout,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.pwritev
    def short(fd: int, buffers: list, offset: int) -> int:
        return real(fd, buffers[:1], offset)  # only the header
    monkeypatch.setattr(disk_module.os, "pwritev", short)
    with pytest.raises(OSError, match="short write to slot 1"):
        tier.write(1, _page(layout, 1), KEY_A)
    monkeypatch.undo()
    assert tier.read_into(1, _out(layout), KEY_A) is False


def test_bad_keys_pages_and_slots_are_refused(tier: DiskTier, layout: KVLayout) -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        tier.write(0, _page(layout, 1), b"short")
    with pytest.raises(ValueError, match="expects a page of shape"):
        tier.write(0, torch.zeros(3), KEY_A)
    with pytest.raises(IndexError, match="no slot 8"):
        tier.read_into(8, _out(layout), KEY_A)


def test_path_that_is_a_file_is_refused_at_construction(layout: KVLayout, store_id: str,
                                                        tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match=re.escape(f"{afile} is not a directory")):
        DiskTier.create(layout, 4, afile, store_id)
    with pytest.raises(ValueError, match=re.escape(str(afile / "sub"))):
        DiskTier.create(layout, 4, afile / "sub", store_id)


def test_unwritable_path_is_refused_at_construction(layout: KVLayout, store_id: str,
                                                    tmp_path: Path) -> None:
    """A read-only directory (root ignores modes, so as root a path in read-only /sys)."""
    if os.geteuid() == 0:
        target = Path("/sys/omni-kv-test")
    else:
        target = tmp_path / "locked"
        target.mkdir(mode=0o500)
    with pytest.raises(PermissionError, match=re.escape(str(target))):
        DiskTier.create(layout, 4, target, store_id)


def test_missing_directory_is_created_0700(layout: KVLayout, store_id: str,
                                           tmp_path: Path) -> None:
    target = tmp_path / "a" / "kv"
    disk = DiskTier.create(layout, 1, target, store_id)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o700
    disk.close()
    assert target.is_dir()  # close removes only the per-store directory


def test_default_directory_follows_xdg_cache_home(layout: KVLayout, store_id: str,
                                                  tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_directory() == tmp_path / "omni" / "kv"
    disk = DiskTier.create(layout, 1, None, store_id)
    assert disk.directory == tmp_path / "omni" / "kv" / f"store-{store_id}"
    disk.close()


def test_invalid_store_id_and_a_second_store_of_the_same_id_are_refused(
        tier: DiskTier, layout: KVLayout, store_id: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="invalid store id"):
        DiskTier.create(layout, 1, tmp_path, "../x")
    with pytest.raises(ValueError, match="another store"):
        DiskTier.create(layout, 1, tmp_path, store_id)
    assert tier.path.exists()


def test_close_removes_file_and_directory_and_is_idempotent(tier: DiskTier,
                                                            layout: KVLayout) -> None:
    tier.write(0, _page(layout, 1), KEY_A)
    tier.close()
    tier.close()
    assert not tier.path.exists() and not tier.directory.exists()
    assert "closed" in repr(tier)
    with pytest.raises(ValueError, match="closed"):
        tier.write(0, _page(layout, 1), KEY_A)
