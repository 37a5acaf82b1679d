"""The Control Flow layer's errors: one for graphs that cannot be built, one family for requests."""

from __future__ import annotations

from omni.errors import OmniError, summary

__all__ = ["GraphError", "InputError", "NodeError", "ReplicaLost", "RouteError", "StageError",
           "lost_midway"]


class GraphError(OmniError):
    """A graph does not validate; raised when the graph is built, never while it runs.

    Cycles, unknown or missing arguments, switch branches with different signatures and
    annotated types that cannot connect all raise it. `node` names the node whose call built
    the bad edge and `location` is the ``file:line`` of that call (either may be None).
    """

    def __init__(self, message: str, *, node: str | None = None, location: str | None = None):
        self.message = message
        self.node = node
        self.location = location
        prefix = f"{location}: " if location else ""
        where = f"node '{node}': " if node else ""
        super().__init__(f"{prefix}{where}{message}")


class InputError(OmniError, TypeError):
    """A request's inputs do not match the graph: an unknown name, or a required one missing."""


class NodeError(OmniError):
    """A node failed, which fails its request (and only that request).

    `node` is the node's name, `request_id` the request it ran for and `__cause__` (also
    `cause`) the exception the node raised.
    """

    def __init__(self, node: str, request_id: str, cause: BaseException):
        self.node = node
        self.request_id = request_id
        self.cause = cause
        super().__init__(f"node '{node}' failed in request {request_id}: {summary(cause)}")
        self.__cause__ = cause

    def __reduce__(self):  # keep the error picklable for logging and multiprocessing
        return (type(self), (self.node, self.request_id, self.cause))


class RouteError(NodeError):
    """`omni.switch` got a selector value that names no branch; fails that request only."""

    def __init__(self, node: str, request_id: str, cause: BaseException):
        super().__init__(node, request_id, cause)


class ReplicaLost(OmniError):
    """The process hosting a replica went away while a call was on it, before the call's
    result (or, for a stream, its first item) came back.

    Raised by replicas that live in other processes (the cluster's `WorkerLost` is one).
    Nothing of the call reached its consumers, and whatever it did inside the lost process
    went with it, so the scheduler retries it once on a live replica, waiting for a
    replacement if there is none yet (see `omni.graph.balance.Pool`), even for a node without
    ``retries``. A stream that had passed items on is not retried: it fails with this error,
    `items_passed` saying how many (0 for a call lost before anything came back); the request
    is then run again from the start where nothing of it reached its caller
    (`omni.Runtime.run`).
    """

    items_passed: int = 0


class StageError(OmniError):
    """A chain of class-node calls run in other processes as one (`omni.graph._plan.Step.chain`)
    failed at stage `stage` (0: its first) with `cause`, that stage's own error; the scheduler
    reports it as that stage's node failing."""

    def __init__(self, stage: int, cause: BaseException):
        self.stage = stage
        self.cause = cause
        super().__init__(f"stage {stage} of a chain failed: {summary(cause)}")

    def __reduce__(self):
        return (type(self), (self.stage, self.cause))


def lost_midway(exc: NodeError) -> bool:
    """Whether `exc` failed its request only because a node's stream was lost with the process
    hosting its replica after passing items on (`ReplicaLost.items_passed`; a call lost before
    anything came back was retried already). Such a request may run again from its start
    wherever nothing of it has reached its caller: `omni.Runtime.run`, a served reply not yet
    sent."""
    cause = exc.cause
    return isinstance(cause, ReplicaLost) and cause.items_passed > 0
