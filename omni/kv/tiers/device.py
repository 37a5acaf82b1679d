"""The device tier: the pages engines compute with, on the GPU when there is one."""

from __future__ import annotations

import torch

from omni.kv.layout import KVLayout
from omni.kv.tiers.memory import MemoryTier, create_arena

__all__ = ["DeviceTier"]


class DeviceTier(MemoryTier):
    """The top tier. On CUDA a plain device tensor; without CUDA a CPU pool in the shared
    arena ``omni-{store_id}-device``, so the CPU form can hand pages to other processes too."""

    @classmethod
    def create(cls, layout: KVLayout, num_slots: int, store_id: str,
               device: torch.device | str | None = None) -> DeviceTier:
        """A device tier of `num_slots` pages on `device` (default: CUDA if available, else CPU).

        Raises:
            ValueError: no slot, or a `store_id` that is not 8 to 32 lowercase hex digits.
        """
        if num_slots < 1:
            raise ValueError(f"tier 'device' holds no page: num_slots={num_slots}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type != "cpu":
            return cls("device", layout, num_slots, arena=None, device=device)
        arena = create_arena(f"omni-{store_id}-device", layout, num_slots)
        return cls("device", layout, num_slots, arena=arena, device=device)
