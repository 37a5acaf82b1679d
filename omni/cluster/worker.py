"""A cluster worker (``omni cluster join``): hosts replicas of class nodes for drivers.

The worker serves RPC on its own port: ``node.deploy`` builds a replica (the class's code comes
with the request, see `omni.cluster._code`), ``node.call`` runs one call, ``node.next`` pulls a
streaming call's items, ``node.chain`` (a notice) runs a stage of a chain and sends its value
on (`omni.cluster.chains`), ``node.undeploy`` drops a replica, ``node.leave`` ends a driver's
session. When a driver deploys here, the worker checks that it reaches the driver, where its
chains end. It registers with the head and beats
with what it hosts (`omni.cluster.membership.HeadLink`), so the head can place replicas and show
status, and it re-registers by itself when the head restarts.

Its KV store is made when the first deployment that uses KV arrives (the layout comes from the
driver; the tier sizes from the worker's options). The store's events are published for the
cluster's KV directory, and pages other workers hold are fetched from them when that beats
recomputing (`omni.cluster.kv.peers`).

The event loop must keep answering heartbeats, so constructors and synchronous node bodies
run in worker threads. On a host with Unix sockets the worker also has a lane
(`omni.transport.lane`): one thread outside the event loop where chains' stages from this host
arrive, of synchronous nodes that run one call at a time (the driver gives other nodes'
addresses no lane: `omni.cluster.driver`), and run there and then, one at a time, as a
compiled graph's actor runs its methods; a stage the lane cannot run at once goes to the event
loop (`_on_lane`). A worker that stops waits for the stage its
lane is running, as for any synchronous call.

A driver's session ends when it says so (``node.leave``, as it stops) or stops renewing for
`SESSION_LEASE_S` (killed): its replicas are dropped, the payload segments it still held are
unlinked and the worker's mappings of its segments dropped; once no session is left, the
worker's payload pool is emptied too, so an idle worker holds no payload memory.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio

from omni.cluster._code import check_kv_layout, resolve
from omni.cluster.errors import ClusterError, KeptValueLost
from omni.cluster.gate import Gate
from omni.cluster.kv import request_holders
from omni.cluster.membership import ClientSet, HeadLink, Roster, member_servers, unix_endpoint
from omni.cluster.protocol import HEARTBEAT_S, Failure, MemberInfo, MemberLoad
from omni.cluster.remote import (
    KEEP_MIN,
    STREAM_BATCH,
    Broken,
    CallHead,
    Chain,
    ChainEnd,
    Chunk,
    Deploy,
    Feed,
    KeptArg,
    Renew,
    Stage,
    StreamBatch,
    Take,
    ValueHead,
    WorkerAddress,
    encode_for,
    move_out,
    pack_for,
    pack_out,
    pull_transfers,
    split_items,
    unpack_from,
    unpack_here,
)
from omni.graph.context import CallContext, current
from omni.graph.hosting import call_shape, host_replica
from omni.transport.credentials import Credentials
from omni.transport.errors import PeerGone, TransportError, WireError
from omni.transport.host import host_id, ipc_enabled
from omni.transport.lane import Lane
from omni.transport.movers import payload_mover
from omni.transport.rpc import Reply, RPCServer
from omni.transport.unix import is_unix
from omni.transport.values import Packed, decode_value
from omni.transport.wire import Request

__all__ = ["KVTiers", "Worker"]

log = logging.getLogger("omni.cluster.worker")

STREAM_IDLE_S = 120.0  # a stream nobody pulls for this long is dropped
DRIVER_REACH_S = 10.0  # seconds a deployment waits for its driver to answer this worker
SESSION_LEASE_S = 30.0  # replicas of a driver that stopped renewing for this long are dropped


@dataclass(frozen=True)
class KVTiers:
    """The KV tiers a worker offers: sizes ("8GiB") and the disk tier's folder."""

    device: str | None = None
    host: str | None = "1GiB"
    disk: str | None = None
    disk_path: str | None = None

    def capacity(self) -> dict[str, int]:
        from omni._units import parse_size

        sizes = {"device": self.device, "host": self.host, "disk": self.disk}
        return {name: parse_size(size) for name, size in sizes.items() if size is not None}

    def configs(self) -> list[Any]:
        """The `TierConfig`s of the store these tiers make."""
        from omni.kv import TierConfig

        tiers = [TierConfig(name, size) for name, size in (("device", self.device),
                                                            ("host", self.host)) if size]
        if self.disk:
            tiers.append(TierConfig("disk", self.disk, path=self.disk_path))
        return tiers

    def check(self) -> None:
        """Make each tier once and remove it, so that a flag naming a tier that cannot be made
        fails when the worker joins, not at its first deployment.

        Raises:
            KVTierError: a tier that cannot be made (``.tier`` names it).
            ValueError: a size that is not one.
        """
        from omni.kv.probe import check_tiers

        check_tiers(self.configs())


@dataclass
class _Hosted:
    node: str
    instance: Any
    streaming: bool
    is_async: bool
    resources: dict[str, float]
    session: str
    same_host: bool
    stop: trio.Event = field(default_factory=trio.Event)
    # the node's calls in flight at once (its ``concurrency``): the driver holds its calls to
    # it, but a chain's later stages come from other workers and wait here (`_run`)
    gate: Gate | None = None


@dataclass
class _Stream:
    """A streaming call's items, encoded, waiting for the driver to pull them."""

    receive: trio.MemoryReceiveChannel
    scope: trio.CancelScope
    session: str
    error: list[BaseException] = field(default_factory=list)
    last_pull: float = 0.0


