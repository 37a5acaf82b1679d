"""`omni.context()`: what a node body can know about the call it is serving."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any

__all__ = ["Context", "context"]

# (request_id, node name, replica index, runtime); a tuple because it is set on every node call.
current: contextvars.ContextVar[tuple[str | None, str, int | None, Any] | None] = (
    contextvars.ContextVar("omni_context", default=None))


@dataclass(frozen=True, slots=True)
class Context:
    """The request a node serves, the node's name, its replica index (None for a function node
    without replicas), the process's KV store (None when the Runtime has none) and the
    Runtime. In a class node's ``__init__``, `request_id` is None."""

    request_id: str | None
    node: str
    replica: int | None
    kv: Any
    runtime: Any


def context() -> Context:
    """The `Context` of the node call this code runs in.

    Raises:
        RuntimeError: called outside a node body (or outside a class node's constructor).
    """
    value = current.get()
    if value is None:
        raise RuntimeError("omni.context() is only available inside a node")
    request_id, node, replica, runtime = value
    return Context(request_id, node, replica, getattr(runtime, "kv", None), runtime)
