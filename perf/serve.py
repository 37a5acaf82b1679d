"""omni serve: streaming chats through the official client, and the server's own overhead.

Chat: ``omni serve examples/omni_dialogue.py`` (the built-in tiny model) and `chats`
concurrent streaming chat completions through `openai.AsyncOpenAI`, each a fresh one-message
conversation asking for `reply_tokens` tokens: completions per second, generated tokens per
second, time to first token (p50 / p99, from the request to the first content delta) and
errors (target: 0).

Overhead: requests per second through POST /v1/graphs/NAME vs the bare server stack.

Two server processes, started the same way (`omni.serve.serve`: hypercorn's trio worker,
FastAPI, the guard, the inputs checked against the graph's annotations, the answer as JSON):
"omni" serves a no-op graph (`noop(x: int) -> x`) through a real `omni.Runtime`; "constant"
is the very same stack with the runtime replaced by one that answers the input at once, so
the two differ only by what Omni adds per request (the scheduler, the request's nursery, the
node call). One client process (httpx on trio, `concurrency` connections, each sending
requests back to back) loads each server for `seconds`, the two alternating round by round.

Hostile requests (on the chat server, after the chats): `hostile_requests` at once, a third
each a PNG of a few KB holding 12,000 x 12,000 pixels, a 30 MB message, and twenty
4,096 x 4,096 PNGs of 2.8 KB each (each under the per-image cap, a gigabyte decoded
together), while a client polls ``GET /health`` back to back; the same polling with no
hostile request first, as the baseline. Every hostile request must be refused (400), and
/health's p99 latency stay within `HEALTH_P99_TARGET_MS` (an absolute target: a load
balancer's health check must not time out while the server refuses abuse). Before that, the
twenty-PNG requests alone (a third of `hostile_requests`, at once): the server's peak
resident memory may grow by at most `HOSTILE_RSS_TARGET_MIB` while they are refused (its
peak reset just before: ``/proc/PID/clear_refs``; a 30 MB message costs its body's size in
memory, which `--max-body-mib` and `--max-concurrency` bound, so it is not in that figure).

Multi-turn chats (`turns`): ``omni serve`` against ``transformers serve
--continuous-batching`` on the same ~25 M instruct checkpoint, 6-turn conversations at 1 and
8 sessions at once: TTFT p50 and output tokens/s (perf/_serve_turns.py). transformers serve
needs its serving extra, which ``make bench`` installs (``.[bench]``); without it the claim
records Omni's figures only and does not pass.

Claims: the chats end without an error; omni requests/s >= 0.7 x constant's (median over
rounds of the paired ratio), with 0 errors; /health's p99 under hostile requests <= 100 ms
with every one refused, the server's peak RSS up by <= 100 MiB over the twenty-PNG
requests; multi-turn output tokens/s at 8 sessions >= 1.3 x transformers serve's. Both
servers and the client share this machine's cores, which bounds the absolute figures, not
the ratio.

Usage: ``python perf/serve.py [--quick] [--out PATH.json] [--plot PATH.png] [--repeats N]``
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import statistics
import subprocess
import sys
import tempfile
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
from perf._serve_turns import measure_turns

__all__ = ["Params", "main", "measure"]

TARGET = 0.7  # omni requests/s / the constant server's, at least
HEALTH_P99_TARGET_MS = 100.0  # /health's p99 while hostile requests are refused, at most
HOSTILE_RSS_TARGET_MIB = 100.0  # the server's peak resident memory growth over them, at most
ROOT = Path(__file__).resolve().parent.parent
GRAPHS = Path(__file__).with_name("_serve_graphs.py")
DIALOGUE = ROOT / "examples" / "omni_dialogue.py"
CHAT_MODEL = "chat"  # the dialogue file's chat graph (a model is named after its graph)
READY = "omni serve: http://"
START_CAP_S = 180.0


@dataclass(frozen=True, slots=True)
class Params:
    """The sizes of one run (`quick` shrinks them for a smoke run)."""

    seed: int = 0
    repeats: int = 5
    seconds: float = 3.0  # of load per server per round
    concurrency: int = 16
    chats: int = 64  # streaming chat completions at once
    reply_tokens: int = 32
    hostile_requests: int = 9  # bombs, 30 MB messages and 20-image requests, at once
    health_polls: int = 100  # of the baseline (no hostile request)
    sessions: tuple[int, ...] = (1, 8)  # multi-turn conversations at once
    turns: int = 6
    turn_tokens: int = 32  # tokens of each reply
    turn_repeats: int = 3  # rounds per server and session count
    quick: bool = False

    @classmethod
    def small(cls, seed: int = 0) -> Params:
        """Sizes for a smoke run (a few seconds)."""
        return cls(seed=seed, repeats=1, seconds=0.5, concurrency=4, chats=4, reply_tokens=4,
                   hostile_requests=3, health_polls=20, sessions=(1, 2), turns=2,
                   turn_tokens=4, turn_repeats=1, quick=True)


def start(kind: str, folder: Path) -> tuple[subprocess.Popen, str]:
    """A server process (`kind` "omni", "constant" or "chat") and its URL, once it listens.

    Its stderr goes to a file in `folder` (a pipe left unread would fill and stall it)."""
    args = {"omni": [sys.executable, "-m", "cli", "serve", str(GRAPHS), "noop", "--port", "0"],
            "constant": [sys.executable, str(GRAPHS)],
            "chat": [sys.executable, "-m", "cli", "serve", str(DIALOGUE), "--port", "0"]}[kind]
    log = folder / f"{kind}.stderr"
    with open(log, "wb") as err:
        process = subprocess.Popen(args, cwd=ROOT, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=err,
                                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + START_CAP_S
    while time.monotonic() < deadline and process.poll() is None:
        lines = [line for line in log.read_text(errors="replace").splitlines() if READY in line]
        if lines:
            return process, lines[0].split()[2]
        time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"{kind} server did not start:\n{log.read_text(errors='replace')}")


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


async def chat_load(url: str, model: str, params: Params) -> dict[str, Any]:
    """`params.chats` streaming chat completions at once through `openai.AsyncOpenAI`."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    ttfts: list[float] = []
    tokens, errors = 0, []

    async def one(i: int) -> None:
        nonlocal tokens
        started, first = time.perf_counter(), None
        try:
            stream = await client.chat.completions.create(
                model=model, max_tokens=params.reply_tokens, stream=True,
                stream_options={"include_usage": True},
                messages=[{"role": "user", "content": f"Chat {i}: how are you today?"}])
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter()
                if chunk.usage is not None:
                    tokens += chunk.usage.completion_tokens
        except Exception as exc:  # counted, and the first few kept, not raised: a claim
            errors.append(f"{type(exc).__name__}: {exc}"[:300])
            return
        if first is not None:
            ttfts.append(first - started)

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(params.chats)))
    elapsed = time.perf_counter() - started
    await client.close()
    return {"chats": params.chats, "seconds": round(elapsed, 3),
            "completions_per_s": round((params.chats - len(errors)) / elapsed, 2),
            "tokens_per_s": round(tokens / elapsed, 1), "generated_tokens": tokens,
            "ttft_ms": {"p50": _percentile_ms(ttfts, 50), "p99": _percentile_ms(ttfts, 99)},
            "errors": len(errors), "first_errors": errors[:3], "pass": not errors}


