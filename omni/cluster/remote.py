"""Replicas on cluster workers, as the driver sees them.

A `RemoteReplica` stands in a pool where a class node's instance would: calling it runs the
node on its worker (``node.call``), and a streaming node's items come back in batches pulled
by the driver (``node.next``), so a slow consumer slows the producer instead of filling
memory. An argument that is a stream is fed to the worker in batches (``node.feed``), each
batch answered once the worker's node has room for it: backpressure both ways.

Values travel as themselves (`omni.transport.values`): the body carries the structure, and
arrays go out of band by locality (`omni.transport.movers`): through shared memory when
the worker is on this host, else as zero-copy frames. A message is ``[body, *frames]`` per
value; its head (`CallHead`, `ValueHead`, `StreamBatch`, `Feed`) carries the buffer refs, and
the shared-memory leases each side released since it last spoke, so segments are reused.

A result that only class nodes take (`omni.graph.context.CallContext.keep`), with
`KEEP_MIN` bytes or more out of band, stays on its worker: the call returns a `KeptValue`
(a reference), which the scheduler passes to the next class nodes as it would the value, and
their workers take it from that worker directly (``node.take``), over TCP or a Unix socket,
so the bytes never cross this process. A kept value is let go of when its `KeptValue` is
(the ids go back with the next call or renewal: `KeptReleases`), or with this driver's
session. Should its worker die before a consumer took it, the consumer's call fails with
`WorkerLost` as a stream that had passed items on does, and `omni.Runtime.run` runs the
request again from the start.

When the worker stops answering heartbeats the replica is marked dead: the call fails with
`WorkerLost` naming the worker (a `ReplicaLost`: the scheduler retries it once on a live
replica, unless a stream had passed items on), and the pool places no more calls on it until
the cluster runtime replaces it (calls wait for that, see `omni.graph.balance.Pool`).
"""

from __future__ import annotations

import functools
import itertools
import threading
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from omni.cluster._code import CodeRef
from omni.cluster.errors import KeptValueLost, RemoteNodeError, WorkerLost
from omni.cluster.protocol import pick_endpoint
from omni.errors import describe, traceback_text
from omni.graph.errors import StageError
from omni.transport.errors import PeerGone, RPCError, TransportError, WireError
from omni.transport.movers import BufferRef, PayloadMover
from omni.transport.rpc import RPCClient
from omni.transport.values import Packed, pack_value, unpack_value

if TYPE_CHECKING:
    from omni.cluster.chains import ChainEnds

__all__ = ["KEEP_MIN", "Broken", "CallHead", "Chain", "ChainEnd", "Chunk", "Deploy", "Feed",
           "KeptArg", "KeptReleases", "KeptValue", "RemoteReplica", "Renew", "RequestTrail",
           "Stage", "StreamBatch", "Take", "ValueHead", "WorkerAddress", "pack_for",
           "pack_out", "pull_transfers", "split_items", "unpack_from", "unpack_here"]

STREAM_BATCH = 64  # items a stream pull may bring back, or a feed carry, at once
OFF_LOOP_BYTES = 16 << 20  # shared-memory copies and mappings this large run in a thread
_CHAIN_ERROR_CHARS = 8192  # a failed chain stage's error message is cut to this
_CHAIN_TRACEBACK_CHARS = 32768  # and its traceback to its last this many characters
KEEP_MIN = 1 << 20  # a result only class nodes take stays on its worker from this size


class Deploy(msgspec.Struct, frozen=True):
    """Build replica `replica` of a class node on a worker."""

    deployment: str
    replica: int
    node: str
    code: CodeRef
    init: bytes  # encode_value([args, kwargs])
    resources: dict[str, float] = {}
    session: str = ""  # the driver's; its replicas go when it stops renewing (`node.renew`)
    kv_layout: dict[str, Any] | None = None  # a LayoutSpec's fields, when the node uses KV
    # the `KV_LAYOUT` of the node's module as the driver imported it (`module_kv_layout`)
    module_kv_layout: dict[str, Any] | None = None
    host_id: str = ""  # the driver's host: on the same one, values move through shared memory
    concurrency: int | None = None  # the node's calls in flight at once (None: unbounded)
    driver: WorkerAddress | None = None  # where the driver's chains end (`ChainEnds`)