class _Inbox:
    """A stream argument as the node sees it: an async iterator over what the driver feeds
    (`Worker._feed`), with room for `STREAM_BATCH` items before a feed waits."""

    def __init__(self) -> None:
        self.send, self.receive = trio.open_memory_channel[Any](STREAM_BATCH)
        self.error = ""
        self.last_fed = trio.current_time()
        self.claimed = False  # a call's arguments hold it (else a feed came first, or late)

    def __aiter__(self) -> _Inbox:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            if self.error:
                raise RuntimeError(f"the stream argument failed upstream: {self.error}") \
                    from None
            raise StopAsyncIteration from None


class Worker:
    """One worker process's hosting (see the module docstring).

    Args:
        name: the worker's name in the cluster (unique among members).
        head: the head's address.
        creds: the process's credentials.
        host: the address to serve on and advertise (where drivers and the head reach it).
        resources: what it offers: ``cpu``, ``gpu``, ``memory`` (bytes).
        kv: the KV tiers it offers.
        kv_fetch: fetch missing pages from other workers when that beats recomputing.
        reserve: what holds a replica's `resources` while it is hosted, from before it is
            built to after it is dropped (an async context manager made per replica; under
            Ray, a placement group on the worker's node, so that Ray's own tasks see them
            taken). None: the head's accounting is all.
    """

    def __init__(self, name: str, head: str, creds: Credentials, *, host: str = "127.0.0.1",
                 resources: dict[str, float] | None = None, kv: KVTiers | None = None,
                 heartbeat_interval: float = HEARTBEAT_S, kv_fetch: bool = True,
                 reserve: Callable[[dict[str, float]],
                                   contextlib.AbstractAsyncContextManager[Any]] | None = None):
        self.name = name
        self.reserve = reserve
        self.kv_fetch = kv_fetch
        self.head = head
        self.creds = creds
        self.host = host
        self.resources = dict(resources or {})
        self.kv_tiers = kv or KVTiers()
        self.heartbeat_interval = heartbeat_interval
        self.kv: Any = None  # the store, once a deployment needs one
        self.endpoint: str | None = None
        self.link: HeadLink | None = None
        self._hosted: dict[tuple[str, int], _Hosted] = {}
        self._streams: dict[int, _Stream] = {}
        self._inboxes: dict[tuple[str, int], _Inbox] = {}
        self.mover = payload_mover()
        self._stream_ids = itertools.count(1)
        self._requests = self._failed = 0
        self._sessions: dict[str, float] = {}  # driver session -> when it last renewed
        self._kv_events = ""
        self._kv_lock = trio.Lock()
        self._nursery: trio.Nursery | None = None
        self._servers: list[RPCServer] = []
        self.ipc = ""
        self.peers: Any = None  # the PeerFetcher, once the store exists
        self.directory: Any = None
        self._stopping = trio.Event()
        # results kept for the class nodes that take them: id -> (driver session, value)
        self._kept: dict[int, tuple[str, Any]] = {}
        # the chunked sends of kept values to the workers taking them: id -> [(peer, ids)]
        self._kept_sends: dict[int, list[tuple[str, list[int]]]] = {}
        self._peer_set: ClientSet | None = None  # clients to other workers (KV, kept values)
        self.lane: Lane | None = None  # where chains' stages from this host come (`_on_lane`)
        self._lane_set: ClientSet | None = None  # clients to other workers' lanes
        self._lane_requests = self._lane_failed = 0  # (counted on the lane's thread)
        self._lane_endpoints: dict[WorkerAddress, str] = {}  # `_lane_of`
        self._drivers: dict[str, WorkerAddress] = {}  # session -> where its chains end
        # the chains' stages running here: (session, token, stage) -> its scope
        self._chains: dict[tuple[str, int, int], trio.CancelScope] = {}

    def stop(self) -> None:
        """End `run` cleanly: tell the head this worker leaves, drop its replicas, return."""
        self._stopping.set()

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; `task_status.started(endpoint)` once registered.

        Raises:
            ClusterError: the head refused the registration.
        """
        self._servers = member_servers(self.creds, self.host, "w")
        for server in self._servers:
            self._register(server)
        try:
            async with contextlib.AsyncExitStack() as stack:
                for server in self._servers:
                    await stack.enter_async_context(server)
                nursery = await stack.enter_async_context(trio.open_nursery())
                self._nursery = nursery
                self.endpoint = self._servers[0].endpoint
                self.ipc = self._servers[1].endpoint if len(self._servers) > 1 else ""
                if ipc_enabled():
                    self.lane = Lane(unix_endpoint("wl"), self._on_lane)
                    await nursery.start(self.lane.run)
                self.link = HeadLink(self.creds, self.head, self.info, self.load,
                                     heartbeat_interval=self.heartbeat_interval)
                await nursery.start(self.link.run)
                nursery.start_soon(self._reap_streams)
                nursery.start_soon(self._reap_sessions)
                log.info("worker '%s' serving at %s", self.name, self.endpoint)
                task_status.started(self.endpoint)
                await self._stopping.wait()
                await self.link.leave()
                for hosted in self._hosted.values():
                    hosted.stop.set()
                nursery.cancel_scope.cancel()
        finally:
            if self.kv is not None:
                self.kv.close()

    def _register(self, server: RPCServer) -> None:
        server.register("node.deploy", self._deploy, body_type=Deploy)
        server.register("node.undeploy", self._undeploy, body_type=tuple[str, int])
        server.register("node.call", self._call, body_type=CallHead, with_payload=True)
        server.register("node.next", self._next, body_type=tuple[int, int])
        server.register("node.close", self._close_stream, body_type=int)
        server.register("node.feed", self._feed, body_type=Feed, with_payload=True)
        server.register("node.renew", self._renew, body_type=Renew)
        server.register("node.leave", self._leave, body_type=Renew)
        server.register("payload.push", self._push, body_type=Chunk, with_payload=True)
        server.register("payload.pull", self._pull, body_type=Chunk)
        server.register("node.take", self._take, body_type=Take)
        server.register("node.let_go", self._let_go_taken, body_type=tuple[str, int],
                        inline=True)
        server.register("node.chain", self._chain, body_type=CallHead, with_payload=True,
                        refused=self._chain_refused)
        server.register("chain.cancel", self._cancel_chain, body_type=tuple[str, int],
                        inline=True)
        server.register("worker.load", self._load_rpc, body_type=Any)

    def info(self) -> MemberInfo:
        return MemberInfo(self.name, self.endpoint or "", host_id(), os.getpid(),
                          self.resources, self.kv_tiers.capacity(), self._kv_events, self.ipc,
                          self.lane.endpoint if self.lane is not None else "")

    def note_progress(self, node: str, request_id: str | None, done: int, total: int) -> None:
        """A hosted call's steps (`omni.Context.progress`): not counted here. Why: the
        driver's ``/metrics`` shows a runtime's steps, and a worker does not send its calls'
        steps to the driver yet; the call runs the same either way."""

    def load(self) -> MemberLoad:
        deployments = {f"{d}/{r}": (h.node, h.resources) for (d, r), h in self._hosted.items()}
        kv = self.kv.stats() if self.kv is not None else {}
        if self.peers is not None:
            kv["peers"] = {k: v for k, v in self.peers.stats().items() if isinstance(v, int)}
        return MemberLoad(deployments, kv, self._requests + self._lane_requests,
                          self._failed + self._lane_failed)

    async def _load_rpc(self, _: Any) -> MemberLoad:
        return self.load()

    # -- deployments -------------------------------------------------------------------------

    async def _deploy(self, body: Deploy) -> Failure | None:
        """``node.deploy``: None once the replica is hosted, else why it is not: the error
        as the node raised it (not the nursery's group around it), with its traceback."""
        try:
            await self._build(body)
        except Exception as exc:
            failure = Failure.of(exc)
            log.warning("replica %d of %s did not start: %s: %s", body.replica, body.node,
                        failure.remote_type, failure.message)
            return failure
        return None

    async def _build(self, body: Deploy) -> None:
        key = (body.deployment, body.replica)
        if body.driver is not None:
            await self._reach_driver(body.session, body.driver)
        self._sessions[body.session] = trio.current_time()
        if key in self._hosted:
            return
        target = await trio.to_thread.run_sync(resolve, body.code)
        check_kv_layout(target, body.module_kv_layout, body.code.path, self.name)
        if body.kv_layout is not None:
            await self._ensure_store(body.kv_layout)
        cls = getattr(target, "cls", target)  # an @omni.node class is a NodeClass
        args, kwargs = decode_value(body.init)
        assert self._nursery is not None
        await self._nursery.start(self._host, key, body, cls, args, kwargs)
        log.info("hosting %s replica %d (%s)", body.node, body.replica, body.deployment)

    async def _host(self, key: tuple[str, int], body: Deploy, cls: type, args: list,
                    kwargs: dict, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Hold one replica (see `host_replica`) while it is listed in `_hosted`."""
        streaming, is_async = call_shape(cls, body.node)
        stop = trio.Event()
        reserved = self.reserve(dict(body.resources)) if self.reserve is not None else \
            contextlib.nullcontext()
        async with reserved, trio.open_nursery() as nursery:
            instance = await nursery.start(functools.partial(
                host_replica, functools.partial(cls, *args, **kwargs),
                CallContext(request_id=None, node=body.node, replica=body.replica, runtime=self),
                stop, in_thread=True))
            self._hosted[key] = _Hosted(body.node, instance, streaming, is_async,
                                        dict(body.resources), body.session,
                                        body.host_id == host_id(), stop,
                                        Gate(body.concurrency) if body.concurrency else None)
            task_status.started()
        self._hosted.pop(key, None)

    async def _undeploy(self, body: tuple[str, int]) -> bool:
        hosted = self._hosted.get(tuple(body))
        if hosted is not None:
            hosted.stop.set()
        return hosted is not None

    async def _renew(self, body: Renew) -> list[int]:
        """A driver says it is still there (and which of our leases it released); the leases
        of its segments released here since."""
        self._sessions[body.session] = trio.current_time()
        self.mover.release(body.session, body.released)
        self._let_go(body.session, body.kept)
        return self.mover.take_releases(body.session)

    async def _leave(self, body: Renew) -> list[int]:
        """A driver is done (it stops): end its session now rather than when its lease runs
        out; the leases of its segments released here, as `_renew` answers."""
        self.mover.release(body.session, body.released)
        ours = self.mover.take_releases(body.session)
        self._end_session(body.session, "its driver left")
        return ours

    async def _reap_sessions(self) -> None:
        """Drop the replicas of drivers that are gone (killed before they could undeploy)."""
        while True:
            await trio.sleep(SESSION_LEASE_S / 4)
            cutoff = trio.current_time() - SESSION_LEASE_S
            for session in [s for s, at in self._sessions.items() if at < cutoff]:
                self._end_session(session, "its driver stopped renewing")

    def _end_session(self, session: str, why: str) -> None:
        """Forget a driver: its replicas, the payload segments it held, our mappings of its
        segments; and the payload pool once no driver is left to reuse it."""
        self._sessions.pop(session, None)
        driver = self._drivers.pop(session, None)
        if driver is not None:
            self._peers().drop(driver.name)
        for hosted in self._hosted.values():
            if hosted.session == session:
                log.info("dropping %s: %s", hosted.node, why)
                hosted.stop.set()
        for stream_id in [i for i, s in self._streams.items() if s.session == session]:
            stream = self._streams.pop(stream_id)
            stream.scope.cancel()
            stream.receive.close()
        self._drop_inboxes(session, [feed for s, feed in self._inboxes if s == session])
        # (a copy first: the lane's thread may keep a value meanwhile)
        self._let_go(session, [k for k, (s, _) in list(self._kept.items()) if s == session])
        self.mover.forget(session)
        if not self._sessions:
            self.mover.shrink()

    # -- calls -------------------------------------------------------------------------------

    def _hosted_for(self, head: CallHead) -> _Hosted:
        """The replica `head` calls, of a driver whose session is live."""
        hosted = self._hosted.get((head.deployment, head.replica))
        if hosted is None:
            raise LookupError(f"worker '{self.name}' hosts no replica {head.replica} of "
                              f"{head.deployment}")
        self._check_session(hosted.session)
        return hosted

    async def _call(self, head: CallHead, payload: list[Any]) -> Any:
        """``node.call``: run the node; its value (or kept id), or a stream's id."""
        hosted = self._hosted_for(head)
        result = await self._run_call(hosted, head, payload)
        if head.stream:
            return result
        self._check_session(hosted.session)  # it may have left while the call ran
        value, frames = await self._value_for_driver(
            hosted, result, keep=head.keep, released=self.mover.take_releases(hosted.session))
        return Reply(value, frames)

    async def _run_call(self, hosted: _Hosted, head: CallHead, payload: list[Any]) -> Any:
        """Take the call's arguments (and those kept on other workers) and run the node: its
        result, or a stream's id."""
        session = hosted.session
        self.mover.release(session, head.released)
        self._let_go(session, head.kept_released)
        feeds: list[int] = []
        try:
            args, kwargs = await unpack_from(self.mover, head.refs, payload, peer=session,
                                             streams=lambda i: self._inbox(session, i, feeds))
            del payload  # the arguments' leases end with the arguments
            for kept in head.kept_args:
                value = await self._kept_value(session, kept)
                if kept.position >= 0:
                    args[kept.position] = value
                else:
                    kwargs[kept.key] = value
            self._requests += 1
            if head.stream:
                return self._open_stream(hosted, head, args, kwargs, feeds)
            return await self._run(hosted, head, args, kwargs)
        finally:
            if not head.stream:
                self._drop_inboxes(session, feeds)

    async def _value_for_driver(self, hosted: _Hosted, result: Any, *, keep: bool,
                                released: list[int]) -> tuple[ValueHead, list[Any]]:
        """`result` as it goes to the driver: its head and frames, or kept here when only
        class nodes take it (`keep`) and it is large; with `released`, the driver's leases
        released here (none for a chain's end: the chain carries them, `Chain.released`)."""
        packed, kept = self._result_out(hosted, result, keep=keep, released=released)
        if packed is None:
            return kept, []
        refs, frames = await move_out(self.mover, packed, peer=hosted.session,
                                      same_host=hosted.same_host)
        return ValueHead(refs, released), frames

    def _result_out(self, hosted: _Hosted, result: Any, *, keep: bool, released: list[int]
                    ) -> tuple[Packed | None, ValueHead]:
        """`result` encoded for the driver (`_value_for_driver`), or (None, its head) when
        it is kept here instead."""
        try:
            packed = encode_for(result, same_host=hosted.same_host)
        except TypeError as exc:
            raise TypeError(f"the result of node '{hosted.node}' cannot travel back: {exc}") \
                from None
        nbytes = sum(buffer.nbytes for buffer in packed.buffers)
        if keep and nbytes >= KEEP_MIN:  # only class nodes take it: it waits here
            return None, ValueHead([], released, self._keep(hosted.session, result), nbytes)
        return packed, ValueHead([], released)

    # -- chains (see omni.cluster.chains) ------------------------------------------------------
    #
    # A chain's stage comes over RPC (from another host, where there are no Unix sockets, or
    # for an async node) or on the lane (`omni.transport.lane`), whose thread runs it there
    # and then when its node has a slot free and its arguments are all in the notice
    # (`_on_lane`), and hands it to the event loop otherwise. Either way its value goes on to
    # the next stage's lane when its address has one on this host, else to its RPC endpoint.

    async def _chain(self, head: CallHead, payload: list[Any]) -> None:
        """``node.chain``, a notice: run this stage of a chain, then send its value on to the
        next stage's worker, or to the driver as the chain's end; or, should anything fail,
        the failure to the driver. The driver's ``chain.cancel`` stops it."""
        started = trio.current_time()
        chain = head.chain
        if chain is None:
            raise ValueError("a chain's stage came without its chain")
        key = (chain.session, chain.token, head.stage)  # (a worker may run two of its stages)
        with trio.CancelScope() as scope:  # (cancelled: nothing is sent on)
            self._chains[key] = scope
            try:
                end, frames = await self._stage(head, chain, payload, started)
            except Exception as exc:
                end, frames = self._broken(head, chain, exc), []
            finally:
                del self._chains[key]
            if end is not None:
                await self._end_chain(chain.session, end, frames)

    async def _stage(self, head: CallHead, chain: Chain, payload: list[Any], started: float
                     ) -> tuple[ChainEnd | None, list[Any]]:
        """Run the stage and pass its value on: the chain's end when this is its last stage
        (or the next stage's worker cannot be reached), else None."""
        hosted = self._hosted_for(head)
        result = await self._run_call(hosted, head, payload)
        took = trio.current_time() - started
        self._check_session(hosted.session)  # it may have left while the call ran
        if not head.then:
            value, frames = await self._value_for_driver(hosted, result, keep=head.keep,
                                                         released=[])
            return ChainEnd(self._passing(chain, took), self.name, value), frames
        stage, call, frames = self._next_stage(hosted, head, chain, result, took)
        del result
        await self._send_on(hosted.session, stage, call, frames)
        return None, []

    async def _send_on(self, session: str, stage: Stage, call: CallHead, frames: list[Any]
                       ) -> None:
        """Send the next stage to its worker from the event loop: to its lane on this host,
        else over RPC; the chain ends here as broken when that worker cannot be reached."""
        try:
            lane = self._lane_of(stage.worker)
            if lane:
                client = await self._lanes().connect(stage.worker.name, lane)
            else:
                client = await self._peers().connect(stage.worker.name, stage.worker.endpoint())
            await client.notify("node.chain", call, payload=frames)
        except TransportError as exc:  # stopped answering, or cannot be reached
            await self._end_chain(session, self._unreached(session, stage, call, exc), [])

    def _next_stage(self, hosted: _Hosted, head: CallHead, chain: Chain, result: Any,
                    took: float) -> tuple[Stage, CallHead, list[Any]]:
        """The next stage's worker, call and frames: `result` its argument, kept here when it
        is too large to ride with the notice (the next worker takes it from here, then lets
        go of it, or the driver's session ends)."""
        stage, later = head.then[0], head.then[1:]
        try:
            packed = encode_for([[result], {}], same_host=False)
        except TypeError as exc:
            raise TypeError(f"the result of node '{hosted.node}' cannot travel on: {exc}") \
                from None
        kept_args: list[KeptArg] = []
        if sum(buffer.nbytes for buffer in packed.buffers) >= KEEP_MIN:
            kept_args = [KeptArg(0, "", self.address(), self._keep(hosted.session, result),
                                 once=True)]
            packed = encode_for([[None], {}], same_host=False)
        refs, frames = pack_out(self.mover, packed, peer=stage.worker.name, same_host=False)
        call = msgspec.structs.replace(stage.head, refs=refs, kept_args=kept_args, then=later,
                                       chain=self._passing(chain, took))
        return stage, call, frames

    def _unreached(self, session: str, stage: Stage, call: CallHead, exc: Exception
                   ) -> ChainEnd:
        """The chain's end when the next stage's worker cannot be reached: its argument
        kept here is let go of."""
        self._let_go(session, [k.kept for k in call.kept_args])
        assert call.chain is not None
        return ChainEnd(call.chain, self.name, broken=Broken.of(
            call.stage, stage.worker.name, exc, lost=True))

    def _broken(self, head: CallHead, chain: Chain, exc: Exception) -> ChainEnd:
        """The chain's end when its stage here failed with `exc`."""
        broken = Broken.of(head.stage, self.name, exc)
        if isinstance(exc, KeptValueLost) and head.stage > 0:
            # the worker before, which kept this stage's argument, is gone
            broken = Broken.of(head.stage - 1, head.kept_args[0].holder.name, exc, lost=True)
        return ChainEnd(self._passing(chain), self.name, broken=broken)

    def _passing(self, chain: Chain, took: float | None = None) -> Chain:
        """What the chain passes on from here: this stage's seconds (`took`) added, and the
        driver's leases released here (taken now: nothing may fail after this but sending)."""
        seconds = chain.seconds if took is None else [*chain.seconds, took]
        mine = self.mover.take_releases(chain.session)
        released = [*chain.released, (self.name, mine)] if mine else chain.released
        return msgspec.structs.replace(chain, seconds=seconds, released=released)

    # -- the lane's thread -----------------------------------------------------------------

    def _on_lane(self, msg: Request, payload: list[Any]) -> None:
        """A notice on the lane: a chain's stage, run on the lane's thread when it can be
        (`_lane_hosted`), else handed to the event loop as if it had come over RPC (within
        its server's ``max_in_flight``)."""
        assert self.lane is not None
        if msg.method != "node.chain":
            raise WireError(f"a worker's lane takes chains' stages, not {msg.method!r}")
        head = self.lane.codec.decode_body(msg.body, CallHead)
        if head.chain is None:
            raise WireError("a chain's stage came without its chain")
        hosted = self._lane_hosted(head)
        if hosted is None:  # (the Unix socket's server: there is one where there is a lane)
            self.lane.hand_to_loop(self._servers[-1].dispatch, msg, payload)
            return
        started = time.perf_counter()
        try:
            end, frames = self._lane_stage(hosted, head, head.chain, payload, started)
        except Exception as exc:
            end, frames = self._broken(head, head.chain, exc), []
        finally:
            if hosted.gate is not None:
                hosted.gate.release()
        if end is not None:
            self._lane_end(head.chain.session, end, frames)

    def _lane_hosted(self, head: CallHead) -> _Hosted | None:
        """The replica `head` calls, when its stage may run on the lane's thread now: a
        synchronous node with a slot free (its gate's, taken here), and no argument to take
        from another worker."""
        hosted = self._hosted.get((head.deployment, head.replica))
        if hosted is None or hosted.is_async or head.stream or head.kept_args \
                or (hosted.gate is not None and not hosted.gate.try_acquire()):
            return None
        return hosted

    def _lane_stage(self, hosted: _Hosted, head: CallHead, chain: Chain, payload: list[Any],
                    started: float) -> tuple[ChainEnd | None, list[Any]]:
        """`_stage` on the lane's thread."""
        assert self.lane is not None
        session = hosted.session
        self._check_session(session)
        if head.released:
            self.mover.release(session, head.released)
        if head.kept_released:
            self._let_go(session, head.kept_released)
        args, kwargs = unpack_here(self.mover, head.refs, payload, peer=session)
        del payload  # the arguments' leases end with the arguments
        self._lane_requests += 1
        token = self._enter_call(hosted, head)
        try:
            result = hosted.instance(*args, **kwargs)
        except BaseException:
            self._lane_failed += 1
            raise
        finally:
            current.reset(token)
        del args, kwargs
        took = time.perf_counter() - started
        self._check_session(session)  # it may have left while the call ran
        if not head.then:
            packed, value = self._result_out(hosted, result, keep=head.keep, released=[])
            frames: list[Any] = []
            if packed is not None:
                refs, frames = pack_out(self.mover, packed, peer=session,
                                        same_host=hosted.same_host)
                value = ValueHead(refs)
            self._drop_if_gone(session, [value.kept] if value.kept else [])
            return ChainEnd(self._passing(chain, took), self.name, value), frames
        stage, call, frames = self._next_stage(hosted, head, chain, result, took)
        del result
        self._drop_if_gone(session, [k.kept for k in call.kept_args])
        lane = self._lane_of(stage.worker)
        if not lane:  # on another host: over RPC, from the event loop
            self.lane.hand_to_loop(self._start, self._send_on, session, stage, call, frames)
            return None, []
        try:
            self.lane.notify(lane, "node.chain", call, payload=frames)
        except TransportError as exc:
            return self._unreached(session, stage, call, exc), []
        return None, []

    def _drop_if_gone(self, session: str, kept: list[int]) -> None:
        """After keeping values or leasing memory for `session` on the lane's thread: should
        its session have ended meanwhile (on the event loop's thread, which let go of what
        it held then), let go of these too, and fail the stage. (Ended after this check, the
        session's end finds them.)"""
        if session not in self._sessions:
            self._let_go(session, kept)
            self.mover.forget(session)
            self._check_session(session)

    def _lane_end(self, session: str, end: ChainEnd, frames: list[Any]) -> None:
        """Send the chain's end to its driver from the lane's thread: straight to its Unix
        socket on this host, else (or should that fail) from the event loop."""
        assert self.lane is not None
        driver = self._drivers.get(session)
        endpoint = driver.endpoint() if driver is not None else ""
        if is_unix(endpoint):
            with contextlib.suppress(TransportError):  # (the event loop tries again)
                self.lane.notify(endpoint, "chain.end", end, payload=frames)
                return
        self.lane.hand_to_loop(self._start, self._end_chain, session, end, frames)

    def _start(self, fn: Callable[..., Any], *args: Any) -> None:
        """Start task `fn(*args)` in the worker's nursery (from a lane's hand-over)."""
        if self._nursery is not None:
            self._nursery.start_soon(fn, *args)

    async def _end_chain(self, session: str, end: ChainEnd, frames: list[Any]) -> None:
        """Send the chain's end to its driver. While the driver does not answer this worker's
        heartbeats (its event loop may be stalled), try again every heartbeat interval, until
        it does or its session ends here: nothing else would tell it how the chain ended."""
        while (driver := self._drivers.get(session)) is not None:
            try:
                client = await self._peers().connect(driver.name, driver.endpoint())
                await client.notify("chain.end", end, payload=frames)
                return
            except PeerGone:
                await trio.sleep(self.heartbeat_interval)
            except TransportError as exc:
                log.warning("the end of chain %d could not go to its driver at %s: %s",
                            end.chain.token, driver.endpoint(), exc)
                return
        log.info("chain %d ended after its driver left", end.chain.token)

    def _chain_refused(self, head: CallHead) -> None:
        """A chain's stage this worker had no room for (its RPC server runs as many calls as
        it may): the chain ends as broken here, so that its request fails, not waits."""
        if head.chain is None or self._nursery is None:
            return
        end = ChainEnd(head.chain, self.name, broken=Broken(
            head.stage, self.name, "ServerBusy", f"worker '{self.name}' runs too many calls"))
        self._nursery.start_soon(self._end_chain, head.chain.session, end, [])

    def _cancel_chain(self, body: tuple[str, int]) -> None:
        """``chain.cancel``, a notice: the driver gave up on a chain; stop its stage here."""
        session, token = body
        for (s, t, _), scope in self._chains.items():
            if (s, t) == (session, token):
                scope.cancel()

    async def _reach_driver(self, session: str, driver: WorkerAddress) -> None:
        """Check once per driver that its chains' ends can go to it, when it deploys here."""
        if self._drivers.get(session) == driver:
            return
        try:
            client = await self._peers().connect(driver.name, driver.endpoint())
            await client.call("chain.hello", self.name, timeout=DRIVER_REACH_S)
        except TransportError as exc:
            self._peers().drop(driver.name)
            raise ClusterError(f"worker '{self.name}' cannot reach its driver at "
                               f"{driver.endpoint()}: {exc}") from None
        self._drivers[session] = driver

    def _keep(self, session: str, value: Any) -> int:
        """Keep `value` here for the class nodes that take it; its id, a random one (never
        one a restarted worker of the same name could mean too)."""
        kept = secrets.randbits(62) + 1
        self._kept[kept] = (session, value)
        return kept

    def address(self) -> WorkerAddress:
        """How other processes reach this worker."""
        return WorkerAddress(self.name, self.endpoint or "", self.ipc, host_id(),
                             self.lane.endpoint if self.lane is not None else "")

    # -- kept results (see omni.cluster.remote) ------------------------------------------------

    def _let_go(self, session: str, kept: list[int]) -> None:
        """Drop kept values of `session`, and what a taker left unfinished of them (one that
        died half-way through a large value would otherwise keep it alive here)."""
        for kept_id in kept:
            # (popped, not deleted: the event loop's and the lane's threads both let go)
            if self._kept.get(kept_id, ("",))[0] == session \
                    and self._kept.pop(kept_id, None) is not None:
                for peer, transfers in self._kept_sends.pop(kept_id, []):
                    self.mover.drop_transfers(peer, transfers)

    async def _take(self, body: Take) -> Reply:
        """Another worker takes a value kept here, as frames (it may be on another host)."""
        entry = self._kept.get(body.kept)
        if entry is None or entry[0] != body.session:
            raise LookupError(f"worker '{self.name}' keeps no value {body.kept} (let go of)")
        peer = _taker(body.requester)
        refs, frames = await pack_for(self.mover, entry[1], peer=peer, same_host=False)
        transfers = [ref.transfer for ref in refs if ref.transfer]
        if transfers:
            self._kept_sends.setdefault(body.kept, []).append((peer, transfers))
        return Reply(ValueHead(refs), frames)

    async def _kept_value(self, session: str, kept: KeptArg) -> Any:
        """The value `kept` names: from this worker's own table, or taken from its holder
        (its bytes come straight from there). `KeptValueLost` when it cannot be had. One
        kept for this call alone (`KeptArg.once`) is let go of there once taken."""
        if kept.holder.name == self.name and kept.holder.rpc == self.endpoint:
            entry = self._kept.get(kept.kept)
            if entry is None:
                raise KeptValueLost(f"value {kept.kept} kept here was let go of")
            if kept.once:
                self._let_go(session, [kept.kept])
            return entry[1]
        client = None
        try:
            # (a new client when the holder restarted at another endpoint)
            client = await self._peers().connect(kept.holder.name, kept.holder.endpoint())
            reply = await client.call_with_payload(
                "node.take", Take(session, kept.kept, self.name), result_type=ValueHead)
            peer = _taker(self.name)
            await pull_transfers(self.mover, reply.body.refs, peer, functools.partial(
                client.call_with_payload, "payload.pull"))
            return await unpack_from(self.mover, reply.body.refs, reply.payload, peer=peer)
        except (TransportError, LookupError) as exc:
            raise KeptValueLost(f"the value kept on worker '{kept.holder.name}' cannot be "
                                f"had: {exc}") from None
        finally:
            if kept.once and client is not None and client.peer_alive:
                with contextlib.suppress(TransportError):
                    await client.notify("node.let_go", (session, kept.kept))

    def _let_go_taken(self, body: tuple[str, int]) -> None:
        """``node.let_go``, a notice: the worker a value was kept for has taken it."""
        self._let_go(body[0], [body[1]])

    def _peers(self) -> ClientSet:
        """This worker's clients to other workers: for their KV pages and kept values."""
        if self._peer_set is None:
            assert self._nursery is not None
            self._peer_set = ClientSet(self.creds, self._nursery,
                                       heartbeat_interval=self.heartbeat_interval)
        return self._peer_set

    def _lane_of(self, worker: WorkerAddress) -> str:
        """`worker`'s lane as this worker reaches it, or '' (`WorkerAddress.lane_endpoint`,
        remembered: it never changes for an address)."""
        lane = self._lane_endpoints.get(worker)
        if lane is None:
            if len(self._lane_endpoints) >= 1024:  # (workers come and go under new names)
                self._lane_endpoints.clear()
            lane = self._lane_endpoints[worker] = worker.lane_endpoint()
        return lane

    def _lanes(self) -> ClientSet:
        """This worker's clients to other workers' lanes (no heartbeats: `omni.transport.lane`;
        `_peers` watches the workers)."""
        if self._lane_set is None:
            assert self._nursery is not None
            self._lane_set = ClientSet(self.creds, self._nursery, heartbeat_interval=None)
        return self._lane_set

    def _check_session(self, session: str) -> None:
        """Refuse work for a driver whose session has ended: nothing may be leased to it any
        more, since nobody would end that lease."""
        if session not in self._sessions:
            raise LookupError(f"the driver of this call has left worker '{self.name}'")

    async def _run(self, hosted: _Hosted, head: CallHead, args: list, kwargs: dict) -> Any:
        gate = hosted.gate
        if gate is None:
            return await self._invoke(hosted, head, args, kwargs)
        await gate.acquire()
        try:
            return await self._invoke(hosted, head, args, kwargs)
        finally:
            gate.release()

    async def _invoke(self, hosted: _Hosted, head: CallHead, args: list, kwargs: dict) -> Any:
        token = self._enter_call(hosted, head)
        try:
            if hosted.is_async:
                return await hosted.instance(*args, **kwargs)
            return await trio.to_thread.run_sync(
                functools.partial(hosted.instance, *args, **kwargs))
        except BaseException:
            self._failed += 1
            raise
        finally:
            current.reset(token)

    def _enter_call(self, hosted: _Hosted, head: CallHead) -> contextvars.Token:
        """Set the call's context for the node's body (`omni.graph.context.current`, and the
        workers its KV may come from); the token that resets it."""
        token = current.set(CallContext(request_id=head.request_id, node=hosted.node,
                                        replica=head.replica, runtime=self))
        if self.kv is not None:  # (a store is made at deployment, before any call)
            _set_request_holders(head)
        return token

    def _open_stream(self, hosted: _Hosted, head: CallHead, args: list, kwargs: dict,
                     feeds: list[int]) -> int:
        stream_id = next(self._stream_ids)
        send, receive = trio.open_memory_channel(STREAM_BATCH)
        stream = self._streams[stream_id] = _Stream(receive, trio.CancelScope(), hosted.session,
                                                    last_pull=trio.current_time())
        assert self._nursery is not None
        self._nursery.start_soon(self._produce, stream, hosted, head, args, kwargs, send, feeds)
        return stream_id

    async def _produce(self, stream: _Stream, hosted: _Hosted, head: CallHead, args: list,
                       kwargs: dict, send: trio.MemorySendChannel, feeds: list[int]) -> None:
        token = current.set(CallContext(request_id=head.request_id, node=hosted.node,
                                        replica=head.replica, runtime=self))
        if self.kv is not None:
            _set_request_holders(head)
        try:
            with stream.scope:
                agen = hosted.instance(*args, **kwargs)
                del args, kwargs
                try:
                    async for item in agen:
                        await send.send(await pack_for(
                            self.mover, item, peer=hosted.session,
                            same_host=hosted.same_host))
                finally:
                    await agen.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the driver closed the stream
        except Exception as exc:
            self._failed += 1
            stream.error.append(exc)
        finally:
            # Only now, the error recorded: `_next` takes the channel's end for the stream's,
            # and a failure noted after it would never reach the driver.
            send.close()
            current.reset(token)
            self._drop_inboxes(hosted.session, feeds)

    async def _next(self, body: tuple[int, int]) -> Reply:
        stream_id, most = body
        stream = self._streams.get(stream_id)
        if stream is None:
            raise LookupError(f"no stream {stream_id} on worker '{self.name}'")
        stream.last_pull = trio.current_time()
        items: list[tuple[list, list]] = []
        done = False
        try:
            items.append(await stream.receive.receive())
            while len(items) < max(1, most):
                items.append(stream.receive.receive_nowait())
        except trio.WouldBlock:
            pass
        except trio.EndOfChannel:
            done = True
            del self._streams[stream_id]
        if done and stream.error:
            raise stream.error[0]
        frames = [frame for _, item_frames in items for frame in item_frames]
        batch = StreamBatch(len(items), done, [refs for refs, _ in items],
                            self.mover.take_releases(stream.session))
        return Reply(batch, frames)

    # -- payload transfers (see RemoteReplica._push) -----------------------------------------

    async def _push(self, body: Chunk, payload: list[Any]) -> bool:
        if body.session not in self._sessions or len(payload) != 1:
            raise LookupError(f"no session {body.session!r} on worker '{self.name}'")
        self.mover.accept(body.session, body.transfer, body.nbytes, body.offset, payload[0])
        return True

    async def _pull(self, body: Chunk) -> Reply:
        return Reply(None, [self.mover.chunk_of(body.session, body.transfer, body.offset)])

    # -- stream arguments --------------------------------------------------------------------

    def _inbox(self, session: str, feed_id: int, feeds: list[int] | None = None) -> _Inbox:
        """The inbox of a stream argument (made by whichever comes first: call or feed)."""
        inbox = self._inboxes.get((session, feed_id))
        if inbox is None:
            inbox = self._inboxes[(session, feed_id)] = _Inbox()
        if feeds is not None:
            inbox.claimed = True
            feeds.append(feed_id)
        return inbox

    def _drop_inboxes(self, session: str, feeds: list[int]) -> None:
        for feed_id in feeds:
            inbox = self._inboxes.pop((session, feed_id), None)
            if inbox is not None:
                inbox.receive.close()

    async def _feed(self, body: Feed, payload: list[Any]) -> bool:
        """Items for a stream argument; answered once the node has room for them. False: the
        call is over, send no more."""
        if body.session not in self._sessions:
            return False
        inbox = self._inbox(body.session, body.feed)
        inbox.last_fed = trio.current_time()
        try:
            for refs, frames in split_items(body.refs, payload):
                await inbox.send.send(await unpack_from(self.mover, refs, frames,
                                                        peer=body.session))
            if body.done or body.error:
                inbox.error = body.error
                inbox.send.close()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        return True

    async def _close_stream(self, stream_id: int) -> bool:
        stream = self._streams.pop(stream_id, None)
        if stream is not None:
            stream.scope.cancel()
            stream.receive.close()
        return stream is not None

    async def _reap_streams(self) -> None:
        while True:
            await trio.sleep(STREAM_IDLE_S / 4)
            cutoff = trio.current_time() - STREAM_IDLE_S
            for stream_id in [i for i, s in self._streams.items() if s.last_pull < cutoff]:
                log.warning("dropping stream %d: not pulled for %.0f s", stream_id,
                            STREAM_IDLE_S)
                await self._close_stream(stream_id)
            for key in [k for k, i in self._inboxes.items()
                        if not i.claimed and i.last_fed < cutoff]:
                self._inboxes.pop(key).receive.close()  # fed for a call that never came

    # -- KV ----------------------------------------------------------------------------------

    async def _ensure_store(self, spec: dict[str, Any]) -> None:
        from omni.kv import KVLayout, KVStore
        from omni.kv.descriptors import LayoutSpec

        layout = KVLayout.from_spec(LayoutSpec(**spec))
        async with self._kv_lock:
            if self.kv is not None:
                if self.kv.layout != layout:
                    raise ValueError(f"worker '{self.name}' keeps KV pages of {self.kv.layout}; "
                                     f"this node needs {layout}")
                return
            tiers = self.kv_tiers.configs()
            # In a thread: a store can take a second to start (with CUDA it page-locks its
            # whole host tier), in which the event loop must go on answering heartbeats (else
            # the head drops this worker).
            self.kv = await trio.to_thread.run_sync(KVStore, layout, tiers)
            assert self._nursery is not None
            await self._nursery.start(self._serve_kv)

    async def _serve_kv(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Publish the store's events, serve its pages, and fetch pages from peers."""
        from omni.cluster.kv.directory import KVPublisher
        from omni.cluster.kv.peers import PeerFetcher, serve_kv
        from omni.cluster.kv_follow import follow_members, kv_directory

        assert self._servers and self.link is not None
        publisher = KVPublisher(self.kv, self.name, self.creds, bind=f"tcp://{self.host}:*")
        async with publisher:
            clients = self._peers()
            for server in self._servers:
                publisher.register(server)
                serve_kv(server, self.kv)
            self._kv_events = publisher.endpoint
            async with kv_directory(self.creds, clients) as directory:
                self.directory = directory
                self.peers = PeerFetcher(directory, clients.get, self.name,
                                         layout=self.kv.layout, connect=clients.connect)
                if self.kv_fetch:
                    self.kv.peers = self.peers
                roster = Roster(self.link.client, interval=self.heartbeat_interval * 2)
                await follow_members(roster, clients, directory, skip=self.name,
                                     drop_gone=True, task_status=task_status)

    def __repr__(self) -> str:
        return f"<Worker {self.name} at {self.endpoint} hosting {len(self._hosted)}>"


def _set_request_holders(head: CallHead) -> None:
    """The workers that served the request's earlier nodes, for this task's KV fetches
    (`omni.cluster.kv.request_holders`, a context variable: the task's own)."""
    request_holders.set(tuple((h.name, h.endpoint()) for h in head.kv_from))


def _taker(worker: str) -> str:
    """The payload mover's name for a worker taking kept values (frames only, no leases)."""
    return f"take:{worker}"

