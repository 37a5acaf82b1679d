"""Cluster security: private token files, CURVE on every socket, and only the token's client
admitted (ZAP) — a wrong key never gets a message through."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from omni.transport import security
from omni.transport.errors import TransportError
from omni.transport.security import (
    Authenticator,
    ClientSecurity,
    ClusterToken,
    ServerSecurity,
    check_curve,
    create_token_file,
    ensure_token_file,
    load_token,
    start_authenticator,
)
from tests._wait import CAP_S, wait_until_sync

# Synchronous tests: the handshakes run in libzmq's I/O thread. An admitted message is waited
# for (the cap only stops a hang). A refused one is watched for a short while: a slow machine
# can only make that watch see less, never fail a test that should pass; where ZAP is involved
# the refusal itself is counted first (`denied`), which does not depend on time.
SEEN_S = CAP_S  # how long an admitted message may take to arrive (it takes milliseconds)
REFUSED_S = 0.3  # how long we watch for a message that must not arrive


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def token() -> ClusterToken:
    return ClusterToken.generate()


@pytest.fixture
def server(ctx: zmq.Context,
           token: ClusterToken) -> Iterator[tuple[zmq.Socket, str, Authenticator]]:
    """A CURVE ROUTER admitting `token`'s client, bound to a free local port."""
    with token.server().start_authenticator(ctx) as auth:
        router = ctx.socket(zmq.ROUTER)
        token.server().apply(router, auth)
        router.bind("tcp://127.0.0.1:*")
        yield router, router.get(zmq.LAST_ENDPOINT).decode(), auth
        router.close(linger=0)