class WorkerAddress(msgspec.Struct, array_like=True, frozen=True):
    """A worker by name and endpoints: one that served an earlier node of a request, keeps a
    value, or runs the next stage of a chain; another worker that has not heard of it from
    the head can still reach it (`endpoint`)."""

    name: str
    rpc: str  # TCP
    ipc: str = ""  # its Unix socket, for processes on its host
    host: str = ""
    lane: str = ""  # its lane, for chains' stages sent from its host (`omni.transport.lane`)

    def endpoint(self) -> str:
        """Where this process reaches it: its Unix socket on the same host, else TCP."""
        return pick_endpoint(self.rpc, self.ipc, self.host)

    def lane_endpoint(self) -> str:
        """Where this process sends it a chain's stage: its lane on the same host (as its
        Unix socket would be picked), else '' (its RPC endpoint takes them)."""
        return pick_endpoint("", self.lane, self.host)


class KeptArg(msgspec.Struct, array_like=True, frozen=True):
    """An argument that is a value kept on a worker: argument `position` (or keyword `key`
    when position is -1), kept value `kept` of worker `holder`."""

    position: int
    key: str
    holder: WorkerAddress
    kept: int
    once: bool = False  # the holder lets go of it once taken (a chain's stage's value)


class Take(msgspec.Struct, frozen=True):
    """``node.take``: a worker asks the holder of kept value `kept` for it."""

    session: str  # the driver whose request it is
    kept: int
    requester: str


class CallHead(msgspec.Struct, frozen=True):
    deployment: str
    replica: int
    request_id: str
    stream: bool = False
    refs: list[BufferRef] = []  # the arguments' out-of-band buffers
    released: list[int] = []  # leases of the worker's segments the driver is done with
    # workers that served earlier nodes of this request, latest first: their stores may hold
    # pages this call needs before the cluster's KV directory has heard of them
    kv_from: list[WorkerAddress] = []
    keep: bool = False  # only class nodes take the result: keep it here if it is large
    kept_args: list[KeptArg] = []  # arguments to take from the workers that keep them
    kept_released: list[int] = []  # kept values of this worker the driver let go of
    stage: int = 0  # its place in a chain: > 0 when the stage before's worker sent it
    then: list[Stage] = []  # the chain's later stages: the result is the next one's argument
    chain: Chain | None = None  # set on a chain's stages (``node.chain``)


class Stage(msgspec.Struct, array_like=True, frozen=True):
    """A later stage of a chain: its worker, and its call's head as the driver made it (the
    worker before adds the argument: its own result)."""

    worker: WorkerAddress
    head: CallHead


class ValueHead(msgspec.Struct, frozen=True):
    """A call's result: its buffer refs, and the driver's leases the worker released; or,
    when `kept`, the id under which the worker keeps it (and its out-of-band bytes)."""

    refs: list[BufferRef] = []
    released: list[int] = []
    kept: int = 0
    kept_bytes: int = 0


class Chain(msgspec.Struct, array_like=True, frozen=True):
    """A chain's token at its driver, and what its stages so far pass on to the driver: each
    one's own seconds, and the driver's leases released on their workers."""

    session: str  # the driver's
    token: int
    seconds: list[float] = []
    released: list[tuple[str, list[int]]] = []  # (worker, lease ids)


