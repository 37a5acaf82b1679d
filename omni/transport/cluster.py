"""Cluster membership: the head, and each member's link to it.

The head (``omni cluster start``) is a directory, not a proxy: requests never pass through it.
It knows its members (workers) by name, watches each with heartbeats, and places replicas on
them by resources. Everything it knows is soft state rebuilt from the members' beats: a head
that restarts learns its cluster again within one beat, as members re-register on their own.

- A member registers with `MemberInfo` (its RPC endpoint, its KV event endpoint, host,
  resources) and then beats every `heartbeat_interval` seconds with its `MemberLoad` (what it
  hosts, its KV usage). A beat the head does not recognise (it restarted) makes the member
  register again.
- The head holds an RPC client to every member, heartbeating the other way: a member silent
  for `missed` intervals is lost (logged, dropped from placement, shown as lost in status).
- Placement (`cluster.place`) spreads a deployment's replicas over the members with the free
  resources it asks for (anti-affinity: the member hosting the fewest replicas of that
  deployment first), or puts them on the member it names (``where=``). The choice is the
  synchronous `place`, over member views; the handler only reserves what it chose.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio
import zmq

from omni.transport._host import host_id, ipc_enabled
from omni.transport.credentials import Credentials
from omni.transport.errors import PeerGone, RPCError, RPCTimeout, TransportError
from omni.transport.rpc import RPCClient, RPCServer

__all__ = [
    "HEARTBEAT_S", "MISSED_BEATS", "ClientSet", "ClusterError", "Head", "HeadLink",
    "HeadUnreachable", "MemberInfo", "MemberLoad", "MemberView", "PlaceRequest", "Roster",
    "TokenRefused", "check_address", "endpoint_for", "place", "probe",
]

log = logging.getLogger("omni.cluster")

HEARTBEAT_S = 0.5  # seconds between heartbeats, both ways
MISSED_BEATS = 3  # silent intervals before a peer is declared gone
RESERVATION_S = 10.0  # how long a placement holds resources before a beat must confirm it
LOST_KEPT_S = 300.0  # lost members stay in the status this long
_ADDRESS = re.compile(r"^tcp://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5}|\*)$")


class ClusterError(TransportError):
    """A cluster operation cannot be done as asked (the message says why)."""


class HeadUnreachable(ClusterError):
    """Nothing answers at the head's address."""


class TokenRefused(ClusterError):
    """The head answered but refused this token's credentials."""


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
    ipc: str = ""  # its ipc:// endpoint for processes of its host (no CURVE: see endpoint_for)


def endpoint_for(info: MemberInfo) -> str:
    """Where this process reaches `info`: its ipc:// endpoint when both share a host (the
    socket lives in a 0700 folder, so the filesystem is the authentication, and nothing
    crosses the network stack), else its TCP endpoint with CURVE."""
    if info.ipc and info.host_id == host_id() and ipc_enabled():
        return info.ipc
    return info.rpc


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


# -- the head -------------------------------------------------------------------------------


@dataclass
class _Member:
    """A member as the head keeps it. Why `reserved`: a placement takes effect on the member
    only once the driver has deployed there and a beat reports it; until then (at most
    `RESERVATION_S`) the head counts it here, keyed like the beat's ``DEPLOYMENT/REPLICA``,
    as (expiry, node, resources)."""

    info: MemberInfo
    load: MemberLoad
    joined: float
    done: trio.Event = field(default_factory=trio.Event)
    client: RPCClient | None = None
    reserved: dict[str, tuple[float, str, dict[str, float]]] = field(default_factory=dict)

    def view(self) -> MemberView:
        """This member as placement sees it: its reservations count as hosted replicas."""
        deployments = dict(self.load.deployments)
        for key, (_, node, resources) in self.reserved.items():
            deployments.setdefault(key, (node, resources))
        load = msgspec.structs.replace(self.load, deployments=deployments)
        return MemberView(self.info, "up", self.joined, load)


