"""What every tier offers the tier manager: numbered page slots, and copies in and out."""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["Tier"]


class Tier(Protocol):
    """Fixed-size storage for `num_slots` pages of one `KVLayout`.

    The tier keeps no bookkeeping of which slot holds which key: the tier manager does. A
    memory tier's methods are called with the store's lock held, from any thread. The disk
    tier's `write` and `read_into` are called without it (`omni.kv.transfers`), possibly from
    several threads at once, each on a slot reserved for that one call.
    """

    name: str  # "device", "host" or "disk"
    num_slots: int

    def write(self, slot: int, page: torch.Tensor, key: bytes) -> None:
        """Copy one page (a tensor of the layout's page shape, any device) into `slot`.

        `key` is the page's 16-byte key. A wrong page shape or dtype raises ValueError, a slot
        out of range IndexError.

        Raises OSError when the bytes cannot be stored (a disk that is full); the slot then
        holds nothing valid.
        """

    def read_into(self, slot: int, out: torch.Tensor, key: bytes) -> bool:
        """Copy the page in `slot` into `out`; False if it fails verification (disk: a bad
        checksum, or a header naming another key). `out` is then undefined."""

    def close(self) -> None:
        """Free the tier's memory or files. Idempotent."""
