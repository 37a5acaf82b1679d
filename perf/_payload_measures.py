"""The payload measurements of `perf/payloads.py` (the latency ones are in
`perf/_payload_latency.py`), one section per claim, each returning its claim as JSON: Omni
through a started `omni.Runtime` on the cluster, Ray through a `perf._payload_ray` object on a
`BlockingThread`, alternating round by round.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from omni.transport.movers import payload_mover
from perf import _payload_nodes as nodes
from perf._common import Samples
from perf._payload_support import BlockingThread, PeakRss, ShmJanitor

if TYPE_CHECKING:
    from perf.payloads import Params, RayState

__all__ = ["CLAIMS", "TARGETS", "Measure", "alternate", "claim", "error_text", "one_gib_section",
           "payload_section", "ray_timer", "size_label", "tcp_section"]

ROOT = Path(__file__).resolve().parent.parent
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
PAGE = 4 * KIB
RAY_TARGET = 1.0  # Omni's time at most Ray's (payloads, hop latency)
CALL_LATENCY_TARGET = 0.5  # a trivial call at most half Ray's time
TCP_TARGET = 0.8  # at least this fraction of raw pyzmq's GiB/s
THROUGHPUT_TARGET = 1.0  # at least the baseline's requests/s
RSS_TARGET_MIB = 1536.0  # each process at most 1.5 GiB above idle, 1 GiB payloads
CALL_TIMEOUT_S = 120.0
CLAIMS = ("numpy_64mib", "torch_64mib", "round_trip_64mib", "one_gib", "tcp_64mib",
          "call_latency", "hop_latency", "pipeline_throughput")
TARGETS = {  # claim -> (unit, target, which side of it passes)
    "numpy_64mib": ("ms", RAY_TARGET, "lower"), "torch_64mib": ("ms", RAY_TARGET, "lower"),
    "round_trip_64mib": ("ms", RAY_TARGET, "lower"),
    "one_gib": ("MiB above idle", RSS_TARGET_MIB, "lower"),
    "tcp_64mib": ("GiB/s", TCP_TARGET, "higher"),
    "call_latency": ("µs", CALL_LATENCY_TARGET, "lower"),
    "hop_latency": ("µs per hop", RAY_TARGET, "lower"),
    "pipeline_throughput": ("requests/s", THROUGHPUT_TARGET, "higher"),
}
NO_RAY = "Ray not run (--no-ray)"


def size_label(n: int) -> str:
    """64MiB, 64MiB-4KiB, 1GiB."""
    unit, name = (GIB, "GiB") if n >= GIB else (MIB, "MiB")
    whole = -(-n // unit) * unit
    short = whole - n
    return f"{whole // unit}{name}" + (f"-{short // KIB}KiB" if short else "")


def error_text(exc: BaseException) -> str:
    """What an exception says, for the JSON: a group of them (concurrent calls that failed
    together) by the first one it holds."""
    if isinstance(exc, BaseExceptionGroup):
        first = exc.exceptions[0]
        return f"{len(exc.exceptions)} failed together, the first: {error_text(first)}"[:2000]
    return f"{type(exc).__name__}: {exc}"[:2000]


# ---------------------------------------------------------------------------------------------
# Measuring


Measure = Callable[[], Awaitable[float]]


async def alternate(measures: dict[str, Measure], repeats: int
                    ) -> tuple[dict[str, Samples], dict[str, str]]:
    """`perf._common.alternate` for async measures that may fail: one warm-up round, then
    `repeats` rounds, reversing the order each round. A measure that raises is dropped from
    the rounds after; its error is returned instead of samples."""
    names = list(measures)
    values: dict[str, list[float]] = {name: [] for name in names}
    errors: dict[str, str] = {}
    for r in range(-1, repeats):  # -1: the warm-up round
        for name in names if r % 2 == 0 else reversed(names):
            if name in errors:
                continue
            gc.collect()  # untimed: no collection left over from the last measure
            try:
                value = await measures[name]()
            except Exception as exc:
                errors[name] = error_text(exc)
                continue
            if r >= 0:
                values[name].append(value)
    return {n: Samples(tuple(v)) for n, v in values.items() if v}, errors


def make_value(kind: str, nbytes: int, seed: int) -> Any:
    """A float32 payload of `nbytes` bytes: a numpy array, or a torch tensor for "torch"."""
    array = np.random.default_rng(seed).random(nbytes // 4, dtype=np.float32)
    if kind != "torch":
        return array
    import torch

    return torch.from_numpy(array)


def _checker(expect_value: Any | None, nbytes: int) -> Callable[[Any], None]:
    """Checks a call's result: the size it reports, or the payload itself (round trips)."""

    def check(out: Any) -> None:
        if expect_value is None:
            if out != nbytes:
                raise RuntimeError(f"the node reported {out!r} bytes, not {nbytes}")
            return
        if isinstance(expect_value, np.ndarray):
            same = isinstance(out, np.ndarray) and np.array_equal(out, expect_value)
        else:
            import torch

            same = isinstance(out, torch.Tensor) and torch.equal(out, expect_value)
        if not same:
            raise RuntimeError(f"the payload came back changed ({type(out).__name__})")

    return check


