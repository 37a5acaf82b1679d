"""`Segment`: a named shared-memory segment that several processes map."""

from __future__ import annotations

import errno
import gc
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from omni import _shm as shm_module
from omni._shm import Segment, shm_directory
from omni.kv.errors import KVLeaseError
from omni.kv.leases import attach_segment


def _run_child(code: str) -> str:
    """Run `code` in a fresh interpreter (nothing inherited, as a spawned process) and return
    its stdout."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_create_then_attach_in_same_process_shares_bytes(store_id: str) -> None:
    with Segment.create(f"omni-{store_id}-host", 4096) as owner:
        with Segment.attach(owner.name) as other:
            owner.tensor(0, (4,), torch.int32)[:] = torch.tensor([1, 2, 3, 4])
            assert other.tensor(0, (4,), torch.int32).tolist() == [1, 2, 3, 4]
            other.buffer[100] = 7
            assert owner.buffer[100] == 7


@pytest.mark.proc  # another process maps it, and exits
def test_subprocess_shares_the_mapping_and_cleans_up_after_itself(store_id: str) -> None:
    """A write on either side is seen on the other (the mapping is shared); the child's exit does
    not unlink the segment it attached (the multiprocessing resource-tracker trap), and does
    unlink the one it created and never closed (the exit finalizer)."""
    child_name = f"omni-{store_id}-child"
    with Segment.create(f"omni-{store_id}-host", 8192) as owner:
        owner.tensor(64, (3,), torch.float32)[:] = torch.tensor([1.5, 2.5, 3.5])
        out = _run_child(f"""
            import torch
            from omni._shm import Segment
            a = Segment.attach({owner.name!r})
            print(a.tensor(64, (3,), torch.float32).tolist())
            a.tensor(4096, (2,), torch.int64)[:] = torch.tensor([11, 22])
            a.close()
            keep = Segment.create({child_name!r}, 4096)
            print(keep.path.exists())
        """)
        assert out.splitlines() == ["[1.5, 2.5, 3.5]", "True"]
        assert owner.tensor(4096, (2,), torch.int64).tolist() == [11, 22]
        assert owner.path.exists()
    assert not (shm_directory() / child_name).exists()


def test_segment_file_is_private_to_the_user(store_id: str) -> None:
    with Segment.create(f"omni-{store_id}-host", 4096) as arena:
        assert arena.path.parent == shm_directory()
        assert os.stat(arena.path).st_mode & 0o777 == 0o600


@pytest.mark.parametrize("name", [
    "../etc/passwd", "omni-zz-host", "omni-1234567-host", "omni-" + "a" * 33 + "-host",
    "omni-deadbeef-Host", "omni-deadbeef-host/../x", "omni-deadbeef-host\n", "/dev/shm/x", "",
    "omni-pay-12-t3-deadbeef-x", "omni-pay-12-deadbeef-1", "omni-pay-../x",
])
def test_names_outside_the_pattern_are_refused(name: str) -> None:
    """Creating or attaching validates the name, so a descriptor cannot name an arbitrary file."""
    with pytest.raises(ValueError, match="invalid shared-memory segment name"):
        Segment.create(name, 4096)
    with pytest.raises(ValueError, match="invalid shared-memory segment name"):
        Segment.attach(name)


def test_existing_name_and_empty_size_are_refused(store_id: str) -> None:
    with pytest.raises(ValueError, match="positive"):
        Segment.create(f"omni-{store_id}-host", 0)
    with Segment.create(f"omni-{store_id}-host", 4096), pytest.raises(FileExistsError):
        Segment.create(f"omni-{store_id}-host", 4096)


@pytest.mark.parametrize(("offset", "shape", "dtype", "message"), [
    (4096 - 8, (4,), torch.float32, "outside"),
    (-4, (1,), torch.float32, "outside"),
    (0, (1025,), torch.float32, "outside"),
    (2, (2,), torch.float32, "aligned"),
    (1, (1,), torch.float16, "aligned"),
])
def test_out_of_bounds_or_misaligned_views_are_refused(
        store_id: str, offset: int, shape: tuple[int, ...], dtype: torch.dtype,
        message: str) -> None:
    with Segment.create(f"omni-{store_id}-host", 4096) as arena, \
            pytest.raises(ValueError, match=message):
        arena.tensor(offset, shape, dtype)


def test_tensor_is_a_view_not_a_copy(store_id: str) -> None:
    with Segment.create(f"omni-{store_id}-host", 4096) as arena:
        view = arena.tensor(8, (2, 3), torch.float64)
        view.fill_(2.0)
        assert arena.tensor(8, (6,), torch.float64).tolist() == [2.0] * 6
        assert view.data_ptr() == arena.address + 8


def test_close_unlinks_and_attach_after_close_finds_nothing(store_id: str) -> None:
    name = f"omni-{store_id}-host"
    arena = Segment.create(name, 4096)
    arena.close()
    arena.close()  # idempotent
    assert not arena.path.exists()
    assert arena.closed and "closed" in repr(arena)
    with pytest.raises(FileNotFoundError):
        Segment.attach(name)
    with pytest.raises(KVLeaseError, match="does not exist"):  # as a store's reader sees it
        attach_segment(name)


def test_close_with_live_views_keeps_them_valid_and_unlinks(store_id: str) -> None:
    """close() must not raise BufferError while tensor views or buffer slices exist; the views
    keep the mapping until they die."""
    arena = Segment.create(f"omni-{store_id}-host", 4096)
    view = arena.tensor(0, (16,), torch.int32)
    view[:] = 5
    arena.close()
    assert not arena.path.exists()
    assert view.sum().item() == 80  # still mapped: reading does not crash
    with pytest.raises(ValueError, match="closed"):
        arena.tensor(0, (1,), torch.int32)


def test_attacher_closing_does_not_unlink(store_id: str) -> None:
    with Segment.create(f"omni-{store_id}-host", 4096) as owner:
        Segment.attach(owner.name).close()
        assert owner.path.exists()


def test_read_only_attach_sees_owner_writes_and_keeps_its_own_private(store_id: str) -> None:
    with Segment.create(f"omni-{store_id}-host", 4096) as owner:
        reader = Segment.attach(owner.name, writable=False)
        owner.buffer[0] = 9
        assert reader.buffer[0] == 9
        reader.buffer[1] = 3  # copy-on-write: never reaches the segment
        assert owner.buffer[1] == 0
        reader.close()


def test_garbage_collected_owner_unlinks(store_id: str) -> None:
    arena = Segment.create(f"omni-{store_id}-host", 4096)
    path = arena.path
    del arena
    gc.collect()
    assert not path.exists()


def test_pin_without_cuda_is_a_no_op(store_id: str) -> None:
    with Segment.create(f"omni-{store_id}-host", 4096) as arena:
        assert arena.pin() is torch.cuda.is_available()
        assert arena.pinned is torch.cuda.is_available()


@pytest.mark.gpu
def test_pin_makes_views_page_locked(store_id: str) -> None:
    with Segment.create(f"omni-{store_id}-host", 1 << 20) as arena:
        assert arena.pin()
        view = arena.tensor(0, (1 << 18,), torch.float32)
        assert view.is_pinned()
        view.copy_(torch.arange(1 << 18, dtype=torch.float32, device="cuda"))
        assert view[-1].item() == (1 << 18) - 1
        assert "pinned" in repr(arena)
    assert not arena.pinned


def test_full_shared_memory_is_an_oserror_at_creation_not_a_sigbus_later(
        store_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full /dev/shm is simulated by replacing `os.posix_fallocate` as `omni._shm` sees
    it; the half-made segment is removed."""
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(shm_module.os, "posix_fallocate", full)
    with pytest.raises(OSError, match=r"cannot reserve 4096 B .* --shm-size") as info:
        Segment.create(f"omni-{store_id}-host", 4096)
    assert info.value.errno == errno.ENOSPC


