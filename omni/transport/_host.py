"""This machine's identity as cluster peers see it (torch-free)."""

from __future__ import annotations

import functools
import hashlib
import os
import socket

from omni._shm import shm_directory

__all__ = ["host_id"]


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
