"""``omni cluster``: start a head, join it as a worker, show its status.

    omni cluster start [--bind tcp://127.0.0.1:7100] [--token-file PATH]
    omni cluster join ADDRESS [--token-file PATH] [--name NAME] [--kv-host 8GiB]
                      [--kv-disk 64GiB:/path]
    omni cluster status ADDRESS [--json]

Every socket is CURVE-encrypted and every client authenticated with the token file, which
`start` creates (mode 0600) when there is none; copy it to the workers. Ctrl-C or SIGTERM
stops a head or a worker cleanly (a worker tells the head it leaves, and its KV store's files
go), then exits 130 or 143. Mistakes (an address in use, no head at the address, a wrong
token, a taken name) are one line on stderr, exit code 2.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import trio
import typer

from cli._cluster_status import print_status
from cli._errors import CliError, Stopped, first_of, reporting
from cli._options import DataPlaneOption, use_data_plane
from cli._signals import stopped_by_signals

__all__ = ["app"]

app = typer.Typer(help="Run Omni across machines: a head, workers, and their status.",
                  no_args_is_help=True)

TOKEN_HELP = ("The cluster's token file (default: $OMNI_TOKEN_FILE or "
              "~/.config/omni/cluster.token).")
DEBUG_HELP = "Show tracebacks for errors, not only the one-line message."


def _say(line: str) -> None:
    typer.echo(line)
    sys.stdout.flush()


@contextmanager
def _saying_when_stopped(line: str) -> Iterator[None]:
    """Say `line` once the server has stopped, by a signal (then `Stopped` goes on to be
    reported: exit 130 or 143) or by itself."""
    try:
        yield
    except Stopped:
        _say(line)
        raise
    _say(line)


def _token_path(token_file: str | None) -> str:
    from omni.cluster import default_token_path

    return str(token_file or default_token_path())


def _credentials(path: str, *, create: bool) -> Any:
    from omni.transport.credentials import Credentials
    from omni.transport.errors import TransportError
    from omni.transport.security import ensure_token_file, load_token

    try:
        token = ensure_token_file(path) if create else load_token(path)
    except FileNotFoundError:
        raise CliError(f"no token file at {path}: copy the head's token file here or pass "
                       "--token-file") from None
    except (TransportError, OSError) as exc:
        message = str(exc)  # the token's own errors name the file already
        raise CliError(message if path in message else f"token file {path}: {message}") \
            from None
    return Credentials(token)


def _address(address: str, *, bind: bool = False) -> str:
    """The address as a ZeroMQ endpoint, or a `CliError` saying what is wrong with it."""
    from omni.cluster import ClusterError, check_address

    try:
        return check_address(address, bind=bind)
    except ClusterError as exc:
        raise CliError(str(exc)) from None


def _run(serve: Any) -> Any:
    """`trio.run(serve)`; a cluster error (even inside an exception group) is one line."""
    from omni.cluster import ClusterError
    from omni.transport.errors import TransportError

    try:
        return trio.run(serve)
    except BaseException as exc:
        error = first_of(exc, (ClusterError, TransportError))
        if error is None:
            raise
        raise CliError(str(error)) from exc


# -- start ----------------------------------------------------------------------------------


@app.command("start")
def start(
    bind: Annotated[str, typer.Option(
        "--bind", metavar="ADDRESS", help="Address to serve on (tcp://HOST:PORT; port * "
                                          "picks a free one).")] = "tcp://127.0.0.1:7100",
    token_file: Annotated[str | None, typer.Option(
        "--token-file", metavar="PATH", show_default=False,
        help=TOKEN_HELP + " Created (0600) if missing.")] = None,
    heartbeat: Annotated[float, typer.Option(
        "--heartbeat", min=0.05, help="Seconds between heartbeats; a worker silent for 3 is "
                                      "lost.")] = 0.5,
    debug: Annotated[bool, typer.Option("--debug", help=DEBUG_HELP)] = False,
) -> None:
    """Start the cluster's head and serve until Ctrl-C or SIGTERM."""
    from omni.cluster import Head

    with reporting(debug):
        bind = _address(bind, bind=True)
        path = _token_path(token_file)
        with _credentials(path, create=True) as creds:
            head = Head(creds, bind, heartbeat_interval=heartbeat)

            async def serve() -> None:
                async with stopped_by_signals(), trio.open_nursery() as nursery:
                    endpoint = await nursery.start(head.run)
                    _say(f"omni cluster head at {endpoint}")
                    _say(f"token file: {path} (workers join with: omni cluster join {endpoint} "
                         f"--token-file {path})")

            with _saying_when_stopped("head stopped"):
                _run(serve)


# -- join -----------------------------------------------------------------------------------


