"""The cluster layer's errors, under `omni.OmniError` like every family."""

from __future__ import annotations

from omni.errors import OmniError, RemoteError
from omni.graph.errors import ReplicaLost

__all__ = ["ClusterError", "HeadUnreachable", "KeptValueLost", "LayoutMismatch", "NameTaken",
           "RemoteNodeError", "TokenRefused", "WorkerLost"]


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


class LayoutMismatch(ClusterError):
    """A worker's import of a node's module gives its ``KV_LAYOUT`` another value than the
    driver's did (the module reads an environment the worker was not started with): raised
    on the worker as the replica is deployed, before it is built."""


class RemoteNodeError(ClusterError, RemoteError):
    """A node raised on its worker; `remote_type` is its exception's type name and
    `remote_message` its message. `remote_traceback` is the worker's traceback text (empty
    when it sent none), also added as a note, so that a printed traceback (``--debug``)
    shows it under this error."""

    def __init__(self, member: str, remote_type: str, message: str, *,
                 remote_traceback: str = ""):
        self.member = member
        self.remote_type = remote_type
        self.remote_message = message
        self.remote_traceback = remote_traceback
        super().__init__(f"{remote_type}: {message} (on worker '{member}')")
        if remote_traceback:
            self.add_note(f"on worker '{member}':\n{remote_traceback.rstrip()}")

