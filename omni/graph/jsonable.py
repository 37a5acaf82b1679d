"""Values flowing through graphs as plain JSON: what ``omni run --json`` prints and what
``omni serve`` answers. Common non-JSON values (bytes, numpy arrays, torch tensors,
dataclasses) are converted without importing numpy or torch."""

from __future__ import annotations

import base64
import dataclasses
import json
import math
from typing import Any

__all__ = ["to_jsonable"]


def to_jsonable(value: Any) -> Any:
    """`value` as plain JSON values: containers recursively, bytes as base64 text, arrays and
    tensors as (nested) lists, dataclasses as objects, non-finite floats and anything else as
    ``str(value)``."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {_key(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return _from_array(value)


def _key(key: Any) -> str:
    return key if isinstance(key, str) else json.dumps(to_jsonable(key)).strip('"')


def _from_array(value: Any) -> Any:
    """numpy arrays and scalars, torch tensors: by duck typing, so neither is imported here."""
    package = type(value).__module__.partition(".")[0]
    if package == "torch" and hasattr(value, "detach"):
        return to_jsonable(value.detach().cpu().tolist())
    if package == "numpy" and hasattr(value, "tolist"):
        return to_jsonable(value.tolist())
    return str(value)
