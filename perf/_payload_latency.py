"""The latency measurements of `perf/payloads.py`: a trivial call, and a three-stage pipeline
(hop latency, throughput with requests in flight), Omni against Ray (a Compiled Graph for the
pipeline), alternating round by round.

After the pipeline's rounds, where Omni's time goes is measured once (`explain_pipeline`,
the claims' ``explain`` and its one-line summary ``why``): the same requests again, first
plain, for CPU time per request (the driver: ``time.process_time``, and its trio thread:
``time.thread_time``; the head and the workers, and Ray's processes: their threads' on-CPU
time from ``/proc/PID/task/*/schedstat``, and of the cluster's processes their main threads'
(their event loops'), apart; the machine: busy time in ``/proc/stat``) against
wall time per request; then under cProfile in the driver (its trio thread), for the functions
with the most own time (share of the profiled wall time) and the remote calls per request.
Both while Ray's pipeline stands, as in the rounds; then the plain requests once more after
it is torn down (``after_ray_teardown``): the same figures without Ray's compiled graph
standing by. And, also while Ray's pipeline stands, the hop claim's ``floor``: four bare
processes passing 8 bytes around a ring of Unix sockets (`perf/_ring.py`), with trio event
loops as Omni's processes run and with blocking sockets.
"""

from __future__ import annotations

import cProfile
import math
import os
import pstats
import re
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from perf import _payload_nodes as nodes
from perf import _ring
from perf._common import Samples
from perf._payload_measures import (
    CALL_LATENCY_TARGET,
    CALL_TIMEOUT_S,
    NO_RAY,
    RAY_TARGET,
    THROUGHPUT_TARGET,
    Measure,
    alternate,
    claim,
    error_text,
    ray_timer,
)
from perf._payload_support import BlockingThread, descendants

if TYPE_CHECKING:
    from perf.payloads import Params, RayState

__all__ = ["call_latency_section", "explain_pipeline", "pipeline_section"]

ROOT = Path(__file__).resolve().parent.parent
TOP_FUNCTIONS = 5


async def call_latency_section(rt: Any, p: Params, ray: RayState, thread: BlockingThread
                               ) -> dict[str, Any]:
    """A trivial call (an int each way) on w1: median µs of sequential calls."""

    async def omni_us() -> float:
        durations = []
        for i in range(p.calls):
            start = time.perf_counter()
            out = await rt.run(nodes.Tiny, value=i)
            durations.append(time.perf_counter() - start)
            if out != i:
                raise RuntimeError(f"the node returned {out!r} for {i}")
        return statistics.median(durations) * 1e6

    measures: dict[str, Measure] = {"omni": omni_us}
    if ray.side is not None:
        measures["ray"] = ray_timer(thread, lambda: ray.side.latency_us(p.calls))
    samples, errors = await alternate(measures, p.repeats)
    return claim(
        unit="µs", target=CALL_LATENCY_TARGET, better="lower", measured=samples.get("omni"),
        baseline=samples.get("ray"), digits=1,
        error=errors.get("omni") or errors.get("ray") or (
            None if ray.side is not None else ray.error or NO_RAY),
        note=(f"µs per call, the median of {p.calls} sequential calls of a class node on "
              "worker w1 that returns its argument (an int); measured: Omni (`rt.run`), "
              "baseline: Ray (`ray.get(actor.tiny.remote(i))`); median of "
              f"{p.repeats} alternating rounds after a warm-up; ratio = Omni / Ray, target "
              f"<= {CALL_LATENCY_TARGET:g}"))