class Broken(msgspec.Struct, array_like=True, frozen=True):
    """How a chain broke: its stage `stage` failed on worker `member` with an error of type
    `remote_type` (`traceback`: as the worker printed it), or (`lost`) that worker stopped
    answering."""

    stage: int
    member: str
    remote_type: str
    message: str
    lost: bool = False
    traceback: str = ""

    @classmethod
    def of(cls, stage: int, member: str, error: BaseException, *, lost: bool = False
           ) -> Broken:
        """`error`'s, raised by stage `stage` on worker `member` (message and traceback cut
        short; a lost worker's error was raised here, so its traceback is of no use)."""
        remote_type, message = describe(error)
        text = "" if lost else traceback_text(error, _CHAIN_TRACEBACK_CHARS)
        return cls(stage, member, remote_type, message[:_CHAIN_ERROR_CHARS], lost, text)

    def cause(self) -> Exception:
        """The stage's error as the driver raises it: `WorkerLost` for a lost worker (an
        earlier stage's value went on: `_lost_midway`), else `RemoteNodeError`."""
        if self.lost:
            return _lost_midway(self.member, self.message)
        return RemoteNodeError(self.member, self.remote_type, self.message,
                               remote_traceback=self.traceback)


class ChainEnd(msgspec.Struct, frozen=True):
    """``chain.end``, a notice to the driver: the chain's last value (`value`, its frames the
    payload), from the last stage's worker `sender`, or how it broke (`broken`), from the
    worker of the stage that failed; with what its stages passed on (`chain`)."""

    chain: Chain
    sender: str
    value: ValueHead | None = None
    broken: Broken | None = None


class StreamBatch(msgspec.Struct, frozen=True):
    count: int
    done: bool
    refs: list[list[BufferRef]] = []  # per item
    released: list[int] = []


class Feed(msgspec.Struct, frozen=True):
    """Items of a stream argument, driver to worker; `error` ends the stream with a failure."""

    session: str
    feed: int
    refs: list[list[BufferRef]] = []  # per item
    done: bool = False
    error: str = ""


class Renew(msgspec.Struct, frozen=True):
    session: str
    released: list[int] = []
    kept: list[int] = []  # kept values the driver let go of


class Chunk(msgspec.Struct, frozen=True):
    """A chunk of a payload transfer (`omni.transport.movers`): pushed by the driver with
    the chunk as its frame (``payload.push``), or asked of the worker (``payload.pull``)."""

    session: str
    transfer: int
    offset: int
    nbytes: int = 0  # the transfer's, on a push


def encode_for(value: Any, *, same_host: bool, streams: Callable[[Any], int] | None = None
               ) -> Packed:
    """`value` encoded for a peer (no bytes copied yet). Raises TypeError if it cannot
    travel."""
    return pack_value(value, streams=streams, cuda_ipc=same_host)


def pack_out(mover: PayloadMover, packed: Packed, *, peer: str, same_host: bool
             ) -> tuple[list[BufferRef], list[Any]]:
    """`packed`'s buffer refs, and its frames ``[body, *buffers]``, for `peer`, moved in the
    calling thread (`move_out` from the event loop)."""
    refs, frames = mover.pack(packed.buffers, peer=peer, same_host=same_host)
    return refs, [packed.body, *frames]


async def move_out(mover: PayloadMover, packed: Packed, *, peer: str, same_host: bool
                   ) -> tuple[list[BufferRef], list[Any]]:
    """`pack_out` from the event loop: a copy into shared memory of `OFF_LOOP_BYTES` or more
    runs in a thread, since a gigabyte takes the better part of a second, in which the event
    loop must go on answering heartbeats and calls."""
    if same_host and mover.shm and sum(b.nbytes for b in packed.buffers) >= OFF_LOOP_BYTES:
        return await trio.to_thread.run_sync(functools.partial(
            pack_out, mover, packed, peer=peer, same_host=same_host))
    return pack_out(mover, packed, peer=peer, same_host=same_host)


async def pack_for(mover: PayloadMover, value: Any, *, peer: str, same_host: bool
                   ) -> tuple[list[BufferRef], list[Any]]:
    """`value`'s buffer refs, and its frames ``[body, *buffers]``, for `peer`."""
    return await move_out(mover, encode_for(value, same_host=same_host), peer=peer,
                          same_host=same_host)