class Head:
    """The cluster's head: membership, heartbeats and placement (see the module docstring).

    Args:
        creds: this process's credentials (CURVE on every socket when it holds a token).
        bind: the address to serve on (``tcp://HOST:*`` picks a free port).
        heartbeat_interval / missed: seconds between heartbeats, and how many missed ones make
            a member lost.
    """

    def __init__(self, creds: Credentials, bind: str, *, heartbeat_interval: float = HEARTBEAT_S,
                 missed: int = MISSED_BEATS):
        self.creds = creds
        self.bind = check_address(bind, bind=True)
        self.epoch = secrets.token_hex(8)
        self.heartbeat_interval = heartbeat_interval
        self.missed = missed
        self.endpoint: str | None = None
        self._members: dict[str, _Member] = {}
        self._lost: dict[str, MemberView] = {}
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; `task_status.started(endpoint)` once bound.

        Raises:
            TransportError: the address cannot be bound (the message says why).
        """
        server = RPCServer(self.bind, ctx=self.creds.ctx, options=self.creds.server_options())
        server.register("cluster.register", self._register, body_type=Register)
        server.register("cluster.beat", self._beat, body_type=Beat)
        server.register("cluster.leave", self._leave, body_type=str)
        server.register("cluster.members", self._members_view, body_type=Any)
        server.register("cluster.place", self._place, body_type=PlaceRequest)
        async with server, trio.open_nursery() as nursery:
            self._nursery = nursery
            self.endpoint = server.endpoint
            log.info("head serving at %s", self.endpoint)
            task_status.started(self.endpoint)
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None
                for member in self._members.values():
                    member.done.set()

    def members(self) -> list[MemberView]:
        """Every member, up ones first, then those lost recently."""
        up = [MemberView(m.info, "up", m.joined, m.load) for m in self._members.values()]
        cutoff = time.time() - LOST_KEPT_S
        lost = [v for v in self._lost.values() if v.since >= cutoff and v.info.name not in
                self._members]
        return up + lost

    # -- handlers ----------------------------------------------------------------------------

    async def _register(self, body: Register) -> Welcome:
        info = body.info
        old = self._members.get(info.name)
        if old is not None:
            same = old.info.pid == info.pid and old.info.host_id == info.host_id
            if not same and old.client is not None and old.client.peer_alive:
                raise ClusterError(f"a worker named '{info.name}' is already a member (pid "
                                   f"{old.info.pid} at {old.info.rpc}); pick another --name")
            self._drop(info.name, None)
        member = self._members[info.name] = _Member(info, body.load, time.time())
        self._lost.pop(info.name, None)
        assert self._nursery is not None
        self._nursery.start_soon(self._watch, member)
        log.info("worker '%s' joined from %s (pid %d)", info.name, info.rpc, info.pid)
        return Welcome(self.epoch, self.heartbeat_interval)

    async def _beat(self, body: Beat) -> BeatReply:
        member = self._members.get(body.info.name)
        known = member is not None and member.info.pid == body.info.pid
        if known:
            member.info, member.load = body.info, body.load
            now = trio.current_time()
            member.reserved = {d: r for d, r in member.reserved.items()
                               if d not in body.load.deployments and r[0] > now}
        return BeatReply(known, self.epoch)

    async def _leave(self, name: str) -> bool:
        if name in self._members:
            log.info("worker '%s' left", name)
            self._drop(name, None)
            return True
        return False

    async def _members_view(self, _: Any) -> list[MemberView]:
        return self.members()

    async def _place(self, body: PlaceRequest) -> list[MemberInfo]:
        names = place(body, [m.view() for m in self._members.values()])
        expiry = trio.current_time() + RESERVATION_S
        for offset, name in enumerate(names):
            key = f"{body.deployment}/{body.first_replica + offset}"
            self._members[name].reserved[key] = (expiry, body.node, dict(body.resources))
        return [self._members[name].info for name in names]

    # -- watching ----------------------------------------------------------------------------

    async def _watch(self, member: _Member) -> None:
        """Heartbeat a member from the head's side; drop it once it is silent too long."""
        client = RPCClient(member.info.rpc, ctx=self.creds.ctx,
                           options=self.creds.client_options(),
                           heartbeat_interval=self.heartbeat_interval,
                           missed_heartbeats=self.missed)
        async with client:
            member.client = client
            while not member.done.is_set():
                if not client.peer_alive:
                    silent = self.heartbeat_interval * self.missed
                    log.warning("worker '%s' lost: no heartbeat for %.1f s",
                                member.info.name, silent)
                    self._drop(member.info.name, member)
                    break
                with trio.move_on_after(self.heartbeat_interval / 4):
                    await member.done.wait()

    def _drop(self, name: str, member: _Member | None) -> None:
        current = self._members.get(name)
        if current is None or (member is not None and current is not member):
            return
        del self._members[name]
        current.done.set()
        if member is not None:  # lost (not a clean leave): keep it visible in the status
            self._lost[name] = MemberView(current.info, "lost", time.time(), current.load)


