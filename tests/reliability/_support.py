"""What the reliability tests share: a small page layout, pages derived from their keys (so
that "the bytes a request gets equal recomputation" is one comparison), stores, and the
hypothesis settings that keep every count deterministic."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings

from omni.kv import KVLayout, KVStore, TierConfig, block_keys

__all__ = ["LAYOUT", "Tally", "check_pages", "fuzz", "keys_for", "make_store", "page_of",
           "pages_of", "same_bytes"]

# 1 layer x K,V x 4 tokens x 1 head x 4 dims, float32: 128-byte pages.
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, page_size=4, dtype=torch.float32)


def fuzz(examples: int) -> settings:
    """Hypothesis settings for a fixed, repeatable number of examples (the table's counts)."""
    return settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck))


def keys_for(n: int, start: int = 0, extra: str = "reliability") -> list[bytes]:
    """`n` page keys (chained digests of tokens start, start+1, ...)."""
    tokens = range(start * LAYOUT.page_size, (start + n) * LAYOUT.page_size)
    return block_keys(tokens, LAYOUT.page_size, extra=(extra,))


def page_of(key: bytes) -> torch.Tensor:
    """The page a recomputation gives for `key`: bytes derived from the key alone, every bit
    pattern possible (NaNs included: compare with `same_bytes`)."""
    raw = bytearray(hashlib.shake_128(key).digest(LAYOUT.page_bytes))
    return torch.frombuffer(raw, dtype=LAYOUT.dtype).view(LAYOUT.page_shape)


def pages_of(keys: Sequence[bytes]) -> torch.Tensor:
    return torch.stack([page_of(k) for k in keys]) if keys else torch.empty(
        (0, *LAYOUT.page_shape), dtype=LAYOUT.dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return tuple(a.shape) == tuple(b.shape) and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def check_pages(keys: Sequence[bytes], pages: torch.Tensor) -> None:
    """Assert that `pages` are exactly the recomputed pages of `keys`: never another key's."""
    assert len(pages) == len(keys)
    for i, key in enumerate(keys):
        assert same_bytes(pages[i], page_of(key)), f"page {i} ({key.hex()}) is not its own"


def make_store(device: int, host: int = 0, disk: int = 0, path: Path | None = None,
               **kwargs) -> KVStore:
    """A store with tiers of so many pages (a tier of 0 pages is left out)."""
    tiers = [TierConfig("device", device * LAYOUT.page_bytes)]
    if host:
        tiers.append(TierConfig("host", host * LAYOUT.page_bytes))
    if disk:
        from omni.kv.tiers.disk import DiskTier

        tiers.append(TierConfig("disk", disk * DiskTier.slot_bytes_for(LAYOUT), path=path))
    return KVStore(LAYOUT, tiers, **kwargs)


class Tally:
    """Counts outcomes by name: what a test reports in its row."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def __call__(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def __getitem__(self, name: str) -> int:
        return self.counts.get(name, 0)
