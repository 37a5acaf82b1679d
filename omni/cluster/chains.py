"""Where a driver's chains end.

A chain (`omni.cluster.remote.RemoteReplica.omni_chain`) is a run of class nodes on workers,
each taking only the one before. The driver sends the first stage's worker one notice
(``node.chain``, a one-way message); each worker runs its stage and sends its result on to the
next stage's worker the same way; the last one sends the chain's value to the driver, and a
stage that fails sends its failure instead (``chain.end``, `ChainEnd`). A three-stage request
is four messages, and no worker waits on another. Between processes of one host the stages of
a synchronous node that runs one call at a time go to its worker's lane (`omni.transport.lane`,
`omni.cluster.worker`), where they run without waking the worker's event loop.

`ChainEnds` is the driver's side: an RPC endpoint (TCP with CURVE, and a Unix socket for the
workers on this host) that the workers learn, and check they reach, when a replica is
deployed; and the chains that wait on it. Nothing answers a notice, so each way a chain can
end without its last stage is covered where it happens:

- a stage's worker stops answering the driver's heartbeats: the chain ends here as broken by
  it (`Broken.lost`), as a call to that worker would fail;
- a stage fails, or its worker cannot reach the next one: that worker sends the failure;
- a worker has no room for the stage (`RPCServer`'s ``max_in_flight``): it sends that;
- the driver seems gone to the last worker (its event loop stalled past the heartbeats): the
  end waits there until the driver answers again, or its session ends;
- the request is given up on: the workers are told to stop its stages (``chain.cancel``), and
  an end that comes anyway is let go of (`ChainEnds.late`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
from collections.abc import Sequence
from typing import Any

import trio

from omni._parking import Parked
from omni.cluster.membership import ClientSet, member_servers
from omni.cluster.remote import (
    Broken,
    CallHead,
    Chain,
    ChainEnd,
    KeptReleases,
    RemoteReplica,
    WorkerAddress,
)
from omni.transport.credentials import Credentials
from omni.transport.errors import TransportError, WireError
from omni.transport.host import host_id
from omni.transport.movers import PayloadMover

__all__ = ["ChainEnds", "Waiting", "address_towards"]

log = logging.getLogger(__name__)


class Waiting(Parked):
    """A chain in flight: its token, its stages' replicas, and its end once it came."""

    __slots__ = ("end", "payload", "replicas", "token")

    def __init__(self, token: int, replicas: Sequence[RemoteReplica]):
        super().__init__()
        self.token = token
        self.replicas = replicas
        self.end: ChainEnd | None = None
        self.payload: list[Any] = []

    def finish(self, end: ChainEnd, payload: list[Any]) -> None:
        self.end, self.payload = end, payload
        self.resolve()

    async def result(self) -> tuple[ChainEnd, list[Any]]:
        """The chain's end and its frames, once it came."""
        await self.wait()
        assert self.end is not None
        return self.end, self.payload


