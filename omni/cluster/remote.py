"""Replicas on cluster workers, as the driver sees them.

A `RemoteReplica` stands in a pool where a class node's instance would: calling it runs the
node on its worker (``node.call``), and a streaming node's items come back in batches pulled
by the driver (``node.next``), so a slow consumer slows the producer instead of filling
memory. An argument that is a stream is fed to the worker in batches (``node.feed``), each
batch answered once the worker's node has room for it: backpressure both ways.

Values travel as themselves (`omni.transport.values`): the body carries the structure, and
arrays go out of band by locality (`omni.transport.payloads`): through shared memory when
the worker is on this host, else as zero-copy frames. A message is ``[body, *frames]`` per
value; its head (`CallHead`, `ValueHead`, `StreamBatch`, `Feed`) carries the buffer refs, and
the shared-memory leases each side released since it last spoke, so segments are reused.

When the worker stops answering heartbeats the replica is marked dead: the call fails with
`WorkerLost` naming the worker (a `ReplicaLost`: the scheduler retries it once on a live
replica, unless a stream had passed items on), and the pool places no more calls on it until
the cluster runtime replaces it (calls wait for that, see `omni.graph.balance.Pool`).
"""

from __future__ import annotations

import functools
import itertools
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import trio

from omni.cluster._code import CodeRef
from omni.cluster.errors import RemoteNodeError, WorkerLost
from omni.transport.cuda import cuda_ipc_enabled
from omni.transport.errors import PeerGone, RPCError, TransportError, WireError
from omni.transport.payloads import BufferRef, PayloadMover
from omni.transport.rpc import RPCClient
from omni.transport.values import Packed, pack_value, unpack_value

__all__ = ["CallHead", "Chunk", "Deploy", "Feed", "KVHolder", "RemoteReplica", "Renew",
           "RequestTrail", "StreamBatch", "ValueHead", "pack_for", "split_items", "unpack_from"]

STREAM_BATCH = 64  # items a stream pull may bring back, or a feed carry, at once
OFF_LOOP_BYTES = 16 << 20  # shared-memory copies and mappings this large run in a thread


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
    host_id: str = ""  # the driver's host: on the same one, values move through shared memory


class KVHolder(msgspec.Struct, array_like=True, frozen=True):
    """A worker that served an earlier node of a request, and its TCP endpoint (a worker that
    has not heard of it yet from the head can still reach it)."""

    name: str
    rpc: str


class CallHead(msgspec.Struct, frozen=True):
    deployment: str
    replica: int
    request_id: str
    stream: bool = False
    refs: list[BufferRef] = []  # the arguments' out-of-band buffers
    released: list[int] = []  # leases of the worker's segments the driver is done with
    # workers that served earlier nodes of this request, latest first: their stores may hold
    # pages this call needs before the cluster's KV directory has heard of them
    kv_from: list[KVHolder] = []


class ValueHead(msgspec.Struct, frozen=True):
    """A call's result: its buffer refs, and the driver's leases the worker released."""

    refs: list[BufferRef] = []
    released: list[int] = []


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


class Chunk(msgspec.Struct, frozen=True):
    """A chunk of a payload transfer (`omni.transport.payloads`): pushed by the driver with
    the chunk as its frame (``payload.push``), or asked of the worker (``payload.pull``)."""

    session: str
    transfer: int
    offset: int
    nbytes: int = 0  # the transfer's, on a push


def encode_for(value: Any, *, same_host: bool, streams: Callable[[Any], int] | None = None
               ) -> Packed:
    """`value` encoded for a peer (no bytes copied yet). Raises TypeError if it cannot
    travel."""
    return pack_value(value, streams=streams, cuda_ipc=same_host and cuda_ipc_enabled())


async def move_out(mover: PayloadMover, packed: Packed, *, peer: str, same_host: bool
                   ) -> tuple[list[BufferRef], list[Any]]:
    """`packed`'s buffer refs, and its frames ``[body, *buffers]``, for `peer`. A copy into
    shared memory of `OFF_LOOP_BYTES` or more runs in a thread: a gigabyte takes the better
    part of a second, in which the event loop must go on answering heartbeats and calls."""
    if same_host and mover.shm and sum(b.nbytes for b in packed.buffers) >= OFF_LOOP_BYTES:
        refs, frames = await trio.to_thread.run_sync(functools.partial(
            mover.pack, packed.buffers, peer=peer, same_host=same_host))
    else:
        refs, frames = mover.pack(packed.buffers, peer=peer, same_host=same_host)
    return refs, [packed.body, *frames]


async def pack_for(mover: PayloadMover, value: Any, *, peer: str, same_host: bool
                   ) -> tuple[list[BufferRef], list[Any]]:
    """`value`'s buffer refs, and its frames ``[body, *buffers]``, for `peer`."""
    return await move_out(mover, encode_for(value, same_host=same_host), peer=peer,
                          same_host=same_host)


async def unpack_from(mover: PayloadMover, refs: list[BufferRef], frames: Any, *, peer: str,
                      streams: Callable[[int], Any] | None = None) -> Any:
    """The value `pack_for` sent from `peer` (frames: ``[body, *buffers]``); shared memory of
    `OFF_LOOP_BYTES` or more is mapped in a thread (see `move_out`)."""
    if not frames:
        raise WireError("a value arrived without its body")
    if sum(r.nbytes for r in refs if r.segment) >= OFF_LOOP_BYTES:
        buffers = await trio.to_thread.run_sync(functools.partial(
            mover.unpack, refs, frames[1:], peer=peer))
    else:
        buffers = mover.unpack(refs, frames[1:], peer=peer)
    return unpack_value(frames[0], buffers, streams=streams)