async def unpack_from(mover: PayloadMover, refs: list[BufferRef], frames: Any, *, peer: str,
                      streams: Callable[[int], Any] | None = None) -> Any:
    """The value `pack_for` sent from `peer` (frames: ``[body, *buffers]``); shared memory of
    `OFF_LOOP_BYTES` or more is mapped in a thread (see `move_out`)."""
    if sum(r.nbytes for r in refs if r.segment) < OFF_LOOP_BYTES:
        return unpack_here(mover, refs, frames, peer=peer, streams=streams)
    if not frames:
        raise WireError("a value arrived without its body")
    buffers = await trio.to_thread.run_sync(functools.partial(
        mover.unpack, refs, frames[1:], peer=peer))
    return unpack_value(frames[0], buffers, streams=streams)


def unpack_here(mover: PayloadMover, refs: list[BufferRef], frames: Any, *, peer: str,
                streams: Callable[[int], Any] | None = None) -> Any:
    """`unpack_from` in the calling thread."""
    if not frames:
        raise WireError("a value arrived without its body")
    return unpack_value(frames[0], mover.unpack(refs, frames[1:], peer=peer), streams=streams)


def split_items(refs: list[list[BufferRef]], frames: Any) -> list[tuple[list[BufferRef], Any]]:
    """Per item, its refs and its frames, from a batch's concatenated frames."""
    items, position = [], 0
    for item_refs in refs:
        count = 1 + sum(r.frames for r in item_refs)
        items.append((item_refs, frames[position:position + count]))
        position += count
    return items


