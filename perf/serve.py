"""omni serve: requests per second through POST /v1/graphs/NAME vs the bare server stack.

Two server processes, started the same way (`omni.serve.serve`: hypercorn's trio worker,
FastAPI, the guard, the inputs checked against the graph's annotations, the answer as JSON):
"omni" serves a no-op graph (`noop(x: int) -> x`) through a real `omni.Runtime`; "constant"
is the very same stack with the runtime replaced by one that answers the input at once, so
the two differ only by what Omni adds per request (the scheduler, the request's nursery, the
node call). One client process (httpx on trio, `concurrency` connections, each sending
requests back to back) loads each server for `seconds`, the two alternating round by round.

Claim: omni requests/s >= 0.7 x constant's (median over rounds of the paired ratio), with 0
errors. Both servers and the client share this machine's cores, which bounds the absolute
figures, not the ratio.

Usage: ``python perf/serve.py [--quick] [--out PATH.json] [--plot PATH.png] [--repeats N]``
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perf._common import (
    Samples,
    benchmark_parser,
    claim,
    environment,
    params_from,
    plot_bars,
    write_json,
)

__all__ = ["Params", "main", "measure"]

TARGET = 0.7  # omni requests/s / the constant server's, at least
ROOT = Path(__file__).resolve().parent.parent
GRAPHS = Path(__file__).with_name("_serve_graphs.py")
READY = "omni serve: http://"


@dataclass(frozen=True, slots=True)
class Params:
    """The sizes of one run (`quick` shrinks them for a smoke run)."""

    seed: int = 0
    repeats: int = 5
    seconds: float = 3.0  # of load per server per round
    concurrency: int = 16
    quick: bool = False

    @classmethod
    def small(cls, seed: int = 0) -> Params:
        """Sizes for a smoke run (a few seconds)."""
        return cls(seed=seed, repeats=1, seconds=0.5, concurrency=4, quick=True)


def start(kind: str) -> tuple[subprocess.Popen, str]:
    """A server process (`kind` "omni" or "constant") and its URL, once it listens."""
    args = ([sys.executable, "-m", "cli", "serve", str(GRAPHS), "noop", "--port", "0"]
            if kind == "omni" else [sys.executable, str(GRAPHS)])
    process = subprocess.Popen(args, cwd=ROOT, stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert process.stderr is not None
    for line in process.stderr:
        if READY in line:
            return process, line.split()[2]
    raise RuntimeError(f"{kind} server did not start (exit {process.wait()})")


async def load(url: str, seconds: float, concurrency: int) -> dict[str, float]:
    """`concurrency` clients posting back to back for `seconds`: requests/s and errors."""
    done = errors = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as http:

        async def client(i: int) -> None:
            nonlocal done, errors
            while time.perf_counter() < deadline:
                response = await http.post("/v1/graphs/noop", json={"inputs": {"x": i}})
                ok = response.status_code == 200 and response.json() == {"output": i}
                done, errors = done + ok, errors + (not ok)

        started = time.perf_counter()
        deadline = started + seconds
        async with trio.open_nursery() as nursery:
            for i in range(concurrency):
                nursery.start_soon(client, i)
        elapsed = time.perf_counter() - started
    return {"requests_per_s": done / elapsed, "errors": errors}


def measure(params: Params) -> dict[str, Any]:
    """Start both servers, load them in alternating rounds, stop them; the result dict."""
    servers = {kind: start(kind) for kind in ("omni", "constant")}
    rates: dict[str, list[float]] = {kind: [] for kind in servers}
    errors = 0
    try:
        for _, url in servers.values():  # warm-up: connections, first requests
            trio.run(load, url, min(params.seconds, 0.5), params.concurrency)
        for r in range(params.repeats):
            for kind in (list(servers) if r % 2 == 0 else list(reversed(servers))):
                got = trio.run(load, servers[kind][1], params.seconds, params.concurrency)
                rates[kind].append(got["requests_per_s"])
                errors += int(got["errors"])
    finally:
        codes = {kind: _stop(process) for kind, (process, _) in servers.items()}
    omni_rate, constant = Samples(tuple(rates["omni"])), Samples(tuple(rates["constant"]))
    ratio = statistics.median(o / c for o, c in zip(omni_rate.values, constant.values,
                                                    strict=True))
    return {
        "benchmark": "serve", "env": environment(), "params": asdict(params),
        "claim": claim(unit="requests per second", target=TARGET, measured=omni_rate,
                       baseline=constant, ratio=ratio,
                       passed=ratio >= TARGET and errors == 0, errors=errors,
                       exit_codes=codes,
                       note=("POST /v1/graphs/noop with {\"inputs\": {\"x\": i}}, "
                             f"{params.concurrency} connections back to back for "
                             f"{params.seconds:g} s per server per round, the servers "
                             "alternating; ratio: median over rounds of omni / constant. "
                             "constant: the same app and server with the runtime replaced "
                             "by one answering the input at once.")),
    }


def _stop(process: subprocess.Popen) -> int:
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse `argv`, run the benchmark, print (and optionally write) the result."""
    parser = benchmark_parser(__doc__, repeats_help="rounds per server",
                              plot_help="write a bar chart (PNG) of requests/s here",
                              profile_help="(no profile for this benchmark)")
    args = parser.parse_args(argv)
    result = measure(params_from(args, Params))
    write_json(result, args.out)
    if args.plot:
        measured = result["claim"]
        plot_bars(args.plot, f"omni serve: POST /v1/graphs/noop ({result['env']['cpu_count']} "
                             "CPUs)", [("no-op graph vs the bare stack", "requests / s", {
                                 "omni": Samples(tuple(measured["measured"]["runs"])),
                                 "constant": Samples(tuple(measured["baseline"]["runs"]))})])
    return result


if __name__ == "__main__":
    main()
