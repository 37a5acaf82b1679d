"""Hosting one replica of a class node: what the local runtime and a cluster worker share.

Why one function: a replica's life is the same wherever it lives. Its instance is built with
``omni.context()`` naming the node and the replica (``request_id`` None), entered if it is an
async context manager (with the same context), handed to whoever started it, and held until
`stop` is set; then it is exited in the same task that entered it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from omni.graph.context import CallContext, current

__all__ = ["call_shape", "host_replica"]


def call_shape(cls: type, name: str) -> tuple[bool, bool]:
    """Whether the calls of class node `cls` (named `name`) stream (an async generator) and
    whether they are async: how a replica hosted elsewhere is called."""
    from omni.graph._node import Node, NodeOptions

    node = Node(cls, NodeOptions(), name, kind="class")
    return node.streaming, node.is_async


async def host_replica(build: Callable[[], Any], context: CallContext,
                       stop: trio.Event, *, in_thread: bool = False,
                       wrap_error: Callable[[Exception], Exception] | None = None,
                       task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Build, enter and hold one instance until `stop`; `task_status.started(instance)`.

    Args:
        build: makes the instance (the class bound to its arguments).
        context: what ``omni.context()`` says while it is built (``request_id`` None).
        in_thread: build it in a worker thread (a worker's event loop keeps answering).
        wrap_error: what an error building or entering the instance is raised as.

    Raises:
        Exception: what building or entering the instance raised (wrapped by `wrap_error`).
    """
    current.set(context)  # this task's own context (trio copies it per task): it ends here
    try:
        instance = await trio.to_thread.run_sync(build) if in_thread else build()
        entered = hasattr(instance, "__aenter__") and hasattr(instance, "__aexit__")
        if entered:
            await instance.__aenter__()
    except Exception as exc:
        if wrap_error is None:
            raise
        raise wrap_error(exc) from exc
    if not entered:
        task_status.started(instance)
        await stop.wait()
        return
    try:
        task_status.started(instance)
        await stop.wait()
    except BaseException as exc:
        if not await instance.__aexit__(type(exc), exc, exc.__traceback__):
            raise
    else:
        await instance.__aexit__(None, None, None)