async def pipeline_section(rt: Any, p: Params, ray: RayState, thread: BlockingThread,
                           pids: dict[str, int] | None = None) -> dict[str, Any]:
    """hop_latency and pipeline_throughput: the chain of three nodes on w1, w2, w3 against a
    Ray Compiled Graph of three actors (or chained actor calls); then, once, where Omni's time
    goes (`explain_pipeline`; `pids`: the cluster's processes by name, whose CPU it reads)."""
    pipeline: Any = None
    if ray.side is not None:
        from perf._payload_ray import Pipeline

        pipeline = await thread.run(
            lambda: Pipeline(ray.ray, ray.side.stage_class, p.in_flight))
    explain: dict[str, Any] = {}
    try:
        hop = await _hop_latency(rt, p, pipeline, thread)
        throughput = await _throughput(rt, p, pipeline, thread)
        floor = await _floor(p)
        if "omni" not in hop[1] and "omni" not in throughput[1]:
            try:  # while Ray's pipeline still stands, as in the rounds
                explain = await explain_pipeline(rt, p, pids or {})
            except Exception as exc:  # recorded; the claims stand without it
                error = f"not measured: {error_text(exc)}"
                explain = {"hop": {"error": error}, "throughput": {"error": error}}
    finally:
        if pipeline is not None:
            await thread.run(pipeline.teardown)
    if pipeline is not None and explain and "error" not in explain["hop"]:
        try:  # the same plain requests with Ray's graph torn down (its actors idle)
            after = await explain_pipeline(rt, p, pids or {}, profile=False)
        except Exception as exc:  # recorded; the rest stands without it
            after = {"hop": {"error": error_text(exc)}, "throughput": {"error": error_text(exc)}}
        for kind in ("hop", "throughput"):
            explain[kind]["after_ray_teardown"] = after[kind]
    baseline = {"baseline_kind": None if pipeline is None else pipeline.kind,
                "compile_error": None if pipeline is None else pipeline.compile_error}
    no_ray = None if pipeline is not None else ray.error or NO_RAY
    kind = "a Ray Compiled Graph of three actors (ray.dag InputNode, experimental_compile"
    kind += f", _max_inflight_executions={p.in_flight})"
    if pipeline is not None and pipeline.kind == "ray_actors":
        kind = ("plain Ray actor calls chained by object refs (the compiled graph did not "
                "compile: see compile_error)")
    samples, errors = hop
    hop_claim = claim(
        unit="µs per hop", target=RAY_TARGET, better="lower", measured=samples.get("omni"),
        baseline=samples.get("ray"), digits=1,
        error=errors.get("omni") or errors.get("ray") or no_ray, **baseline, floor=floor,
        **_why(explain.get("hop"), "hop"),
        note=(f"a graph of three class nodes, one per worker (w1, w2, w3), each returning its "
              f"argument (an int) from a synchronous method, as the baseline's actors do (their "
              f"stages run on the workers' lanes): one request's end-to-end µs / 3, the median of "
              f"{p.hop_requests} sequential requests; baseline: {kind}, the same; median of "
              f"{p.repeats} alternating rounds after a warm-up; ratio = Omni / baseline, "
              f"target <= {RAY_TARGET:g}"))
    samples, errors = throughput
    throughput_claim = claim(
        unit="requests/s", target=THROUGHPUT_TARGET, better="higher",
        measured=samples.get("omni"), baseline=samples.get("ray"), digits=1,
        error=errors.get("omni") or errors.get("ray") or no_ray, **baseline,
        in_flight=p.in_flight, requests=p.requests,
        **_why(explain.get("throughput"), "throughput"),
        note=(f"the same pipeline: {p.requests} requests / wall seconds with {p.in_flight} in "
              f"flight; baseline: {kind}, the same; median of {p.repeats} alternating rounds "
              f"after a warm-up; ratio = Omni / baseline, target >= {THROUGHPUT_TARGET:g}"))
    return {"hop_latency": hop_claim, "pipeline_throughput": throughput_claim}


async def _sequential(rt: Any, requests: int) -> list[float]:
    """Seconds of each of `requests` sequential requests through the chain."""
    durations = []
    for i in range(requests):
        start = time.perf_counter()
        out = await rt.run(nodes.chain, value=i)
        durations.append(time.perf_counter() - start)
        if out != i:
            raise RuntimeError(f"the pipeline returned {out!r} for {i}")
    return durations


