"""Options several commands share: the same flag with the same help everywhere."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from cli._errors import CliError
from omni.graph.balance import REPLACE_TIMEOUT_S

__all__ = ["REPLACE_TIMEOUT_S", "ClusterOption", "DataPlaneOption", "DebugOption",
           "KvDeviceOption", "KvDiskOption", "KvHostOption", "MetricsPortOption",
           "ReplaceTimeoutOption", "TokenFileOption", "use_data_plane"]

KvDeviceOption = Annotated[str | None, typer.Option(
    "--kv-device", metavar="SIZE", show_default=False,
    help="Size of the KV store's device tier (e.g. 2GiB); needs KV_LAYOUT in FILE.")]

KvHostOption = Annotated[str | None, typer.Option(
    "--kv-host", metavar="SIZE", show_default=False,
    help="Size of the KV store's host-memory tier (e.g. 4GiB).")]

KvDiskOption = Annotated[str | None, typer.Option(
    "--kv-disk", metavar="SIZE[:PATH]", show_default=False,
    help="Size and folder of the KV store's disk tier (e.g. 32GiB:/data/kv; the folder "
         "defaults to the user's cache directory).")]

ClusterOption = Annotated[str | None, typer.Option(
    "--cluster", metavar="ADDRESS", show_default=False,
    help="Run class nodes' replicas on the workers of the cluster whose head is at "
         "ADDRESS (omni cluster start), or on a Ray cluster: 'ray' ($RAY_ADDRESS, else the "
         "cluster this machine is in) or 'ray://HOST:PORT'; function nodes run here.")]

ReplaceTimeoutOption = Annotated[float, typer.Option(
    "--replace-timeout", metavar="SECONDS", min=0,
    help="With --cluster: how long a request waits for a class node's replicas to be placed "
         "again when the workers hosting them are gone (a call that was running there is "
         "retried once on the replacement) before it fails.")]

DataPlaneOption = Annotated[str | None, typer.Option(
    "--data-plane", metavar="MODE", show_default=False,
    help="How large values and KV pages cross between cluster processes over TCP: "
         "'encrypted' (AES-256-GCM, the default) or 'plaintext' (only on a network you trust; "
         "both ends must say so). Default: $OMNI_DATA_PLANE, else encrypted.")]

TokenFileOption = Annotated[str | None, typer.Option(
    "--token-file", metavar="PATH", show_default=False,
    help="The cluster's token file (default: $OMNI_TOKEN_FILE or "
         "~/.config/omni/cluster.token).")]

MetricsPortOption = Annotated[int | None, typer.Option(
    "--metrics-port", metavar="PORT", min=0, max=65535, show_default=False,
    help="Serve Prometheus metrics at http://127.0.0.1:PORT/metrics while the run lasts "
         "(0: a free port, printed on stderr).")]

DebugOption = Annotated[bool, typer.Option(
    "--debug", help="Show tracebacks for errors, not only the one-line message.")]


def use_data_plane(mode: str | None) -> None:
    """``--data-plane``, checked, becomes this process's setting (``OMNI_DATA_PLANE``), which
    every cluster connection it opens reads."""
    if mode is None:
        return
    from omni.transport.data_channel import data_plane_mode
    from omni.transport.errors import TransportError

    try:
        os.environ["OMNI_DATA_PLANE"] = data_plane_mode(mode)
    except TransportError as exc:
        raise CliError(str(exc)) from None
