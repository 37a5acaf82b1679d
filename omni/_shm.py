"""Where shared memory lives; torch-free, so that processes that only talk (a head, a status
query) can name their machine without loading the KV layer."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

__all__ = ["shm_directory"]


def shm_directory() -> Path:
    """Where arenas live: /dev/shm, or a private per-user folder in the temp dir without it."""
    shm = Path("/dev/shm")
    if shm.is_dir():
        return shm
    private = Path(tempfile.gettempdir()) / f"omni-shm-{os.getuid()}"
    private.mkdir(mode=0o700, exist_ok=True)
    info = os.lstat(private)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise PermissionError(f"{private} is not a directory owned by this user")
    return private
