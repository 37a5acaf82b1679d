"""Soak: thousands of requests through both example pipelines; afterwards nothing may be left.

A long-running server dies of what each request leaves behind: a lease never released, a page
left pinned, an arena never unlinked, a descriptor or temp file never closed, a request the
engine decodes on after its caller left, a session table that only grows. Each is too small to
see in one request, so this sends many (5,000, 64 in flight) and counts what remains.

One `omni.Runtime` serves both example pipelines (loaded as the CLI loads them; tiny built-in
models) with one KV store of their `KV_LAYOUT` over a small device tier, a host tier and a disk
tier in a temp folder, so pages are demoted, read back and evicted all along. Seeded workload:
half dialogue turns (`sessions` conversations at once, `turns` turns each, then a new session
takes the slot, so more sessions pass than the example keeps; every `media_every`-th turn
brings a WAV or an image), half 32x32 images in 2 steps from a pool of prompts. Every
`cancel_every`-th request is cancelled after a random delay. Outputs are checked and deleted.

Two phases, each drained to zero in flight: `warmup` (the tiers fill, the dialogue's table
reaches its 256 sessions, thread and allocator pools grow), then the rest. First a throwaway
runtime serves a few requests, so one-time lazy initialisation is not taken for a leak.

Then the signal phase (`perf/_soak_signal.py`): a child process runs the same load under the
CLI's signal handling and is sent SIGTERM once `signal_after` requests are done and its disk
tier holds pages; it must exit 143 after one line, leaving no arena, lease table, disk-tier
file, payload segment or socket.

Claims: no failed request; after the load, before close: no lease open, no page pinned, no
request left in the runtime, its replicas or the engines, at most 256 sessions held; after
close and a gc: no more fds than before, no shared-memory file or mapping of this run's
stores, no file in the disk tier's folder or temp file by the outputs, no ResourceWarning
(something left to the garbage collector); RSS growth after warm-up <= 5 MiB per 1,000
requests. Why 5: leaking one 8 KiB page, or one request's prompt and reply (a few KiB), per
request exceeds it, while what the allocator keeps (glibc's free lists: `heap_free`, beside
`heap_in_use`) levels off below it. SIGTERM mid-load: exit status 143, one line on stderr,
nothing left.

Usage: ``python perf/soak.py [--quick] [--requests N] [--concurrency C] [--out PATH.json]
[--plot PATH.png] [--seed S] [--phase all|load|signal]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import trio

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import omni
from cli._load import load_module, select_graph
from omni._shm import shm_directory
from omni.compute.speech import write_wav
from omni.kv import KVConfig, TierConfig
from perf._common import Samples, claim, environment, memory_status, write_json
from perf._probes import Resources, leftovers, memory, open_fds
from perf._soak_signal import claims as signal_claims
from perf._soak_signal import measure_signalled, run_child

__all__ = ["Params", "main", "measure", "workload"]

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
RSS_BOUND = 5.0  # MiB per 1,000 requests after warm-up
WORDS = ("fox snow river dusk lamp city night storm field tower moss glass copper tide "
         "hollow ember quiet north bridge orchard salt violet harbour winter").split()


@dataclass(frozen=True, slots=True)
class Params:
    """The sizes of one run (`small()`: the short soak of the test suite)."""

    seed: int = 0
    requests: int = 5_000
    concurrency: int = 64
    warmup: int = 2_000
    sessions: int = 200  # conversations going on at once
    turns: int = 6  # per conversation; then a new session takes its place
    image_share: float = 0.5
    prompts: int = 100  # the pool image prompts are drawn from
    max_tokens: int = 8
    image_side: int = 32
    steps: int = 2
    expand: int = 4
    media_every: int = 10
    cancel_every: int = 50
    device_pages: int = 64  # 8 KiB pages: 512 KiB
    host_pages: int = 128  # 1 MiB: idle sessions go on to disk
    disk: str = "24MiB"  # 2,048 slots of 12 KiB: the oldest pages are evicted
    sample_s: float = 0.25
    signal_after: int = 1_000  # requests the signal phase's child finishes before SIGTERM
    quick: bool = False

    @classmethod
    def small(cls, seed: int = 0) -> Params:
        return cls(seed=seed, requests=200, concurrency=16, warmup=50, sessions=20,
                   prompts=20, cancel_every=20, signal_after=50, quick=True)


@dataclass(frozen=True, slots=True)
class Job:
    kind: str  # "dialogue" or "image"
    inputs: dict[str, Any]
    cancel_after: float | None  # seconds; None: let it finish


def workload(p: Params, folder: Path) -> list[Job]:
    """The seeded requests, outputs in `folder` (a WAV and an image there for the media)."""
    rng = random.Random(p.seed)
    audio, image = str(folder / "clip.wav"), str(folder / "picture.npy")
    write_wav(audio, np.sin(np.arange(3_200, dtype=np.float32) / 7) * 0.3)
    np.save(image, np.random.default_rng(p.seed).integers(0, 256, (16, 16, 3), np.uint8))
    pool = [" ".join(rng.choices(WORDS, k=rng.randint(4, 12))) for _ in range(p.prompts)]
    images = round(p.requests * p.image_share)
    kinds = ["image"] * images + ["dialogue"] * (p.requests - images)
    rng.shuffle(kinds)
    # [slot, conversation, turns so far]; the first conversations are shorter, so that the
    # mix of short and long histories is already steady after the warm-up
    live = [[k, 0, rng.randrange(p.turns)] for k in range(p.sessions)]
    jobs = []
    for i, kind in enumerate(kinds):
        if kind == "dialogue":
            slot = rng.choice(live)
            if slot[2] == p.turns:  # the conversation ended: a new session takes its place
                slot[1:] = [slot[1] + 1, 0]
            slot[2] += 1
            inputs: dict[str, Any] = {
                "session": f"s{slot[0]:03d}-{slot[1]}", "out": str(folder / f"{i}.wav"),
                "text": " ".join(rng.choices(WORDS, k=rng.randint(2, 8))),
                "max_tokens": rng.randint(1, p.max_tokens)}
            if p.media_every and i % p.media_every == 0:
                hear = i % (2 * p.media_every) != 0  # else look
                inputs["audio" if hear else "image"] = audio if hear else image
        else:
            inputs = {"prompt": rng.choice(pool), "out": str(folder / f"{i}.png"),
                      "width": p.image_side, "height": p.image_side, "steps": p.steps,
                      "expand": p.expand, "seed": rng.randrange(1_000)}
        cancel = p.cancel_every and i % p.cancel_every == p.cancel_every - 1
        jobs.append(Job(kind, inputs, rng.uniform(0.0, 0.05) if cancel else None))
    return jobs


# -- the run ----------------------------------------------------------------------------------


class Soak:
    """Drives jobs through a runtime and keeps the figures."""

    def __init__(self, p: Params, graphs: dict[str, Any]) -> None:
        self.p, self.graphs = p, graphs
        self.latency: dict[str, list[float]] = {k: [] for k in graphs}
        self.failures: dict[str, list[str]] = {k: [] for k in graphs}
        self.sent: Counter[str] = Counter()
        self.cancelled: Counter[str] = Counter()
        self.sessions: set[str] = set()  # dialogue sessions that spoke
        self.missing_outputs = self.done = 0
        self.timeline: list[dict[str, float]] = []

    async def one(self, rt: omni.Runtime, job: Job, limit: trio.Semaphore) -> None:
        self.sent[job.kind] += 1
        self.sessions.add(job.inputs.get("session", ""))
        out = Path(job.inputs["out"])
        try:
            start = time.perf_counter()
            with trio.move_on_after(job.cancel_after or math.inf) as scope:
                await rt.run(self.graphs[job.kind], **job.inputs)
            if scope.cancelled_caught:
                self.cancelled[job.kind] += 1
            else:
                self.latency[job.kind].append(time.perf_counter() - start)
                self.missing_outputs += not (out.is_file() and out.stat().st_size > 0)
            out.unlink(missing_ok=True)  # also a cancelled turn's partial WAV
        except Exception as exc:  # a failed request is an outcome to count
            self.failures[job.kind].append(f"{type(exc).__name__}: {exc}"[:300])
        finally:
            self.done += 1
            limit.release()

    async def phase(self, rt: omni.Runtime, jobs: list[Job]) -> float:
        """Run `jobs`, `concurrency` at a time, until none is in flight; the seconds taken."""
        limit = trio.Semaphore(self.p.concurrency)
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for job in jobs:
                await limit.acquire()
                nursery.start_soon(self.one, rt, job, limit)
        return time.perf_counter() - start

    def snapshot(self, store: Any, started: float) -> None:
        """Requests done, RSS, leases and pinned pages now (the plot's data)."""
        leases = store.stats()["leases"]
        self.timeline.append({
            "t": round(time.perf_counter() - started, 2), "done": self.done,
            "rss_mib": round(memory_status().get("VmRSS", 0) / MIB, 2),
            "leases": leases["open"] + leases["exported"], "pinned": leases["pinned_pages"]})

    async def sample(self, store: Any, started: float) -> None:
        while True:
            self.snapshot(store, started)
            await trio.sleep(self.p.sample_s)


def runtime(p: Params, modules: dict[str, Any], graphs: dict[str, Any], folder: Path
            ) -> omni.Runtime:
    layout, page = modules["dialogue"].KV_LAYOUT, modules["dialogue"].KV_LAYOUT.page_bytes
    return omni.Runtime(kv=KVConfig(layout, (TierConfig("device", p.device_pages * page),
                                             TierConfig("host", p.host_pages * page),
                                             TierConfig("disk", p.disk, path=folder))),
                        graphs=list(graphs.values()))


async def prime(p: Params, modules: dict[str, Any], graphs: dict[str, Any], folder: Path,
                jobs: list[Job]) -> str:
    """A throwaway runtime serving a few requests; returns its store's id."""
    async with runtime(p, modules, graphs, folder) as rt:
        await Soak(replace(p, concurrency=4), graphs).phase(rt, jobs)
        return rt.kv.store_id


async def load(p: Params, soak: Soak, modules: dict[str, Any], folder: Path, jobs: list[Job]
               ) -> dict[str, Any]:
    """The two phases in one runtime; the figures taken while it is open."""
    out: dict[str, Any] = {}
    async with runtime(p, modules, soak.graphs, folder) as rt:
        out["store_id"] = rt.kv.store_id
        dialogue = rt.pool_for(modules["dialogue"].Dialogue()).replicas[0].instance
        engines = {"dialogue": dialogue.engine,
                   "image": rt.pool_for(modules["image"].Understand()).replicas[0].instance.engine}
        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(soak.sample, rt.kv, started)
            out["warmup_s"] = await soak.phase(rt, jobs[: p.warmup])
            out["memory_warm"] = memory()
            out["completed_warm"] = sum(map(len, soak.latency.values()))
            out["steady_s"] = await soak.phase(rt, jobs[p.warmup:])
            # before any collection: what only the collector would let go still counts
            out["kv"] = rt.kv.stats()
            stats = rt.stats()
            out["requests_left"] = {
                "runtime": stats.requests_in_flight,
                "replica_slots": sum(r[0] + r[1] for ps in stats.pools for r in ps.replicas)
                + sum(ps.waiting for ps in stats.pools),
                **{f"engine_{k}": len(e.scheduler.running) + len(e.scheduler.waiting)
                   for k, e in engines.items()}}
            out["memory_loaded"] = memory()
            nursery.cancel_scope.cancel()
        soak.snapshot(rt.kv, started)
        out["sessions"] = sum(len(kept) for kept in dialogue.sessions.values())
    return out


def percentiles(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        return {"p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50_ms": round(q[49] * 1e3, 1), "p99_ms": round(q[98] * 1e3, 1),
            "max_ms": round(max(values) * 1e3, 1)}


def examples() -> tuple[dict[str, Any], dict[str, Any]]:
    """Both example pipelines' modules and graphs, loaded as the CLI loads them."""
    modules = {"dialogue": load_module(str(ROOT / "examples" / "omni_dialogue.py")),
               "image": load_module(str(ROOT / "examples" / "image_generation.py"))}
    graphs = {k: select_graph(m, None, k) for k, m in modules.items()}
    if modules["image"].KV_LAYOUT != modules["dialogue"].KV_LAYOUT:
        raise SystemExit("the examples' KV layouts differ (OMNI_MODEL?): one store cannot "
                         "serve both")
    return modules, graphs


def signal_child(spec: str) -> int:
    """The signal phase's child: the soak's load in `spec`'s folder until SIGTERM comes."""
    args = json.loads(spec)
    p, folder = Params(**args["params"]), Path(args["folder"])
    outputs, disk = folder / "out", folder / "kv"
    outputs.mkdir()
    disk.mkdir()
    modules, graphs = examples()
    soak = Soak(p, graphs)
    return run_child(lambda: runtime(p, modules, graphs, disk), soak, workload(p, outputs),
                     disk, p.sample_s)


def measure(p: Params, *, signal_phase: bool = True) -> dict[str, Any]:
    """Run the soak in this process (a fresh one: it counts the process's fds and RSS), then
    its signal phase in a child (not with `signal_phase` False: ``--phase load``)."""
    started = time.perf_counter()
    modules, graphs = examples()
    with tempfile.TemporaryDirectory(prefix="omni-soak-") as tmp:
        outputs, disk = Path(tmp) / "out", Path(tmp) / "kv"
        outputs.mkdir()
        disk.mkdir()
        warm_jobs = workload(replace(p, requests=12, seed=p.seed + 1, cancel_every=4), outputs)
        jobs = workload(p, outputs)  # its media files replace the warm-up's
        with Resources() as resources:
            prime_id = trio.run(prime, p, modules, graphs, disk, warm_jobs)
            fds_before, memory_start = open_fds(), memory()
            soak = Soak(p, graphs)
            f = trio.run(load, p, soak, modules, disk, jobs)
            fds_after, memory_end = open_fds(), memory()
        f["shm"] = leftovers([prime_id, f["store_id"]])
        f["files"] = {"disk_folder": sorted(str(x.relative_to(disk)) for x in disk.rglob("*")),
                      "temp": sorted(n for n in os.listdir(outputs) if n.endswith(".tmp"))}
    f.update(fds_before=fds_before, fds_after=fds_after, warned=resources.seen,
             memory_start=memory_start, memory_end=memory_end,
             max_sessions=modules["dialogue"].MAX_SESSIONS)
    if signal_phase:
        f["signalled"] = measure_signalled(asdict(p), p.signal_after)
    f["wall_s"] = time.perf_counter() - started
    return report(p, soak, f)


def one_claim(target: float, value: float, passed: bool, unit: str, note: str,
              **extra: Any) -> dict[str, Any]:
    return claim(unit=unit, target=target, measured=Samples((value,)), baseline=None,
                 ratio=None, passed=passed, note=note, digits=3, **extra)


def report(p: Params, soak: Soak, f: dict[str, Any]) -> dict[str, Any]:
    seconds = f["warmup_s"] + f["steady_s"]
    everything = [v for vs in soak.latency.values() for v in vs]
    failed = sum(len(v) for v in soak.failures.values())
    pipelines = {kind: {
        "requests": soak.sent[kind], "completed": len(soak.latency[kind]),
        "failures": len(soak.failures[kind]), "cancelled": soak.cancelled[kind],
        "throughput_rps": round(len(soak.latency[kind]) / seconds, 1),
        **percentiles(soak.latency[kind]), "first_failures": soak.failures[kind][:3]}
        for kind in soak.graphs}
    warm, loaded = f["memory_warm"], f["memory_loaded"]
    steady = p.requests - p.warmup
    growth = {k: round(loaded[k] - warm[k], 2) for k in ("VmRSS", "heap_in_use", "heap_free")
              if k in warm}
    per_1k = growth["VmRSS"] / max(steady, 1) * 1_000
    late = [(x["done"], x["rss_mib"]) for x in soak.timeline if x["done"] >= p.warmup]
    trend = None  # a leak is a slope; a pool that grows once is a step
    if len({d for d, _ in late}) > 2:
        trend = round(float(np.polyfit(*np.array(late).T, 1)[0]) * 1_000, 3)
    leases = f["kv"]["leases"]
    before, after = f["fds_before"], f["fds_after"]
    leaked = sorted({target for fd, target in after.items() if before.get(fd) != target})
    shm, files = f["shm"], f["files"]
    n_shm, n_files = sum(map(len, shm.values())), sum(map(len, files.values()))
    left = sum(f["requests_left"].values())
    peak = {"leases": max((s["leases"] for s in soak.timeline), default=0),
            "pinned_pages": max((s["pinned"] for s in soak.timeline), default=0)}
    claims = {
        "failures": one_claim(
            0, failed + soak.missing_outputs, failed + soak.missing_outputs == 0, "requests",
            "requests that raised, plus finished ones whose WAV/PNG was missing or empty "
            "(requests cancelled on purpose are counted apart)"),
        "leases_open": one_claim(
            0, leases["open"] + leases["exported"], leases["open"] + leases["exported"] == 0,
            "leases", "store.stats()['leases'] open + exported once every request ended, "
            "before the runtime closed", peak=peak["leases"]),
        "pinned_pages": one_claim(
            0, leases["pinned_pages"], leases["pinned_pages"] == 0, "pages",
            "store.stats()['leases']['pinned_pages'] at the same moment",
            peak=peak["pinned_pages"]),
        "requests_left": one_claim(
            0, left, left == 0, "requests", "once every request ended: requests the runtime "
            "counts in flight, replica slots held or queued for, requests running or waiting "
            "in the two engines (a cancelled one decoded on)", **f["requests_left"]),
        "sessions_held": one_claim(
            f["max_sessions"], f["sessions"], f["sessions"] <= f["max_sessions"], "sessions",
            "sessions the dialogue node keeps after the load (its LRU bound is the target), "
            "of all that spoke", spoke=len(soak.sessions - {""})),
        "fds_leaked": one_claim(
            0, len(leaked), not leaked, "fds", "/proc/self/fd after the runtime closed and a "
            "gc, vs before it started", before=len(before), after=len(after), leaked=leaked),
        "shm_left": one_claim(
            0, n_shm, n_shm == 0, "segments", f"files omni-<store id>-* in {shm_directory()} "
            "and mappings of them in /proc/self/maps, both stores, after close and a gc", **shm),
        "files_left": one_claim(
            0, n_files, n_files == 0, "files", "anything in the disk tier's folder after close, "
            "and *.tmp files next to the outputs", **files),
        "resource_warnings": one_claim(
            0, sum(f["warned"].values()), not f["warned"], "warnings", "ResourceWarnings during "
            "the run: leases or streams left to the garbage collector, unclosed files",
            seen=dict(f["warned"])),
        "rss_growth": one_claim(
            RSS_BOUND, round(per_1k, 3), per_1k <= RSS_BOUND, "MiB per 1,000 requests",
            f"VmRSS after the steady phase ({steady} requests) minus after the warm-up "
            f"({p.warmup}), both with no request in flight, after a gc; the trend is the "
            "least-squares slope of VmRSS over the steady phase's samples",
            growth_mib=growth, trend_mib_per_1k=trend),
        **(signal_claims(f["signalled"]) if "signalled" in f else {}),
    }
    return {
        "benchmark": "soak", "params": asdict(p), "env": soak_environment(),
        "wall_s": round(f["wall_s"], 1), "load_s": round(seconds, 1),
        "overall": {
            "requests": p.requests, "completed": len(everything), "failures": failed,
            "cancelled": sum(soak.cancelled.values()), "missing_outputs": soak.missing_outputs,
            "throughput_rps": round(len(everything) / seconds, 1),
            "steady_throughput_rps": round(
                (len(everything) - f["completed_warm"]) / max(f["steady_s"], 1e-9), 1),
            **percentiles(everything)},
        "pipelines": pipelines,
        "memory_mib": {"start": f["memory_start"], "after_warmup": warm,
                       "end_of_load": loaded, "after_close": f["memory_end"]},
        "kv": f["kv"], **claims, "all_pass": all(c["pass"] for c in claims.values()),
        "timeline": soak.timeline,
    }


def soak_environment() -> dict[str, Any]:
    return {**environment(), "malloc": {k: v for k, v in os.environ.items()
                                        if k.startswith("MALLOC_")}}


def measure_signal_only(p: Params) -> dict[str, Any]:
    """The signal phase alone (``--phase signal``): its claims, without the load's."""
    started = time.perf_counter()
    claims = signal_claims(measure_signalled(asdict(p), p.signal_after))
    return {"benchmark": "soak", "params": asdict(p), "env": soak_environment(),
            "wall_s": round(time.perf_counter() - started, 1), **claims,
            "all_pass": all(c["pass"] for c in claims.values())}


def _plot(result: dict[str, Any], path: str) -> None:
    """RSS and leases against requests done (the dashed line: the end of the warm-up)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    line, o = result["timeline"], result["overall"]
    done = [s["done"] for s in line]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(done, [s["rss_mib"] for s in line])
    left.set(title="resident memory", ylabel="VmRSS (MiB)")
    right.plot(done, [s["leases"] for s in line], label="open leases")
    right.plot(done, [s["pinned"] for s in line], label="pinned pages")
    right.set(title="leases and pinned pages (must end at 0)")
    right.legend()
    for ax in (left, right):
        ax.set_xlabel("requests done")
        ax.axvline(result["params"]["warmup"], color="gray", linestyle="--")
    fig.suptitle(f"soak: {o['requests']:,} requests, {result['params']['concurrency']} in "
                 f"flight, {o['throughput_rps']} req/s, p99 {o['p99_ms']} ms, RSS "
                 f"+{result['rss_growth']['measured']['median']} MiB / 1,000 after warm-up")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse `argv`, run the soak, print (and optionally write and plot) the result."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the short soak (200 requests)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, help="default 5,000 (warm-up: 40%%)")
    parser.add_argument("--concurrency", type=int, help="requests in flight (default 64)")
    parser.add_argument("--out", help="also write the JSON here (folders are created)")
    parser.add_argument("--plot", help="write RSS and leases over the run (PNG) here")
    parser.add_argument("--phase", choices=("all", "load", "signal"), default="all",
                        help="load: only the load, in this process (no signal claims); "
                             "signal: only SIGTERM in the middle of the load, in a child")
    parser.add_argument("--signal-child", help=argparse.SUPPRESS)  # the child's own mode
    args = parser.parse_args(argv)
    if args.signal_child:
        raise SystemExit(signal_child(args.signal_child))
    p = Params.small(args.seed) if args.quick else Params(seed=args.seed)
    if args.requests is not None:
        p = replace(p, requests=args.requests, warmup=min(p.warmup, args.requests * 2 // 5))
    if args.concurrency is not None:
        p = replace(p, concurrency=args.concurrency)
    result = (measure_signal_only(p) if args.phase == "signal"
              else measure(p, signal_phase=args.phase == "all"))
    write_json(result, args.out)
    if args.plot and args.phase != "signal":
        _plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