def omni_timer(rt: Any, graph: Any, check: Callable[[Any], None], **inputs: Any) -> Measure:
    async def measure() -> float:
        start = time.perf_counter()
        with trio.fail_after(CALL_TIMEOUT_S):
            out = await rt.run(graph, **inputs)
        elapsed = time.perf_counter() - start
        check(out)
        return elapsed

    return measure


def ray_timer(thread: BlockingThread, fn: Callable[[], float]) -> Measure:
    async def measure() -> float:
        return await thread.run(fn)

    return measure


def copy_timer(value: Any) -> Measure:
    copy = value.clone if hasattr(value, "clone") else lambda: np.copy(value)

    async def measure() -> float:
        start = time.perf_counter()
        copy()
        return time.perf_counter() - start

    return measure


def claim(*, unit: str, target: float, better: str, measured: Samples | None,
          baseline: Samples | None, error: str | None, note: str, digits: int = 2,
          **extra: Any) -> dict[str, Any]:
    """One claim as JSON (the fields of `perf._common.claim`), where the measurement or its
    baseline may be missing: then `error` says why, the ratio is null and the claim fails.
    The ratio is measured / baseline (medians); `better` says which side of `target` passes."""
    ratio = (measured.median / baseline.median
             if measured is not None and baseline is not None and baseline.median else None)
    passed = error is None and ratio is not None and (
        ratio <= target if better == "lower" else ratio >= target)
    return {"unit": unit, "target": target, "better": better,
            "measured": None if measured is None else measured.to_json(digits),
            "baseline": None if baseline is None else baseline.to_json(digits),
            "ratio": None if ratio is None else round(ratio, 3), "pass": bool(passed),
            "error": error, **extra, "note": note}


# ---------------------------------------------------------------------------------------------
# The sections: each returns its claims


async def payload_section(rt: Any, p: Params, ray: RayState, thread: BlockingThread,
                          kind: str) -> dict[str, Any]:
    """numpy_64mib, torch_64mib (the argument) or round_trip_64mib (argument and result)."""
    sizes = (p.payload_bytes, p.payload_bytes - PAGE)
    round_trip = kind == "round_trip"
    graph, method = (nodes.Echo, "echo") if round_trip else (nodes.Size, "size")
    measures: dict[str, Measure] = {}
    for size in sizes:
        value = await trio.to_thread.run_sync(make_value, kind, size, p.seed)
        check = _checker(value if round_trip else None, size)
        label = size_label(size)
        measures[f"omni {label}"] = omni_timer(rt, graph, check, value=value)
        if ray.side is not None:
            measures[f"ray {label}"] = ray_timer(
                thread, lambda m=method, v=value, c=check: ray.side.call(m, v, c))
        measures[f"copy {label}"] = copy_timer(value)
    samples, errors = await alternate(measures, p.repeats)
    ms = {k: s.map(lambda v: v * 1e3) for k, s in samples.items()}
    per_size = {}
    for size in sizes:
        label = size_label(size)
        entry: dict[str, Any] = {"bytes": size}
        for side in ("omni", "ray", "copy"):
            s = ms.get(f"{side} {label}")
            entry[f"{side}_ms"] = None if s is None else s.to_json(2)
            entry[f"{side}_gib_s"] = None if s is None else round(size / GIB / (s.median / 1e3),
                                                                  3)
            entry[f"{side}_error"] = errors.get(f"{side} {label}")
        if ray.side is None:
            entry["ray_error"] = ray.error or NO_RAY
        omni_s, ray_s = ms.get(f"omni {label}"), ms.get(f"ray {label}")
        entry["ratio"] = round(omni_s.median / ray_s.median, 3) if omni_s and ray_s else None
        per_size[label] = entry
    exact = per_size[size_label(sizes[0])]
    label = size_label(sizes[0])
    what = {"numpy": "a float32 numpy array as the argument, its byte size as the result",
            "torch": "a float32 torch tensor as the argument, its byte size as the result",
            "round_trip": "a float32 numpy array as the argument and the same array as the "
                          "result"}[kind]
    copy = ms.get(f"copy {label}")
    omni_ms = ms.get(f"omni {label}")
    return claim(
        unit="ms", target=RAY_TARGET, better="lower", measured=omni_ms,
        baseline=ms.get(f"ray {label}"), error=exact["omni_error"] or exact["ray_error"],
        payload=kind, payload_bytes=sizes[0], sizes=per_size,
        copy=None if copy is None else copy.to_json(2),
        vs_copy=round(omni_ms.median / copy.median, 2) if omni_ms and copy else None,
        note=(f"ms per call of a class node on worker w1 (same host): {what}; "
              f"{label} (the claim) and {size_label(sizes[1])}; measured: Omni "
              f"(`rt.run`), baseline: Ray (`ray.get(actor.{method}.remote(value))`, one "
              "actor), copy: one in-process copy of the same bytes "
              f"({'torch clone' if kind == 'torch' else 'np.copy'}); median of {p.repeats} "
              "alternating rounds after a warm-up; ratio = Omni / Ray, target <= "
              f"{RAY_TARGET:g}; error: why the claim's size has no figure"))


