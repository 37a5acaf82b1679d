"""Shared memory: the one segment type (`Segment`), where segments live, whether the process
that made one still runs, and the one reclaim of the segments of processes that are gone
(`reclaim_dead`). The KV stores' tiers and lease tables (`omni.kv`) and the buffers of stage
values (`omni.transport.movers`) are all `Segment`s. Torch-free at import, so that processes
that only talk (a head, a status query) can name their machine without loading torch.

Why not `multiprocessing.shared_memory`: on Python 3.11 its resource tracker unlinks a segment
when a process that merely attached to it exits, which would pull a store's memory out from
under it. Here only the owner unlinks: on `Segment.close()`, when the segment is collected, at
interpreter exit, or, when the owner was killed, in the next process's `reclaim_dead`."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import math
import mmap
import os
import re
import stat
import tempfile
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["Segment", "owner_stamp", "page_end", "process_alive", "process_start_time",
           "reclaim_dead", "shm_directory", "stamp_owner"]

log = logging.getLogger("omni.shm")


def shm_directory() -> Path:
    """Where arenas live: ``$OMNI_SHM_DIR`` when set, else /dev/shm, else a private per-user
    folder in the temp dir.

    Why the variable: a machine whose /dev/shm is small, or shared with other users' stores,
    can point Omni at a folder of its own on a memory filesystem. Processes that share pages
    must agree on it (a worker and the processes that read its host tier).

    Raises:
        NotADirectoryError: ``$OMNI_SHM_DIR`` names no directory.
    """
    chosen = os.environ.get("OMNI_SHM_DIR")
    if chosen:
        path = Path(chosen)
        if not path.is_dir():
            raise NotADirectoryError(f"OMNI_SHM_DIR={chosen}: not a directory")
        return path
    shm = Path("/dev/shm")
    if shm.is_dir():
        return shm
    private = Path(tempfile.gettempdir()) / f"omni-shm-{os.getuid()}"
    private.mkdir(mode=0o700, exist_ok=True)
    info = os.lstat(private)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise PermissionError(f"{private} is not a directory owned by this user")
    return private


def _stat_fields(pid: int) -> list[bytes]:
    """The fields of ``/proc/PID/stat`` after the first two (pid, comm), or [] where there
    is none to read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return []


def process_start_time(pid: int) -> int:
    """When process `pid` started (clock ticks since boot), or 0 where that is not known."""
    try:
        return int(_stat_fields(pid)[19])  # the 22nd field
    except (IndexError, ValueError):
        return 0


def process_alive(pid: int, started: int = 0) -> bool:
    """Whether process `pid` runs (another user's counts), and, given the `started` time
    `process_start_time` gave when it was recorded, is still that process (not a reused
    pid): what decides whether a dead owner's segments may be reclaimed.

    A zombie (killed, not yet reaped by its parent: a SIGKILLed worker whose supervisor has
    not waited for it yet) is dead: it runs no code and will never unlink anything."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    fields = _stat_fields(pid)
    if fields[:1] in ([b"Z"], [b"X"]):  # the state: zombie, or dead
        return False
    now = process_start_time(pid)
    return not (started and now and now != started)


def owner_stamp() -> str:
    """This process as a segment's name carries it: ``PID-tSTART`` (the start time tells a
    reused pid from its first owner); `stamp_owner` reads it back."""
    pid = os.getpid()
    return f"{pid}-t{process_start_time(pid)}"


def stamp_owner(fields: list[str]) -> tuple[int, int] | None:
    """The (pid, start time) of a name's fields from the one `owner_stamp` made (the start
    time 0 where a name has none), or None when they hold no pid."""
    if not fields or not fields[0].isdigit():
        return None
    started = fields[1][1:] if len(fields) > 1 and fields[1].startswith("t") else ""
    return int(fields[0]), int(started) if started.isdigit() else 0


def reclaim_dead(pattern: str, owner: Callable[[Path], tuple[int, int] | None], *,
                 with_it: Callable[[Path], Iterable[Path]] = lambda path: ()) -> list[str]:
    """Unlink each file of `shm_directory()` matching `pattern` whose owner process is gone,
    after the files `with_it(path)` names with it; the names removed.

    `owner(path)` says whose a file is: (pid, start time, 0 if unknown), or None to leave it
    alone (not ours, unreadable). A live owner, or one of another user, keeps its files. The
    owner's own file goes last: a reclaim cut short leaves it to the next one."""
    removed: list[str] = []
    for path in shm_directory().glob(pattern):
        found = owner(path)
        if found is None or process_alive(*found):
            continue
        for doomed in [*with_it(path), path]:
            with contextlib.suppress(FileNotFoundError):
                doomed.unlink()
                removed.append(doomed.name)
    return removed


