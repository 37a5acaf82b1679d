"""Shared-memory segments: where they live, how one is made (`create_segment`: this user's
only, its memory reserved up front) and opened (`open_segment`), whether the process that made
one still runs, and the one reclaim of the segments of processes that are gone
(`reclaim_dead`). The KV stores' arenas (`omni.kv.arena`) and the payload segments
(`omni.transport.payloads`) are both made, opened and reclaimed here. Torch-free, so that
processes that only talk (a head, a status query) can name their machine without loading the
KV layer."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = ["create_segment", "open_segment", "owner_stamp", "page_end", "process_alive",
           "process_start_time", "reclaim_dead", "reserve_bytes", "room_left", "shm_directory",
           "stamp_owner"]


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


def process_start_time(pid: int) -> int:
    """When process `pid` started (clock ticks since boot), or 0 where that is not known."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[19])  # the 22nd field; the first two (pid, comm) are before ")"
    except (OSError, IndexError, ValueError):
        return 0


def process_alive(pid: int, started: int = 0) -> bool:
    """Whether process `pid` runs (another user's counts), and, given the `started` time
    `process_start_time` gave when it was recorded, is still that process (not a reused
    pid): what decides whether a dead owner's segments may be reclaimed."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
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


def create_segment(name: str, size: int, *, reserve: int | None = None) -> int:
    """Create the segment `name` (a file of `shm_directory()`) of `size` bytes, readable and
    writable by this user only, never through a link, with memory reserved for its first
    `reserve` bytes (default: all of them): a full filesystem is an `OSError` naming the
    room left here, not a SIGBUS when the bytes are first written. Its open descriptor.

    Raises:
        FileExistsError: a segment of that name exists already.
        OSError: no room for `reserve` bytes (the file is removed again).
    """
    path = shm_directory() / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)  # sparse: the size costs nothing until reserved
        end = page_end(size if reserve is None else reserve, size)
        no_room = reserve_bytes(fd, 0, end)
        if no_room is not None:
            free = room_left(fd)
            raise OSError(no_room, f"cannot reserve {end} B for shared memory {name!r} in "
                          f"{path.parent} ({'unknown' if free is None else free} B free; in a "
                          f"container, raise --shm-size): {os.strerror(no_room)}")
    except BaseException:
        os.unlink(path)
        os.close(fd)
        raise
    return fd


def open_segment(name: str, *, writable: bool = True) -> int:
    """Open the existing segment `name`, never through a link; its descriptor.

    Raises:
        FileNotFoundError: there is none (its owner removed it).
    """
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(shm_directory() / name, flags)


def reserve_bytes(fd: int, start: int, end: int) -> int | None:
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


def room_left(fd: int) -> int | None:
    """Bytes free in a segment's filesystem, or None when it has no fixed size (a tmpfs
    mounted without one reports no blocks at all)."""
    info = os.fstatvfs(fd)
    return info.f_bavail * info.f_frsize if info.f_blocks else None