async def one_gib_section(rt: Any, p: Params, worker_pid: int, tcp_pid: int
                          ) -> dict[str, Any]:
    """A 1 GiB argument, then a 1 GiB result: must work; peak RSS above idle of both ends;
    through shared memory (worker w1), then over TCP (worker wtcp, as between hosts)."""
    pids = {"driver": os.getpid(), "worker": worker_pid}
    available = _mem_available()
    if available is not None and available < 4 * p.big_bytes:
        # Refused rather than risk the OOM killer taking this process (and its cleanup).
        raise RuntimeError(f"not run: {available / GIB:.1f} GiB of memory available, "
                           f"{4 * p.big_bytes / GIB:g} GiB wanted (other programs' shared "
                           "memory in /dev/shm counts against it)")
    parts: dict[str, dict[str, Any]] = {}
    # Made in a thread: a gigabyte of random numbers would stall the runtime's heartbeats.
    argument = {"value": await trio.to_thread.run_sync(make_value, "numpy", p.big_bytes,
                                                       p.seed)}
    small = np.zeros(1024, dtype=np.float32)
    parts["argument"] = await _big_calls(
        p, pids, lambda: rt.run(nodes.Size, value=argument["value"]),
        _checker(None, p.big_bytes), probe=lambda: rt.run(nodes.Size, value=small))
    argument.clear()  # its gigabyte is not the result case's idle memory
    gc.collect()

    def result_ok(out: Any) -> None:
        if not (isinstance(out, np.ndarray) and out.nbytes == p.big_bytes
                and out[0] == out[-1] == 1.5):
            raise RuntimeError(f"the result is not the {p.big_bytes}-byte array: {out!r:.200}")

    parts["result"] = await _big_calls(p, pids, lambda: rt.run(nodes.Make, nbytes=p.big_bytes),
                                       result_ok, probe=lambda: rt.run(nodes.Make, nbytes=4096))
    gc.collect()
    # The TCP path: wtcp sends no shared memory and serves no Unix socket, and this process
    # stops sending through shared memory meanwhile, so values over a chunk go as transfers.
    mover, tcp_pids = payload_mover(), {"driver": os.getpid(), "worker": tcp_pid}
    mover.shm = False
    try:
        argument["value"] = await trio.to_thread.run_sync(make_value, "numpy", p.big_bytes,
                                                          p.seed)
        parts["tcp_argument"] = await _big_calls(
            p, tcp_pids, lambda: rt.run(nodes.SizeTcp, value=argument["value"]),
            _checker(None, p.big_bytes), probe=lambda: rt.run(nodes.SizeTcp, value=small))
        argument.clear()
        gc.collect()
        parts["tcp_result"] = await _big_calls(
            p, tcp_pids, lambda: rt.run(nodes.MakeTcp, nbytes=p.big_bytes), result_ok,
            probe=lambda: rt.run(nodes.MakeTcp, nbytes=4096))
    finally:
        mover.shm = True
    worst = [max(v) for v in zip(*(part["above_idle_runs"][end] for part in parts.values()
                                   for end in pids), strict=False)]
    errors = [f"{name}: {part['error']}" for name, part in parts.items() if part["error"]]
    measured = Samples(tuple(worst)) if worst else None
    passed = not errors and measured is not None and measured.max <= RSS_TARGET_MIB
    label = size_label(p.big_bytes)
    return {"unit": "MiB above idle", "target": RSS_TARGET_MIB, "better": "lower",
            "measured": None if measured is None else measured.to_json(1), "baseline": None,
            "ratio": None, "pass": bool(passed), "error": "; ".join(errors) or None,
            "payload_bytes": p.big_bytes, **parts,
            "note": (f"a {label} float32 numpy array as a class node's argument on worker w1 "
                     f"(result: its size), then a {label} array made on w1 as the result, "
                     "both through shared memory; then the same with worker wtcp over TCP, as "
                     "between hosts (tcp_argument, tcp_result: transfers of 64 MiB chunks); "
                     "each must work; per call, the peak RSS above idle of the driver (this "
                     "process) and of the worker: VmHWM reset before the call (clear_refs) "
                     "and VmRSS sampled every 2 ms, the larger; idle = RSS just before the "
                     "call, the argument already allocated; RSS counts shared memory touched; "
                     "measured: the largest of the eight per round, target <= "
                     f"{RSS_TARGET_MIB:g} MiB; error: what a call raised")}