def _create_file(name: str, size: int, reserve: int) -> int:
    """Create the file of segment `name` (in `shm_directory()`) of `size` bytes, readable and
    writable by this user only, never through a link, with memory reserved for its first
    `reserve` bytes: a full filesystem is an `OSError` naming the room left here, not a SIGBUS
    when the bytes are first written. Its open descriptor.

    Raises:
        FileExistsError: a segment of that name exists already.
        OSError: no room for `reserve` bytes (the file is removed again).
    """
    path = shm_directory() / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)  # sparse: the size costs nothing until reserved
        end = page_end(reserve, size)
        no_room = _reserve_bytes(fd, 0, end)
        if no_room is not None:
            free = _room_left(fd)
            raise OSError(no_room, f"cannot reserve {end} B for shared memory {name!r} in "
                          f"{path.parent} ({'unknown' if free is None else free} B free; in a "
                          f"container, raise --shm-size): {os.strerror(no_room)}")
    except BaseException:
        os.unlink(path)
        os.close(fd)
        raise
    return fd


def _open_file(name: str, *, writable: bool) -> int:
    """Open the existing segment `name`, never through a link; its descriptor.

    Raises:
        FileNotFoundError: there is none (its owner removed it).
    """
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(shm_directory() / name, flags)


def _reserve_bytes(fd: int, start: int, end: int) -> int | None:
    """Reserve memory for bytes [start, end) of a segment. None when done, or the errno saying
    the filesystem has no room (ENOSPC; ENOMEM: a memory cgroup's limit). A filesystem without
    fallocate cannot reserve: done, and its pages come when first touched."""
    try:
        os.posix_fallocate(fd, start, end - start)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return None
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            return exc.errno
        raise
    return None


def page_end(nbytes: int, size: int) -> int:
    """`nbytes` rounded up to whole memory pages (what a filesystem reserves), at most `size`."""
    return min(size, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)


def _room_left(fd: int) -> int | None:
    """Bytes free in a segment's filesystem, or None when it has no fixed size (a tmpfs
    mounted without one reports no blocks at all)."""
    info = os.fstatvfs(fd)
    return info.f_bavail * info.f_frsize if info.f_blocks else None


# A name Omni makes: a store's tier or lease table (omni-<store id>-<what>), or a buffer of a
# stage value (omni-pay-<pid>-t<start>-<token>-<n>). One path component: no "/", no "..".
_NAME = re.compile(r"omni-(?:[0-9a-f]{8,32}-[a-z]+|pay-[0-9]+-t[0-9]+-[0-9a-f]{8}-[0-9]+)")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_WRITE_STEP = 1 << 30  # bytes per pwrite: the kernel writes at most about 2 GiB per call


def _check_name(name: str) -> None:
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise ValueError(f"invalid shared-memory segment name {name!r}: not one Omni makes "
                         "(omni-<8 to 32 hex digits>-<tier>, or a value buffer's)")