# -- placement (synchronous: no I/O) ----------------------------------------------------------


def place(request: PlaceRequest, members: Sequence[MemberView]) -> list[str]:
    """The members to host `request`'s replicas: one name per replica, in order.

    Each replica goes, among the members allowed (``where``, ``avoid``) with the free
    resources it needs, to the one hosting the fewest replicas of the request's deployment,
    then the fewest replicas overall, then the first by name; each choice counts in the next.
    A member's hosted replicas are its ``load.deployments`` (keys ``DEPLOYMENT/REPLICA``),
    which should include what the head reserved there. Members not "up" are skipped.

    Raises:
        ClusterError: there are no members ("the cluster has no workers"), ``where`` names
            none of them, or no allowed member has the resources (the message says what is
            free where).
    """
    up = {m.info.name: m for m in members if m.state == "up"}
    if not up:
        raise ClusterError("the cluster has no workers (start one with `omni cluster join`)")
    if request.where is not None and request.where not in up:
        raise ClusterError(f"node '{request.node}' asks for worker '{request.where}', which "
                           f"is not a member (members: {', '.join(sorted(up))})")
    allowed = [m for name, m in sorted(up.items())
               if (request.where is None or name == request.where) and name not in request.avoid]
    slots = [_Slot.of(m, request.deployment) for m in allowed]
    chosen: list[str] = []
    for _ in range(request.replicas):
        fits = [s for s in slots if s.fits(request.resources)]
        if not fits:  # say what was free before this request
            raise ClusterError(_no_fit(request, [_Slot.of(m, request.deployment)
                                                 for m in allowed]))
        slot = min(fits, key=lambda s: (s.num_here, s.num_replicas, s.name))
        slot.take(request.resources)
        chosen.append(slot.name)
    return chosen


@dataclass
class _Slot:
    """One candidate member during a `place` call. Why: the call places replicas one after
    another, and each must see the ones it chose before (counts and resources)."""

    name: str
    free: dict[str, float]
    offered: dict[str, float]
    num_here: int  # replicas of the deployment being placed
    num_replicas: int  # replicas of any deployment

    @classmethod
    def of(cls, view: MemberView, deployment: str) -> _Slot:
        hosted = view.load.deployments
        offered = dict(view.info.resources)
        free = dict(offered)
        for _, resources in hosted.values():
            for name, amount in resources.items():
                free[name] = free.get(name, 0.0) - amount
        here = sum(1 for key in hosted if key.rpartition("/")[0] == deployment)
        return cls(view.info.name, free, offered, here, len(hosted))

    def fits(self, resources: dict[str, float]) -> bool:
        return all(self.free.get(name, 0.0) >= amount - 1e-9
                   for name, amount in resources.items() if amount > 0)

    def take(self, resources: dict[str, float]) -> None:
        for name, amount in resources.items():
            self.free[name] = self.free.get(name, 0.0) - amount
        self.num_here += 1
        self.num_replicas += 1