def split_items(refs: list[list[BufferRef]], frames: Any) -> list[tuple[list[BufferRef], Any]]:
    """Per item, its refs and its frames, from a batch's concatenated frames."""
    items, position = [], 0
    for item_refs in refs:
        count = 1 + sum(r.frames for r in item_refs)
        items.append((item_refs, frames[position:position + count]))
        position += count
    return items


class RequestTrail:
    """Which workers served each recent request's nodes, latest first: the pages an earlier
    stage of a request computed follow it to the next stage's worker (`CallHead.kv_from`).

    Bounded: the oldest requests are forgotten first (a request's trail matters only while
    it runs)."""

    MAX_REQUESTS = 4096
    MAX_MEMBERS = 4

    def __init__(self) -> None:
        self._trails: OrderedDict[str, list[KVHolder]] = OrderedDict()

    def note(self, request_id: str, holder: KVHolder) -> None:
        trail = self._trails.pop(request_id, [])
        self._trails[request_id] = [holder, *(h for h in trail if h.name != holder.name)][
            :self.MAX_MEMBERS]
        while len(self._trails) > self.MAX_REQUESTS:
            self._trails.popitem(last=False)

    def holders(self, request_id: str, exclude: str) -> list[KVHolder]:
        return [h for h in self._trails.get(request_id, ()) if h.name != exclude]


class RemoteReplica:
    """A replica of `node` hosted by worker `member`, reached through `client`.

    Args:
        mover: the process's payload mover.
        same_host: the worker shares this host's shared memory.
        session: the driver's session id (names this driver to the worker).
        nursery: where stream arguments' feeders run (the cluster link's).
        trail: the driver's record of which workers served each request (None: none kept).
        member_rpc: the worker's TCP endpoint, for that record.
    """

    omni_remote = True
    _feeds = itertools.count(1)

    def __init__(self, member: str, client: RPCClient, deployment: str, replica: int,
                 streaming: bool, *, mover: PayloadMover, same_host: bool, session: str,
                 nursery: trio.Nursery, trail: RequestTrail | None = None,
                 member_rpc: str = ""):
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
        self._holder = KVHolder(member, member_rpc)
        self.lost = False

    @property
    def alive(self) -> bool:
        return not self.lost and self.client.peer_alive

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from omni.graph.context import current

        call = current.get()
        request_id = call.request_id if call is not None and call.request_id is not None else "-"
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
            return self._stream(request_id, packed, inputs)
        return self._call(request_id, packed, inputs)

    async def _send_call(self, request_id: str, packed: Packed) -> tuple[CallHead, list[Any]]:
        """The call's head and frames, its buffers moved (pushed, for transfers)."""
        refs, frames = await move_out(self.mover, packed, peer=self.member,
                                      same_host=self.same_host)
        await self._push(refs)
        trail = [] if self.trail is None else self.trail.holders(request_id, self.member)
        return CallHead(self.deployment, self.replica, request_id, self.streaming, refs,
                        self.mover.take_releases(self.member), trail), frames

    def _served(self, request_id: str) -> None:
        if self.trail is not None and request_id != "-":
            self.trail.note(request_id, self._holder)

    async def _call(self, request_id: str, packed: Packed, inputs: list) -> Any:
        head, frames = await self._send_call(request_id, packed)
        feeders = self._start_feeders(inputs)
        try:
            reply = await self._rpc("node.call", head, frames, result_type=ValueHead)
        finally:
            for scope in feeders:
                scope.cancel()
        self.mover.release(self.member, reply.body.released)
        self._served(request_id)
        await self._pull(reply.body.refs)
        return await unpack_from(self.mover, reply.body.refs, reply.payload, peer=self.member)

    # -- payload transfers: the driver pushes what it sends and pulls what it receives, a
    # chunk at a time, so neither side holds more than the value and one chunk --------------

    async def _push(self, refs: list[BufferRef]) -> None:
        transfers = [ref for ref in refs if ref.transfer]
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
        transfers = [ref for ref in refs if ref.transfer]
        try:
            for ref in transfers:
                offset = 0
                while offset < ref.nbytes:
                    reply = await self._rpc("payload.pull",
                                            Chunk(self.session, ref.transfer, offset), [])
                    if len(reply.payload) != 1:
                        raise WireError(f"a chunk arrived in {len(reply.payload)} frames")
                    self.mover.accept(self.member, ref.transfer, ref.nbytes, offset,
                                      reply.payload[0])
                    offset += memoryview(reply.payload[0]).nbytes
        except BaseException:
            self.mover.drop_transfers(self.member, [ref.transfer for ref in transfers])
            raise

    async def _stream(self, request_id: str, packed: Packed, inputs: list
                      ) -> AsyncIterator[Any]:
        head, frames = await self._send_call(request_id, packed)
        feeders = self._start_feeders(inputs)
        done = False
        stream_id: int | None = None
        try:
            reply = await self._rpc("node.call", head, frames, result_type=int)
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
                   result_type: Any = Any) -> Any:
        try:
            return await self.client.call_with_payload(method, body, payload=payload,
                                                       result_type=result_type)
        except PeerGone as exc:
            self.lost = True
            self.mover.forget(self.member)
            raise WorkerLost(self.member, f"no heartbeat for {exc.silent_for:.1f} s") from None
        except RPCError as exc:
            raise RemoteNodeError(self.member, exc.remote_type, exc.remote_message) from None

    def __repr__(self) -> str:
        state = "alive" if self.alive else "lost"
        return f"<RemoteReplica {self.deployment}#{self.replica} on {self.member} {state}>"


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
