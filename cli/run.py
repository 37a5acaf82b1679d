"""``omni run``: run a graph from a file on one or many requests and print the outputs."""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from typing import Annotated, Any, TextIO

import trio
import typer

from cli._errors import EXIT_FAILED, CliError, first_of, reporting
from cli._inputs import Requests
from cli._kv import kv_config
from cli._load import load_module, select_graph
from cli._options import (
    REPLACE_TIMEOUT_S,
    ClusterOption,
    DataPlaneOption,
    DebugOption,
    KvDeviceOption,
    KvDiskOption,
    KvHostOption,
    MetricsPortOption,
    ReplaceTimeoutOption,
    TokenFileOption,
    use_data_plane,
)
from cli._output import HumanPrinter, JsonPrinter, Printer, describe_cause
from cli._report import Outcome, Reporter, summary_line
from cli._runner import run_batch
from omni import Graph, NodeError

__all__ = ["run"]

FILE_HELP = "Python file that defines the graph (its folder is put on sys.path)."
GRAPH_HELP = ("Name of the graph in FILE (or of a node, run as a one-node graph); "
              "needed only when FILE defines several graphs.")


def run(
    file: Annotated[str, typer.Argument(metavar="FILE", help=FILE_HELP, show_default=False)],
    graph_name: Annotated[str | None, typer.Argument(
        metavar="GRAPH", help=GRAPH_HELP, show_default=False)] = None,
    inputs: Annotated[list[str] | None, typer.Option(
        "--input", "-i", metavar="KEY=VALUE", show_default=False,
        help="An input for every request (repeatable). VALUE is parsed as JSON when it is "
             "JSON (3, true, [1,2], '\"3\"'), otherwise taken as a string.")] = None,
    inputs_json: Annotated[str | None, typer.Option(
        "--inputs-json", metavar="PATH|-", show_default=False,
        help="Request inputs from a file, or '-' for stdin: one JSON object, or JSON lines "
             "(one object per request). Its keys override --input.")] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print exactly one JSON object per request on stdout (outputs, "
                       "streams collected as lists, or {\"error\": ...}), in request order.")
    ] = False,
    num_requests: Annotated[int | None, typer.Option(
        "--requests", "-n", min=1, show_default=False,
        help="Run N requests, cycling through the input lines (default: one per line). "
             "Prints a summary (throughput, p50/p99 latency) on stderr.")] = None,
    concurrency: Annotated[int | None, typer.Option(
        "--concurrency", "-c", min=1, show_default=False,
        help="Run at most C requests at once (default 1). Prints the summary too.")] = None,
    kv_device: KvDeviceOption = None,
    kv_host: KvHostOption = None,
    kv_disk: KvDiskOption = None,
    cluster: ClusterOption = None,
    token_file: TokenFileOption = None,
    data_plane: DataPlaneOption = None,
    replace_timeout: ReplaceTimeoutOption = REPLACE_TIMEOUT_S,
    metrics_port: MetricsPortOption = None,
    debug: DebugOption = False,
) -> None:
    """Run GRAPH from FILE and print its outputs as they are produced.

    Exit status: 0 when every request succeeded, 1 when a request failed (stderr names the
    node and the cause), 2 for bad usage, a file that does not load or a graph that does not
    validate.

    Example: omni run examples/hello.py --input text="omni runs pipelines"
    """
    with reporting(debug), _results_stdout(as_json) as out:
        use_data_plane(data_plane)
        module = load_module(file)
        graph = select_graph(module, graph_name, file)
        kv = kv_config(module, file, device=kv_device, host=kv_host, disk=kv_disk)
        requests = Requests(graph, inputs or [], inputs_json, num_requests)
        printer = JsonPrinter(out) if as_json else HumanPrinter(graph, requests.numbered)
        outcome = _execute(graph, requests, concurrency or 1, printer, debug, kv,
                           {"cluster": cluster, "token_file": token_file,
                            "replace_timeout": replace_timeout, "metrics_port": metrics_port,
                            "blocking_input": requests.blocking})
    if num_requests is not None or concurrency is not None:
        typer.echo(summary_line(outcome, concurrency or 1), err=True)
    if outcome.num_failed:
        raise typer.Exit(EXIT_FAILED)


@contextmanager
def _results_stdout(as_json: bool) -> Iterator[TextIO]:
    """The stream results go to. With --json, whatever else writes to stdout (a print in a
    node, a library's log) goes to stderr instead, so that stdout holds only JSON lines."""
    out = sys.stdout
    if not as_json:
        yield out
        return
    with redirect_stdout(sys.stderr):
        yield out


def _execute(graph: Graph, requests: Requests, concurrency: int,
             printer: Printer, debug: bool, kv: Any, options: dict[str, Any]) -> Outcome:
    from omni.cluster import ClusterError
    from omni.kv.errors import KVTierError
    from omni.transport.errors import TransportError

    try:
        with Reporter(requests.count, debug=debug) as reporter:
            return trio.run(functools.partial(run_batch, graph, requests, concurrency, printer,
                                              reporter, kv, **options))
    except (ClusterError, TransportError, KVTierError, OSError, BaseExceptionGroup) as exc:
        error = first_of(exc, (ClusterError, TransportError, KVTierError, OSError))
        if isinstance(error, (ClusterError, TransportError)):  # no head, a refused token
            raise CliError(str(error)) from exc
        if isinstance(error, KVTierError):  # a --kv-* tier that cannot be made
            raise CliError(f"--kv-{error.tier}: {error}") from exc
        if isinstance(error, OSError) and options.get("metrics_port") is not None:
            raise CliError(f"cannot serve metrics on port {options['metrics_port']}: "
                           f"{error.strerror or error}") from exc
        raise
    except NodeError as exc:  # raised only while the Runtime starts the graph's replicas
        raise CliError(_start_failure(exc), exit_code=EXIT_FAILED) from exc


def _start_failure(error: NodeError) -> str:
    """What failed as the Runtime started `error`'s node: on a worker, the error it raised
    there, by its own type (its traceback comes with ``--debug``, as the error's note)."""
    from omni.cluster import RemoteNodeError

    cause = error.cause
    if isinstance(cause, RemoteNodeError):
        return (f"node '{error.node}' failed to start on worker '{cause.member}': "
                f"{cause.remote_type}: {cause.remote_message}")
    return f"node '{error.node}' failed to start: {describe_cause(error)}"
