"""Drive a batch of requests through one `omni.Runtime`, at most `concurrency` at once.

The library does the work; this module only starts requests in order, hands results to a
`Printer`, failures to the `Reporter`, and times each request.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Iterable
from typing import Any

import trio

from cli._errors import CliError
from cli._output import FLUSH_INTERVAL, Printer
from cli._report import Outcome, Reporter
from cli._signals import stopped_by_signals
from omni import Graph, NodeError, Ref, Runtime
from omni.graph.balance import REPLACE_TIMEOUT_S

__all__ = ["run_batch"]


async def run_batch(graph: Graph, requests: Iterable[dict[str, Any]], concurrency: int,
                    printer: Printer, reporter: Reporter, kv: Any = None,
                    cluster: str | None = None, token_file: str | None = None,
                    replace_timeout: float = REPLACE_TIMEOUT_S, metrics_port: int | None = None,
                    blocking_input: bool = False) -> Outcome:
    """Run `requests` (inputs, in order) on a fresh Runtime; return their latencies and failures.

    Raises:
        NodeError: a node failed while the Runtime started (its replicas were being built).
        Stopped: Ctrl-C or SIGTERM ended the run (after the Runtime cleaned up).
    """
    outcome = Outcome()
    async with stopped_by_signals(), Runtime(
            graphs=[graph], kv=kv, cluster=cluster, token_file=token_file,
            replace_timeout=replace_timeout, metrics_port=metrics_port) as rt:
        if rt.metrics_address is not None:
            host, port = rt.metrics_address
            sys.stderr.write(f"metrics at http://{host}:{port}/metrics\n")
        started = time.perf_counter()
        async with trio.open_nursery() as flushing:
            flushing.start_soon(_keep_flushed, printer)
            async with trio.open_nursery() as nursery:
                bad_input = await _start_all(nursery, rt, graph, requests, printer, reporter,
                                             outcome, trio.Semaphore(concurrency),
                                             blocking_input)
            flushing.cancel_scope.cancel()
        printer.flush()
        outcome.elapsed = time.perf_counter() - started
    if bad_input is not None:
        raise bad_input
    return outcome


async def _start_all(nursery: trio.Nursery, rt: Runtime, graph: Graph,
                     requests: Iterable[dict[str, Any]], printer: Printer, reporter: Reporter,
                     outcome: Outcome, limit: trio.Semaphore, blocking: bool) -> CliError | None:
    """Start the requests in order, at most `limit` at once. A request whose input is bad
    (read from stdin as the run goes) ends the admission; the ones started finish first.
    `blocking`: reading the next request may wait (stdin), so it is read in a thread."""
    pending = iter(requests)
    for index in itertools.count():
        await limit.acquire()  # requests start in order: request ids follow it
        try:
            if blocking:  # a pipe: waiting for its next line must not stall the requests
                inputs = await trio.to_thread.run_sync(next, pending, None,
                                                       abandon_on_cancel=True)
            else:
                inputs = next(pending, None)
        except CliError as exc:
            return exc
        if inputs is None:
            return None
        nursery.start_soon(_request, rt, graph, index, inputs, printer, reporter, outcome, limit)
    return None


async def _keep_flushed(printer: Printer) -> None:
    """Flush the printer's output on a beat, so a line waits at most that long to be seen."""
    while True:
        await trio.sleep(FLUSH_INTERVAL)
        printer.flush()


async def _request(rt: Runtime, graph: Graph, index: int, inputs: dict[str, Any],
                   printer: Printer, reporter: Reporter, outcome: Outcome,
                   limit: trio.Semaphore) -> None:
    started = time.perf_counter()
    try:
        if printer.streams:
            async with rt.stream(graph, **inputs) as stream:
                async for arrived in stream.batches():
                    for name, item in arrived:
                        printer.item(index, name, item)
        else:
            value = await rt.run(graph, **inputs)
            printer.result(index, {"output": value} if isinstance(graph.output, Ref) else value)
    except NodeError as exc:
        outcome.num_failed += 1
        printer.failure(index, exc)
        reporter.failure(exc)
    finally:
        outcome.latencies.append(time.perf_counter() - started)
        reporter.request_done()
        limit.release()
