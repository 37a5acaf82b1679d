"""The Data Flow layer's errors."""

from __future__ import annotations

from omni.errors import OmniError

__all__ = ["KVCapacityError", "KVError", "KVLeaseError", "KVTierError"]


class KVError(OmniError):
    """Base class of the KV store's errors."""


class KVCapacityError(KVError):
    """No page can be evicted to make room: every candidate is pinned by a lease."""


class KVLeaseError(KVError):
    """A lease or descriptor is unknown, released or expired, or names memory it may not."""


class KVTierError(KVError, ValueError):
    """A tier cannot be made as configured (its folder, its size, the memory it needs);
    `tier` names it."""

    def __init__(self, tier: str, message: str):
        super().__init__(message)
        self.tier = tier
