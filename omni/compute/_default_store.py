"""The KV store an engine makes for itself when its caller gives none: prefix caching on by
default, as in SGLang and vLLM.

The store is one device tier next to the model, sized from memory that is free when the engine
is built:

- model on the CPU: `HOST_FRACTION` of the smaller of the memory available to new allocations
  (``MemAvailable`` in /proc/meminfo) and the room left in the shared-memory filesystem the
  arena lives in, at most `HOST_CAP` bytes. The arena reserves its memory as pages arrive, so
  the capacity is a ceiling, not an allocation: an engine that caches nothing costs one
  reservation step (4 MiB of /dev/shm), and the tier's slot bookkeeping grows with its pages.
- model on a CUDA device: `DEVICE_FRACTION` of that device's free memory
  (``torch.cuda.mem_get_info``), at most `DEVICE_CAP` bytes, allocated at once (as GPU
  KV pools are).

Each engine built without a store gets its own; pages are never shared between engines that
way (give them one `KVStore` to share).
"""

from __future__ import annotations

import logging
import os
from typing import Literal

import torch

from omni._shm import shm_directory
from omni.kv import KVError, KVLayout, KVStore, TierConfig

__all__ = ["DEVICE_CAP", "DEVICE_FRACTION", "HOST_CAP", "HOST_FRACTION", "StoreOption",
           "choose_store", "default_store", "default_store_bytes", "describe_store"]

log = logging.getLogger("omni.compute")

HOST_FRACTION = 0.25  # of the free host memory a CPU engine's default store may grow to
HOST_CAP = 64 << 30
DEVICE_FRACTION = 0.25  # of the free memory of a CUDA engine's device, allocated at once
DEVICE_CAP = 64 << 30

StoreOption = KVStore | None | Literal["auto"]  # what an engine's `store` argument takes


def free_host_bytes() -> int:
    """Memory available to new allocations: ``MemAvailable``, else free physical pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def free_shm_bytes() -> int | None:
    """Room left where arenas live, or None when that filesystem has no fixed size."""
    info = os.statvfs(shm_directory())
    return info.f_bavail * info.f_frsize if info.f_blocks else None


def default_store_bytes(device: torch.device) -> int:
    """The capacity of the default store of an engine whose model is on `device`."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return min(int(free * DEVICE_FRACTION), DEVICE_CAP)
    free = free_host_bytes()
    room = free_shm_bytes()
    if room is not None:
        free = min(free, room)
    return min(int(free * HOST_FRACTION), HOST_CAP)


def default_store(layout: KVLayout, device: torch.device) -> KVStore | None:
    """A one-tier store of `layout` on `device`, `default_store_bytes` large; None (prefix
    caching off, said in the log) when that much memory holds not even one page, or when the
    store cannot be made (e.g. a full /dev/shm): an engine is still built, it recomputes."""
    capacity = default_store_bytes(device)
    if capacity < layout.page_bytes:
        log.warning("prefix caching is off: %d B of free memory hold no KV page of %d B",
                    capacity, layout.page_bytes)
        return None
    try:
        return KVStore(layout, [TierConfig("device", capacity)], device=device)
    except (KVError, OSError, torch.OutOfMemoryError) as exc:
        log.warning("prefix caching is off: the engine's KV store cannot be made: %s", exc)
        return None


def choose_store(store: StoreOption, layout: KVLayout, device: torch.device) -> KVStore | None:
    """The store an engine uses: `store` checked against the model's `layout`, None as given
    (no reuse), or for "auto" the `default_store`.

    Raises:
        ValueError: a store of another layout, or a value that is no `StoreOption`.
    """
    if isinstance(store, str) and store == "auto":
        return default_store(layout, device)
    if store is not None and not isinstance(store, KVStore):
        raise ValueError(f"store must be a KVStore, None or 'auto', got {store!r}")
    if store is not None and store.layout != layout:
        raise ValueError(f"the KV store's layout {store.layout} does not match the model's "
                         f"{layout}")
    return store


def describe_store(store: KVStore | None) -> str:
    """Pages used / held per tier and each tier's capacity, e.g. ``device=3/8192(64MiB)``."""
    if store is None:
        return "none"
    page = store.layout.page_bytes
    return " ".join(f"{name}={tier['pages']}/{tier['capacity']}({_mib(tier['capacity'] * page)})"
                    for name, tier in store.stats().items() if "capacity" in tier)


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.0f}MiB" if num_bytes >= 1 << 20 else f"{num_bytes}B"