async def _concurrent(rt: Any, requests: int, in_flight: int) -> float:
    """Requests/s of `requests` through the chain, `in_flight` at a time."""
    numbers = iter(range(requests))

    async def client() -> None:
        for i in numbers:  # shared: each request is sent once
            out = await rt.run(nodes.chain, value=i)
            if out != i:
                raise RuntimeError(f"the pipeline returned {out!r} for {i}")

    start = time.perf_counter()
    with trio.fail_after(CALL_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            for _ in range(in_flight):
                nursery.start_soon(client)
    return requests / (time.perf_counter() - start)


async def _floor(p: Params) -> dict[str, Any]:
    """The rings of `perf/_ring.py` (µs per hop; an error string where one failed)."""
    requests = p.hop_requests * 20
    out: dict[str, Any] = {"requests": requests}
    for kind in ("trio", "blocking"):
        try:
            out[f"{kind}_us_per_hop"] = round(
                await trio.to_thread.run_sync(_ring.measure, kind, requests), 1)
        except Exception as exc:  # recorded; the claim stands without it
            out[f"{kind}_us_per_hop"] = f"not measured: {error_text(exc)}"
    out["note"] = ("four processes that only pass 8 bytes around a ring of Unix sockets, as "
                   "the pipeline's request goes around its processes: one request's µs / 3, "
                   "the median; trio: each process a trio event loop, as Omni's are; "
                   "blocking: plain blocking sockets, no event loop")
    return out


async def _hop_latency(rt: Any, p: Params, pipeline: Any, thread: BlockingThread
                       ) -> tuple[dict[str, Samples], dict[str, str]]:
    async def omni_us() -> float:
        return statistics.median(await _sequential(rt, p.hop_requests)) * 1e6 / 3

    measures: dict[str, Measure] = {"omni": omni_us}
    if pipeline is not None:
        measures["ray"] = ray_timer(thread, lambda: pipeline.hop_latency_us(p.hop_requests))
    return await alternate(measures, p.repeats)


async def _throughput(rt: Any, p: Params, pipeline: Any, thread: BlockingThread
                      ) -> tuple[dict[str, Samples], dict[str, str]]:
    async def omni_rate() -> float:
        return await _concurrent(rt, p.requests, p.in_flight)

    measures: dict[str, Measure] = {"omni": omni_rate}
    if pipeline is not None:
        measures["ray"] = ray_timer(
            thread, lambda: pipeline.throughput(p.requests, p.in_flight))
    return await alternate(measures, p.repeats)


# ---------------------------------------------------------------------------------------------
# Where the time goes


def _task_cpu_ns(pid: int) -> int | None:
    """On-CPU nanoseconds of `pid`'s live threads (``/proc/PID/task/*/schedstat``), or its
    user + system time from ``/proc/PID/stat`` (clock ticks) where there is no schedstat;
    None if it is gone."""
    total, found = 0, False
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
                found = True
            except (OSError, ValueError, IndexError):
                continue
        if found:
            return total
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * 10**9 // os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _main_thread_cpu_ns(pid: int) -> int | None:
    """On-CPU nanoseconds of `pid`'s main thread (its event loop's, in Omni's processes), or
    None (gone, or no schedstat)."""
    try:
        return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _machine_busy_ns() -> int | None:
    """Nanoseconds every CPU of the machine spent busy (``/proc/stat``: all but idle and
    iowait), or None."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(ticks[:8]) - ticks[3] - ticks[4]  # user..steal, less idle and iowait
    return busy * 10**9 // os.sysconf("SC_CLK_TCK")


def _ray_pids(pids: dict[str, int]) -> set[int]:
    """This process's descendants other than the cluster's processes (and theirs): Ray's
    (its GCS, raylet and actor workers); none where Ray was not started."""
    if "ray" not in sys.modules:
        return set()
    cluster = set(pids.values())
    for pid in pids.values():
        cluster |= descendants(pid)
    return descendants(os.getpid()) - cluster


def _snapshot(pids: dict[str, int], ray_pids: set[int]) -> dict[str, Any]:
    ray = [_task_cpu_ns(pid) for pid in ray_pids]
    return {"wall": time.perf_counter_ns(), "driver": time.process_time_ns(),
            "trio_thread": time.thread_time_ns(), "machine": _machine_busy_ns(),
            "procs": {name: _task_cpu_ns(pid) for name, pid in pids.items()},
            "loops": {name: _main_thread_cpu_ns(pid) for name, pid in pids.items()},
            "ray": {pid: ns for pid, ns in zip(ray_pids, ray, strict=True) if ns is not None}}


def _per_request(before: dict[str, Any], after: dict[str, Any], requests: int
                 ) -> dict[str, Any]:
    """µs per request of wall time and of each process's CPU time between two snapshots."""

    def us(a: int | None, b: int | None) -> float | None:
        return None if a is None or b is None else round((b - a) / 1e3 / requests, 1)

    wall = us(before["wall"], after["wall"])
    procs = {name: us(before["procs"][name], after["procs"].get(name))
             for name in before["procs"]}
    loops = {name: us(before["loops"][name], after["loops"].get(name))
             for name in before["loops"]}
    ray_pids = before["ray"].keys() & after["ray"].keys()
    ray = us(sum(before["ray"][pid] for pid in ray_pids),
             sum(after["ray"][pid] for pid in ray_pids))
    out: dict[str, Any] = {
        "requests": requests, "wall_us": wall,
        "driver_cpu_us": us(before["driver"], after["driver"]),
        "driver_trio_thread_cpu_us": us(before["trio_thread"], after["trio_thread"]),
        "cluster_cpu_us": procs, "cluster_loop_cpu_us": loops,
        "ray_cpu_us": ray, "ray_processes": len(ray_pids),
        "machine_busy_us": us(before["machine"], after["machine"]), "cpus": os.cpu_count()}
    known = [out["driver_cpu_us"], *procs.values(), ray]
    if out["machine_busy_us"] is not None and None not in known:
        out["other_cpu_us"] = round(out["machine_busy_us"] - sum(known), 1)  # the OS, others
    if wall:
        out["driver_cpu_share"] = round(out["driver_cpu_us"] / wall, 3)
        if out["machine_busy_us"] is not None:
            out["machine_busy_share"] = round(
                out["machine_busy_us"] / wall / (os.cpu_count() or 1), 3)
    return out


def _function_name(key: tuple[str, int, str]) -> str:
    """A pstats key as text: omni/cluster/remote.py:177(_call), trio/_core/_run.py:..."""
    filename, line, name = key
    if filename == "~":
        return name  # a built-in: <method 'poll' of 'select.epoll' objects>
    path = Path(filename)
    if path.is_relative_to(ROOT) and ".venv" not in path.parts:
        shown = path.relative_to(ROOT).as_posix()
    elif "site-packages" in path.parts:
        shown = Path(*path.parts[path.parts.index("site-packages") + 1:]).as_posix()
    else:
        shown = "/".join(path.parts[-2:])
    return f"{shown}:{line}({name})"


def _profile(profiler: cProfile.Profile, wall_s: float, requests: int) -> dict[str, Any]:
    """The top functions by own time (share of the profiled wall time, calls per request:
    a coroutine counts once per resumption), what the trio thread spent waiting for events
    (the epoll poll), and the remote calls (``RemoteReplica.__call__``) per request."""
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)
    top = [{"function": _function_name(key), "share": round(tt / wall_s, 3),
            "tottime_us_per_request": round(tt * 1e6 / requests, 1),
            "calls_per_request": round(nc / requests, 2)}
           for key, (_cc, nc, tt, _ct, _callers) in rows[:TOP_FUNCTIONS]]
    waiting = sum(tt for key, (_cc, _nc, tt, _ct, _callers) in stats.items()
                  if "epoll" in key[2] and "poll" in key[2])
    # RemoteReplica.__call__: plain, so called once per remote call (a coroutine's count
    # would be one per resumption)
    remote = sum(nc for key, (_cc, nc, _tt, _ct, _callers) in stats.items()
                 if key[0].endswith("omni/cluster/remote.py") and key[2] == "__call__")
    return {"profiled_wall_us": round(wall_s * 1e6 / requests, 1),
            "profiled_functions": len(stats), "top_by_tottime": top,
            "epoll_wait_share": round(waiting / wall_s, 3),
            "remote_calls_per_request": round(remote / requests, 2)}


