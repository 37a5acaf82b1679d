"""The node `perf/gpu_check.py` runs on its cluster worker (the worker loads this file's
source): it reads the last element of the CUDA tensor it was given, on its own GPU, so that a
call's time is the cost of handing the tensor over."""

from __future__ import annotations

from typing import Any

import omni

__all__ = ["Receive"]


@omni.node
class Receive:
    """Returns the tensor's device and its last element."""

    async def __call__(self, value: Any) -> dict[str, Any]:
        return {"device": str(value.device), "last": float(value.reshape(-1)[-1])}