MIB = 1 << 20


def _bytes_held(arena: Segment) -> int:
    """The memory the segment's file holds in its filesystem (tmpfs counts reserved pages)."""
    return os.stat(arena.path).st_blocks * 512


def test_a_partly_reserved_arena_has_its_full_size_and_holds_only_what_it_reserved(
        store_id: str) -> None:
    with Segment.create(f"omni-{store_id}-host", 64 * MIB, reserve=1) as arena:
        assert arena.size == 64 * MIB and os.stat(arena.path).st_size == 64 * MIB
        assert arena.reserved == 4096  # whole memory pages
        assert _bytes_held(arena) <= 4096
        assert "reserved=4096" in repr(arena)


def test_reserve_grows_the_memory_held_and_keeps_what_was_written(store_id: str) -> None:
    with Segment.create(f"omni-{store_id}-host", 64 * MIB, reserve=4096) as arena:
        arena.tensor(0, (4,), torch.int64)[:] = torch.tensor([7, 8, 9, 10])
        assert arena.reserve(16 * MIB) is True
        assert arena.reserved == 16 * MIB
        assert 16 * MIB <= _bytes_held(arena) < 17 * MIB
        assert arena.tensor(0, (4,), torch.int64).tolist() == [7, 8, 9, 10]
        assert arena.reserve(8 * MIB) is True and arena.reserved == 16 * MIB  # never shrinks
        assert arena.reserve(1 << 40) is True and arena.reserved == 64 * MIB  # at most its size


