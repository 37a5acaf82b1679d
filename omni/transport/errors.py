"""The Wire layer's errors: one family under `TransportError`, each saying when it is raised.

Nothing here carries a pickled exception: an error raised by a remote handler travels as its
type name and message (`RPCError`), never as an object to be unpickled.
"""

from __future__ import annotations

from omni.errors import OmniError

__all__ = ["PeerGone", "RPCError", "RPCTimeout", "TransportError", "WireError"]


class TransportError(OmniError):
    """Base class of the transport's errors; raised as is when a socket cannot be bound or
    connected (the message names the address), or when a closed socket, server or client is
    used."""


class RPCTimeout(TransportError):
    """An RPC call got no reply within its `timeout`; the server was told to cancel it.

    `method` is the method called and `timeout` the limit in seconds.
    """

    def __init__(self, method: str, timeout: float):
        self.method = method
        self.timeout = timeout
        super().__init__(f"call to '{method}' timed out after {timeout:g} s")

    def __reduce__(self):  # picklable for logging and multiprocessing
        return (type(self), (self.method, self.timeout))


class RPCError(TransportError):
    """The remote side refused or failed a call: its handler raised, the method is unknown,
    or the request did not decode into the handler's body type.

    `remote_type` is the name of the remote exception's type (e.g. ``"ValueError"``,
    ``"UnknownMethod"``), `remote_message` its message and `remote_traceback` the traceback
    text of a handler's error as the server printed it (empty for the server's own refusals);
    `method` is the method called.
    """

    def __init__(self, method: str, remote_type: str, remote_message: str,
                 remote_traceback: str = ""):
        self.method = method
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback
        super().__init__(f"'{method}' failed remotely: {remote_type}: {remote_message}")

    def __reduce__(self):
        return (type(self), (self.method, self.remote_type, self.remote_message,
                             self.remote_traceback))


class WireError(TransportError):
    """A message is malformed, oversize, of an unknown kind or of another protocol version.

    Raised by `omni.transport.wire.decode` for bytes that arrived (servers and clients count
    and drop such messages rather than fail), and by the encoders and `RPCClient.call` for a
    message that is too large to send.
    """


class PeerGone(TransportError):
    """The peer stopped answering heartbeats: in-flight calls fail with it, and new calls fail
    with it at once until the peer answers again. `endpoint` is the peer's address."""

    def __init__(self, endpoint: str, silent_for: float):
        self.endpoint = endpoint
        self.silent_for = silent_for
        super().__init__(f"peer {endpoint} silent for {silent_for:.3g} s")

    def __reduce__(self):
        return (type(self), (self.endpoint, self.silent_for))
