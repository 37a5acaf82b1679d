"""An unauthenticated join: workers with another cluster's token, with the head's public key
but no admitted client key, or with no CURVE at all, are refused before any message reaches
the head, which keeps its members and admits the worker that holds the token."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import trio
import zmq

from omni.cluster import Head, HeadLink, MemberInfo, MemberLoad, TokenRefused, probe
from omni.cluster.protocol import Register
from omni.transport import RPCClient, RPCServer, RPCTimeout
from omni.transport.credentials import Credentials
from omni.transport.security import ClientSecurity, ClusterToken
from tests.reliability._support import Tally

# How long a probe waits for the handshake's outcome. Refusals come at once; the intruder
# whose handshake goes unanswered waits it out. Loopback connects in milliseconds even on a
# loaded machine, so 3 s (not 1 s) cannot turn a refusal into "unreachable".
PROBE_S = 3.0


def intruders(token: ClusterToken) -> dict[str, tuple[Credentials, Callable[[], dict]]]:
    """Each: the credentials (their context) and the client socket options it connects with."""
    other = Credentials(ClusterToken.generate())
    stranger = Credentials.insecure()
    _, stranger_secret = zmq.curve_keypair()
    return {
        "another cluster's token": (other, other.client_options),
        "the head's public key, an unknown client key": (stranger, lambda: ClientSecurity(
            stranger_secret, token.server_public_key).socket_options()),
        "no CURVE": (Credentials.insecure(), dict),
    }


def member(name: str, rpc: str) -> MemberInfo:
    return MemberInfo(name, rpc, "host", os.getpid(), {"cpu": 1.0})


async def test_an_unauthenticated_join_is_refused(record):
    tally = Tally()
    token = ClusterToken.generate()
    with Credentials(token) as creds:
        head = Head(creds, "tcp://127.0.0.1:*", heartbeat_interval=0.2)
        async with trio.open_nursery() as nursery:
            endpoint = await nursery.start(head.run)
            for what, (intruder, options) in intruders(token).items():
                with intruder:
                    with pytest.raises(TokenRefused):
                        await probe(intruder, endpoint, timeout=PROBE_S)
                    client = RPCClient(endpoint, ctx=intruder.ctx, options=options(),
                                       heartbeat_interval=None)
                    async with client:
                        with pytest.raises(RPCTimeout):  # nothing reached the head
                            await client.call("cluster.register", Register(
                                member(f"intruder-{what}", "tcp://127.0.0.1:1"), MemberLoad()),
                                timeout=0.5)
                    assert head.members() == []
                    tally("refused")
            # ZAP refused the client with the head's key; the others failed the handshake.
            assert creds.auth_denied() >= 1
            # The worker with the token joins, and the head still serves.
            with Credentials(token) as worker_creds:
                server = RPCServer(ctx=worker_creds.ctx, options=worker_creds.server_options())
                async with server:
                    link = HeadLink(worker_creds, endpoint, lambda: member("w1", server.endpoint),
                                    MemberLoad, heartbeat_interval=0.2)
                    async with trio.open_nursery() as worker:
                        await worker.start(link.run)
                        assert [m.info.name for m in head.members()] == ["w1"]
                        worker.cancel_scope.cancel()
            nursery.cancel_scope.cancel()
    record("input.unauthenticated_join", tries=tally["refused"],
           outcome=f"{tally['refused']}/{tally['refused']} refused before any message reached "
                   "the head (TokenRefused on probe, register timed out, members unchanged); "
                   "the worker with the token then joined")