def hostile_bodies() -> list[bytes]:
    """Chat requests as JSON bodies: a decompression bomb (a PNG of a few KB, 12,000 x 12,000
    pixels), a 30 MB message, and twenty 4,096 x 4,096 one-bit PNGs (2.8 KB each, each under
    the per-image pixel cap)."""
    import base64
    import io
    import json

    from PIL import Image

    def png_url(size: int) -> dict[str, Any]:
        png = io.BytesIO()
        Image.new("1", (size, size)).save(png, "PNG")
        return {"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()}}

    bomb = [png_url(12_000)]
    huge = "tell me more " * (30 * 2**20 // 13)
    many = [png_url(4096)] * 20
    return [json.dumps({"model": CHAT_MODEL, "max_tokens": 1,
                        "messages": [{"role": "user", "content": content}]}).encode()
            for content in (bomb, huge, many)]


def peak_rss_mib(pid: int, *, reset: bool = False) -> float:
    """The process's peak resident memory (VmHWM) in MiB; `reset` first makes it the
    current resident memory (``clear_refs`` 5)."""
    if reset:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


async def hostile_health(url: str, pid: int, params: Params) -> dict[str, Any]:
    """The growth of the peak resident memory of the server (process `pid`) while the
    twenty-PNG requests alone are refused; then /health's latency polled back to back: alone
    (`health_polls` times), then while `hostile_requests` hostile requests are refused; the
    claim."""
    bodies = hostile_bodies()
    statuses: list[int] = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:

        async def poll(latencies: list[float], until: trio.Event | None) -> None:
            while (until is None and len(latencies) < params.health_polls) or (
                    until is not None and not until.is_set()):
                start = time.perf_counter()
                answer = await http.get("/health")
                latencies.append(time.perf_counter() - start)
                assert answer.status_code == 200, answer.text

        async def attack(body: bytes) -> None:
            answer = await http.post("/v1/chat/completions", content=body,
                                     headers={"content-type": "application/json"})
            statuses.append(answer.status_code)

        before = peak_rss_mib(pid, reset=True)
        async with trio.open_nursery() as attackers:
            for _ in range(params.hostile_requests // len(bodies)):
                attackers.start_soon(attack, bodies[-1])
        growth = round(peak_rss_mib(pid) - before, 1)
        alone: list[float] = []
        await poll(alone, None)
        under: list[float] = []
        done = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll, under, done)
            async with trio.open_nursery() as attackers:
                for i in range(params.hostile_requests):
                    attackers.start_soon(attack, bodies[i % len(bodies)])
            done.set()
    p99 = _percentile_ms(under, 99) or 0.0
    num_alone = params.hostile_requests // len(bodies)  # the twenty-PNG requests alone
    refused = statuses.count(400) - num_alone
    return {"unit": "ms", "target": HEALTH_P99_TARGET_MS,
            "measured": {"p50": _percentile_ms(under, 50), "p99": p99,
                         "max": round(max(under) * 1e3, 1), "polls": len(under)},
            "baseline": {"p50": _percentile_ms(alone, 50), "p99": _percentile_ms(alone, 99),
                         "max": round(max(alone) * 1e3, 1), "polls": len(alone)},
            "refused": refused, "hostile_requests": len(statuses) - num_alone,
            "peak_rss_growth_mib": growth, "rss_target_mib": HOSTILE_RSS_TARGET_MIB,
            "pass": (p99 <= HEALTH_P99_TARGET_MS and statuses.count(400) == len(statuses)
                     and growth <= HOSTILE_RSS_TARGET_MIB),
            "note": (f"GET /health polled back to back while {len(statuses)} hostile chat "
                     "requests (a third each a PNG of 12,000 x 12,000 pixels, a 30 MB "
                     "message, twenty 4,096 x 4,096 PNGs) were refused; baseline: the same "
                     "polling with none; the server's peak RSS growth while "
                     f"{num_alone} requests of twenty 4,096 x 4,096 PNGs were refused, before")}


def _percentile_ms(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] * 1e3, 1)


def measure_chat(params: Params, folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The chat server, one warm-up chat, then `params.chats` at once, then the hostile
    requests; the chat claim and the hostile one."""
    process, url = start("chat", folder)
    try:
        model = CHAT_MODEL
        warm = dataclasses.replace(params, chats=1)
        asyncio.run(chat_load(url, model, warm))
        result = asyncio.run(chat_load(url, model, params))
        hostile = trio.run(hostile_health, url, process.pid, params)
    finally:
        result_code = _stop(process)
    return {**result, "model": model, "exit_code": result_code,
            "note": (f"{params.chats} streaming chat completions at once through "
                     "openai.AsyncOpenAI (one connection each), max_tokens "
                     f"{params.reply_tokens}, against omni serve examples/omni_dialogue.py "
                     "(the built-in tiny model); TTFT from the request to the first content "
                     "delta")}, hostile


def measure(params: Params) -> dict[str, Any]:
    """The chat claim, then both overhead servers in alternating rounds; the result dict."""
    with tempfile.TemporaryDirectory(prefix="omni-perf-serve-") as folder:
        return _measure(params, Path(folder))


def _measure(params: Params, folder: Path) -> dict[str, Any]:
    chat, hostile = measure_chat(params, folder)
    turns = measure_turns(params.sessions, params.turns, params.turn_tokens,
                          params.turn_repeats, params.quick, folder)
    servers = {kind: start(kind, folder) for kind in ("omni", "constant")}
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
        "benchmark": "serve", "env": environment(), "params": asdict(params), "chat": chat,
        "hostile": hostile, "turns": turns,
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
