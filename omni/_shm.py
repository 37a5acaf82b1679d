"""Where shared memory lives, whether the process that made a segment still runs, and the one
reclaim of the segments of processes that are gone (`reclaim_dead`: the KV stores' arenas and
the payload segments both go through it); torch-free, so that processes that only talk (a
head, a status query) can name their machine without loading the KV layer."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = ["owner_stamp", "process_alive", "process_start_time", "reclaim_dead",
           "shm_directory", "stamp_owner"]


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
