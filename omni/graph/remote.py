"""Replicas on cluster workers, as the driver sees them.

A `RemoteReplica` stands in a pool where a class node's instance would: calling it runs the
node on its worker (``node.call``), and a streaming node's items come back in batches pulled
by the driver (``node.next``), so a slow consumer slows the producer instead of filling
memory. Arguments and results travel as `omni.transport.values` (msgpack, tensors as raw
bytes), in payload frames.

When the worker stops answering heartbeats the replica is marked dead: the call fails with
`WorkerLost` naming the worker (a node with ``retries`` is retried on another replica), and the
pool places no more calls on it until the cluster runtime replaces it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec

from omni.graph._code import CodeRef
from omni.transport.errors import PeerGone, RPCError, TransportError
from omni.transport.rpc import RPCClient
from omni.transport.values import decode_value, encode_value

__all__ = ["CallHead", "Deploy", "RemoteNodeError", "RemoteReplica", "StreamBatch",
           "WorkerLost"]

STREAM_BATCH = 64  # items a stream pull may bring back at once


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


class CallHead(msgspec.Struct, frozen=True):
    deployment: str
    replica: int
    request_id: str
    stream: bool = False


class StreamBatch(msgspec.Struct, frozen=True):
    count: int
    done: bool


class WorkerLost(Exception):
    """The worker hosting a replica stopped answering while a call was on it."""

    def __init__(self, member: str, detail: str):
        self.member = member
        super().__init__(f"worker '{member}' stopped answering ({detail})")


class RemoteNodeError(Exception):
    """A node raised on its worker; `remote_type` is its exception's type name."""

    def __init__(self, member: str, remote_type: str, message: str):
        self.member = member
        self.remote_type = remote_type
        super().__init__(f"{remote_type}: {message} (on worker '{member}')")


class RemoteReplica:
    """A replica of `node` hosted by worker `member`, reached through `client`."""

    omni_remote = True

    def __init__(self, member: str, client: RPCClient, deployment: str, replica: int,
                 streaming: bool):
        self.member = member
        self.client = client
        self.deployment = deployment
        self.replica = replica
        self.streaming = streaming
        self.lost = False

    @property
    def alive(self) -> bool:
        return not self.lost and self.client.peer_alive

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from omni.graph.context import current

        value = current.get()
        request_id = value[0] if value is not None and value[0] is not None else "-"
        frame = _encode_args(args, kwargs, self.member)
        if self.streaming:
            return self._stream(request_id, frame)
        return self._call(request_id, frame)

    async def _call(self, request_id: str, frame: bytes) -> Any:
        head = CallHead(self.deployment, self.replica, request_id)
        reply = await self._rpc("node.call", head, [frame])
        return decode_value(reply.payload[0])

    async def _stream(self, request_id: str, frame: bytes) -> AsyncIterator[Any]:
        head = CallHead(self.deployment, self.replica, request_id, stream=True)
        reply = await self._rpc("node.call", head, [frame])
        stream_id = reply.body
        done = False
        try:
            while not done:
                reply = await self._rpc("node.next", [stream_id, STREAM_BATCH], [])
                batch = msgspec.convert(reply.body, StreamBatch)
                done = batch.done
                for item in reply.payload:
                    yield decode_value(item)
        finally:
            if not done and self.alive:
                try:
                    await self.client.call("node.close", stream_id, timeout=2.0)
                except TransportError:
                    pass  # the worker drops idle streams by itself

    async def _rpc(self, method: str, body: Any, payload: list[bytes]) -> Any:
        try:
            return await self.client.call_with_payload(method, body, payload=payload)
        except PeerGone as exc:
            self.lost = True
            raise WorkerLost(self.member, f"no heartbeat for {exc.silent_for:.1f} s") from None
        except RPCError as exc:
            raise RemoteNodeError(self.member, exc.remote_type, exc.remote_message) from None

    def __repr__(self) -> str:
        state = "alive" if self.alive else "lost"
        return f"<RemoteReplica {self.deployment}#{self.replica} on {self.member} {state}>"


def _encode_args(args: tuple, kwargs: dict[str, Any], member: str) -> bytes:
    try:
        return encode_value([list(args), kwargs])
    except TypeError as exc:
        raise TypeError(f"cannot send the call's arguments to worker '{member}': {exc}") from None
