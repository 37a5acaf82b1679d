"""Fixtures for the tier tests: unique store ids, and a check that no arena file is left behind."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
import torch

from omni._shm import shm_directory
from omni.kv.layout import KVLayout


@pytest.fixture
def layout() -> KVLayout:
    """A small layout: pages of 2*2*4*2*8 float16 = 512 bytes."""
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float16)


@pytest.fixture
def store_id() -> Iterator[str]:
    """A fresh store id; after the test, no arena of that store may remain in /dev/shm."""
    value = secrets.token_hex(8)
    yield value
    leftovers = sorted(p.name for p in shm_directory().glob(f"omni-{value}-*"))
    assert leftovers == [], f"arena files left behind: {leftovers}"