async def _explain_one(run: Callable[[], Awaitable[Any]], requests: int,
                       pids: dict[str, int], profile: bool = True, min_seconds: float = 2.0
                       ) -> dict[str, Any]:
    """`run` plain, repeated for at least `min_seconds` (CPU and wall time per request: the
    kernel counts the workers' and the machine's in clock ticks), then once under cProfile
    (its functions) if `profile`."""
    start = time.perf_counter()
    await run()  # untimed: the same state as after a round; and how long a run takes
    runs = max(1, math.ceil(min_seconds / max(time.perf_counter() - start, 1e-3)))
    ray_pids = _ray_pids(pids)
    before = _snapshot(pids, ray_pids)
    for _ in range(runs):
        await run()
    out = _per_request(before, _snapshot(pids, ray_pids), requests * runs)
    if not profile:
        return out
    if sys.getprofile() is not None:  # --profile: one profiler per thread, it has the run
        out["profile"] = {"error": "not profiled: --profile is profiling the whole run"}
        return out
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    try:
        await run()
    finally:
        profiler.disable()
    out["profile"] = _profile(profiler, time.perf_counter() - start, requests)
    return out


async def explain_pipeline(rt: Any, p: Params, pids: dict[str, int], profile: bool = True
                           ) -> dict[str, Any]:
    """Where Omni's pipeline time goes, for each claim (hop: `p.hop_requests` sequential
    requests; throughput: `p.requests`, `p.in_flight` in flight): see the module's doc."""
    hop = await _explain_one(lambda: _sequential(rt, p.hop_requests), p.hop_requests, pids,
                             profile)
    rate = await _explain_one(lambda: _concurrent(rt, p.requests, p.in_flight), p.requests,
                              pids, profile)
    return {"hop": hop, "throughput": {"in_flight": p.in_flight, **rate}}


