"""Options several commands share: the same flag with the same help everywhere."""

from __future__ import annotations

from typing import Annotated

import typer

from omni.graph.balance import REPLACE_TIMEOUT_S

__all__ = ["REPLACE_TIMEOUT_S", "ClusterOption", "DebugOption", "KvDeviceOption", "KvDiskOption",
           "KvHostOption", "MetricsPortOption", "ReplaceTimeoutOption", "TokenFileOption"]

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
