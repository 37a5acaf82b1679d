"""What a process holds, for the soak (`perf/soak.py`) to compare before and after a run:
open file descriptors, shared-memory files and mappings of KV stores, resident memory and the
malloc heap, and the ResourceWarnings raised meanwhile. Linux (/proc); glibc for the heap."""

from __future__ import annotations

import ctypes
import gc
import os
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omni._shm import shm_directory
from perf._common import memory_status

__all__ = ["Resources", "leftovers", "memory", "open_fds"]

MIB = 1 << 20


def open_fds() -> dict[int, str]:
    """This process's open file descriptors and what each points to (Linux /proc)."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the descriptor listdir itself used, closed meanwhile
    return out


def leftovers(store_ids: Sequence[str]) -> dict[str, list[str]]:
    """Shared-memory files of these stores still in the shm folder, and mappings of them
    still in this process (a tensor view that outlived its store keeps its arena mapped)."""
    prefixes = tuple(f"omni-{sid}-" for sid in store_ids)
    files = sorted(n for n in os.listdir(shm_directory()) if n.startswith(prefixes))
    maps = Path("/proc/self/maps").read_text().splitlines()
    mapped = sorted({line.split()[-1] for line in maps if any(f"/{x}" in line for x in prefixes)})
    return {"segments": files, "mappings": mapped}


class Resources:
    """Counts ResourceWarnings while installed: each is a leak (a lease released by
    `Lease.__del__`, a stream finalized by trio, an unclosed file) that the garbage collector
    happened to clean up, late."""

    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()

    def __enter__(self) -> Resources:
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always", ResourceWarning)
        self._show, warnings.showwarning = warnings.showwarning, self._record
        return self

    def _record(self, message: Any, category: type, *args: Any, **kwargs: Any) -> None:
        if issubclass(category, ResourceWarning):
            self.seen[str(message)[:120]] += 1
        else:
            self._show(message, category, *args, **kwargs)

    def __exit__(self, *exc_info: Any) -> None:
        self._catch.__exit__(*exc_info)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def memory() -> dict[str, float]:
    """After a full collection, in MiB: VmRSS and its parts, and glibc's heap: `heap_in_use`
    (live blocks) and `heap_free` (freed, kept by the allocator). Why both: RSS grows with
    either, but only live blocks growing without bound are a leak."""
    gc.collect()
    out = {k: round(v / MIB, 2) for k, v in memory_status().items()}
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):  # not glibc
        return out
    mallinfo2.restype = _MallInfo2
    m = mallinfo2()
    return {**out, "heap_in_use": round((m.uordblks + m.hblkhd) / MIB, 2),
            "heap_free": round(m.fordblks / MIB, 2)}