def _why(explain: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    """The claim's ``explain`` and ``why`` fields (none where nothing was measured)."""
    if not explain:
        return {}
    if "error" in explain:
        return {"explain": explain, "why": explain["error"]}
    try:
        return {"explain": explain, "why": _summary(explain, kind)}
    except (KeyError, TypeError, ZeroDivisionError, IndexError) as exc:
        return {"explain": explain, "why": f"not summarised: {error_text(exc)}"}


def _summary(e: dict[str, Any], kind: str) -> str:
    """One line from the figures of `explain_pipeline`."""
    prof = e.get("profile") or {}
    procs = e["cluster_cpu_us"]
    workers = {k: v for k, v in procs.items() if k.startswith("w")}
    lead = ("sequential requests" if kind == "hop" else
            f"{e.get('in_flight', '?')} requests in flight")
    parts = []
    if prof.get("remote_calls_per_request"):
        parts.append(f"{prof['remote_calls_per_request']:g} driver<->worker round trips per "
                     "request (the driver calls each stage in turn)")
    cpu = f"per request {e['wall_us']:,.0f} µs wall"
    if None not in procs.values():
        cpu += f" and {e['driver_cpu_us'] + sum(procs.values()):,.0f} µs CPU in Omni's processes"
    cpu += f" (driver {e['driver_cpu_us']:,.0f} µs, {e['driver_cpu_share']:.0%} of wall"
    if workers and None not in workers.values():
        cpu += f"; workers {'/'.join(f'{v:,.0f}' for v in workers.values())} µs"
        loops = [e.get("cluster_loop_cpu_us", {}).get(k) for k in workers]
        if None not in loops:
            cpu += f", of which their event loops' threads {'/'.join(f'{v:,.0f}' for v in loops)}"
    cpu += ")"
    if e.get("ray_processes"):
        cpu += f"; Ray's processes, serving none of these: {e['ray_cpu_us']:,.0f} µs"
    if e.get("machine_busy_share") is not None:
        cpu += f"; the {e['cpus']} CPUs {e['machine_busy_share']:.0%} busy"
    parts.append(cpu)
    if prof.get("top_by_tottime"):
        top = ", ".join(f"{_short_name(t['function'])} {t['share']:.0%}"
                        for t in prof["top_by_tottime"][:3])
        parts.append(f"driver profile, own time: {top}")
    after = e.get("after_ray_teardown") or {}
    if after.get("wall_us"):
        parts.append(f"with Ray's graph torn down: {after['wall_us']:,.0f} µs wall per "
                     f"request (Ray's processes {after['ray_cpu_us']:,.0f} µs CPU)")
    return f"{lead}: " + "; ".join(parts)


def _short_name(function: str) -> str:
    """<method 'poll' of 'select.epoll' objects> -> select.epoll.poll (waiting: the trio
    thread idle until an event), trio/_core/_run.py:2712(unrolled_run) ->
    _run.py(unrolled_run)."""
    if function.startswith("<"):
        found = re.fullmatch(r"<method '(\w+)' of '([\w.]+)' objects>", function)
        name = f"{found[2]}.{found[1]}" if found else function.strip("<>").split()[-1]
        return name + (" (waiting)" if name == "select.epoll.poll" else "")
    location, _, name = function.partition("(")
    return f"{location.rsplit('/', 1)[-1].split(':')[0]}({name}"