def dealer(ctx: zmq.Context, endpoint: str, client: ClientSecurity | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if client is not None:
        client.apply(sock)
    sock.connect(endpoint)
    return sock


def received(router: zmq.Socket, timeout_s: float) -> list[bytes] | None:
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    if poller.poll(int(timeout_s * 1000)):
        return router.recv_multipart()
    return None


# -- token files ---------------------------------------------------------------------------


def test_token_file_is_created_private_and_reads_back(tmp_path: Path) -> None:
    path = tmp_path / "secrets" / "cluster.token"
    token = create_token_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    loaded = load_token(path)
    assert loaded == token
    assert loaded.client_public_key == token.client_public_key
    assert loaded.server_public_key != loaded.client_public_key


def test_token_file_is_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        path = tmp_path / "t"
        create_token_file(path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_token_is_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "t"
    first = create_token_file(path)
    with pytest.raises(FileExistsError):
        create_token_file(path)
    assert ensure_token_file(path) == first  # what `omni cluster start` does on a restart
    assert ensure_token_file(tmp_path / "new") != first


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_token_others_can_access_is_refused_with_the_fix(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "t"
    create_token_file(path)
    path.chmod(mode)
    with pytest.raises(TransportError) as caught:
        load_token(path)
    message = str(caught.value)
    assert str(path) in message and f"chmod 600 {path}" in message and f"{mode:04o}" in message
    path.chmod(0o600)
    load_token(path)


@pytest.mark.parametrize("body", [
    b"not json",
    b'{"version": 1, "server_secret_key": "short", "client_secret_key": "short"}',
    b'{"version": 2, "server_secret_key": "a", "client_secret_key": "b"}',
    b'{"version": 1, "server_secret_key": "' + b"x" * 40 + b'"}',
    b"{" + b" " * 5000 + b"}",
])
def test_a_malformed_token_file_is_refused_by_name(tmp_path: Path, body: bytes) -> None:
    path = tmp_path / "t"
    path.write_bytes(body)
    path.chmod(0o600)
    with pytest.raises(TransportError, match=str(path)):
        load_token(path)


def test_a_token_never_shows_its_keys(token: ClusterToken) -> None:
    for text in (repr(token), repr(token.server()), repr(token.client())):
        assert token.server_secret_key.decode() not in text
        assert token.client_secret_key.decode() not in text
    assert token.fingerprint in repr(token) and len(token.fingerprint) == 16


def test_check_curve_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    check_curve()  # this libzmq has it
    monkeypatch.setattr(security.zmq, "has", lambda feature: False)
    with pytest.raises(TransportError, match="pyzmq"):
        check_curve()


# -- socket options ------------------------------------------------------------------------


def test_curve_options_are_set_on_both_sides(ctx: zmq.Context, token: ClusterToken) -> None:
    with start_authenticator(ctx, [token.client_public_key]) as auth:
        router = ctx.socket(zmq.ROUTER)
        token.server().apply(router, auth)
        assert router.get(zmq.CURVE_SERVER) == 1
        assert router.get(zmq.MECHANISM) == zmq.CURVE
        assert router.get(zmq.ZAP_DOMAIN) == b"omni"
        client = ctx.socket(zmq.DEALER)
        token.client().apply(client)
        assert client.get(zmq.CURVE_SERVER) == 0
        assert client.get(zmq.MECHANISM) == zmq.CURVE
        router.close(linger=0)
        client.close(linger=0)


def test_a_server_socket_cannot_be_made_to_fail_open(ctx: zmq.Context,
                                                     token: ClusterToken) -> None:
    """Without a running authenticator on its own context, CURVE would admit anyone."""
    router = ctx.socket(zmq.ROUTER)
    idle = Authenticator(ctx, [token.client_public_key])
    with pytest.raises(TransportError, match="not running"):
        token.server().apply(router, idle)
    other = zmq.Context()
    try:
        with start_authenticator(other, [token.client_public_key]) as elsewhere:
            with pytest.raises(TransportError, match="another zmq context"):
                token.server().apply(router, elsewhere)
    finally:
        other.destroy(linger=0)
    with start_authenticator(ctx, [token.client_public_key]) as auth:
        router.bind("tcp://127.0.0.1:*")
        with pytest.raises(TransportError, match="before bind"):
            token.server().apply(router, auth)
    router.close(linger=0)


def test_one_authenticator_per_context(ctx: zmq.Context, token: ClusterToken) -> None:
    with start_authenticator(ctx, [token.client_public_key]):
        with pytest.raises(TransportError, match="ZAP authenticator"):
            start_authenticator(ctx, [token.client_public_key])


def test_the_authenticator_thread_stops(ctx: zmq.Context, token: ClusterToken) -> None:
    before = threading.active_count()
    auth = start_authenticator(ctx, [token.client_public_key])
    assert auth.running and threading.active_count() == before + 1
    assert "running" in repr(auth)
    auth.stop()
    auth.stop()
    assert not auth.running and threading.active_count() == before
    assert "stopped" in repr(auth)


def test_keys_are_checked(ctx: zmq.Context) -> None:
    with pytest.raises(TransportError, match="not a CURVE key"):
        ClientSecurity(b"x" * 39, b"y" * 40)
    with pytest.raises(ValueError, match="at least one"):
        Authenticator(ctx, [])


# -- handshakes over TCP -------------------------------------------------------------------


def test_the_tokens_client_gets_through(ctx: zmq.Context, server, token: ClusterToken) -> None:
    router, endpoint, auth = server
    client = dealer(ctx, endpoint, token.client())
    client.send(b"hello")
    message = received(router, SEEN_S)
    assert message is not None and message[1] == b"hello"
    router.send_multipart([message[0], b"welcome"])  # and the reply comes back
    assert client.poll(int(SEEN_S * 1000)) and client.recv() == b"welcome"
    assert auth.stats().allowed == 1 and auth.stats().denied == 0
    client.close()


def test_a_wrong_client_key_is_refused_before_any_data(ctx: zmq.Context, server,
                                                       token: ClusterToken) -> None:
    """Knowing the server key (encryption) is not enough: ZAP refuses the unknown client."""
    router, endpoint, auth = server
    _, stranger_secret = zmq.curve_keypair()
    intruder = dealer(ctx, endpoint, ClientSecurity(stranger_secret, token.server_public_key))
    intruder.send(b"let me in")
    wait_until_sync(lambda: auth.stats().denied >= 1)
    assert received(router, REFUSED_S) is None
    assert auth.stats().allowed == 0
    intruder.close()


def test_another_clusters_client_key_is_refused(ctx: zmq.Context, server,
                                                token: ClusterToken) -> None:
    router, endpoint, auth = server
    other = ClusterToken.generate()
    intruder = dealer(ctx, endpoint, ClientSecurity(other.client_secret_key,
                                                    token.server_public_key))
    intruder.send(b"let me in")
    wait_until_sync(lambda: auth.stats().denied >= 1)
    assert received(router, REFUSED_S) is None
    intruder.close()


@pytest.mark.parametrize("kind", ["plain text", "wrong server key"])
def test_clients_without_the_servers_curve_key_get_nothing_through(
        ctx: zmq.Context, server, token: ClusterToken, kind: str) -> None:
    router, endpoint, _ = server
    if kind == "plain text":
        client = None
    else:
        client = ClientSecurity(token.client_secret_key, zmq.curve_keypair()[0])
    intruder = dealer(ctx, endpoint, client)
    intruder.send(b"let me in")
    assert received(router, REFUSED_S) is None
    # ... while the right client still gets through on the same server.
    friend = dealer(ctx, endpoint, token.client())
    friend.send(b"hello")
    message = received(router, SEEN_S)
    assert message is not None and message[1] == b"hello"
    intruder.close()
    friend.close()


def test_the_authenticator_outlives_its_server_sockets(ctx: zmq.Context,
                                                        token: ClusterToken) -> None:
    """libzmq admits any CURVE client once no ZAP handler runs: stopping first is refused."""
    auth = start_authenticator(ctx, [token.client_public_key])
    router = ctx.socket(zmq.ROUTER)
    token.server().apply(router, auth)
    router.bind("tcp://127.0.0.1:*")
    with pytest.raises(TransportError, match="close the 1 CURVE server socket"):
        auth.stop()
    assert auth.running  # still vetting: an intruder still gets nothing through
    _, stranger_secret = zmq.curve_keypair()
    intruder = dealer(ctx, router.get(zmq.LAST_ENDPOINT).decode(),
                      ClientSecurity(stranger_secret, token.server_public_key))
    intruder.send(b"let me in")
    wait_until_sync(lambda: auth.stats().denied >= 1)
    assert received(router, REFUSED_S) is None
    intruder.close()
    router.close(linger=0)
    auth.stop()
    assert not auth.running


def test_server_security_from_a_token_file(tmp_path: Path, ctx: zmq.Context) -> None:
    """What `omni cluster start` and `join` do with the same file."""
    path = tmp_path / "t"
    head_side: ServerSecurity = ensure_token_file(path).server()
    worker_side: ClientSecurity = load_token(path).client()
    assert worker_side.server_public_key == head_side.public_key
    with head_side.start_authenticator(ctx) as auth:
        router = ctx.socket(zmq.ROUTER)
        head_side.apply(router, auth)
        router.bind("tcp://127.0.0.1:*")
        client = dealer(ctx, router.get(zmq.LAST_ENDPOINT).decode(), worker_side)
        client.send(b"joined")
        message = received(router, SEEN_S)
        assert message is not None and message[1] == b"joined"
        client.close()
        router.close(linger=0)


def test_socket_options_carry_the_same_settings(ctx: zmq.Context, token: ClusterToken) -> None:
    """For code that makes its sockets itself (`trio_zmq.open_socket(options=...)`)."""
    with pytest.raises(TransportError, match="not running"):
        token.server().socket_options(Authenticator(ctx, [token.client_public_key]))
    with start_authenticator(ctx, [token.client_public_key]) as auth:
        router = ctx.socket(zmq.ROUTER)
        for option, value in token.server().socket_options(auth).items():
            router.setsockopt(option, value)
        router.bind("tcp://127.0.0.1:*")
        client = ctx.socket(zmq.DEALER)
        client.linger = 0
        for option, value in token.client().socket_options().items():
            client.setsockopt(option, value)
        client.connect(router.get(zmq.LAST_ENDPOINT).decode())
        client.send(b"hello")
        message = received(router, SEEN_S)
        assert message is not None and message[1] == b"hello"
        assert auth.stats().allowed == 1
        client.close()
        router.close(linger=0)
