"""This machine's identity as cluster peers see it (torch-free)."""

from __future__ import annotations

import functools
import hashlib
import os
import socket
import stat
import tempfile
from pathlib import Path

from omni._shm import shm_directory

__all__ = ["host_id", "ipc_directory", "ipc_enabled"]


def _read_first_line(path: str) -> str:
    try:
        with open(path) as f:
            return f.readline().strip()
    except OSError:
        return ""


@functools.cache
def host_id() -> str:
    """This machine as peers see it: 32 hex digits from the boot id, the machine id, the host
    name and the shared-memory folder's device and inode.

    Two processes get the same id when they share /dev/shm on the same boot of the same
    machine, which is what `SharedMemoryMover` needs; containers with private /dev/shm differ.
    """
    parts = [_read_first_line("/proc/sys/kernel/random/boot_id"),
             _read_first_line("/etc/machine-id") or _read_first_line("/var/lib/dbus/machine-id"),
             socket.gethostname()]
    try:
        info = os.stat(shm_directory())
        parts.append(f"{info.st_dev}:{info.st_ino}")
    except OSError:
        parts.append("")
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=16).hexdigest()


def ipc_enabled() -> bool:
    """Whether processes of one host talk over Unix sockets (``OMNI_IPC=0`` turns it off)."""
    return os.environ.get("OMNI_IPC", "").strip().lower() not in ("0", "false", "no", "off")


def ipc_directory() -> Path:
    """The folder of this user's Unix sockets: private (0700), so that only this user's
    processes can connect to them.

    Raises:
        PermissionError: the folder exists but is not a directory this user owns, or others
            can enter it.
    """
    folder = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()) / \
        f"omni-ipc-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{folder} must be a directory of this user's that others cannot "
                              "enter (0700)")
    return folder