class KeptReleases:
    """The kept values a driver has let go of, per worker, until they go back to it (with the
    next call or renewal). Thread-safe: a `KeptValue` is let go of wherever the garbage
    collector finds it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: dict[str, list[int]] = {}

    def add(self, member: str, kept: int) -> None:
        with self._lock:
            self._ids.setdefault(member, []).append(kept)

    def take(self, member: str) -> list[int]:
        if not self._ids:  # the common case, on every call: no lock (one added meanwhile
            return []      # goes with the next call)
        with self._lock:
            return self._ids.pop(member, [])


class KeptValue:
    """A node's result kept on worker `holder` (see the module doc): what the scheduler holds
    in its place. Only class nodes' calls take it (`CallContext.keep`); it cannot be used here.
    """

    __slots__ = ("__weakref__", "holder", "kept", "nbytes")

    def __init__(self, holder: WorkerAddress, kept: int, nbytes: int, releases: KeptReleases):
        self.holder = holder
        self.kept = kept
        self.nbytes = nbytes
        weakref.finalize(self, releases.add, holder.name, kept)

    def __repr__(self) -> str:
        return f"<KeptValue {self.kept} on {self.holder.name}: {self.nbytes} bytes>"


class RequestTrail:
    """Which workers served each recent request's nodes, latest first: the pages an earlier
    stage of a request computed follow it to the next stage's worker (`CallHead.kv_from`).

    Bounded: the oldest requests are forgotten first (a request's trail matters only while
    it runs)."""

    MAX_REQUESTS = 4096
    MAX_MEMBERS = 4

    def __init__(self) -> None:
        self._trails: OrderedDict[str, list[WorkerAddress]] = OrderedDict()

    def note(self, request_id: str, *holders: WorkerAddress) -> None:
        """`holders` served the request, in that order (the last one latest)."""
        latest = holders[::-1]
        names = {h.name for h in holders}
        trail = self._trails.pop(request_id, ())
        self._trails[request_id] = [*latest, *(h for h in trail if h.name not in names)][
            :self.MAX_MEMBERS]
        while len(self._trails) > self.MAX_REQUESTS:
            self._trails.popitem(last=False)

    def holders(self, request_id: str, exclude: str) -> list[WorkerAddress]:
        return [h for h in self._trails.get(request_id, ()) if h.name != exclude]


class RemoteReplica:
    """A replica of `node` hosted by worker `member`, reached through `client`.

    Args:
        mover: the process's payload mover.
        same_host: the worker shares this host's shared memory.
        session: the driver's session id (names this driver to the worker).
        nursery: where stream arguments' feeders run (the cluster link's).
        trail: the driver's record of which workers served each request (None: none kept,
            and no call names them: the nodes keep no KV).
        address: the worker's address, for that record, kept values and chains.
        releases: the driver's kept values let go of (None: results are never kept).
        chains: the driver's end of its chains (None: this replica starts none).
    """

    omni_remote = True
    _feeds = itertools.count(1)

    def __init__(self, member: str, client: RPCClient, deployment: str, replica: int,
                 streaming: bool, *, mover: PayloadMover, same_host: bool, session: str,
                 nursery: trio.Nursery, trail: RequestTrail | None = None,
                 address: WorkerAddress | None = None, releases: KeptReleases | None = None,
                 chains: ChainEnds | None = None):
        self.member = member
        self.client = client
        self.deployment = deployment
        self.replica = replica
        self.streaming = streaming
        self.mover = mover
        self.same_host = same_host
        self.session = session
        self.nursery = nursery
        self.trail = trail
        self.address = address or WorkerAddress(member, "")
        self.lane = self.address.lane_endpoint()  # where its chains start, or ''
        self.releases = releases
        self.chains = chains
        self.lost = False

    @property
    def alive(self) -> bool:
        return not self.lost and self.client.peer_alive

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from omni.graph.context import current

        call = current.get()
        request_id = call.request_id if call is not None and call.request_id is not None else "-"
        keep = call is not None and call.keep and self.releases is not None
        args, kwargs, kept = _take_out_kept(args, kwargs)
        inputs: list[tuple[int, Any]] = []

        def stream_id(stream: Any) -> int:
            inputs.append((next(self._feeds), stream))
            return inputs[-1][0]

        try:
            packed = encode_for([list(args), kwargs], same_host=self.same_host,
                                streams=stream_id)
        except TypeError as exc:
            raise TypeError(f"cannot send the call's arguments to worker '{self.member}': "
                            f"{exc}") from None
        if self.streaming:
            return self._stream(request_id, packed, inputs, kept)
        return self._call(request_id, packed, inputs, kept, keep)

    async def _send_call(self, request_id: str, packed: Packed, kept: list[KeptArg], *,
                         keep: bool = False) -> tuple[CallHead, list[Any]]:
        """The call's head and frames, its buffers moved (pushed, for transfers)."""
        refs, frames = await move_out(self.mover, packed, peer=self.member,
                                      same_host=self.same_host)
        await self._push(refs)
        return self._head(request_id, refs, keep=keep, kept=kept), frames

    def _head(self, request_id: str, refs: list[BufferRef], *, keep: bool,
              kept: list[KeptArg] | None = None, stage: int = 0,
              before: Sequence[WorkerAddress] = ()) -> CallHead:
        """The head of a call of this replica: the leases and kept values released since it
        last went there, and the workers whose pages the request may find there (`before`:
        those of a chain's earlier stages, latest first, then the request's trail)."""
        kv_from: list[WorkerAddress] = []
        if self.trail is not None:  # (None: the nodes keep no KV, so none follows)
            kv_from = [a for a in before if a.name != self.member]
            kv_from += [a for a in self.trail.holders(request_id, self.member)
                        if a not in kv_from]
        let_go = [] if self.releases is None else self.releases.take(self.member)
        return CallHead(self.deployment, self.replica, request_id, self.streaming, refs,
                        self.mover.take_releases(self.member), kv_from, keep, kept or [],
                        let_go, stage)

    def _served(self, request_id: str, *later: RemoteReplica) -> None:
        """Note that this replica's worker served the request (then `later`'s, in order)."""
        if self.trail is not None and request_id != "-":
            self.trail.note(request_id, self.address, *(replica.address for replica in later))

    async def _call(self, request_id: str, packed: Packed, inputs: list, kept: list[KeptArg],
                    keep: bool) -> Any:
        head, frames = await self._send_call(request_id, packed, kept, keep=keep)
        feeders = self._start_feeders(inputs)
        try:
            reply = await self._rpc("node.call", head, frames, result_type=ValueHead,
                                    kept=kept)
        finally:
            for scope in feeders:
                scope.cancel()
        self.mover.release(self.member, reply.body.released)
        self._served(request_id)
        if reply.body.kept:
            assert self.releases is not None
            return KeptValue(self.address, reply.body.kept, reply.body.kept_bytes,
                             self.releases)
        await self._pull(reply.body.refs)
        return await unpack_from(self.mover, reply.body.refs, reply.payload, peer=self.member)

    async def omni_chain(self, request_id: str, args: tuple, kwargs: dict[str, Any],
                         later: Sequence[RemoteReplica], *, keep: bool
                         ) -> tuple[Any, list[float]]:
        """Run this replica's node on `args`, then each of `later`'s on the value of the one
        before, as one chain of notices: each worker sends its result straight to the next
        stage's worker, and the last one the chain's value to this driver (`ChainEnds`), as
        does any stage that fails. `keep`: only class nodes take the last value. Returns the
        last value and each stage's seconds.

        Raises:
            WorkerLost: this replica's worker stopped answering.
            StageError: a later stage failed (its cause a `RemoteNodeError`, or a `WorkerLost`
                as of a stream that had passed items on).
            RemoteNodeError: this replica's stage failed.
        """
        ends = self.chains
        assert ends is not None, "chains need the driver's ChainEnds"
        args, kwargs, kept = _take_out_kept(args, kwargs)
        try:
            packed = encode_for([list(args), kwargs], same_host=self.same_host)
        except TypeError as exc:
            raise TypeError(f"cannot send the call's arguments to worker '{self.member}': "
                            f"{exc}") from None
        head, frames = await self._send_call(request_id, packed, kept)
        stages, before = [], [self.address]
        for i, replica in enumerate(later, 1):
            last_keeps = keep and i == len(later) and replica.releases is not None
            stages.append(Stage(replica.address, replica._head(
                request_id, [], keep=last_keeps, stage=i, before=before)))
            before.insert(0, replica.address)
        replicas = (self, *later)
        waiting = ends.open(replicas)
        try:
            await ends.start(self, msgspec.structs.replace(
                head, then=stages, chain=Chain(self.session, waiting.token)), frames)
            end, payload = await waiting.result()
        except PeerGone as exc:
            raise self._lost(f"no heartbeat for {exc.silent_for:.1f} s") from None
        finally:
            ends.close(waiting)
        for member, released in end.chain.released:
            self.mover.release(member, released)
        broken = end.broken
        if broken is not None:
            if broken.stage > 0:
                raise StageError(broken.stage, broken.cause())
            if broken.lost:  # this replica's own worker: as a plain call's
                raise self._lost(broken.message)
            raise _call_failure(self.member, broken.remote_type, broken.message, kept,
                                broken.traceback)
        self._served(request_id, *later)
        last = later[-1]
        assert end.value is not None
        if end.value.kept:
            assert last.releases is not None
            value = KeptValue(last.address, end.value.kept, end.value.kept_bytes,
                              last.releases)
        else:
            await last._pull(end.value.refs)
            value = await unpack_from(self.mover, end.value.refs, payload, peer=last.member)
        return value, end.chain.seconds

    # -- payload transfers: the driver pushes what it sends and pulls what it receives, a
    # chunk at a time, so neither side holds more than the value and one chunk --------------

    async def _push(self, refs: list[BufferRef]) -> None:
        transfers = [ref for ref in refs if ref.transfer]
        if not transfers:
            return
        try:
            for ref in transfers:
                offset = 0
                while offset < ref.nbytes:
                    chunk = self.mover.chunk_of(self.member, ref.transfer, offset)
                    await self._rpc("payload.push", Chunk(self.session, ref.transfer, offset,
                                                          ref.nbytes), [chunk])
                    offset += chunk.nbytes
        except BaseException:
            self.mover.drop_transfers(self.member, [ref.transfer for ref in transfers])
            raise

    async def _pull(self, refs: list[BufferRef]) -> None:
        if not any(ref.transfer for ref in refs):
            return
        await pull_transfers(self.mover, refs, self.member,
                             lambda chunk: self._rpc("payload.pull", chunk, []),
                             session=self.session)

    async def _stream(self, request_id: str, packed: Packed, inputs: list, kept: list[KeptArg]
                      ) -> AsyncIterator[Any]:
        head, frames = await self._send_call(request_id, packed, kept)
        feeders = self._start_feeders(inputs)
        done = False
        stream_id: int | None = None
        try:
            reply = await self._rpc("node.call", head, frames, result_type=int, kept=kept)
            stream_id = reply.body
            self._served(request_id)
            while not done:
                reply = await self._rpc("node.next", [stream_id, STREAM_BATCH], [],
                                        result_type=StreamBatch)
                batch = reply.body
                done = batch.done
                self.mover.release(self.member, batch.released)
                for refs, item in split_items(batch.refs, reply.payload):
                    await self._pull(refs)
                    yield await unpack_from(self.mover, refs, item, peer=self.member)
        finally:
            for scope in feeders:
                scope.cancel()
            if stream_id is not None and not done and self.alive:
                self.nursery.start_soon(self._close_stream, stream_id)

    async def _close_stream(self, stream_id: int) -> None:
        try:
            await self.client.call("node.close", stream_id, timeout=2.0)
        except TransportError:
            pass  # the worker drops idle streams by itself

    # -- stream arguments --------------------------------------------------------------------

    def _start_feeders(self, inputs: list[tuple[int, Any]]) -> list[trio.CancelScope]:
        scopes = []
        for feed_id, stream in inputs:
            scope = trio.CancelScope()
            self.nursery.start_soon(self._feed, feed_id, stream, scope)
            scopes.append(scope)
        return scopes

    async def _feed(self, feed_id: int, stream: Any, scope: trio.CancelScope) -> None:
        """Send `stream`'s items to the worker in batches, each once the last one landed.

        It runs in the cluster link's nursery, so it never raises: whatever goes wrong (the
        upstream node fails, an item cannot travel) ends the stream on the worker with an
        error, which fails the call there and so the request here."""
        with scope:
            send, receive = trio.open_memory_channel[Any](STREAM_BATCH)
            failure: list[str] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_read_into, stream, send, failure)
                async with receive:
                    while True:
                        items = await _take_batch(receive)
                        done = len(items) < STREAM_BATCH and _drained(receive)
                        error = failure[0] if failure else ""
                        if not await self._send_feed(feed_id, items, done, error) \
                                or done or error:
                            nursery.cancel_scope.cancel()  # finished, or the worker wants no more
                            return

    async def _send_feed(self, feed_id: int, items: list[Any], done: bool, error: str) -> bool:
        """One batch (False: the worker wants no more, or cannot be reached)."""
        refs, frames = [], []
        try:
            for item in items:
                item_refs, item_frames = await pack_for(self.mover, item, peer=self.member,
                                                        same_host=self.same_host)
                refs.append(item_refs)
                frames.extend(item_frames)
        except (TypeError, TransportError) as exc:
            refs, frames, error = [], [], f"an item cannot travel to the worker: {exc}"
        try:
            for item_refs in refs:
                await self._push(item_refs)
            reply = await self.client.call_with_payload(
                "node.feed", Feed(self.session, feed_id, refs, done, error), payload=frames,
                result_type=bool)
        except (TransportError, WorkerLost, RemoteNodeError):
            return False  # the call itself reports a lost worker
        return bool(reply.body) and not error

    async def _rpc(self, method: str, body: Any, payload: list[Any], *,
                   result_type: Any = Any, kept: Sequence[KeptArg] = ()) -> Any:
        try:
            return await self.client.call_with_payload(method, body, payload=payload,
                                                       result_type=result_type)
        except PeerGone as exc:
            raise self._lost(f"no heartbeat for {exc.silent_for:.1f} s") from None
        except RPCError as exc:
            raise _call_failure(self.member, exc.remote_type, exc.remote_message,
                                kept, exc.remote_traceback) from None

    def _lost(self, why: str) -> WorkerLost:
        """This replica's worker stopped answering: mark it lost; the error to raise."""
        self.lost = True
        self.mover.forget(self.member)
        return WorkerLost(self.member, why)

    def __repr__(self) -> str:
        state = "alive" if self.alive else "lost"
        return f"<RemoteReplica {self.deployment}#{self.replica} on {self.member} {state}>"


