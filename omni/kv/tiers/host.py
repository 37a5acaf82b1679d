"""The host tier: pages in a shared-memory arena, page-locked for CUDA when there is one."""

from __future__ import annotations

import torch

from omni.kv.layout import KVLayout
from omni.kv.tiers.memory import MemoryTier, create_arena

__all__ = ["HostTier"]


class HostTier(MemoryTier):
    """The middle tier: the arena ``omni-{store_id}-host``, which processes on the node map to
    read pages without a copy through a socket."""

    @classmethod
    def create(cls, layout: KVLayout, num_slots: int, store_id: str) -> HostTier:
        """A host tier of `num_slots` pages, pinned-registered when CUDA is available.

        Raises:
            ValueError: no slot, or a `store_id` that is not 8 to 32 lowercase hex digits.
            FileExistsError: the store's host arena exists already.
        """
        if num_slots < 1:
            raise ValueError(f"tier 'host' holds no page: num_slots={num_slots}")
        arena = create_arena(f"omni-{store_id}-host", layout, num_slots)
        try:
            arena.pin()
            return cls("host", layout, num_slots, arena=arena, device=torch.device("cpu"))
        except BaseException:
            arena.close()
            raise
