"""CURVE encryption and client authentication for every cluster socket.

The scheme: one token file per cluster, JSON, mode 0600, holding two CURVE secret keys
(Z85 text): the head's *server* key and the workers' *client* key. Public keys are derived
from them, so whoever holds the file can do both halves of the handshake:

- the head (``omni cluster start --token-file F``) binds with the server secret key and,
  through a ZAP authenticator, admits exactly the client public key derived from F;
- a worker (``omni cluster join ADDRESS --token-file F``) connects with the server public key
  (encryption: it talks to the real head) and the client secret key (authentication: the head
  admits it).

Why the authenticator: CURVE alone encrypts but admits *any* client that knows the server's
public key, and libzmq admits every CURVE client when no ZAP handler is bound on the socket's
context (checked: also after the handler stops). So `ServerSecurity.apply` refuses to
configure a socket unless a running `Authenticator` serves that same context, and
`Authenticator.stop` refuses while a server socket it vets is open: close the sockets first.

The token is the cluster's only secret. To rotate it, delete the file and start the head
again (workers need the new file). The authenticator is pyzmq's `ThreadAuthenticator`, the
one thread the design allows outside `trio.to_thread`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from omni.transport.errors import TransportError

__all__ = [
    "DATA_ZAP_DOMAIN", "ZAP_DOMAIN", "AuthStats", "Authenticator", "ClientSecurity", "ClusterToken",
    "ServerSecurity", "check_curve", "create_token_file", "ensure_token_file", "load_token",
    "start_authenticator",
]

log = logging.getLogger("omni.transport.auth")

TOKEN_VERSION = 1
MAX_TOKEN_BYTES = 4096
ZAP_DOMAIN = "omni"  # the ZAP domain of Omni's server sockets; the authenticator serves only it
DATA_ZAP_DOMAIN = "omni-data"  # the data channels' sockets (PLAIN: `Authenticator.admit_data`)
_Z85_KEY_CHARS = 40  # a 32-byte CURVE key in Z85
_Z85_ALPHABET = frozenset(z85.Z85CHARS)


def check_curve() -> None:
    """Raise TransportError unless this process's libzmq supports CURVE security."""
    if not zmq.has("curve"):
        raise TransportError(
            f"this libzmq ({zmq.zmq_version()}) was built without CURVE security, which Omni "
            "needs for cluster sockets: install pyzmq's PyPI wheel, whose bundled libzmq has "
            "it (`pip install --force-reinstall --only-binary=:all: pyzmq`), or a libzmq built "
            "with libsodium (e.g. `apt install libsodium-dev` and rebuild libzmq and pyzmq)")


def _check_key(key: str | bytes, what: str) -> bytes:
    """A Z85 CURVE key as bytes; TransportError when it is not one (the key is not echoed)."""
    raw = key.encode("ascii", "replace") if isinstance(key, str) else bytes(key)
    if len(raw) != _Z85_KEY_CHARS or not set(raw) <= _Z85_ALPHABET:
        raise TransportError(f"{what} is not a CURVE key ({_Z85_KEY_CHARS} Z85 characters)")
    return raw


def _public_key(secret_key: bytes) -> bytes:
    check_curve()
    return zmq.curve_public(secret_key)


class _TokenFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A token file's JSON. Why a struct: an unknown or missing field is an error, not a
    silently different cluster."""

    version: int
    server_secret_key: str
    client_secret_key: str


@dataclass(frozen=True, repr=False)
class ClusterToken:
    """The cluster's secret: the head's CURVE server secret key and the workers' client
    secret key (Z85 bytes). Its repr shows a fingerprint, never a key."""

    server_secret_key: bytes
    client_secret_key: bytes

    def __post_init__(self) -> None:
        _check_key(self.server_secret_key, "the server secret key")
        _check_key(self.client_secret_key, "the client secret key")

    @classmethod
    def generate(cls) -> ClusterToken:
        """Two fresh CURVE keypairs' secret halves."""
        check_curve()
        return cls(zmq.curve_keypair()[1], zmq.curve_keypair()[1])

    @property
    def server_public_key(self) -> bytes:
        """What a client needs to reach (and encrypt to) the head."""
        return _public_key(self.server_secret_key)

    @property
    def client_public_key(self) -> bytes:
        """The one client key the head admits."""
        return _public_key(self.client_secret_key)

    @property
    def fingerprint(self) -> str:
        """16 hex digits naming the cluster (from the server public key; safe to show)."""
        return hashlib.blake2b(self.server_public_key, digest_size=8).hexdigest()

    def server(self) -> ServerSecurity:
        """The head's side: its secret key, admitting this token's client key only."""
        return ServerSecurity(self.server_secret_key, frozenset({self.client_public_key}))

    def client(self) -> ClientSecurity:
        """A worker's side: its client secret key and the head's public key."""
        return ClientSecurity(self.client_secret_key, self.server_public_key)

    def __repr__(self) -> str:
        return f"<ClusterToken {self.fingerprint}>"