class ChainEnds:
    """See the module docstring. `run` lives in the cluster link's nursery.

    Args:
        session: the driver's session (names its address: ``driver-<session>``).
        creds: the cluster's credentials (the TCP endpoint's CURVE keys).
        host: the address to bind the TCP endpoint on, one the workers reach.
        interval: seconds between looks for chains whose workers stopped answering.
        mover: the driver's payload mover; releases: its kept values let go of (the values
            of chains whose request gave up are let go of at once).
    """

    def __init__(self, session: str, creds: Credentials, *, host: str, interval: float,
                 mover: PayloadMover, releases: KeptReleases):
        self.session = session
        self.mover = mover
        self.releases = releases
        self.creds = creds
        self.host = host
        self.interval = interval
        self.address: WorkerAddress | None = None  # once running
        self._waiting: dict[int, Waiting] = {}
        self._tokens = itertools.count(1)
        self._nursery: trio.Nursery | None = None
        self._lanes: ClientSet | None = None  # to the workers' lanes on this host
        self.ended = self.late = 0

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the endpoint until cancelled; `task_status.started()` once it is bound."""
        servers = member_servers(self.creds, self.host, "d")
        for server in servers:
            server.register("chain.end", self._end, body_type=ChainEnd, with_payload=True,
                            inline=True)
            server.register("chain.hello", _hello, body_type=str, inline=True)
        async with contextlib.AsyncExitStack() as stack:
            for server in servers:
                await stack.enter_async_context(server)
            self.address = WorkerAddress(f"driver-{self.session}", servers[0].endpoint,
                                         servers[1].endpoint if len(servers) > 1 else "",
                                         host_id())
            try:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    self._lanes = ClientSet(self.creds, nursery, heartbeat_interval=None)
                    task_status.started()
                    await self._watch()
            finally:
                self._nursery = self._lanes = None

    def open(self, replicas: Sequence[RemoteReplica]) -> Waiting:
        """A new chain over `replicas`' workers, waiting for its end until `close`."""
        waiting = Waiting(next(self._tokens), replicas)
        self._waiting[waiting.token] = waiting
        return waiting

    async def start(self, replica: RemoteReplica, head: CallHead, frames: list[Any]) -> None:
        """Send a chain's first stage to `replica`'s worker: to its lane on this host (its
        heartbeats still answered: else the call fails as a call would), else over RPC.

        Raises `PeerGone` when the worker stopped answering heartbeats.
        """
        if replica.lane and self._lanes is not None and replica.client.peer_alive:
            client = await self._lanes.connect(replica.member, replica.lane)
        else:
            client = replica.client
        await client.notify("node.chain", head, payload=frames)

    def close(self, waiting: Waiting) -> None:
        """Stop waiting for the chain's end; before it came (cancelled, or the first notice
        refused), tell the chain's workers to stop its stages (``chain.cancel``)."""
        del self._waiting[waiting.token]
        if not waiting.done and self._nursery is not None:
            self._nursery.start_soon(_cancel, waiting)

    def _end(self, end: ChainEnd, payload: list[Any]) -> None:
        waiting = self._waiting.get(end.chain.token)
        if waiting is None or waiting.done:
            self.late += 1
            self._let_go(end, payload)
            return
        self.ended += 1
        waiting.finish(end, payload)

    def _let_go(self, end: ChainEnd, payload: list[Any]) -> None:
        """Release the value of a chain whose request gave up: a kept one, or its leases of
        the last worker's shared memory (they end with the buffers)."""
        value = end.value
        if value is None:
            return
        if value.kept:
            self.releases.add(end.sender, value.kept)
        elif payload:
            with contextlib.suppress(TransportError, WireError):
                self.mover.unpack(value.refs, payload[1:], peer=end.sender)

    async def _watch(self) -> None:
        """End each chain one of whose workers stopped answering, as broken by it."""
        while True:
            await trio.sleep(self.interval)
            for waiting in list(self._waiting.values()):
                if waiting.done:
                    continue
                for stage, replica in enumerate(waiting.replicas):
                    if not replica.alive:
                        client = replica.client
                        why = f"{client.endpoint} stopped answering heartbeats"
                        waiting.finish(ChainEnd(
                            Chain(self.session, waiting.token), replica.member,
                            broken=Broken(stage, replica.member, "PeerGone", why, lost=True)),
                            [])
                        break


def _hello(_: str) -> bool:
    """A worker checks, when a replica is deployed, that it reaches this driver."""
    return True


async def _cancel(waiting: Waiting) -> None:
    """Tell the workers of a chain nobody waits for any more to drop its stages."""
    for replica in waiting.replicas:
        if replica.alive:
            with contextlib.suppress(TransportError):
                await replica.client.notify("chain.cancel", [replica.session, waiting.token])


def address_towards(endpoint: str) -> str:
    """The address of this host's interface that reaches `endpoint` (``tcp://HOST:PORT``):
    where other hosts reach this process too."""
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, int(port)))  # (a datagram socket sends nothing to connect)
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1" if family == socket.AF_INET else "::1"
