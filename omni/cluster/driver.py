"""A driver's link to a cluster: ``omni.Runtime(cluster=ADDRESS)`` and ``omni run --cluster``.

The driver runs the graph's scheduler and its function nodes itself; each class node's replicas
are placed by the head on workers (by ``resources=`` and ``where=``) and built there. Calls go
straight from the driver to the worker hosting the replica; the head is never on the path.

It also keeps the replicas: a replica whose worker stops answering is marked dead at once, and
a repair task places a replacement, on the same worker when it rejoins or on another with room.
Calls wait for it rather than fail: a call that finds every replica of its node dead waits up
to `replace_timeout` seconds for one to be placed again (then fails with `NoLiveReplica`
naming the node and the timeout), and a call in flight on the lost worker fails with
`WorkerLost`, which the scheduler retries once on a live replica (a `ReplicaLost`; not a
stream that had passed items on). The head
spreads a node's replicas over the workers; when a worker joins (or rejoins) while another
hosts two or more replicas of a node and it hosts none, the repair task moves one there: the
new replica takes the old one's place in the pool, and the old one is undeployed once its calls
in flight are done (none fails for the move). ``min_workers`` makes the first placement wait
until that many workers are members. For
``balance="kv_aware"`` it follows the workers' KV events in a `KVDirectory` and binds the pool's
balancer to it, with the call's page keys from the node class's ``kv_keys`` static method.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import secrets
from collections import Counter
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import msgspec
import trio

from omni.cluster._code import code_ref, module_kv_layout
from omni.cluster._reclaim import reclaim_dead_owners
from omni.cluster.chains import ChainEnds, address_towards
from omni.cluster.errors import ClusterError
from omni.cluster.membership import ClientSet, HeadCluster, Membership, Roster
from omni.cluster.protocol import (
    HEARTBEAT_S,
    Failure,
    MemberInfo,
    PlaceRequest,
    endpoint_for,
)
from omni.cluster.remote import (
    Deploy,
    KeptReleases,
    RemoteReplica,
    Renew,
    RequestTrail,
    WorkerAddress,
)
from omni.graph.balance import REPLACE_TIMEOUT_S, CallInfo, Pool, Replica
from omni.graph.errors import NodeError
from omni.transport.credentials import Credentials
from omni.transport.errors import RPCError, TransportError
from omni.transport.host import host_id
from omni.transport.movers import payload_mover
from omni.transport.rpc import RPCClient
from omni.transport.values import cannot_travel, encode_value

__all__ = ["ClusterLink", "default_token_path"]

log = logging.getLogger("omni.cluster.driver")

REPAIR_S = 1.0  # seconds between looks for dead replicas to replace
RENEW_S = 5.0  # seconds between renewals of this driver's replicas (workers drop them at 30)


def default_token_path() -> Path:
    """``$OMNI_TOKEN_FILE``, else ``$XDG_CONFIG_HOME/omni/cluster.token`` (~/.config)."""
    explicit = os.environ.get("OMNI_TOKEN_FILE")
    if explicit:
        return Path(explicit)
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(Path.home(), ".config")
    return Path(config) / "omni" / "cluster.token"


class _Placed:
    """A pool whose replicas live on workers, with what it takes to rebuild one. `settled`:
    the members (name, pid) for which the head found no room to spread it further, so that
    the repair task asks again only once the members change."""

    def __init__(self, pool: Pool, node: Any, deployment: str):
        self.pool = pool
        self.node = node
        self.deployment = deployment
        self.settled: frozenset[tuple[str, int]] | None = None


class _Tracked(RemoteReplica):
    """A remote replica that counts its calls in flight. Why: a replica moved to another
    worker leaves the pool at once, but calls that already hold it run on; it may be
    undeployed only once they are done (`wait_idle`), and the pool's counters are per slot,
    shared by the old instance and the new one, so they cannot tell."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.num_calls = 0
        self._idle = trio.lowlevel.ParkingLot()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = super().__call__(*args, **kwargs)
        return self._counted_stream(call) if self.streaming else self._counted_call(call)

    async def _counted_call(self, call: Any) -> Any:
        self.num_calls += 1
        try:
            return await call
        finally:
            self._left()

    async def omni_chain(self, request_id: str, args: tuple, kwargs: dict[str, Any],
                         later: Sequence[_Tracked], *, keep: bool) -> tuple[Any, list[float]]:
        stages = (self, *later)
        for replica in stages:
            replica.num_calls += 1
        try:
            return await super().omni_chain(request_id, args, kwargs, later, keep=keep)
        finally:
            for replica in stages:
                replica._left()

    async def _counted_stream(self, stream: Any) -> Any:
        self.num_calls += 1
        try:
            async for item in stream:
                yield item
        finally:
            try:
                await stream.aclose()
            finally:
                self._left()

    def _left(self) -> None:
        self.num_calls -= 1
        if self.num_calls == 0 and self._idle:  # (someone waits for it to be idle)
            self._idle.unpark_all()

    async def wait_idle(self) -> None:
        """Return once no call is in flight on this replica."""
        while self.num_calls:
            await self._idle.park()


