"""Named shared-memory arenas: one file under /dev/shm mapped into every process that uses it.

Why not `multiprocessing.shared_memory`: on Python 3.11 its resource tracker unlinks a segment
when a process that merely attached to it exits, which would pull the host tier out from under
the store that owns it. Here only the owner unlinks, on `close()`, when it is garbage-collected,
or when the interpreter exits.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import mmap
import os
import re
import weakref
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import torch

from omni._shm import (
    create_segment,
    open_segment,
    page_end,
    reserve_bytes,
    room_left,
    shm_directory,
)
from omni.kv.errors import KVLeaseError

__all__ = ["Arena", "register_pinned", "shm_directory"]

log = logging.getLogger("omni.kv")

# A name is a single path component: no "/", no "..", nothing but what the store generates.
_NAME_PATTERN = re.compile(r"omni-[0-9a-f]{8,32}-[a-z]+")


def _check_name(name: str) -> None:
    if not isinstance(name, str) or _NAME_PATTERN.fullmatch(name) is None:
        raise ValueError(f"invalid arena name {name!r}: expected omni-<8 to 32 hex digits>-<tier>")


class _Cleanup:
    """What an arena must undo when closed, collected or left at exit.

    Why a separate object: `weakref.finalize` must not reference the arena itself, and the pinned
    registration happens after construction, so the finalizer reads it from here.
    """

    def __init__(self, path: str | None, fd: int | None) -> None:
        self.path = path  # set for owners only: attached processes never unlink
        self.fd = fd  # the owner's, kept to grow the reservation (see `Arena.reserve`)
        self.pinned_address: int | None = None

    def __call__(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)
        if self.pinned_address is not None:
            # Before unmapping: unmapped registered memory leaves CUDA a stale registration.
            address, self.pinned_address = self.pinned_address, None
            try:
                torch.cuda.cudart().cudaHostUnregister(address)
            except Exception as exc:  # at interpreter exit CUDA may be gone already
                log.debug("cudaHostUnregister(%#x) failed: %s", address, exc)
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class Arena:
    """A named shared-memory segment mapped into this process.

    Why: the host tier's pages must be readable by other processes on the node without a copy
    through a socket; a file under /dev/shm that every process maps gives them the same bytes.

    Tensor views made by `tensor()` keep the mapping alive: `close()` unmaps at once only when no
    view remains, and otherwise leaves the unmapping to the last view's death (the owner unlinks
    the file either way, so the name is free at once).

    The segment has its full size from the start (every process maps all of it once and never
    remaps), but memory is reserved only for its first `reserved` bytes, which the owner grows
    with `reserve`. Why: a tier of 1 GiB must start in a container whose /dev/shm holds 64 MiB,
    and memory that was never reserved is found missing only when touched, by a SIGBUS. So
    nothing may touch bytes past `reserved`: the owner reserves before it writes.
    """

    def __init__(self, name: str, path: Path, mapping: mmap.mmap, *, owner: bool,
                 fd: int | None = None, reserved: int | None = None) -> None:
        """Use `Arena.create` or `Arena.attach`."""
        self._name = name
        self._path = path
        self._size = len(mapping)
        self._owner = owner
        self._reserved = reserved
        self._mapping: mmap.mmap | None = mapping
        self.buffer = memoryview(mapping)  # handed to callers; released on close
        # Every tensor view is made from this memoryview and holds a reference to it; while it is
        # alive the mmap has an export and cannot be closed, so no view outlives its memory.
        self._source: memoryview | None = memoryview(mapping)
        self.address = torch.frombuffer(self._source, dtype=torch.uint8, count=1).data_ptr()
        self._cleanup = _Cleanup(str(path) if owner else None, fd)
        self._finalizer = weakref.finalize(self, self._cleanup)

    @classmethod
    def create(cls, name: str, size: int, *, reserve: int | None = None) -> Arena:
        """Create the segment `name` of `size` bytes, readable and writable by this user only,
        with memory reserved for its first `reserve` bytes (default: all of them).

        Raises:
            ValueError: an invalid name, a size below one byte, or `reserve` outside 1..size.
            FileExistsError: a segment of that name exists already.
            OSError: the shared-memory filesystem has no room for `reserve` bytes.
        """
        _check_name(name)
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"arena size must be a positive number of bytes, got {size!r}")
        reserve = size if reserve is None else reserve
        if not isinstance(reserve, int) or not 1 <= reserve <= size:
            raise ValueError(f"an arena of {size} B reserves 1 to {size} B, not {reserve!r}")
        fd = create_segment(name, size, reserve=reserve)
        path = shm_directory() / name
        try:
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.unlink(path)
            os.close(fd)
            raise
        reserve = page_end(reserve, size)
        return cls(name, path, mapping, owner=True, fd=fd, reserved=reserve)

    @classmethod
    def attach(cls, name: str, *, writable: bool = True) -> Arena:
        """Map the existing segment `name`, created by another process (or this one).

        With ``writable=False`` the file is opened read-only and mapped copy-on-write: this
        process can read everything the owner writes, and its own writes stay private.

        Raises:
            ValueError: an invalid name (a descriptor cannot name an arbitrary file).
            KVLeaseError: no segment of that name exists (its owner closed it).
        """
        _check_name(name)
        path = shm_directory() / name
        try:
            fd = open_segment(name, writable=writable)
        except FileNotFoundError:
            raise KVLeaseError(f"shared memory arena {name!r} does not exist") from None
        try:
            size = os.fstat(fd).st_size
            if size < 1:
                raise KVLeaseError(f"shared memory arena {name!r} is empty")
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_COPY
            mapping = mmap.mmap(fd, size, access=access)
        finally:
            os.close(fd)
        return cls(name, path, mapping, owner=False)

    @property
    def name(self) -> str:
        return self._name

    @property
    def size(self) -> int:
        return self._size

    @property
    def path(self) -> Path:
        """The file that backs the segment."""
        return self._path

    @property
    def owner(self) -> bool:
        return self._owner

    @property
    def reserved(self) -> int | None:
        """Bytes from the start that have memory reserved (the owner's count; None when
        attached: another process reserves)."""
        return self._reserved

    def reserve(self, nbytes: int) -> bool:
        """Reserve memory for the first `nbytes` bytes (rounded up to whole memory pages, at
        most `size`), now, so that writing them cannot fail later. False when the filesystem
        has no room for them; what was reserved before stays.

        Not thread-safe: the caller serializes (the KV store calls it with its lock held).

        Raises:
            ValueError: an attached or closed arena (only the owner reserves).
        """
        fd = self._cleanup.fd
        if self._reserved is None or fd is None:
            raise ValueError(f"arena {self._name!r}: only its open owner reserves memory")
        end = page_end(nbytes, self._size)
        if end <= self._reserved:
            return True
        free = room_left(fd)
        if free is not None and free < end - self._reserved:
            return False  # known without trying: a failing fallocate first fills, then undoes
        if reserve_bytes(fd, self._reserved, end) is not None:
            return False
        self._reserved = end
        return True

    @property
    def pinned(self) -> bool:
        """Whether the mapping is registered with CUDA (see `register_pinned`)."""
        return self._cleanup.pinned_address is not None

    @property
    def closed(self) -> bool:
        return self._source is None

    def tensor(self, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A tensor view of ``shape`` and ``dtype`` starting `offset` bytes into the arena.

        Raises:
            ValueError: out of bounds, an offset not aligned to the dtype, or a closed arena.
        """
        if self._source is None:
            raise ValueError(f"arena {self._name!r} is closed")
        if any(d < 0 for d in shape):
            raise ValueError(f"invalid shape {tuple(shape)}")
        itemsize = dtype.itemsize
        count = math.prod(shape)
        if offset < 0 or offset + count * itemsize > self._size:
            raise ValueError(f"{count * itemsize} bytes at offset {offset} lie outside arena "
                             f"{self._name!r} of {self._size} bytes")
        if offset % itemsize:
            raise ValueError(f"offset {offset} is not aligned to {dtype} ({itemsize} bytes)")
        if count == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        flat = torch.frombuffer(self._source, dtype=dtype, count=count, offset=offset)
        return flat.view(tuple(shape))

    def close(self) -> None:
        """Unmap (now, or when the last tensor view dies); the owner also unlinks. Idempotent."""
        if self._source is None:
            return
        self._finalizer()  # unregisters pinned memory, then the owner unlinks; runs once
        try:
            self.buffer.release()
        except BufferError:
            pass  # the caller still holds slices of it; they keep the mapping alive
        self._source = None  # views still alive keep their own reference to it
        mapping, self._mapping = self._mapping, None
        try:
            mapping.close()
        except BufferError:
            pass  # views are alive: the mapping goes when the last of them does

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "owner" if self._owner else "attached"
        state = "closed" if self.closed else ("pinned" if self.pinned else "open")
        reserved = "" if self._reserved is None else f" reserved={self._reserved}"
        return f"<Arena {self._name} size={self._size}{reserved} {role} {state}>"


def register_pinned(arena: Arena) -> bool:
    """Page-lock the arena with ``cudaHostRegister`` so host↔device copies run at pinned speed.

    A no-op returning False without CUDA; True once registered. `arena.close()` unregisters.

    Raises:
        RuntimeError: CUDA refused the registration.
    """
    if arena.closed:
        raise ValueError(f"arena {arena.name!r} is closed")
    if arena.pinned or not torch.cuda.is_available():
        return arena.pinned
    # Page-locking makes every page resident: reserve them all first, so that a full /dev/shm
    # is this error rather than a failed registration (or a SIGBUS) later.
    if arena.reserved is not None and not arena.reserve(arena.size):
        raise OSError(errno.ENOSPC, f"cannot reserve {arena.size} B to page-lock arena "
                      f"{arena.name!r} in {arena.path.parent} (in a container, raise "
                      "--shm-size)")
    result = torch.cuda.cudart().cudaHostRegister(arena.address, arena.size, 0)
    if int(result) != 0:
        raise RuntimeError(f"cudaHostRegister of arena {arena.name!r} failed: error {int(result)}")
    arena._cleanup.pinned_address = arena.address
    return True