@app.command("join", no_args_is_help=True)
def join(
    address: Annotated[str, typer.Argument(metavar="ADDRESS", help="The head's address.")],
    token_file: Annotated[str | None, typer.Option(
        "--token-file", metavar="PATH", show_default=False, help=TOKEN_HELP)] = None,
    name: Annotated[str | None, typer.Option(
        "--name", show_default=False, help="This worker's name, unique in the cluster "
                                           "(default: the host name).")] = None,
    kv_device: Annotated[str | None, typer.Option(
        "--kv-device", metavar="SIZE", show_default=False,
        help="KV device tier to offer (e.g. 20GiB).")] = None,
    kv_host: Annotated[str, typer.Option(
        "--kv-host", metavar="SIZE", help="KV host-memory tier to offer.")] = "1GiB",
    kv_disk: Annotated[str | None, typer.Option(
        "--kv-disk", metavar="SIZE[:PATH]", show_default=False,
        help="KV disk tier to offer, and its folder (e.g. 64GiB:/data/kv).")] = None,
    kv_fetch: Annotated[bool, typer.Option(
        "--kv-fetch/--no-kv-fetch", help="Fetch KV pages other workers hold when that beats "
                                          "recomputing them.")] = True,
    gpus: Annotated[int | None, typer.Option(
        "--gpus", min=0, show_default=False,
        help="GPUs to offer (default: those torch sees).")] = None,
    advertise: Annotated[str | None, typer.Option(
        "--advertise", metavar="HOST", show_default=False,
        help="Address other members reach this worker at (default: the interface that "
             "reaches the head).")] = None,
    timeout: Annotated[float, typer.Option(
        "--timeout", min=0.1, help="Seconds to wait for the head to answer.")] = 5.0,
    heartbeat: Annotated[float, typer.Option("--heartbeat", min=0.05)] = 0.5,
    data_plane: DataPlaneOption = None,
    debug: Annotated[bool, typer.Option("--debug", help=DEBUG_HELP)] = False,
) -> None:
    """Join the cluster at ADDRESS as a worker; serve until Ctrl-C or SIGTERM."""
    from omni.cluster import Worker, probe

    with reporting(debug):
        use_data_plane(data_plane)
        address = _address(address)
        tiers = _kv_tiers(kv_device, kv_host, kv_disk)
        worker_name = name or socket.gethostname()
        host = advertise or _local_address(address)
        resources = {"cpu": float(os.cpu_count() or 1), "memory": float(_memory_bytes()),
                     "gpu": float(gpus if gpus is not None else _gpu_count())}
        with _credentials(_token_path(token_file), create=False) as creds:

            async def serve() -> None:
                worker = Worker(worker_name, address, creds, host=host, resources=resources,
                                kv=tiers, heartbeat_interval=heartbeat, kv_fetch=kv_fetch)
                await probe(creds, address, timeout=timeout)
                async with stopped_by_signals(worker.stop), trio.open_nursery() as nursery:
                    endpoint = await nursery.start(worker.run)
                    _say(f"joined {address} as '{worker_name}' (serving at {endpoint})")

            with _saying_when_stopped(f"'{worker_name}' left the cluster"):
                _run(serve)


def _kv_tiers(device: str | None, host: str, disk: str | None) -> Any:
    from omni._units import parse_size
    from omni.cluster import KVTiers
    from omni.kv.errors import KVTierError

    size, _, folder = (disk or "").partition(":")
    tiers = KVTiers(device, host, size or None, folder or None)
    try:
        for value in (device, host, size or None):
            if value is not None:
                parse_size(value)
    except ValueError as exc:
        raise CliError(f"bad KV tier size: {exc}") from None
    try:
        tiers.check()
    except KVTierError as exc:
        raise CliError(f"--kv-{exc.tier}: {exc}") from None
    return tiers


def _local_address(head: str) -> str:
    """The local interface's address that routes to the head (loopback for a local head)."""
    host = head.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe_socket:
            probe_socket.connect((host, 9))  # no packet is sent: this only picks a route
            return probe_socket.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def _gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# -- status ---------------------------------------------------------------------------------


@app.command("status", no_args_is_help=True)
def status(
    address: Annotated[str, typer.Argument(metavar="ADDRESS", help="The head's address.")],
    token_file: Annotated[str | None, typer.Option(
        "--token-file", metavar="PATH", show_default=False, help=TOKEN_HELP)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", min=0.1)] = 5.0,
    debug: Annotated[bool, typer.Option("--debug", help=DEBUG_HELP)] = False,
) -> None:
    """Show the cluster's members: replicas, KV usage and hit rates."""
    from omni.cluster import MemberView, probe
    from omni.transport.rpc import RPCClient

    with reporting(debug):
        address = _address(address)
        with _credentials(_token_path(token_file), create=False) as creds:

            async def fetch() -> list[MemberView]:
                await probe(creds, address, timeout=timeout)
                async with RPCClient(address, ctx=creds.ctx, options=creds.client_options(),
                                     heartbeat_interval=None, timeout=timeout) as client:
                    return await client.call("cluster.members", None,
                                             result_type=list[MemberView])

            members = _run(fetch)
        print_status(address, members, as_json=as_json, token_file=token_file)
