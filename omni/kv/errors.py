"""The Data Flow layer's errors."""

from __future__ import annotations

from omni.errors import OmniError

__all__ = ["KVCapacityError", "KVError", "KVLeaseError"]


class KVError(OmniError):
    """Base class of the KV store's errors."""


class KVCapacityError(KVError):
    """No page can be evicted to make room: every candidate is pinned by a lease."""


class KVLeaseError(KVError):
    """A lease or descriptor is unknown, released or expired, or names memory it may not."""
