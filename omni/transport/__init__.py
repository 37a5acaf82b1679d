"""Wire: how Omni processes talk. `trio_zmq` gives trio one owner task per ZeroMQ socket,
`wire` the versioned, size-limited msgpack codec (no pickle), `rpc` ROUTER/DEALER calls with
timeouts, cancellation and heartbeats. The mover of buffers and KV pages
(`omni.transport.movers`), CURVE security (`omni.transport.security`) and lanes (notices
received and sent on a thread outside the event loop: `omni.transport.lane`) are imported
from their modules.
"""

from omni.transport.errors import PeerGone, RPCError, RPCTimeout, TransportError, WireError
from omni.transport.rpc import (
    Handler,
    Reply,
    RPCClient,
    RPCClientStats,
    RPCServer,
    RPCServerStats,
)
from omni.transport.trio_zmq import (
    ZERO_COPY_THRESHOLD,
    Buffer,
    Socket,
    SocketStats,
    open_socket,
    wait_sent,
)
from omni.transport.wire import Codec, WireLimits, WireStats

__all__ = [
    "ZERO_COPY_THRESHOLD", "Buffer", "Codec", "Handler", "PeerGone", "RPCClient",
    "RPCClientStats", "RPCError", "RPCServer", "RPCServerStats", "RPCTimeout", "Reply",
    "Socket", "SocketStats", "TransportError", "WireError", "WireLimits", "WireStats",
    "open_socket", "wait_sent",
]
