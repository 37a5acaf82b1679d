"""Where shared memory lives, and whether the process that made a segment still runs;
torch-free, so that processes that only talk (a head, a status query) can name their machine
without loading the KV layer."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

__all__ = ["process_alive", "process_start_time", "shm_directory"]


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