def _call_failure(member: str, remote_type: str, message: str, kept: Sequence[KeptArg],
                  traceback: str) -> Exception:
    """What a call that failed on worker `member` raises here (`traceback`: the worker's)."""
    if remote_type == KeptValueLost.__name__ and kept:  # went with the worker that kept it
        return _lost_midway(kept[0].holder.name, message)
    return RemoteNodeError(member, remote_type, message, remote_traceback=traceback)


def _lost_midway(member: str, detail: str) -> WorkerLost:
    """`WorkerLost` for a worker lost after part of the request had gone on from it (a kept
    argument, a chain's earlier stage): as a stream that had passed items on, not retried by
    itself; the request runs again from the start (`omni.Runtime.run`)."""
    lost = WorkerLost(member, detail)
    lost.items_passed = 1
    return lost


def _take_out_kept(args: tuple, kwargs: dict[str, Any]
                   ) -> tuple[tuple, dict[str, Any], list[KeptArg]]:
    """`args` and `kwargs` with each `KeptValue` replaced by None, and where they were."""
    if not any(type(a) is KeptValue for a in (*args, *kwargs.values())):
        return args, kwargs, []
    kept: list[KeptArg] = []
    new_args = list(args)
    for i, arg in enumerate(args):
        if type(arg) is KeptValue:
            kept.append(KeptArg(i, "", arg.holder, arg.kept))
            new_args[i] = None
    new_kwargs = dict(kwargs)
    for key, arg in kwargs.items():
        if type(arg) is KeptValue:
            kept.append(KeptArg(-1, key, arg.holder, arg.kept))
            new_kwargs[key] = None
    return tuple(new_args), new_kwargs, kept