def _mem_available() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


async def _ready(probe: Callable[[], Awaitable[Any]], seconds: float = 30.0) -> float:
    """Seconds until `probe` (a small call of the same node) succeeds; after a failed call the
    runtime may be replacing a replica it marked lost, and the next case is measured on its
    own. Raises the probe's last error after `seconds`."""
    start = time.perf_counter()
    while True:
        try:
            with trio.fail_after(10.0):
                await probe()
        except Exception:
            if time.perf_counter() - start > seconds:
                raise
            await trio.sleep(0.5)
        else:
            return round(time.perf_counter() - start, 2)


async def _big_calls(p: Params, pids: dict[str, int], call: Callable[[], Awaitable[Any]],
                     check: Callable[[Any], None], probe: Callable[[], Awaitable[Any]]
                     ) -> dict[str, Any]:
    """`p.big_repeats` calls under `PeakRss` (stopping at the first error), once a small
    call of the node works."""
    runs: list[dict[str, Any]] = []
    error = None
    try:
        ready_after = await _ready(probe)
    except Exception as exc:
        return {"error": f"a small call never worked: {error_text(exc)}", "ok_calls": 0,
                "ready_after_s": None, "seconds": None, "above_idle_mib": None,
                "above_idle_runs": {end: [] for end in pids}, "runs": []}
    for _ in range(p.big_repeats):
        gc.collect()
        start = time.perf_counter()
        with PeakRss(pids) as peak:
            try:
                with trio.fail_after(CALL_TIMEOUT_S):
                    out = await call()
                check(out)
            except Exception as exc:
                error = error_text(exc)
            out = None  # the result stays alive until the peak is read
        runs.append({"seconds": round(time.perf_counter() - start, 3), **peak.result})
        if error:
            break
    above = {end: [r[end]["above_idle_mib"] for r in runs] for end in pids}
    return {"error": error, "ok_calls": len(runs) - (1 if error else 0),
            "ready_after_s": ready_after,
            "seconds": Samples(tuple(r["seconds"] for r in runs)).to_json(3),
            "above_idle_mib": {end: Samples(tuple(v)).to_json(1) for end, v in above.items()},
            "above_idle_runs": above, "runs": runs}


