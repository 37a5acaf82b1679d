"""The cluster layer: a head that knows the members and places replicas (`head`), workers that
host them (`worker`), and the driver's link that deploys and calls them (`driver`, `remote`).
Who runs the workers is the backend's (`membership.Membership`): hand-joined (``omni cluster
join``, `membership.HeadCluster`) or Ray (`ray.RayCluster`, imported only when asked for: Ray is
an optional install).

It sits above `omni.graph` (whose pools it fills with remote replicas) and `omni.transport`
(sockets, RPC, values and payload movers); neither imports it. `omni.Runtime(cluster=...)`
plugs the driver's placement into the graph runtime.
"""

from omni.cluster.driver import ClusterLink, default_token_path
from omni.cluster.errors import (
    ClusterError,
    HeadUnreachable,
    LayoutMismatch,
    NameTaken,
    RemoteNodeError,
    TokenRefused,
    WorkerLost,
)
from omni.cluster.head import Head, place
from omni.cluster.membership import ClientSet, HeadCluster, HeadLink, Membership, Roster, probe
from omni.cluster.protocol import (
    HEARTBEAT_S,
    MemberInfo,
    MemberLoad,
    MemberView,
    PlaceRequest,
    check_address,
    endpoint_for,
)
from omni.cluster.remote import RemoteReplica
from omni.cluster.worker import KVTiers, Worker

__all__ = [
    "HEARTBEAT_S", "ClientSet", "ClusterError", "ClusterLink", "Head", "HeadCluster", "HeadLink",
    "HeadUnreachable", "KVTiers", "LayoutMismatch", "MemberInfo", "MemberLoad", "MemberView",
    "Membership", "NameTaken", "PlaceRequest",
    "RemoteNodeError", "RemoteReplica", "Roster", "TokenRefused", "Worker", "WorkerLost",
    "check_address", "default_token_path", "endpoint_for", "place", "probe",
]
