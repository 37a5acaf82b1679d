"""The cluster layer's errors, under `omni.OmniError` like every family."""

from __future__ import annotations

from omni.errors import OmniError
from omni.graph.errors import ReplicaLost

__all__ = ["ClusterError", "HeadUnreachable", "KeptValueLost", "NameTaken", "RemoteNodeError",
           "TokenRefused", "WorkerLost"]


class ClusterError(OmniError):
    """A cluster operation cannot be done as asked (the message says why)."""


class HeadUnreachable(ClusterError):
    """Nothing answers at the head's address."""


class TokenRefused(ClusterError):
    """The head answered but refused this token's credentials."""


class NameTaken(ClusterError):
    """A worker registered under a name another live member holds. A restarted worker whose
    old process the head has not yet found silent gets it too, until the head does."""


class WorkerLost(ClusterError, ReplicaLost):
    """The worker hosting a replica stopped answering while a call was on it, before its
    result (or a stream's next items) came back. A `ReplicaLost`: the scheduler retries the
    call once on a live replica unless a stream had already passed items on."""

    def __init__(self, member: str, detail: str):
        self.member = member
        super().__init__(f"worker '{member}' stopped answering ({detail})")


class KeptValueLost(ClusterError):
    """A worker could not take a node's result kept on another worker (that worker is gone,
    or the value was let go of): raised on the worker, a `WorkerLost` at the driver."""


class RemoteNodeError(ClusterError):
    """A node raised on its worker; `remote_type` is its exception's type name."""

    def __init__(self, member: str, remote_type: str, message: str):
        self.member = member
        self.remote_type = remote_type
        super().__init__(f"{remote_type}: {message} (on worker '{member}')")
