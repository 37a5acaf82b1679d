"""Page storage by tier: device memory, the host shared-memory arena, disk.

Tiers hold pages in numbered slots and know nothing of keys' placement; the tier manager
(`omni.kv.manager`) decides what goes where.
"""

from omni.kv.tiers.base import Tier
from omni.kv.tiers.device import DeviceTier
from omni.kv.tiers.disk import DiskTier
from omni.kv.tiers.host import HostTier
from omni.kv.tiers.memory import MemoryTier, slots_for

__all__ = ["DeviceTier", "DiskTier", "HostTier", "MemoryTier", "Tier", "slots_for"]
