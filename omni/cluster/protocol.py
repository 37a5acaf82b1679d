"""What travels between the head, workers and drivers: membership messages, addresses, and
the timings everyone shares. Placement and hosting build on these; nothing here does I/O."""

from __future__ import annotations

import re

import msgspec

from omni.cluster.errors import ClusterError, RemoteNodeError
from omni.errors import describe, traceback_text
from omni.transport.host import host_id, ipc_enabled

__all__ = [
    "HEARTBEAT_S", "LOST_KEPT_S", "MISSED_BEATS", "RESERVATION_S", "Beat", "BeatReply",
    "Failure", "MemberInfo", "MemberLoad", "MemberView", "PlaceRequest", "Register", "Welcome",
    "check_address", "endpoint_for", "pick_endpoint",
]

HEARTBEAT_S = 0.5  # seconds between heartbeats, both ways
MISSED_BEATS = 3  # silent intervals before a peer is declared gone
RESERVATION_S = 10.0  # how long a placement holds resources before a beat must confirm it
LOST_KEPT_S = 300.0  # lost members stay in the status this long
_MESSAGE_CHARS = 8192  # a `Failure`'s message is cut to this
_TRACEBACK_CHARS = 32768  # and its traceback to its last this many characters
_ADDRESS = re.compile(r"^tcp://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5}|\*)$")


def check_address(address: str, *, bind: bool = False) -> str:
    """`address` as a ZeroMQ TCP endpoint (``host:port`` gains ``tcp://``).

    Raises:
        ClusterError: not ``tcp://HOST:PORT`` (``*`` as the port only when binding).
    """
    full = address if "://" in address else f"tcp://{address}"
    match = _ADDRESS.match(full)
    if match is None or (match.group(2) == "*" and not bind):
        raise ClusterError(f"not a cluster address: {address!r} (expected tcp://HOST:PORT)")
    if match.group(2) != "*" and not 0 < int(match.group(2)) < 65536:
        raise ClusterError(f"port out of range in {address!r}")
    return full


# -- what travels ---------------------------------------------------------------------------


class MemberInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Who a member is and what it offers. `resources` holds ``cpu``, ``gpu`` and
    ``memory`` (bytes); `kv_capacity` the bytes of each KV tier it offers."""

    name: str
    rpc: str
    host_id: str
    pid: int
    resources: dict[str, float] = {}
    kv_capacity: dict[str, int] = {}
    kv_events: str = ""  # the endpoint of its KV event publisher, once it has a store
    ipc: str = ""  # its unix:// endpoint for processes of its host (no CURVE: see endpoint_for)
    lane: str = ""  # a worker's lane for chains' stages on its host (`omni.transport.lane`)


def endpoint_for(info: MemberInfo) -> str:
    """Where this process reaches `info`: its unix:// endpoint when both share a host (the
    socket lives in a 0700 folder, so the filesystem is the authentication, and nothing
    crosses the network stack), else its TCP endpoint with CURVE."""
    return pick_endpoint(info.rpc, info.ipc, info.host_id)


def pick_endpoint(rpc: str, ipc: str, host: str) -> str:
    """`endpoint_for` a member known by its TCP endpoint, Unix endpoint and host."""
    return ipc if ipc and host == host_id() and ipc_enabled() else rpc


class MemberLoad(msgspec.Struct, frozen=True):
    """What a member hosts now: deployment id -> (node name, resources per replica), its KV
    store's counters per tier, and the requests it served."""

    deployments: dict[str, tuple[str, dict[str, float]]] = {}
    kv: dict[str, dict[str, int]] = {}
    requests: int = 0
    failed: int = 0


class Register(msgspec.Struct, frozen=True):
    info: MemberInfo
    load: MemberLoad


class Welcome(msgspec.Struct, frozen=True):
    head_epoch: str
    heartbeat_interval: float


class Beat(msgspec.Struct, frozen=True):
    info: MemberInfo  # it may change (a KV event endpoint appears with the first store)
    load: MemberLoad


class BeatReply(msgspec.Struct, frozen=True):
    known: bool
    head_epoch: str


class MemberView(msgspec.Struct, frozen=True):
    """A member as the head sees it: ``state`` is "up" or "lost"; `since` (wall-clock seconds)
    when it joined or was lost."""

    info: MemberInfo
    state: str
    since: float
    load: MemberLoad


class PlaceRequest(msgspec.Struct, frozen=True):
    """Place `replicas` replicas of `deployment` (numbered from `first_replica`), each needing
    `resources`: on member `where` when given, never on a member named in `avoid`."""

    deployment: str
    node: str
    replicas: int
    resources: dict[str, float] = {}
    where: str | None = None
    first_replica: int = 0
    avoid: tuple[str, ...] = ()


class Failure(msgspec.Struct, frozen=True):
    """Why a worker could not do what a driver asked (``node.deploy``): the error's type
    name, message and traceback text, trio's exception groups unwrapped (`describe`). Why
    not the RPC's own error reply: it carries a type name and a message only, and whoever
    debugs a replica that would not start on a worker needs the worker's traceback."""

    remote_type: str
    message: str
    traceback: str = ""

    @classmethod
    def of(cls, error: BaseException) -> Failure:
        """`error`'s, as raised here (message and traceback cut short)."""
        remote_type, message = describe(error)
        return cls(remote_type, message[:_MESSAGE_CHARS], traceback_text(error, _TRACEBACK_CHARS))

    def error(self, member: str) -> RemoteNodeError:
        """The error the driver raises for it, naming worker `member`."""
        return RemoteNodeError(member, self.remote_type, self.message,
                               remote_traceback=self.traceback)