async def pull_transfers(mover: PayloadMover, refs: list[BufferRef], peer: str,
                         pull: Callable[[Chunk], Awaitable[Any]], *, session: str = "") -> None:
    """Receive the transfers among `refs` from `peer`, a chunk at a time (``pull(Chunk)``:
    its reply's one frame), so that this process holds the value and one chunk, no more.
    `session` names this process to the sender (default: `peer`)."""
    transfers = [ref for ref in refs if ref.transfer]
    try:
        for ref in transfers:
            offset = 0
            while offset < ref.nbytes:
                reply = await pull(Chunk(session or peer, ref.transfer, offset))
                if len(reply.payload) != 1:
                    raise WireError(f"a chunk arrived in {len(reply.payload)} frames")
                mover.accept(peer, ref.transfer, ref.nbytes, offset, reply.payload[0])
                offset += memoryview(reply.payload[0]).nbytes
    except BaseException:
        mover.drop_transfers(peer, [ref.transfer for ref in transfers])
        raise


async def _read_into(stream: Any, send: trio.MemorySendChannel, failure: list[str]) -> None:
    async with send:
        try:
            async for item in stream:
                await send.send(item)
        except Exception as exc:  # the upstream node failed: its request fails anyway
            failure.append(f"{type(exc).__name__}: {exc}")


async def _take_batch(receive: trio.MemoryReceiveChannel) -> list[Any]:
    """One item or more, up to `STREAM_BATCH` (what is there once the first arrives)."""
    try:
        items = [await receive.receive()]
    except trio.EndOfChannel:
        return []
    while len(items) < STREAM_BATCH:
        try:
            items.append(receive.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            break
    return items


def _drained(receive: trio.MemoryReceiveChannel) -> bool:
    """Whether the reader finished and everything it read has been taken."""
    stats = receive.statistics()
    return stats.open_send_channels == 0 and stats.current_buffer_used == 0
