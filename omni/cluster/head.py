"""The cluster's head (``omni cluster start``): membership, heartbeats and placement.

The head is a directory, not a proxy: requests never pass through it. It knows its members
(workers) by name, watches each with heartbeats, and places replicas on them by resources.
Everything it knows is soft state rebuilt from the members' beats: a head that restarts learns
its cluster again within one beat, as members re-register on their own.

- A member registers with `MemberInfo` (its RPC endpoints, its KV event endpoint, host,
  resources) and then beats every `heartbeat_interval` seconds with its `MemberLoad` (what it
  hosts, its KV usage). A beat the head does not recognise (it restarted) makes the member
  register again.
- The head holds an RPC client to every member, heartbeating the other way: a member silent
  for `missed` intervals is lost (logged, dropped from placement, shown as lost in status,
  hosting nothing: its replicas and KV pages went with it).
- Placement (`cluster.place`) spreads a deployment's replicas over the members with the free
  resources it asks for (anti-affinity: the member hosting the fewest replicas of that
  deployment first), or puts them on the member it names (``where=``). The choice is the
  synchronous `place`, over member views; the handler only reserves what it chose.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio

from omni.cluster._reclaim import reclaim_dead_owners
from omni.cluster.errors import ClusterError, NameTaken
from omni.cluster.protocol import (
    HEARTBEAT_S,
    LOST_KEPT_S,
    MISSED_BEATS,
    RESERVATION_S,
    Beat,
    BeatReply,
    MemberInfo,
    MemberLoad,
    MemberView,
    PlaceRequest,
    Register,
    Welcome,
    check_address,
)
from omni.transport.credentials import Credentials
from omni.transport.host import host_id
from omni.transport.rpc import RPCClient, RPCServer

__all__ = ["Head", "place"]

log = logging.getLogger("omni.cluster")

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
                raise NameTaken(f"a worker named '{info.name}' is already a member (pid "
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
        if member is not None:  # lost (not a clean leave): keep it visible in the status,
            # with what it served, but none of the replicas or KV pages that went with it
            load = MemberLoad(requests=current.load.requests, failed=current.load.failed)
            self._lost[name] = MemberView(current.info, "lost", time.time(), load)
            if current.info.host_id == host_id():  # what a killed one left here goes now
                reclaim_dead_owners(f"worker '{name}' lost")


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
