"""A driver's link to a cluster: ``omni.Runtime(cluster=ADDRESS)`` and ``omni run --cluster``.

The driver runs the graph's scheduler and its function nodes itself; each class node's replicas
are placed by the head on workers (by ``resources=`` and ``where=``) and built there. Calls go
straight from the driver to the worker hosting the replica; the head is never on the path.

It also keeps the replicas: a replica whose worker stops answering is marked dead at once (calls
on it fail with `WorkerLost`, retried elsewhere for nodes with ``retries``), and a repair task
places a replacement, on the same worker when it rejoins or on another with room. For
``balance="kv_aware"`` it follows the workers' KV events in a `KVDirectory` and binds the pool's
balancer to it, with the call's page keys from the node class's ``kv_keys`` static method.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import secrets
from pathlib import Path
from typing import Any

import msgspec
import trio

from omni.graph._code import code_ref
from omni.graph.balance import CallInfo, Pool
from omni.graph.errors import NodeError
from omni.graph.remote import Deploy, RemoteReplica
from omni.transport.cluster import (
    HEARTBEAT_S,
    ClientSet,
    ClusterError,
    MemberInfo,
    PlaceRequest,
    Roster,
    check_address,
    probe,
)
from omni.transport.credentials import Credentials
from omni.transport.errors import RPCError, TransportError
from omni.transport.rpc import RPCClient
from omni.transport.values import encode_value

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
    """A pool whose replicas live on workers, with what it takes to rebuild one."""

    def __init__(self, pool: Pool, node: Any, deployment: str):
        self.pool = pool
        self.node = node
        self.deployment = deployment


class ClusterLink:
    """See the module docstring. Made by the `Runtime`; `run` lives in its host nursery.

    Args:
        address: the head's address.
        token_file: the cluster's token file (default: `default_token_path`).
        kv_layout: the `KVLayout` the workers' stores use for this driver's nodes, or None.
        wait_for_workers: seconds a deployment waits for workers to join before failing.
    """

    def __init__(self, address: str, *, token_file: str | os.PathLike[str] | None = None,
                 kv_layout: Any = None, wait_for_workers: float = 10.0,
                 heartbeat_interval: float = HEARTBEAT_S):
        self.address = check_address(address)
        self.token_file = Path(token_file) if token_file is not None else default_token_path()
        self.kv_layout = kv_layout
        self.wait_for_workers = wait_for_workers
        self.heartbeat_interval = heartbeat_interval
        self.directory: Any = None
        self.session = secrets.token_hex(4)
        self._deployments = itertools.count(1)
        self._placed: list[_Placed] = []
        self._head: RPCClient | None = None
        self._clients: ClientSet | None = None
        self._roster: Roster | None = None
        self._creds: Credentials | None = None
        self._stopping = trio.Event()

    def stop(self) -> None:
        """End `run`: it undeploys this driver's replicas (for at most 2 s), then returns."""
        self._stopping.set()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Connect to the head; `task_status.started()` once it answers; serve until cancelled.

        Raises:
            HeadUnreachable, TokenRefused: (`ClusterError`) the head is not there or refuses us.
        """
        if not self.token_file.exists():
            raise ClusterError(f"no token file at {self.token_file}: pass the head's token file "
                               "(token_file= or --token-file)")
        with Credentials.from_token_file(self.token_file) as creds:
            self._creds = creds
            await probe(creds, self.address)
            head = RPCClient(self.address, ctx=creds.ctx, options=creds.client_options(),
                             heartbeat_interval=self.heartbeat_interval, timeout=10.0)
            async with head, trio.open_nursery() as nursery:
                self._head = head
                self._clients = ClientSet(creds, nursery,
                                          heartbeat_interval=self.heartbeat_interval)
                self._roster = Roster(head, interval=self.heartbeat_interval)
                try:
                    self._roster.members = await self._roster.refresh()
                    await nursery.start(self._follow_kv)
                    nursery.start_soon(self._repair)
                    nursery.start_soon(self._renew)
                    task_status.started()
                    await self._stopping.wait()
                    with trio.move_on_after(2.0):
                        await self._undeploy_all()
                finally:
                    self._clients.close()
                    nursery.cancel_scope.cancel()

    # -- deployment --------------------------------------------------------------------------

    async def deploy(self, node: Any) -> Pool:
        """Place and build `node`'s replicas on workers; the pool that calls them."""
        deployment = f"{self.session}-{next(self._deployments)}-{node.name}"
        replicas = [await self._place_one(node, deployment, i)
                    for i in range(node.options.replicas)]
        options = node.options
        pool = Pool(node.name, replicas, balancer=options.balance,
                    concurrency=options.concurrency, max_queue=options.max_queue)
        keys = getattr(node.target, "kv_keys", None)
        if hasattr(pool.balancer, "bind"):
            keys_of = None if keys is None else functools.partial(_call_keys, keys)
            pool.balancer.bind(self.directory, keys_of)
        self._placed.append(_Placed(pool, node, deployment))
        return pool

    async def _place_one(self, node: Any, deployment: str, replica: int) -> RemoteReplica:
        assert self._head is not None and self._clients is not None
        request = PlaceRequest(f"{deployment}#{replica}", node.name, 1,
                               dict(node.options.resources or {}), node.options.where)
        member = await self._placement(node, request)
        client = await self._clients.connect(member.name, member.rpc)
        body = Deploy(deployment, replica, node.name, code_ref(node.target),
                      encode_value([list(node.init_args), node.init_kwargs]),
                      dict(node.options.resources or {}), self.session, self._layout_spec())
        try:
            await client.call("node.deploy", body, timeout=120.0)
        except RPCError as exc:
            raise NodeError(node.name, "startup", ClusterError(
                f"{exc.remote_type}: {exc.remote_message} (on worker '{member.name}')")) \
                from None
        return RemoteReplica(member.name, client, deployment, replica, node.streaming)

    async def _placement(self, node: Any, request: PlaceRequest) -> MemberInfo:
        """The worker the head picks, waiting up to `wait_for_workers` for one to join."""
        assert self._head is not None
        with trio.move_on_after(self.wait_for_workers):
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
        raise NodeError(node.name, "startup", ClusterError(
            f"no worker joined the cluster at {self.address} within "
            f"{self.wait_for_workers:g} s"))

    def _layout_spec(self) -> dict[str, Any] | None:
        if self.kv_layout is None:
            return None
        return msgspec.structs.asdict(self.kv_layout.to_spec())

    async def _undeploy_all(self) -> None:
        for placed in self._placed:
            for replica in placed.pool.replicas:
                proxy = replica.instance
                if proxy.alive:
                    try:
                        await proxy.client.call("node.undeploy", [proxy.deployment,
                                                                  proxy.replica], timeout=1.0)
                    except TransportError:
                        pass  # the worker drops replicas of drivers that are gone anyway

    # -- keeping replicas --------------------------------------------------------------------

    async def _repair(self) -> None:
        """Replace replicas whose worker is gone, as soon as the head can place them."""
        while True:
            await trio.sleep(REPAIR_S)
            for placed in self._placed:
                for replica in placed.pool.replicas:
                    if replica.alive:
                        continue
                    try:
                        proxy = await self._place_one(placed.node, placed.deployment,
                                                      replica.index)
                    except (NodeError, TransportError) as exc:
                        log.debug("cannot replace %s yet: %s", replica.instance, exc)
                        continue
                    log.info("replica %d of '%s' now on worker '%s'", replica.index,
                             placed.node.name, proxy.member)
                    placed.pool.replace(replica.index, proxy)

    async def _renew(self) -> None:
        """Tell the workers hosting this driver's replicas that it is still there."""
        while True:
            await trio.sleep(RENEW_S)
            members = {r.instance.member: r.instance.client for p in self._placed
                       for r in p.pool.replicas if r.alive}
            for client in members.values():
                try:
                    await client.call("node.renew", self.session, timeout=RENEW_S)
                except TransportError:
                    pass  # a lost worker: the repair task deals with it

    async def _follow_kv(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The KV directory of the workers' stores, for KV-aware balancing."""
        from omni.transport.kv_directory import KVDirectory, KVSnapshot, request_snapshot

        assert self._clients is not None and self._roster is not None and self._creds
        clients = self._clients

        async def snapshot(member: str) -> KVSnapshot:
            client = clients.get(member)
            if client is None:
                raise LookupError(f"no worker '{member}'")
            return await request_snapshot(client, timeout=5.0)

        followed: dict[str, str] = {}

        async def on_change(members: dict[str, Any]) -> None:
            for name in [n for n in followed if n not in members
                         or members[n].info.kv_events != followed[n]]:
                self.directory.remove_member(name)
                del followed[name]
            for name, view in members.items():
                if view.info.kv_events and name not in followed:
                    await clients.connect(name, view.info.rpc)
                    self.directory.add_member(name, view.info.kv_events)
                    followed[name] = view.info.kv_events

        async with KVDirectory(self._creds, snapshot) as directory:
            self.directory = directory
            await on_change(self._roster.members)
            task_status.started()
            await self._roster.run(on_change)


def _call_keys(kv_keys: Any, call: CallInfo) -> list[bytes]:
    return list(kv_keys(*call.args, **call.kwargs))
