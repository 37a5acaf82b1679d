"""Sizes as users write them ("8GiB"); torch-free, for the CLI and cluster members."""

from __future__ import annotations

import re
from decimal import Decimal

__all__ = ["parse_size"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as "512MiB", "8GiB", "1.5GB" or "4096".

    Raises:
        ValueError: not a size, or negative.
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative: {value}")
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {value!r} (try e.g. 512MiB, 8GiB, 4096)")
    return int(Decimal(match.group(1)) * _UNITS[match.group(2).lower()])
