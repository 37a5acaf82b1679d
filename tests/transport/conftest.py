"""Fixtures of the transport tests."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def folder() -> Iterator[Path]:
    """A short private folder for Unix sockets (a socket's path has a 108-byte limit),
    emptied and removed after the test."""
    path = Path(tempfile.mkdtemp(prefix="omni-t-", dir="/tmp"))
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()