async def tcp_section(p: Params, address: str, token: str, janitor: ShmJanitor
                      ) -> dict[str, Any]:
    """64 MiB over the TCP path (a child driver and worker wtcp, both with `TCP_SETTINGS`)."""
    sizes = (p.payload_bytes, p.payload_bytes - PAGE)
    from perf._payload_tcp import PLAINTEXT, TCP_SETTINGS

    env = {**os.environ, **TCP_SETTINGS, **PLAINTEXT, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(ROOT / "perf" / "_payload_tcp.py"), address, token,
           *map(str, sizes), "--repeats", str(p.repeats), "--seed", str(p.seed)]
    done = await _run_child(cmd, env, janitor)
    try:
        data = json.loads(done.stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        data = {"error": f"the TCP driver printed no result (exit {done.returncode}); "
                         f"stderr: {done.stderr.decode(errors='replace')[-1500:]!r}"}
    runs, errors = data.get("runs", {}), data.get("errors", {})
    sides = ("omni", "omni_plaintext", "pyzmq", "pyzmq_curve")
    samples = {side: {size_label(int(k)): Samples(tuple(v)) for k, v in runs.get(side, {}).items()}
               for side in sides}
    per_size = {}
    for size in sizes:
        label = size_label(size)
        entry: dict[str, Any] = {"bytes": size}
        for side in sides:
            s = samples[side].get(label)
            entry[f"{side}_gib_s"] = None if s is None else s.to_json(3)
            entry[f"{side}_error"] = errors.get(side, {}).get(str(size))
        o, op, z, zc = (samples[side].get(label) for side in sides)
        entry["ratio"] = round(o.median / z.median, 3) if o and z else None
        entry["ratio_plaintext"] = round(op.median / z.median, 3) if op and z else None
        entry["ratio_vs_curve"] = round(o.median / zc.median, 3) if o and zc else None
        per_size[label] = entry
    label = size_label(sizes[0])
    exact = per_size[label]
    curve = samples["pyzmq_curve"].get(label)
    plain = samples["omni_plaintext"].get(label)
    return claim(
        unit="GiB/s", target=TCP_TARGET, better="higher", measured=samples["omni"].get(label),
        baseline=samples["pyzmq"].get(label), digits=3,
        error=data.get("error") or exact["omni_error"] or exact["pyzmq_error"],
        plaintext_gib_s=None if plain is None else plain.to_json(3),
        ratio_plaintext=exact["ratio_plaintext"],
        plaintext_error=data.get("error") or exact["omni_plaintext_error"],
        pyzmq_curve_gib_s=None if curve is None else curve.to_json(3),
        ratio_vs_curve=exact["ratio_vs_curve"],
        pyzmq_curve_error=data.get("error") or exact["pyzmq_curve_error"],
        payload_bytes=sizes[0], sizes=per_size, setting=data.get("env"),
        note=(f"GiB/s of a call whose argument is a {label} float32 numpy array (result: its "
              "size) from a driver child process to worker wtcp, both started with "
              "OMNI_PAYLOAD_SHM=0 and OMNI_IPC=0 (no shared memory, no Unix socket: the "
              "TCP path, as between hosts; `setting`: what the child saw), crossing on the "
              "encrypted data channel (AES-256-GCM, the control message on CURVE); also at "
              f"{size_label(sizes[1])}; baseline: raw pyzmq, one frame of the same size, "
              "copy=False both ends, blocking DEALER/ROUTER over TCP loopback "
              "(perf/transport.py's pair, unencrypted); pyzmq_curve_gib_s: the same pair with "
              "CURVE encryption (zmq.curve_keypair for each end, curve_server on the ROUTER), "
              "as Omni's TCP sockets are, measured in the same alternating rounds; median of "
              f"{p.repeats} alternating rounds after a warm-up; ratio = Omni / plain pyzmq, "
              f"target >= {TCP_TARGET:g}; ratio_vs_curve = Omni / pyzmq with CURVE "
              "(recorded, not the target); plaintext_gib_s, ratio_plaintext: the same call "
              "to worker wtcp_plain, both ends with OMNI_DATA_PLANE=plaintext (recorded)"))


async def _run_child(cmd: list[str], env: dict[str, str], janitor: ShmJanitor) -> Any:
    """Run `cmd` to its end (killed if cancelled), its pid known to `janitor` meanwhile; the
    finished process (stdout, stderr, returncode)."""
    box: list[Any] = []

    async def run(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        box.append(await trio.run_process(cmd, env=env, cwd=ROOT, capture_stdout=True,
                                          capture_stderr=True, check=False,
                                          task_status=task_status))

    async with trio.open_nursery() as nursery:
        process = await nursery.start(run)
        janitor.pids.add(process.pid)
    return box[0]