def _map(fd: int, size: int, *, writable: bool, populate: bool) -> mmap.mmap:
    """Shared, or copy-on-write when not `writable`; pages faulted in now when `populate`."""
    flags = (mmap.MAP_SHARED if writable else mmap.MAP_PRIVATE) | (_POPULATE if populate else 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


class _Cleanup:
    """What a segment undoes when closed, collected or left at exit. Apart from the segment:
    `weakref.finalize` must not reference it, and the CUDA registration comes after it is
    made, so the finalizer reads it from here."""

    def __init__(self, path: Path | None, fd: int | None) -> None:
        self.path = path  # owners only: attached processes never unlink
        self.fd = fd  # the owner's: reserving and writing go through it
        self.pinned_address: int | None = None

    def __call__(self) -> None:
        if self.pinned_address is not None:
            # Before unmapping: unmapped registered memory leaves CUDA a stale registration.
            address, self.pinned_address = self.pinned_address, None
            try:
                import torch

                torch.cuda.cudart().cudaHostUnregister(address)
            except Exception as exc:  # at interpreter exit CUDA may be gone already
                log.debug("cudaHostUnregister(%#x) failed: %s", address, exc)
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class Segment:
    """A named shared-memory segment: a file of `shm_directory()` that processes map.

    The owner (`create`) unlinks it on `close()`, when it is collected, or at interpreter
    exit; processes that `attach` it never do. Views (`buffer`, `tensor()`, arrays over them)
    keep the mapping alive: `close()` unmaps at once only when none remains, and otherwise
    leaves that to the last one's death (the owner unlinks either way: the name is free).

    Memory is reserved only for the first `reserved` bytes, which the owner grows with
    `reserve`. Why: a KV tier of 1 GiB must start in a container whose /dev/shm holds 64 MiB,
    and memory that was never reserved is found missing only when touched, by a SIGBUS. So
    nothing may touch bytes past `reserved`: the owner reserves before it writes. An owner may
    also leave its segment unmapped and `write` it instead: a large one-off buffer then costs
    the writer no memory of its own.
    """

    def __init__(self, name: str, size: int, mapping: mmap.mmap | None, *, owner: bool,
                 fd: int | None = None, reserved: int | None = None) -> None:
        """Use `Segment.create` or `Segment.attach`."""
        self._name = name
        self._path = shm_directory() / name
        self._size = size
        self._owner = owner
        self._reserved = reserved
        self._closed = False
        self._mapping = mapping
        # Every view is made from this memoryview and holds a reference to it; while one is
        # alive the mmap has an export and cannot be closed, so no view outlives its memory.
        self._source = None if mapping is None else memoryview(mapping)
        self._cleanup = _Cleanup(self._path if owner else None, fd)
        self._finalizer = weakref.finalize(self, self._cleanup)

    @classmethod
    def create(cls, name: str, size: int, *, reserve: int | None = None, mapped: bool = True,
               populate: bool = False) -> Segment:
        """Create the segment `name` of `size` bytes, readable and writable by this user only,
        with memory reserved for its first `reserve` bytes (default: all of them); mapped here
        unless not `mapped` (`write` fills it then), its pages faulted in at once when
        `populate` (a segment reserved whole only).

        Raises:
            ValueError: a name Omni does not make, a size below one byte, `reserve` outside
                1..size, or `populate` with part of it reserved.
            FileExistsError: a segment of that name exists already.
            OSError: the shared-memory filesystem has no room for `reserve` bytes.
        """
        _check_name(name)
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"a segment's size is a positive number of bytes, not {size!r}")
        reserve = size if reserve is None else reserve
        if not isinstance(reserve, int) or not 1 <= reserve <= size:
            raise ValueError(f"a segment of {size} B reserves 1 to {size} B, not {reserve!r}")
        if populate and reserve != size:
            raise ValueError("only a segment reserved whole may be populated (a page past the "
                             "reservation would fault)")
        fd = _create_file(name, size, reserve)
        try:
            mapping = _map(fd, size, writable=True, populate=populate) if mapped else None
        except BaseException:
            os.unlink(shm_directory() / name)
            os.close(fd)
            raise
        reserved = page_end(reserve, size)
        if mapped and reserved == size:  # nothing left to reserve or write through it: why
            os.close(fd)                 # hold a descriptor per segment of a pool
            fd = None
        return cls(name, size, mapping, owner=True, fd=fd, reserved=reserved)

    @classmethod
    def attach(cls, name: str, *, writable: bool = True, populate: bool = False) -> Segment:
        """Map the existing segment `name`, made by another process (or this one).

        With ``writable=False`` the file is opened read-only and mapped copy-on-write: this
        process reads everything the owner writes, and its own writes stay private.

        Raises:
            ValueError: a name Omni does not make (a message cannot name an arbitrary file).
            FileNotFoundError: there is none (its owner closed it).
            OSError: it cannot be mapped (it is empty, say).
        """
        _check_name(name)
        fd = _open_file(name, writable=writable)
        try:
            size = os.fstat(fd).st_size
            if size < 1:
                raise OSError(errno.EINVAL, f"shared memory {name!r} is empty")
            mapping = _map(fd, size, writable=writable, populate=populate)
        finally:
            os.close(fd)
        return cls(name, size, mapping, owner=False)

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

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pinned(self) -> bool:
        """Whether the mapping is page-locked for CUDA (see `pin`)."""
        return self._cleanup.pinned_address is not None

    @property
    def mapped(self) -> bool:
        """Whether the bytes are mapped here (`buffer`, `tensor`): not once closed, nor for
        an owner that writes through its descriptor."""
        return self._source is not None

    @property
    def buffer(self) -> memoryview:
        """The mapped bytes (views of it keep the mapping alive).

        Raises:
            ValueError: closed, or an owner's segment left unmapped.
        """
        if self._source is None:
            state = "closed" if self._closed else "not mapped here"
            raise ValueError(f"segment {self._name!r} is {state}")
        return self._source

    @property
    def address(self) -> int:
        """Where the mapping starts in this process's memory."""
        holder = ctypes.c_char.from_buffer(self.buffer)
        try:
            return ctypes.addressof(holder)
        finally:
            del holder  # its export of the mapping goes with it

    def tensor(self, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A tensor view of ``shape`` and ``dtype`` starting `offset` bytes into the segment.

        Raises:
            ValueError: out of bounds, an offset not aligned to the dtype, or not mapped.
        """
        import torch

        source = self.buffer
        if any(d < 0 for d in shape):
            raise ValueError(f"invalid shape {tuple(shape)}")
        itemsize = dtype.itemsize
        count = math.prod(shape)
        if offset < 0 or offset + count * itemsize > self._size:
            raise ValueError(f"{count * itemsize} bytes at offset {offset} lie outside segment "
                             f"{self._name!r} of {self._size} bytes")
        if offset % itemsize:
            raise ValueError(f"offset {offset} is not aligned to {dtype} ({itemsize} bytes)")
        if count == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        return torch.frombuffer(source, dtype=dtype, count=count, offset=offset).view(
            tuple(shape))

    def reserve(self, nbytes: int) -> bool:
        """Reserve memory for the first `nbytes` bytes (rounded up to whole memory pages, at
        most `size`), now, so that writing them cannot fail later. False when the filesystem
        has no room for them; what was reserved before stays.

        Not thread-safe: the caller serializes (the KV store calls it with its lock held).

        Raises:
            ValueError: an attached or closed segment (only the owner reserves).
        """
        if self._reserved is None or self._closed:
            raise ValueError(f"segment {self._name!r}: only its open owner reserves memory")
        end = page_end(nbytes, self._size)
        if end <= self._reserved:
            return True
        fd = self._owner_fd("reserves memory")
        free = _room_left(fd)
        if free is not None and free < end - self._reserved:
            return False  # known without trying: a failing fallocate first fills, then undoes
        if _reserve_bytes(fd, self._reserved, end) is not None:
            return False
        self._reserved = end
        return True

    def write(self, data: memoryview, offset: int = 0) -> None:
        """Write `data` at `offset` through the owner's descriptor (for a segment left
        unmapped here).

        Raises:
            ValueError: not the open owner, or past the end.
        """
        fd = self._owner_fd("writes")
        view = memoryview(data).cast("B")
        if offset < 0 or offset + view.nbytes > self._size:
            raise ValueError(f"{view.nbytes} bytes at offset {offset} lie outside segment "
                             f"{self._name!r} of {self._size} bytes")
        done = 0
        while done < view.nbytes:
            done += os.pwrite(fd, view[done:done + _WRITE_STEP], offset + done)

    def pin(self) -> bool:
        """Page-lock the mapping with ``cudaHostRegister`` so host↔device copies run at pinned
        speed; `close()` unregisters. A no-op returning False without CUDA; True once pinned.

        Raises:
            ValueError: closed or unmapped.
            OSError: no room to reserve all of it (page-locking makes every page resident).
            RuntimeError: CUDA refused the registration.
        """
        address = self.address
        if self.pinned:
            return True
        import torch

        if not torch.cuda.is_available():
            return False
        # Reserve it all first: a full /dev/shm is this error, not a failed registration (or
        # a SIGBUS) later.
        if self._reserved is not None and not self.reserve(self._size):
            raise OSError(errno.ENOSPC, f"cannot reserve {self._size} B to page-lock segment "
                          f"{self._name!r} in {self._path.parent} (in a container, raise "
                          "--shm-size)")
        result = torch.cuda.cudart().cudaHostRegister(address, self._size, 0)
        if int(result) != 0:
            raise RuntimeError(f"cudaHostRegister of segment {self._name!r} failed: error "
                               f"{int(result)}")
        self._cleanup.pinned_address = address
        return True

    def _owner_fd(self, what: str) -> int:
        fd = self._cleanup.fd
        if fd is None:
            raise ValueError(f"segment {self._name!r}: only its open owner {what}")
        return fd

    def close(self) -> None:
        """Unmap (now, or when the last view dies); the owner also unlinks. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()  # unregisters pinned memory, then the owner unlinks; runs once
        # Not released: views made from it (a tensor holds the memoryview, not an export of
        # it) keep it, and through it the mapping, alive; unmapping under them would crash.
        self._source = None
        mapping, self._mapping = self._mapping, None
        if mapping is not None:
            with contextlib.suppress(BufferError):
                mapping.close()  # raises while views are alive: the last one's death unmaps

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "owner" if self._owner else "attached"
        state = "closed" if self._closed else ("pinned" if self.pinned else "open")
        reserved = "" if self._reserved is None else f" reserved={self._reserved}"
        return f"<Segment {self._name} size={self._size}{reserved} {role} {state}>"