class ClusterLink:
    """See the module docstring. Made by the `Runtime`; `run` lives in its host nursery.

    Args:
        cluster: the cluster (a `Membership`: `HeadCluster`, `omni.cluster.ray.RayCluster`),
            or the address of a head that workers joined by hand.
        token_file: with an address, the cluster's token file (default: `default_token_path`).
        kv_layout: the `KVLayout` the workers' stores use for this driver's nodes, or None.
        wait_for_workers: seconds a deployment waits for workers to join before failing.
        min_workers: workers that must be members before the first replica is placed (within
            `wait_for_workers`), so that the first deployments spread over all of them.
        replace_timeout: seconds a call waits for a replacement when every replica of its
            node is on a worker that is gone, before it fails with `NoLiveReplica`.

    Raises:
        ValueError: `min_workers` or `replace_timeout` is negative.
    """

    def __init__(self, cluster: str | Membership, *,
                 token_file: str | os.PathLike[str] | None = None,
                 kv_layout: Any = None, wait_for_workers: float = 10.0, min_workers: int = 0,
                 replace_timeout: float = REPLACE_TIMEOUT_S,
                 heartbeat_interval: float = HEARTBEAT_S):
        if min_workers < 0:
            raise ValueError(f"min_workers must be >= 0, got {min_workers!r}")
        if not replace_timeout >= 0:  # NaN too
            raise ValueError(f"replace_timeout must be >= 0 seconds, got {replace_timeout!r}")
        self.replace_timeout = replace_timeout
        if isinstance(cluster, str):
            cluster = HeadCluster(cluster, token_file if token_file is not None
                                  else default_token_path())
        self.cluster = cluster
        self.kv_layout = kv_layout
        self.wait_for_workers = wait_for_workers
        self.min_workers = min_workers
        self.heartbeat_interval = heartbeat_interval
        self._num_members = 0  # as last counted while waiting for `min_workers`
        self._retiring: list[_Tracked] = []  # moved out of their pools, draining
        self.directory: Any = None
        self.session = secrets.token_hex(4)
        self._deployments = itertools.count(1)
        self._placed: list[_Placed] = []
        self._head: RPCClient | None = None
        self._clients: ClientSet | None = None
        self._roster: Roster | None = None
        self._creds: Credentials | None = None
        self.chains: ChainEnds | None = None  # where chains end, while running
        self._stopping = trio.Event()
        self._nursery: trio.Nursery | None = None
        self.mover = payload_mover()
        # which workers served each request, so that its KV follows it (none without KV)
        self.trail = RequestTrail() if kv_layout is not None else None
        self.releases = KeptReleases()  # results kept on workers that this driver let go of

    def stop(self) -> None:
        """End `run`: it undeploys this driver's replicas (for at most 2 s), then returns."""
        self._stopping.set()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Connect to the head; `task_status.started()` once it answers; serve until cancelled.

        Raises:
            HeadUnreachable, TokenRefused: (`ClusterError`) the head is not there or refuses us.
        """
        async with self.cluster.connect() as (address, creds):
            self._creds = creds
            head = RPCClient(address, ctx=creds.ctx, options=creds.client_options(),
                             heartbeat_interval=self.heartbeat_interval, timeout=10.0)
            async with head, trio.open_nursery() as nursery:
                self._nursery = nursery
                self._head = head
                self._clients = ClientSet(creds, nursery,
                                          heartbeat_interval=self.heartbeat_interval)
                self._roster = Roster(head, interval=self.heartbeat_interval)
                self.chains = ChainEnds(self.session, creds, host=address_towards(address),
                                         interval=self.heartbeat_interval, mover=self.mover,
                                         releases=self.releases)
                try:
                    await nursery.start(self.chains.run)
                    self._roster.members = await self._roster.refresh()
                    await nursery.start(self._follow_kv)
                    nursery.start_soon(self._repair)
                    nursery.start_soon(self._renew)
                    task_status.started()
                    await self._stopping.wait()
                finally:
                    # also when cancelled (Ctrl-C): the workers let go of this driver now,
                    # not once its session's lease runs out
                    with trio.move_on_after(2.0, shield=True):
                        await self._undeploy_all()
                    self._clients.close()
                    nursery.cancel_scope.cancel()
                    reclaim_dead_owners("the driver is ending")

    # -- deployment --------------------------------------------------------------------------

    async def deploy(self, node: Any) -> Pool:
        """Place and build `node`'s replicas on workers; the pool that calls them."""
        _check_travels(node)
        deployment = f"{self.session}-{next(self._deployments)}-{node.name}"
        replicas = [await self._place_one(node, deployment, i)
                    for i in range(node.options.replicas)]
        options = node.options
        pool = Pool(node.name, replicas, balancer=options.balance,
                    concurrency=options.concurrency, max_queue=options.max_queue,
                    replace_timeout=self.replace_timeout)
        keys = getattr(node.target, "kv_keys", None)
        if hasattr(pool.balancer, "bind"):
            keys_of = None if keys is None else functools.partial(_call_keys, keys)
            pool.balancer.bind(self.directory, keys_of)
        self._placed.append(_Placed(pool, node, deployment))
        return pool

    async def _place_one(self, node: Any, deployment: str, replica: int, *,
                         avoid: Collection[str] = ()) -> _Tracked:
        """Have the head place replica `replica` (on none of `avoid`) and build it there."""
        assert self._head is not None and self._clients is not None
        assert self.chains is not None
        avoid = set(avoid) | self._retiring_on(deployment, replica)
        request = PlaceRequest(deployment, node.name, 1, dict(node.options.resources or {}),
                               node.options.where, first_replica=replica,
                               avoid=tuple(sorted(avoid)))
        member = await self._placement(node, request)
        client = await self._clients.connect(member.name, endpoint_for(member))
        body = Deploy(deployment, replica, node.name, code_ref(node.target),
                      encode_value([list(node.init_args), node.init_kwargs]),
                      dict(node.options.resources or {}), self.session, self._layout_spec(),
                      module_kv_layout(node.target), host_id(), node.options.concurrency,
                      self.chains.address)
        try:
            failure = await client.call("node.deploy", body, timeout=120.0,
                                        result_type=Failure | None)
        except RPCError as exc:
            failure = Failure(exc.remote_type, exc.remote_message)
        if failure is not None:  # the node's own error, raised as it started on the worker
            raise NodeError(node.name, "startup", failure.error(member.name))
        assert self._nursery is not None
        return _Tracked(member.name, client, deployment, replica, node.streaming,
                        mover=self.mover, same_host=member.host_id == host_id(),
                        session=self.session, nursery=self._nursery, trail=self.trail,
                        address=WorkerAddress(member.name, member.rpc, member.ipc,
                                              member.host_id, _lane_of(node, member)),
                        releases=self.releases, chains=self.chains)

    async def _placement(self, node: Any, request: PlaceRequest) -> MemberInfo:
        """The worker the head picks, waiting up to `wait_for_workers` for one to join (and,
        before the first placement, for `min_workers` to)."""
        assert self._head is not None
        with trio.move_on_after(self.wait_for_workers):
            await self._wait_min_workers()
            while True:
                try:
                    (member,) = await self._head.call("cluster.place", request,
                                                      result_type=list[MemberInfo])
                    return member
                except RPCError as exc:
                    if "no workers" not in exc.remote_message:
                        raise NodeError(node.name, "startup",
                                        ClusterError(exc.remote_message)) from None
                await trio.sleep(self.heartbeat_interval)
        if self._num_members < self.min_workers:
            raise NodeError(node.name, "startup", ClusterError(
                f"only {self._num_members} of the {self.min_workers} workers asked for "
                f"(min_workers) joined {self.cluster.description} within "
                f"{self.wait_for_workers:g} s"))
        raise NodeError(node.name, "startup", ClusterError(
            f"no worker joined {self.cluster.description} within "
            f"{self.wait_for_workers:g} s"))

    async def _wait_min_workers(self) -> None:
        """Until the head has `min_workers` members; from then on (repairs) it never waits."""
        assert self._roster is not None
        while self._num_members < self.min_workers:
            try:
                self._num_members = len(await self._roster.refresh())
            except TransportError:
                pass  # the head does not answer yet: ask again
            if self._num_members < self.min_workers:
                await trio.sleep(self.heartbeat_interval)

    def _layout_spec(self) -> dict[str, Any] | None:
        if self.kv_layout is None:
            return None
        return msgspec.structs.asdict(self.kv_layout.to_spec())

    async def _undeploy_all(self) -> None:
        """Drop this driver's replicas, then end its session on each of their workers, which
        then lets go of the payload segments and mappings it kept for this driver (else it
        would keep them until the session's lease ran out); and drop our mappings of their
        segments. (Not `forget`: the mover is the process's, and another runtime here may be
        calling the same workers.)"""
        proxies = [r.instance for p in self._placed for r in p.pool.replicas]
        members: dict[str, Any] = {}
        for proxy in [*proxies, *self._retiring]:
            if proxy.alive:
                members[proxy.member] = proxy.client
                try:
                    await proxy.client.call("node.undeploy", [proxy.deployment,
                                                              proxy.replica], timeout=1.0)
                except TransportError:
                    pass  # the worker drops replicas of drivers that are gone anyway
        for member, client in members.items():
            try:
                ours = await client.call(
                    "node.leave", Renew(self.session, self.mover.take_releases(member)),
                    timeout=1.0, result_type=list[int])
            except TransportError:
                ours = []  # the worker ends the session when it stops being renewed
            self.mover.release(member, ours)
            self.mover.unmap(member)

    # -- keeping replicas --------------------------------------------------------------------

    async def _repair(self) -> None:
        """Replace replicas whose worker is gone, as soon as the head can place them; spread
        replicas crowded on one worker to workers that joined (`_rebalance`). Moved replicas
        drain in this task's nursery."""
        async with trio.open_nursery() as draining:
            while not self._stopping.is_set():
                await trio.sleep(REPAIR_S)
                for placed in list(self._placed):
                    if self._stopping.is_set():
                        break
                    await self._replace_dead(placed)
                    await self._rebalance(placed, draining)

    async def _replace_dead(self, placed: _Placed) -> None:
        """Place a replacement for each dead replica of `placed` (calls wait for them)."""
        pool = placed.pool
        if pool.stats().waiting_for_replica:
            pool.wake()  # a replica whose worker answered again serves them without a move
        for replica in pool.replicas:
            if replica.alive:
                continue
            try:
                assert self._roster is not None and self._clients is not None
                proxy = await self._place_one(placed.node, placed.deployment, replica.index,
                                              avoid=_silent(self._roster.members,
                                                            self._clients.get))
            except (NodeError, TransportError) as exc:
                log.debug("cannot replace %s yet: %s", replica.instance, exc)
                continue
            log.info("replica %d of '%s' now on worker '%s'", replica.index,
                     placed.node.name, proxy.member)
            pool.replace(replica.index, proxy)

    async def _rebalance(self, placed: _Placed, draining: trio.Nursery) -> None:
        """Move one replica off a worker crowded with `placed`'s replicas to a member that
        hosts none, if the head finds one with room (not for nodes pinned with ``where=``)."""
        if placed.node.options.where is not None or self._roster is None:
            return
        members = self._roster.members
        identity = frozenset((name, view.info.pid) for name, view in members.items())
        replica = _crowded(placed.pool.replicas, members)
        if replica is None or placed.settled == identity:
            return
        old = replica.instance
        avoid = {r.member for r in placed.pool.replicas if r.member is not None}
        try:
            new = await self._place_one(placed.node, placed.deployment, replica.index,
                                        avoid=avoid)
        except (NodeError, TransportError) as exc:
            log.info("'%s' stays as it is: %s", placed.node.name, exc)
            placed.settled = identity  # until the members change
            return
        placed.pool.replace(replica.index, new)
        log.info("replica %d of '%s' moved from worker '%s' to '%s'", replica.index,
                 placed.node.name, old.member, new.member)
        self._retiring.append(old)
        draining.start_soon(self._retire, old)

    async def _retire(self, proxy: _Tracked) -> None:
        """Undeploy a replica moved out of its pool once its calls in flight are done."""
        try:
            await proxy.wait_idle()
            if proxy.alive:
                try:
                    await proxy.client.call("node.undeploy", [proxy.deployment, proxy.replica],
                                            timeout=5.0)
                except TransportError:
                    pass  # the worker drops replicas of drivers that are gone anyway
        finally:
            self._retiring.remove(proxy)

    def _retiring_on(self, deployment: str, replica: int) -> set[str]:
        """Workers still draining replica `replica` of `deployment`: a new one placed there
        would share its worker-side name and be undeployed with it."""
        return {p.member for p in self._retiring
                if p.deployment == deployment and p.replica == replica}

    async def _renew(self) -> None:
        """Tell the workers hosting this driver's replicas that it is still there."""
        while True:
            await trio.sleep(RENEW_S)
            proxies = [r.instance for p in self._placed for r in p.pool.replicas]
            members = {proxy.member: proxy.client for proxy in [*proxies, *self._retiring]
                       if proxy.alive}
            for member, client in members.items():
                released = self.mover.take_releases(member)
                try:
                    ours = await client.call(
                        "node.renew", Renew(self.session, released, self.releases.take(member)),
                        timeout=RENEW_S, result_type=list[int])
                except TransportError:
                    continue  # a lost worker: the repair task deals with it
                self.mover.release(member, ours)

    async def _follow_kv(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The KV directory of the workers' stores, for KV-aware balancing."""
        from omni.cluster.kv_follow import follow_members, kv_directory

        assert self._clients is not None and self._roster is not None and self._creds
        async with kv_directory(self._creds, self._clients) as directory:
            self.directory = directory
            await follow_members(self._roster, self._clients, directory,
                                 task_status=task_status)


def _crowded(replicas: Sequence[Replica], members: Collection[str]) -> Replica | None:
    """The replica to move when every replica is alive, a worker hosts two or more of them
    and a member in `members` hosts none: on the most crowded worker (the last by name among
    equals), the least loaded (the highest index among equals). None otherwise."""
    if not replicas or not all(r.alive for r in replicas):
        return None
    hosts = Counter(r.member for r in replicas)
    if not set(members) - set(hosts):
        return None
    crowded, count = max(hosts.items(), key=lambda item: (item[1], item[0] or ""))
    if count < 2:
        return None
    return min((r for r in replicas if r.member == crowded), key=lambda r: (r.load, -r.index))


def _silent(members: dict[str, Any], client_of: Any) -> set[str]:
    """The members (name -> `MemberView`, as the head lists them) whose client here
    (`client_of(name)`) found them silent at the endpoint the head still gives: the head
    notices a loss a beat or so after a driver may, and a replacement placed there would fail.
    A worker restarted under the same name has a new endpoint, so it is not avoided."""
    silent = set()
    for name, view in members.items():
        client = client_of(name)
        if client is not None and not client.peer_alive \
                and client.endpoint == endpoint_for(view.info):
            silent.add(name)
    return silent


def _check_travels(node: Any) -> None:
    """Refuse a node whose parameters or result are annotated with what cannot cross to a
    worker, naming the parameter and the type (before anything is placed)."""
    for name, annotation in node.hints.items():
        reason = cannot_travel(annotation)
        if reason is not None:
            what = "its result" if name == "return" else f"parameter '{name}'"
            raise NodeError(node.name, "startup", TypeError(
                f"{what} cannot cross to a cluster worker: {reason}"))


def _call_keys(kv_keys: Any, call: CallInfo) -> list[bytes]:
    return list(kv_keys(*call.args, **call.kwargs))


def _lane_of(node: Any, member: MemberInfo) -> str:
    """The lane a replica of `node` on `member` takes its chains' stages on: the worker's, for
    a synchronous node that runs one call at a time (its default), as the lane runs them; ''
    for the others, whose stages go to the worker's event loop (an async node's run there, and
    one with more calls at once runs them in as many threads)."""
    return member.lane if not node.is_async and node.options.concurrency == 1 else ""