def create_token_file(path: str | os.PathLike[str]) -> ClusterToken:
    """Write a new cluster token to `path` (mode 0600, created parent folders 0700).

    Raises:
        FileExistsError: `path` exists (a token is never overwritten: delete it to rotate).
        TransportError: libzmq lacks CURVE.
    """
    token = ClusterToken.generate()
    body = msgspec.json.encode(_TokenFile(TOKEN_VERSION, token.server_secret_key.decode(),
                                          token.client_secret_key.decode()))
    target = Path(path)
    missing = [p for p in target.parents if not p.exists()]
    for folder in reversed(missing):  # each 0700: mkdir(parents=True) gives parents the umask's
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            continue
        os.chmod(folder, 0o700)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask may have taken owner bits away
        os.write(fd, body + b"\n")
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        target.unlink(missing_ok=True)
        raise
    os.close(fd)
    return token


def load_token(path: str | os.PathLike[str]) -> ClusterToken:
    """Read the cluster token at `path`.

    Raises:
        FileNotFoundError: no file there.
        TransportError: the file is group/world accessible (fix: ``chmod 600 PATH``), owned by
            another user, not a regular file, or not a token file.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        _check_private(os.fstat(fd), path)  # the opened file itself: no check-then-open race
        data = os.read(fd, MAX_TOKEN_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_TOKEN_BYTES:
        raise TransportError(f"token file {path} is larger than {MAX_TOKEN_BYTES} bytes: "
                             "not an Omni token file")
    try:
        record = msgspec.json.decode(data, type=_TokenFile)
        if record.version != TOKEN_VERSION:
            raise TransportError(f"token file version {record.version} is not supported "
                                 f"(this Omni reads version {TOKEN_VERSION})")
        return ClusterToken(record.server_secret_key.encode("ascii", "replace"),
                            record.client_secret_key.encode("ascii", "replace"))
    except (msgspec.DecodeError, TransportError) as exc:
        raise TransportError(f"token file {path} is not a valid Omni token file: {exc}. "
                             "Create one with `omni cluster start --token-file PATH`") from None


def _check_private(info: os.stat_result, path: str | os.PathLike[str]) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise TransportError(f"token file {path} is not a regular file")
    if info.st_uid != os.geteuid():
        raise TransportError(f"token file {path} belongs to uid {info.st_uid}, not to this "
                             f"user (uid {os.geteuid()}): a token must be the user's own")
    if info.st_mode & 0o077:
        mode = stat.S_IMODE(info.st_mode)
        raise TransportError(f"token file {path} is accessible to other users (mode "
                             f"{mode:04o}); it holds the cluster's secret keys. Fix it with "
                             f"`chmod 600 {path}`")


def ensure_token_file(path: str | os.PathLike[str]) -> ClusterToken:
    """The token at `path`, created first when there is none (what the head does on start)."""
    try:
        return create_token_file(path)
    except FileExistsError:  # made earlier, or by a concurrent start: read it
        return load_token(path)


@dataclass(frozen=True)
class AuthStats:
    """What an authenticator decided: CURVE clients admitted and refused, keys it admits;
    data channel connections admitted and refused, channels open."""

    allowed: int
    denied: int
    num_keys: int
    data_allowed: int = 0
    data_denied: int = 0
    data_channels: int = 0


class _KeyCheck:
    """The credentials provider pyzmq's authenticator calls (in its thread) per handshake.

    Why counters here: they are the only record of refused clients, and only the
    authenticator thread writes them."""

    def __init__(self, keys: frozenset[bytes]):
        self.keys = keys
        self.allowed = 0
        self.denied = 0

    def callback(self, domain: str, client_key: bytes) -> bool:
        if client_key in self.keys:
            self.allowed += 1
            return True
        self.denied += 1
        log.warning("refused a CURVE client with an unknown key (domain %s)", domain)
        return False


class _DataCheck:
    """The data channels a server has opened, by PLAIN user name: their passwords."""

    def __init__(self) -> None:
        self.passwords: dict[str, bytes] = {}
        self.allowed = 0
        self.denied = 0

    def check(self, domain: str, username: str, password: str) -> bool:
        expected = self.passwords.get(username) if domain == DATA_ZAP_DOMAIN else None
        if expected is not None and hmac.compare_digest(expected, password.encode()):
            self.allowed += 1
            return True
        self.denied += 1
        log.warning("refused a data channel connection that named no open channel or the "
                    "wrong password (domain %s)", domain)
        return False


class _ZapThread(ThreadAuthenticator):
    """pyzmq's thread authenticator, its PLAIN check ours: constant-time, per open data
    channel, and never logging a password (pyzmq's logs them at debug level)."""

    def __init__(self, context: zmq.Context[Any], data: _DataCheck):
        super().__init__(context, log=log)
        self._data = data

    def _authenticate_plain(self, domain: str, username: str, password: str
                            ) -> tuple[bool, bytes]:
        allowed = self._data.check(domain, username, password)
        return allowed, b"OK" if allowed else b"no such data channel"


class Authenticator:
    """The ZAP handler of one zmq context: admits CURVE clients whose public key is allowed,
    and PLAIN connections to data channels (`admit_data`) that present their channel's
    password.

    Start it before binding server sockets on `context`, stop it (or leave the ``with``) after
    closing them: libzmq admits any CURVE client once no handler runs, so `stop` refuses
    while a socket `ServerSecurity.apply` gave it is open. One per context: libzmq finds it at
    ``inproc://zeromq.zap.01``.
    """

    def __init__(self, context: zmq.Context[Any], allowed_client_keys: Iterable[str | bytes]):
        keys = frozenset(_check_key(k, "an allowed client key") for k in allowed_client_keys)
        if not keys:
            raise ValueError("an authenticator needs at least one allowed client key")
        self.context = context
        self._check = _KeyCheck(keys)
        self._data = _DataCheck()
        self._thread: ThreadAuthenticator | None = None
        self._lock = threading.Lock()
        self._sockets: weakref.WeakSet[zmq.Socket[Any]] = weakref.WeakSet()  # ones it vets

    @property
    def running(self) -> bool:
        """True between `start` and `stop` while the authenticator thread lives."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Bind the ZAP handler on the context and start its thread.

        Raises:
            TransportError: libzmq lacks CURVE, or the context has a ZAP handler already.
        """
        check_curve()
        with self._lock:
            if self._thread is not None:
                raise TransportError("this authenticator was started already")
            thread = _ZapThread(self.context, self._data)
            try:
                thread.start()
            except zmq.ZMQError as exc:
                thread.stop()
                raise TransportError(f"cannot start a ZAP authenticator on this context "
                                     f"(one is running already?): {exc}") from exc
            thread.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self._check)
            self._thread = thread

    def stop(self) -> None:
        """Stop the thread and unbind the handler (idempotent).

        Raises:
            TransportError: a server socket this authenticator vets is still open (it would
                admit any client); the authenticator keeps running then.
        """
        with self._lock:
            open_sockets = [s for s in self._sockets if not s.closed]
            if open_sockets and self._thread is not None:
                raise TransportError(f"close the {len(open_sockets)} CURVE server socket(s) "
                                     "before stopping their authenticator: without it they "
                                     "would admit any client")
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.stop()

    def admit_data(self, username: str, password: str) -> None:
        """Admit PLAIN connections to `DATA_ZAP_DOMAIN` sockets presenting these
        credentials (one open data channel's; `omni.transport.data_channel`)."""
        self._data.passwords[username] = password.encode()

    def revoke_data(self, username: str) -> None:
        self._data.passwords.pop(username, None)

    def guard(self, sock: zmq.Socket[Any]) -> None:
        """Record a server socket whose clients this authenticator vets: it refuses to
        stop while the socket is open. Raises `TransportError` if it is not running."""
        if sock.context.underlying != self.context.underlying:
            raise TransportError("the authenticator serves another zmq context: ZAP is per "
                                 "context, so this socket would admit any client")
        self._vet(sock)

    def _vet(self, sock: zmq.Socket[Any]) -> None:
        """Record a server socket whose clients this authenticator vets."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                raise TransportError("the authenticator is not running: a CURVE server socket "
                                     "without it admits any client")
            self._sockets.add(sock)

    def stats(self) -> AuthStats:
        """Counts of admitted and refused CURVE clients and data channel connections."""
        data = self._data
        return AuthStats(self._check.allowed, self._check.denied, len(self._check.keys),
                         data.allowed, data.denied, len(data.passwords))

    def __enter__(self) -> Authenticator:
        if self._thread is None:
            self.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        s = self.stats()
        state = "running" if self.running else "stopped"
        return f"<Authenticator {state} keys={s.num_keys} allowed={s.allowed} denied={s.denied}>"


def start_authenticator(context: zmq.Context[Any],
                        allowed_client_keys: Iterable[str | bytes]) -> Authenticator:
    """A started `Authenticator` on `context` admitting `allowed_client_keys` (Z85).

    Raises:
        TransportError: libzmq lacks CURVE, or the context has a ZAP handler already.
        ValueError: no key given.
    """
    authenticator = Authenticator(context, allowed_client_keys)
    authenticator.start()
    return authenticator


def _check_unconnected(sock: zmq.Socket[Any], side: str) -> None:
    if sock.get(zmq.LAST_ENDPOINT):
        raise TransportError(f"apply {side} security before bind/connect: this socket is at "
                             f"{sock.get(zmq.LAST_ENDPOINT)!r} already")


@dataclass(frozen=True, repr=False)
class ServerSecurity:
    """The head's CURVE settings: its secret key and the client public keys it admits."""

    secret_key: bytes
    allowed_client_keys: frozenset[bytes]

    def __post_init__(self) -> None:
        _check_key(self.secret_key, "the server secret key")
        for key in self.allowed_client_keys:
            _check_key(key, "an allowed client key")

    @property
    def public_key(self) -> bytes:
        """What clients put in `curve_serverkey`."""
        return _public_key(self.secret_key)

    def start_authenticator(self, context: zmq.Context[Any]) -> Authenticator:
        """`start_authenticator` for this server's allowed keys."""
        return start_authenticator(context, self.allowed_client_keys)

    def socket_options(self, authenticator: Authenticator) -> dict[int, Any]:
        """`apply`'s settings as ``setsockopt`` options, for code that makes the socket itself
        (``trio_zmq.open_socket(ctx, ..., options=...)``).

        Prefer `apply`: here nothing can check that the socket is on the authenticator's
        context, nor keep the authenticator from stopping while the socket is open.

        Raises:
            TransportError: no CURVE, or `authenticator` is not running.
        """
        check_curve()
        if not authenticator.running:
            raise TransportError("the authenticator is not running: a CURVE server socket "
                                 "without it admits any client")
        return {zmq.CURVE_SECRETKEY: self.secret_key, zmq.CURVE_PUBLICKEY: self.public_key,
                zmq.ZAP_DOMAIN: ZAP_DOMAIN.encode(), zmq.CURVE_SERVER: 1}

    def apply(self, sock: zmq.Socket[Any], authenticator: Authenticator) -> None:
        """Make `sock` a CURVE server whose clients `authenticator` vets. Call before `bind`.

        Raises:
            TransportError: no CURVE, `authenticator` is not running or serves another
                context (the socket would admit anyone), or the socket is bound already.
        """
        _check_unconnected(sock, "server")
        options = self.socket_options(authenticator)
        authenticator.guard(sock)
        for option, value in options.items():
            sock.setsockopt(option, value)

    def __repr__(self) -> str:
        return f"<ServerSecurity clients={len(self.allowed_client_keys)}>"


@dataclass(frozen=True, repr=False)
class ClientSecurity:
    """A worker's CURVE settings: its client secret key and the head's public key."""

    secret_key: bytes
    server_public_key: bytes

    def __post_init__(self) -> None:
        _check_key(self.secret_key, "the client secret key")
        _check_key(self.server_public_key, "the server public key")

    def socket_options(self) -> dict[int, Any]:
        """`apply`'s settings as ``setsockopt`` options (for ``open_socket(options=...)``).

        Raises:
            TransportError: no CURVE.
        """
        return {zmq.CURVE_SECRETKEY: self.secret_key,
                zmq.CURVE_PUBLICKEY: _public_key(self.secret_key),
                zmq.CURVE_SERVERKEY: self.server_public_key}

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Make `sock` a CURVE client of the server. Call before `connect`.

        Raises:
            TransportError: no CURVE, or the socket is connected already.
        """
        _check_unconnected(sock, "client")
        for option, value in self.socket_options().items():
            sock.setsockopt(option, value)

    def __repr__(self) -> str:
        return "<ClientSecurity>"