def _no_fit(request: PlaceRequest, slots: list[_Slot]) -> str:
    wants = ", ".join(f"{k}={v:g}" for k, v in request.resources.items()) or "no resources"
    have = "; ".join(
        f"{s.name}: " + ", ".join(f"{k} {s.free.get(k, 0):g}/{s.offered.get(k, 0):g} free"
                                  for k in request.resources) for s in slots)
    if request.avoid:
        have = "; ".join(filter(None, [have, f"not on {', '.join(sorted(request.avoid))}"]))
    return (f"no worker can host {request.replicas} replica(s) of '{request.node}' needing "
            f"{wants} ({have})")


# -- a member's side ------------------------------------------------------------------------


class HeadLink:
    """A member's registration with the head, renewed across head restarts.

    Args:
        creds: the member's credentials.
        address: the head's address.
        info: the member's `MemberInfo` (called at each registration: it may change).
        load: the member's current `MemberLoad` (called at each beat).
    """

    def __init__(self, creds: Credentials, address: str, info: Callable[[], MemberInfo],
                 load: Callable[[], MemberLoad], *, heartbeat_interval: float = HEARTBEAT_S):
        self.address = check_address(address)
        self.creds = creds
        self._info = info
        self._load = load
        self.heartbeat_interval = heartbeat_interval
        self.head_epoch: str | None = None
        self.registrations = 0
        self.connected = False

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Register, then beat until cancelled; `task_status.started()` once registered.

        Raises:
            ClusterError: the head refused the first registration (e.g. the name is taken).
        """
        client = RPCClient(self.address, ctx=self.creds.ctx,
                           options=self.creds.client_options(),
                           heartbeat_interval=self.heartbeat_interval, timeout=5.0)
        async with client:
            self.client = client
            await self._register(client)
            task_status.started()
            while True:
                await trio.sleep(self.heartbeat_interval)
                try:
                    reply = await client.call("cluster.beat", Beat(self._info(), self._load()),
                                              result_type=BeatReply)
                except (PeerGone, RPCTimeout):
                    if self.connected:
                        log.warning("head at %s not answering; waiting for it", self.address)
                    self.connected = False
                    continue
                if not reply.known or reply.head_epoch != self.head_epoch:
                    log.info("head at %s restarted; registering again", self.address)
                    try:
                        await self._register(client)
                    except (PeerGone, RPCTimeout, ClusterError) as exc:
                        log.warning("registering again failed: %s", exc)

    async def _register(self, client: RPCClient) -> None:
        try:
            welcome = await client.call("cluster.register", Register(self._info(), self._load()),
                                        result_type=Welcome)
        except RPCError as exc:
            raise ClusterError(exc.remote_message) from None
        self.head_epoch = welcome.head_epoch
        self.registrations += 1
        self.connected = True

    async def leave(self) -> None:
        """Tell the head this member is going (best effort, bounded)."""
        client = getattr(self, "client", None)
        if client is None:
            return
        with trio.move_on_after(1.0):
            try:
                await client.call("cluster.leave", self._info().name, timeout=1.0)
            except TransportError:
                pass


class ClientSet:
    """RPC clients to members, by name; each lives in `nursery` until dropped or replaced."""

    def __init__(self, creds: Credentials, nursery: trio.Nursery, *,
                 heartbeat_interval: float = HEARTBEAT_S, missed: int = MISSED_BEATS):
        self.creds = creds
        self.heartbeat_interval = heartbeat_interval
        self.missed = missed
        self._nursery = nursery
        self._clients: dict[str, tuple[RPCClient, trio.CancelScope]] = {}

    def get(self, name: str) -> RPCClient | None:
        entry = self._clients.get(name)
        return entry[0] if entry is not None else None

    def names(self) -> list[str]:
        return list(self._clients)

    async def connect(self, name: str, endpoint: str) -> RPCClient:
        """The client to `name` at `endpoint` (a new one if the endpoint changed)."""
        entry = self._clients.get(name)
        if entry is not None:
            if entry[0].endpoint == endpoint:
                return entry[0]
            self.drop(name)
        options = {} if endpoint.startswith("ipc://") else self.creds.client_options()
        client = RPCClient(endpoint, ctx=self.creds.ctx, options=options,
                           heartbeat_interval=self.heartbeat_interval,
                           missed_heartbeats=self.missed)
        scope = await self._nursery.start(_hold, client)
        self._clients[name] = (client, scope)
        return client

    def drop(self, name: str) -> None:
        entry = self._clients.pop(name, None)
        if entry is not None:
            entry[1].cancel()

    def close(self) -> None:
        for name in list(self._clients):
            self.drop(name)


async def _hold(client: RPCClient, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    with trio.CancelScope() as scope:
        async with client:
            task_status.started(scope)
            await trio.sleep_forever()


class Roster:
    """The cluster's members as last heard from the head, refreshed every `interval` seconds.

    `run` calls `on_change(members)` (name -> `MemberView`, up members only) whenever the set
    of members or an endpoint changes; a head that does not answer leaves the last view as is.
    """

    def __init__(self, client: RPCClient, *, interval: float = HEARTBEAT_S):
        self.client = client
        self.interval = interval
        self.members: dict[str, MemberView] = {}
        self._changed = trio.Event()

    async def refresh(self) -> dict[str, MemberView]:
        """Ask the head now; the up members (raises `TransportError` if it does not answer)."""
        views = await self.client.call("cluster.members", None, result_type=list[MemberView],
                                       timeout=max(self.interval * 4, 2.0))
        return {v.info.name: v for v in views if v.state == "up"}

    async def run(self, on_change: Callable[[dict[str, MemberView]], Any]) -> None:
        while True:
            try:
                members = await self.refresh()
            except TransportError:
                members = self.members
            if _identity(members) != _identity(self.members):
                self.members = members
                result = on_change(members)
                if hasattr(result, "__await__"):
                    await result
                self._changed.set()
                self._changed = trio.Event()
            else:
                self.members = members
            await trio.sleep(self.interval)

    async def wait_changed(self) -> None:
        await self._changed.wait()


def _identity(members: dict[str, MemberView]) -> set[tuple[str, str, int, str]]:
    return {(n, v.info.rpc, v.info.pid, v.info.kv_events) for n, v in members.items()}


# -- probing --------------------------------------------------------------------------------


def _probe_sync(creds: Credentials, address: str, timeout: float) -> str:
    from zmq.utils.monitor import recv_monitor_message

    sock = creds.ctx.socket(zmq.DEALER)
    sock.linger = 0
    for option, value in creds.client_options().items():
        sock.setsockopt(option, value)
    monitor = sock.get_monitor_socket()
    outcome, connected = "unreachable", False
    try:
        sock.connect(address)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not monitor.poll(int(left * 1000) + 1):
                continue
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return "ok"
            if event == zmq.EVENT_CONNECTED:
                connected = True
            elif event & (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                          | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
                return "refused"
        return "silent" if connected else outcome
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)


async def probe(creds: Credentials, address: str, *, timeout: float = 5.0) -> None:
    """Check that a head answers at `address` and accepts these credentials.

    Raises:
        HeadUnreachable: nothing accepts connections there within `timeout`.
        TokenRefused: something answers, but the handshake with this token fails.
    """
    address = check_address(address)
    outcome = await trio.to_thread.run_sync(_probe_sync, creds, address, timeout)
    if outcome == "unreachable":
        raise HeadUnreachable(f"no cluster head answers at {address} (waited {timeout:g} s)")
    if outcome in ("refused", "silent"):
        raise TokenRefused(f"the cluster head at {address} refused this token (use the head's "
                           "token file: --token-file)")
