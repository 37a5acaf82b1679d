"""Data Flow: a paged KV cache across device, host and disk tiers.

`block_keys` names pages by their tokens (chained digests); `KVStore` keeps one copy of each
page, evicting device -> host -> disk under a pluggable policy, pins pages under leases, and
hands them to other processes of the machine as `PageDescriptor`s that `open_descriptor`
maps without a copy. The store is synchronous and thread-safe; `await store.prefetch(keys)`
keeps disk reads off the event loop.
"""

from omni.kv.errors import KVCapacityError, KVError, KVLeaseError
from omni.kv.handle import Lease, OpenedPages, PageDescriptor, open_descriptor
from omni.kv.keys import MediaSpan, block_keys, media_digest
from omni.kv.layout import KVLayout, parse_size
from omni.kv.policy import EvictionPolicy, LFUPolicy, LRUPolicy, make_policy
from omni.kv.store import KVConfig, KVStore, TierConfig

__all__ = [
    "EvictionPolicy", "KVCapacityError", "KVConfig", "KVError", "KVLayout", "KVLeaseError",
    "KVStore", "LFUPolicy", "LRUPolicy", "Lease", "MediaSpan", "OpenedPages", "PageDescriptor",
    "TierConfig", "block_keys", "make_policy", "media_digest", "open_descriptor", "parse_size",
]
