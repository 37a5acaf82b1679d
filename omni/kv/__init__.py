"""Data Flow: a paged KV cache across device, host and disk tiers.

`block_keys` names pages by their tokens (chained digests); `KVStore` keeps one copy of each
page, evicting device -> host -> disk under a pluggable policy, pins pages under leases, and
hands them to other processes of the machine as `PageDescriptor`s that `open_descriptor`
maps without a copy. The store is synchronous and thread-safe; `await store.prefetch(keys)`
keeps disk reads off the event loop.

Names load on first use: importing a torch-free part (`omni.kv.errors`,
`omni.kv.descriptors`, which the transport's movers carry) does not load torch with the store.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omni.kv.descriptors import PageDescriptor
    from omni.kv.errors import KVCapacityError, KVError, KVLeaseError
    from omni.kv.handle import Lease, OpenedPages, open_descriptor
    from omni.kv.keys import MediaSpan, block_keys, media_digest
    from omni.kv.layout import KVLayout, parse_size
    from omni.kv.policy import EvictionPolicy, LFUPolicy, LRUPolicy, make_policy
    from omni.kv.store import KVConfig, KVStore, TierConfig

_HOMES = {
    "omni.kv.descriptors": ["PageDescriptor"],
    "omni.kv.errors": ["KVCapacityError", "KVError", "KVLeaseError"],
    "omni.kv.handle": ["Lease", "OpenedPages", "open_descriptor"],
    "omni.kv.keys": ["MediaSpan", "block_keys", "media_digest"],
    "omni.kv.layout": ["KVLayout", "parse_size"],
    "omni.kv.policy": ["EvictionPolicy", "LFUPolicy", "LRUPolicy", "make_policy"],
    "omni.kv.store": ["KVConfig", "KVStore", "TierConfig"],
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [
    "EvictionPolicy", "KVCapacityError", "KVConfig", "KVError", "KVLayout", "KVLeaseError",
    "KVStore", "LFUPolicy", "LRUPolicy", "Lease", "MediaSpan", "OpenedPages", "PageDescriptor",
    "TierConfig", "block_keys", "make_policy", "media_digest", "open_descriptor", "parse_size",
]


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'omni.kv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
