"""`omni.context()`: what a node body can know about the call it is serving."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import msgspec

if TYPE_CHECKING:
    from omni.kv import KVStore

__all__ = ["CallContext", "Context", "NodeHost", "context", "current"]


class NodeHost(Protocol):
    """What serves a node call, as node code sees it (``omni.context().runtime``): the graph
    `omni.Runtime` in the process that runs the graph, or the cluster worker hosting a class
    node's replica. Node code may rely on `kv` alone; anything else is that host's own."""

    @property
    def kv(self) -> KVStore | None:
        """The process's KV store; None when the host has none."""
        ...

    def note_progress(self, node: str, request_id: str | None, done: int, total: int) -> None:
        """Record that a call of `node` for `request_id` has done `done` of `total` steps
        (`Context.progress`); safe from any thread."""
        ...


class CallContext(msgspec.Struct, frozen=True, kw_only=True):
    """The node call being served, as `current` holds it (`context` builds the public view).

    Why a keyword-only msgspec Struct: it is built on every node call, on the scheduler's hot
    path, and a Struct is built in C. Set and reset with keywords, it measured about 30 ns more
    than a bare tuple, where a NamedTuple took about 400 ns more and a frozen slots dataclass
    about 750 ns more, against the ~1.1 us a hop costs in ``perf/scheduler.py``. Keywords only,
    so that every site that sets the context names each field and none can be misplaced.
    `request_id` is None while a class node's replica is being built (no request yet)."""

    request_id: str | None
    node: str
    replica: int | None
    runtime: NodeHost
    # only class nodes take this call's value (`omni.graph._plan.Step.keep`): a replica in
    # another process may keep it there and hand back a reference to it
    keep: bool = False


# Set, around each node call and each replica's construction, by whoever runs it: the
# scheduler, the replica host (`omni.graph.hosting`) and a cluster worker.
current: contextvars.ContextVar[CallContext | None] = (
    contextvars.ContextVar("omni_context", default=None))


@dataclass(frozen=True, slots=True)
class Context:
    """The request a node serves, the node's name, its replica index (None for a function node
    without replicas), the process's KV store (None when the Runtime has none) and the
    Runtime. In a class node's ``__init__``, `request_id` is None."""

    request_id: str | None
    node: str
    replica: int | None
    kv: KVStore | None
    runtime: NodeHost

    def progress(self, done: int, total: int) -> None:
        """Report that this call has done `done` of its `total` steps (a denoising loop,
        after each step): the runtime's ``/metrics`` counts them (``omni_node_steps_total``,
        ``omni_node_steps_remaining``). Safe from a worker thread, where such loops run.

        Raises:
            ValueError: not ints with 0 <= done <= total and total >= 1.
        """
        self.runtime.note_progress(self.node, self.request_id, done, total)


def context() -> Context:
    """The `Context` of the node call this code runs in.

    Raises:
        RuntimeError: called outside a node body (or outside a class node's constructor).
    """
    call = current.get()
    if call is None:
        raise RuntimeError("omni.context() is only available inside a node")
    return Context(call.request_id, call.node, call.replica, call.runtime.kv, call.runtime)
