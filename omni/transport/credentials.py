"""One process's cluster credentials: a ZeroMQ context, the cluster token and the ZAP
authenticator serving that context.

Every cluster socket a process opens comes from its `Credentials`: servers (ROUTER, PUB) get
`server_options()`, clients (DEALER, SUB) `client_options()`. Every member holds the same token
file, so any member can serve (a worker's RPC and KV event sockets) and any can connect.

>>> with Credentials.from_token_file(path) as creds:
...     async with RPCServer(ctx=creds.ctx, options=creds.server_options()) as server: ...

`Credentials.insecure()` opens plain sockets, for tests and single-process use only.

Large messages between RPC servers and clients that pass `data_plane()` go on data channels
(`omni.transport.data_channel`), sealed with AES-256-GCM, or plain where the operator says the
network is trusted (``data_plane="plaintext"``, or ``OMNI_DATA_PLANE=plaintext``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import zmq

from omni.transport.data_channel import DataPlane, data_plane_mode
from omni.transport.security import Authenticator, AuthStats, ClusterToken, load_token

__all__ = ["Credentials"]

log = logging.getLogger("omni.transport.data")


class Credentials:
    """A context with its token and authenticator; use it as a context manager.

    Args:
        token: the cluster token (``None``: plain, unauthenticated sockets).
        data_plane: ``encrypted`` or ``plaintext`` (``None``: ``OMNI_DATA_PLANE``, else
            encrypted); plaintext only where both ends of a channel say so.
    """

    def __init__(self, token: ClusterToken | None, *, data_plane: str | None = None):
        self.token = token
        self.data_mode = data_plane_mode(data_plane)
        self.ctx: zmq.Context[Any] = zmq.Context()
        self._auth: Authenticator | None = None

    @classmethod
    def from_token_file(cls, path: str | os.PathLike[str]) -> Credentials:
        """Credentials from a token file (see `omni.transport.security.load_token`)."""
        return cls(load_token(path))

    @classmethod
    def insecure(cls) -> Credentials:
        return cls(None)

    @property
    def secure(self) -> bool:
        return self.token is not None

    def __enter__(self) -> Credentials:
        if self.token is not None:
            self._auth = self.token.server().start_authenticator(self.ctx)
            if self.data_mode == "plaintext":
                log.warning("data plane: plaintext: large values and KV pages between this "
                            "process and peers that also say plaintext cross unencrypted "
                            "(authenticated connections, unsealed bytes): only on a network "
                            "you trust")
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop the authenticator and end the context (its sockets must be closed)."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self.ctx.destroy(linger=0)

    def server_options(self) -> dict[int, Any]:
        """Socket options for a socket that binds (CURVE server, clients vetted by ZAP)."""
        if self.token is None:
            return {}
        if self._auth is None:
            raise RuntimeError("Credentials not entered: use `with Credentials(...)`")
        return self.token.server().socket_options(self._auth)

    def client_options(self) -> dict[int, Any]:
        """Socket options for a socket that connects (CURVE client with the cluster's key)."""
        return {} if self.token is None else self.token.client().socket_options()

    def data_plane(self) -> DataPlane | None:
        """What RPC servers and clients need for data channels (None without a token: the
        sockets are plain already)."""
        if self.token is None:
            return None
        return DataPlane(self.data_mode, self._auth)

    def auth_denied(self) -> int:
        """Clients this process's authenticator refused so far."""
        return 0 if self._auth is None else self._auth.stats().denied

    def auth_stats(self) -> AuthStats | None:
        """What this process's authenticator decided (None without a token)."""
        return None if self._auth is None else self._auth.stats()

    def __repr__(self) -> str:
        return f"<Credentials {'curve' if self.secure else 'insecure'}>"
