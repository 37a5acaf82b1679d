"""A member's side of the cluster: its link to the head, clients to other members, the roster
of members as the head last told it, and the probe that checks a head before joining.

Also the one interface a driver sees of a cluster, whoever runs its workers (`Membership`):
a head to place replicas and list members, and the credentials to reach them. Two backends
implement it: `HeadCluster`, workers joined by hand (``omni cluster start`` / ``join``), and
`omni.cluster.ray.RayCluster`, workers that Ray starts, restarts and adds as nodes come. Placement,
remote replicas and KV following run on top of it and do not know which."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Protocol

import trio
import zmq

from omni.cluster._reclaim import reclaim_dead_owners
from omni.cluster.errors import ClusterError, HeadUnreachable, NameTaken, TokenRefused
from omni.cluster.protocol import (
    HEARTBEAT_S,
    MISSED_BEATS,
    Beat,
    BeatReply,
    MemberInfo,
    MemberLoad,
    MemberView,
    Register,
    Welcome,
    check_address,
)
from omni.transport.credentials import Credentials
from omni.transport.errors import PeerGone, RPCError, RPCTimeout, TransportError
from omni.transport.host import host_id, ipc_directory, ipc_enabled
from omni.transport.rpc import RPCClient, RPCServer
from omni.transport.unix import remove_stale

__all__ = ["ClientSet", "HeadCluster", "HeadLink", "Membership", "Roster", "member_servers",
           "probe", "unix_endpoint"]

log = logging.getLogger("omni.cluster")

# -- what a driver sees of a cluster --------------------------------------------------------


class Membership(Protocol):
    """A cluster as a driver uses it (see the module docstring).

    `connect` is entered for the driver's whole life: it yields the head's address and the
    credentials that reach the head and the workers, once the head answers (and whatever the
    backend runs for its workers has started), and stops what it started on exit.
    `description` names the cluster in messages."""

    description: str

    def connect(self) -> contextlib.AbstractAsyncContextManager[tuple[str, Credentials]]: ...


class HeadCluster:
    """A cluster whose workers joined by hand: the head at `address` (``omni cluster start``),
    reached with the token file every member holds.

    Raises (from `connect`):
        ClusterError: no token file there; `HeadUnreachable`, `TokenRefused`: the head is
            not there or refuses the token.
    """

    def __init__(self, address: str, token_file: str | os.PathLike[str]):
        self.address = check_address(address)
        self.token_file = Path(token_file)
        self.description = f"the cluster at {self.address}"

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[tuple[str, Credentials]]:
        if not self.token_file.exists():
            raise ClusterError(f"no token file at {self.token_file}: pass the head's token file "
                               "(token_file= or --token-file)")
        with Credentials.from_token_file(self.token_file) as creds:
            await probe(creds, self.address)
            yield self.address, creds


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
                if not self.connected:
                    log.warning("head at %s answers again", self.address)
                    self.connected = True
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
            error = NameTaken if exc.remote_type == NameTaken.__name__ else ClusterError
            raise error(exc.remote_message) from None
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


def member_servers(creds: Credentials, host: str, prefix: str) -> list[RPCServer]:
    """The RPC servers a member (a worker, or a driver for its chains' ends) serves on, not
    yet started: TCP with CURVE on `host` for everyone, then a Unix socket in a 0700 folder
    for the processes of this host (no ZeroMQ I/O thread, no encryption: see
    `omni.transport.unix`), unless ``OMNI_IPC=0``. `prefix` names the socket files of its
    kind, those of killed processes removed first."""
    servers = [RPCServer(f"tcp://{host}:*", ctx=creds.ctx, options=creds.server_options(),
                         data_plane=creds.data_plane())]
    if ipc_enabled():
        servers.append(RPCServer(unix_endpoint(prefix)))
    return servers


def unix_endpoint(prefix: str) -> str:
    """A fresh ``unix://`` endpoint in this host's 0700 folder for a socket of kind `prefix`
    (the socket files of that kind that killed processes left are removed first)."""
    folder = ipc_directory()
    remove_stale(folder, f"{prefix}-*.sock")
    return f"unix://{folder}/{prefix}-{os.getpid()}-{secrets.token_hex(4)}.sock"


class ClientSet:
    """RPC clients to members, by name; each lives in `nursery` until dropped or replaced.
    `heartbeat_interval` None: the clients send no heartbeats (to lanes, which answer none:
    `omni.transport.lane`)."""

    def __init__(self, creds: Credentials, nursery: trio.Nursery, *,
                 heartbeat_interval: float | None = HEARTBEAT_S, missed: int = MISSED_BEATS):
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
        unix = endpoint.startswith("unix://")
        client = RPCClient(endpoint, ctx=self.creds.ctx,
                           options={} if unix else self.creds.client_options(),
                           data_plane=self.creds.data_plane(),  # used over TCP only
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
                _reclaim_departed(self.members, members)
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


def _reclaim_departed(before: dict[str, MemberView], now: dict[str, MemberView]) -> None:
    """A member process of this host gone from the roster (lost, or replaced by a new one
    of its name): reclaim what it left in shared memory if it died (`reclaim_dead_owners`)."""
    here = host_id()
    alive = {(v.info.name, v.info.pid) for v in now.values()}
    gone = [v.info.name for v in before.values()
            if v.info.host_id == here and (v.info.name, v.info.pid) not in alive]
    if gone:
        reclaim_dead_owners(f"worker(s) {', '.join(gone)} gone")


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