@pytest.mark.proc  # another process maps it
def test_memory_reserved_after_a_process_attached_is_seen_by_that_process(
        store_id: str) -> None:
    """The attached mapping covers the whole segment from the start: pages written after the
    owner grew its reservation are read there without remapping."""
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, torch
        from omni._shm import Segment
        a = Segment.attach(sys.argv[1])
        print("attached", flush=True)
        offset = int(sys.stdin.readline())
        print(a.tensor(offset, (3,), torch.float32).tolist(), flush=True)
        a.tensor(offset + 64, (1,), torch.float32)[:] = 4.5
        a.close()
    """), f"omni-{store_id}-host"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    with Segment.create(f"omni-{store_id}-host", 32 * MIB, reserve=4096) as owner:
        try:
            assert child.stdout.readline().strip() == "attached"
            assert owner.reserve(32 * MIB)
            offset = 31 * MIB
            owner.tensor(offset, (3,), torch.float32)[:] = torch.tensor([1.5, 2.5, 3.5])
            child.stdin.write(f"{offset}\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "[1.5, 2.5, 3.5]"
            assert child.wait(timeout=60) == 0
            assert owner.tensor(offset + 64, (1,), torch.float32).item() == 4.5
        finally:
            child.kill()
            child.wait()


def test_reserve_without_room_is_false_and_keeps_the_reservation(
        store_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with Segment.create(f"omni-{store_id}-host", 64 * MIB, reserve=4 * MIB) as arena:
        def full(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(shm_module.os, "posix_fallocate", full)
        assert arena.reserve(8 * MIB) is False
        assert arena.reserved == 4 * MIB
        assert arena.reserve(4 * MIB) is True  # what it holds needs nothing more


def test_only_the_owner_reserves_and_a_reservation_is_within_the_size(store_id: str) -> None:
    with pytest.raises(ValueError, match=r"reserves 1 to 4096 B, not 8192"):
        Segment.create(f"omni-{store_id}-host", 4096, reserve=8192)
    with Segment.create(f"omni-{store_id}-host", 4096) as owner:
        assert owner.reserved == 4096  # everything, by default
        with Segment.attach(owner.name) as other:
            assert other.reserved is None
            with pytest.raises(ValueError, match="only its open owner reserves"):
                other.reserve(4096)
    with pytest.raises(ValueError, match="only its open owner reserves"):
        owner.reserve(4096)


def test_an_unmapped_owner_writes_through_its_descriptor_and_readers_map_it(
        store_id: str) -> None:
    """A large one-off buffer: the writer never maps it (its memory does not grow)."""
    data = bytes(range(256)) * 64
    with Segment.create(f"omni-{store_id}-host", len(data), mapped=False) as owner:
        with pytest.raises(ValueError, match="not mapped here"):
            owner.buffer  # noqa: B018
        owner.write(memoryview(data))
        with pytest.raises(ValueError, match="outside"):
            owner.write(memoryview(b"x"), len(data))
        with Segment.attach(owner.name, populate=True) as reader:
            assert bytes(reader.buffer) == data
            with pytest.raises(ValueError, match="owner"):
                reader.write(memoryview(b"x"))


def test_only_a_segment_reserved_whole_is_populated(store_id: str) -> None:
    with pytest.raises(ValueError, match="reserved whole"):
        Segment.create(f"omni-{store_id}-host", 8192, reserve=4096, populate=True)
    assert not (shm_directory() / f"omni-{store_id}-host").exists()
