"""Payloads: moving stage payloads between processes, Omni against Ray, in one run.

One Omni head and four workers are started as subprocesses (``python -m cli cluster start`` /
``cluster join``, loopback ports the OS picks), and a local Ray instance on 127.0.0.1 (no
dashboard); this process drives both. The nodes (`perf/_payload_nodes.py`) are pinned to
workers by name; Ray's actors (`perf/_payload_ray.py`) have the same bodies. Every
measurement alternates Omni and its baseline round by round (A B, B A, ...) after one untimed
warm-up round, and reports medians of `repeats` rounds. Claims:

1. ``numpy_64mib``: a call of a class node on worker ``w1`` (same host) whose argument is a
   64 MiB float32 numpy array and whose result is its byte size; also recorded at 4 KiB less.
   Baselines: ``ray.get(actor.size.remote(array))``, and one in-process copy of the same bytes
   (``np.copy``). Target: Omni's time <= Ray's.
2. ``torch_64mib``: the same with a torch tensor (Ray pickles those; the copy: ``clone``).
3. ``round_trip_64mib``: the node returns the array it was given (64 MiB each way). Omni vs
   Ray's ``actor.echo``; recorded, target <= Ray's time.
4. ``one_gib``: a 1 GiB argument, and separately a 1 GiB result (made on the worker), each
   must work; peak RSS above idle of this process (the driver) and of the worker, from VmHWM
   reset before the call (``clear_refs``) and VmRSS sampled every 2 ms. Idle: RSS just before
   the call (the argument already allocated). Then the same over TCP, as between hosts (worker
   ``wtcp``; this process stops using shared memory meanwhile): values of more than one 64 MiB
   frame go as transfers of chunks, so each end should hold the value and one chunk. Target:
   each <= 1.5 GiB above idle. A call that
   fails is recorded with its error (the claim fails; the benchmark goes on); each case starts
   once a small call of its node works; with less than 4 GiB of memory available the section
   is not run (recorded), rather than risk the OOM killer.
5. ``tcp_64mib``: 64 MiB forced across the TCP path as between hosts: a driver child process
   and worker ``wtcp``, both started with ``OMNI_PAYLOAD_SHM=0`` and ``OMNI_IPC=0`` (no shared
   memory, no Unix socket; `perf/_payload_tcp.py`): the value crosses on the encrypted data
   channel (AES-256-GCM). Beside it, recorded: worker ``wtcp_plain``, started with
   ``OMNI_DATA_PLANE=plaintext`` as well (the child asks for plaintext; ``wtcp`` answers
   encrypted), the plaintext data plane.
   Baseline: raw pyzmq zero-copy frames of the same size over TCP loopback (the blocking
   pyzmq pair of `perf/transport.py`, unencrypted). GiB/s; target >= 0.8x raw pyzmq. Also
   measured in the same alternating rounds, and recorded (``pyzmq_curve_gib_s``,
   ``ratio_vs_curve``) but not the target: the same pair with CURVE encryption, as Omni's
   TCP sockets have.
6. ``call_latency``: a trivial call (an int each way) on ``w1``; median µs of sequential
   calls. Target: Omni <= 0.5x Ray's actor call.
7. ``hop_latency`` and ``pipeline_throughput``: three class nodes, one per worker
   (``w1``, ``w2``, ``w3``), chained in a graph; hop latency = one request's end-to-end time
   / 3 (median of sequential requests), throughput = requests/s with 64 in flight. Baseline:
   a Ray Compiled Graph of three actors (``ray.dag.InputNode``, ``experimental_compile``),
   or plain chained actor calls where it does not compile (then labelled ``ray_actors``, with
   the reason). Targets: hop latency <= the baseline's, throughput >= the baseline's.
   Then, once, where Omni's time goes: the same requests plain (CPU time per request of the
   driver, the head and the workers, and of the whole machine, against wall time) and under
   cProfile in the driver (the top functions by own time), then plain again once Ray's graph
   is torn down; each claim's ``explain``, and ``why``, one line of it
   (`perf/_payload_latency.py`).

``--no-ray`` skips Ray (the claims with a Ray baseline then record none and do not pass): the
test suite runs that way, without Ray installed. ``--quick`` shrinks the payloads to 16 MiB
and the "1 GiB" to 128 MiB, with 3 rounds. Everything started is stopped on exit, Ctrl-C and
SIGTERM included, and shared-memory files our processes leave in /dev/shm are removed.

Usage: ``python perf/payloads.py [--quick] [--no-ray] [--repeats N] [--out PATH.json]
[--plot PATH.png]``. Ray comes with the ``bench`` extra (``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import atexit
import cProfile
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import trio

if __package__ in (None, ""):  # run as a script: make `perf` and `omni` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import omni
from perf import _payload_latency as lat
from perf import _payload_measures as m
from perf import _payload_nodes as nodes
from perf._common import Samples, benchmark_parser, environment, profile_report, write_json
from perf._payload_measures import CLAIMS, error_text, size_label
from perf._payload_support import BlockingThread, ShmJanitor, stop_strays, summarise_names
from perf._payload_tcp import PLAINTEXT, TCP_SETTINGS
from perf._procs import START_S, CliProcess, wait_members

__all__ = ["Params", "main", "measure"]

ROOT = Path(__file__).resolve().parent.parent
MIB, GIB = 1 << 20, 1 << 30
RUN_MARKER = "PERF_PAYLOADS_RUN"  # environment variable naming the run's folder


@dataclass(frozen=True, slots=True)
class Params:
    """The sizes of one run (`quick` shrinks them for a smoke run)."""

    seed: int = 0
    repeats: int = 7  # timed rounds per measurement, after one warm-up round
    payload_bytes: int = 64 * MIB
    big_bytes: int = GIB
    big_repeats: int = 3  # calls of each 1 GiB case (memory peaks; they are slow)
    calls: int = 200  # sequential trivial calls per call-latency sample
    hop_requests: int = 100  # sequential pipeline requests per hop-latency sample
    requests: int = 512  # pipeline requests per throughput sample
    in_flight: int = 64
    heartbeat: float = 0.5
    section_timeout_s: float = 240.0
    ray: bool = True
    quick: bool = False
    only: tuple[str, ...] = ()  # the claims to measure (their sections); empty: all

    @classmethod
    def small(cls, seed: int = 0) -> Params:
        """Sizes for a smoke run: 16 MiB payloads, a 128 MiB "1 GiB", 3 rounds."""
        return cls(seed=seed, repeats=3, payload_bytes=16 * MIB, big_bytes=128 * MIB,
                   big_repeats=1, calls=50, hop_requests=30, requests=128, quick=True)


# ---------------------------------------------------------------------------------------------
# Processes: the cluster (and Ray, started meanwhile)


class Processes:
    """The head and the workers (name -> process), in a temporary folder with the token."""

    def __init__(self, params: Params, folder: Path):
        self.params = params
        self.folder = folder
        self.token = str(folder / "cluster.token")
        self.head: CliProcess | None = None
        self.workers: dict[str, CliProcess] = {}
        self.address = ""

    def start(self) -> None:
        """Start the head and wait for it; start the workers (`wait` waits for them)."""
        env = {k: v for k, v in os.environ.items()
               if k not in TCP_SETTINGS and k not in PLAINTEXT}
        env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        beat = str(self.params.heartbeat)
        self.head = CliProcess(["cluster", "start", "--bind", "tcp://127.0.0.1:*",
                                "--token-file", self.token, "--heartbeat", beat], ROOT, env)
        self.address = self.head.wait_line(r"head at (tcp://\S+)").group(1)
        for name in nodes.WORKERS:
            worker_env = {**env, **TCP_SETTINGS} if name == "wtcp" else \
                {**env, **TCP_SETTINGS, **PLAINTEXT} if name == "wtcp_plain" else env
            self.workers[name] = CliProcess(
                ["cluster", "join", self.address, "--token-file", self.token, "--name", name,
                 "--heartbeat", beat, "--kv-host", "16MiB", "--timeout", str(START_S)], ROOT,
                worker_env)

    def wait(self) -> None:
        for proc in self.workers.values():
            proc.wait_line(r"joined .* as")
        wait_members(self.address, self.token, self.workers, cwd=ROOT)

    def pids(self) -> list[int]:
        procs = [self.head, *self.workers.values()]
        return [p.popen.pid for p in procs if p is not None]

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM to all at once (they stop in parallel), once: a second one could cut a
        clean exit short; then SIGKILL for any still running after `grace` seconds."""
        procs = [*self.workers.values(), *([self.head] if self.head else [])]
        for proc in procs:
            proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in procs:
            try:
                proc.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(5)

    def report(self) -> dict[str, Any]:
        """How each worker ended (exit status) and what it logged (first and last lines)."""
        return {name: {"exit": p.popen.poll(), "stderr_lines": len(p.err),
                       "first": [x.rstrip()[:200] for x in p.err[:3]],
                       "last": [x.rstrip()[:200] for x in p.err[3:][-3:]]}
                for name, p in self.workers.items()}


class RayState:
    """Ray for the baselines: the module, the single-call actor, or why there is none."""

    def __init__(self) -> None:
        self.ray: Any = None
        self.side: Any = None
        self.error: str | None = None
        self.version: str | None = None

    def start(self, folder: Path) -> None:
        from perf._payload_ray import RaySide, start_ray

        try:
            self.ray = start_ray(folder / "ray", object_store_bytes=2 * GIB)
            self.version = self.ray.__version__
            self.side = RaySide(self.ray)
        except Exception as exc:  # recorded: the claims then have no Ray baseline
            self.error = error_text(exc)

    def stop(self) -> None:
        """``ray.shutdown`` (its processes and session), also after an interrupted start."""
        ray = sys.modules.get("ray")
        if ray is not None:
            ray.shutdown()


# ---------------------------------------------------------------------------------------------
# The run


async def drive(p: Params, procs: Processes, ray: RayState, thread: BlockingThread,
                janitor: ShmJanitor) -> dict[str, Any]:
    """Deploy the nodes on the cluster, then run every section; a section that raises or
    runs past `p.section_timeout_s` records its error in its claims, and the next one runs."""
    claims: dict[str, Any] = {}
    async with omni.Runtime(cluster=procs.address, token_file=procs.token) as rt:
        for node in (nodes.Size, nodes.Echo, nodes.Tiny, nodes.Make, nodes.SizeTcp,
                     nodes.SizeTcpPlain, nodes.MakeTcp, nodes.chain):
            await rt.deploy(node)
        janitor.watch(procs.pids())
        w1 = procs.workers["w1"].popen.pid
        pipeline_pids = {name: procs.workers[name].popen.pid for name in ("w1", "w2", "w3")}
        if procs.head is not None:
            pipeline_pids["head"] = procs.head.popen.pid
        sections = [
            (("numpy_64mib",), lambda: m.payload_section(rt, p, ray, thread, "numpy")),
            (("torch_64mib",), lambda: m.payload_section(rt, p, ray, thread, "torch")),
            (("round_trip_64mib",),
             lambda: m.payload_section(rt, p, ray, thread, "round_trip")),
            (("one_gib",), lambda: m.one_gib_section(rt, p, w1,
                                                     procs.workers["wtcp"].popen.pid)),
            (("tcp_64mib",), lambda: m.tcp_section(p, procs.address, procs.token, janitor)),
            (("call_latency",), lambda: lat.call_latency_section(rt, p, ray, thread)),
            (("hop_latency", "pipeline_throughput"),
             lambda: lat.pipeline_section(rt, p, ray, thread, pipeline_pids)),
        ]
        for names, section in sections:
            if p.only and not set(names) & set(p.only):
                continue
            began = time.perf_counter()
            try:
                with trio.fail_after(p.section_timeout_s):
                    out = await section()
            except Exception as exc:  # recorded in its claims; the other sections still run
                out = {name: failed_claim(p, name, error_text(exc)) for name in names}
            if len(names) == 1:
                out = {names[0]: out}
            for name in names:
                out[name]["seconds"] = round(time.perf_counter() - began, 1)
            claims.update(out)
            janitor.watch()
    return claims


def failed_claim(p: Params, name: str, error: str) -> dict[str, Any]:
    """Claim `name` when its section failed before it measured anything."""
    unit, target, better = m.TARGETS[name]
    size = p.big_bytes if name == "one_gib" else p.payload_bytes
    return {"unit": unit, "target": target, "better": better, "measured": None,
            "baseline": None, "ratio": None, "pass": False, "error": error,
            "payload_bytes": size, "sizes": {}, "in_flight": p.in_flight,
            "note": "the section failed before it measured anything: see error"}


def measure(p: Params, profiler: cProfile.Profile | None = None) -> dict[str, Any]:
    """Start the cluster and Ray, drive every section, stop everything; the result dict."""
    began = time.perf_counter()
    load_before = [round(x, 2) for x in os.getloadavg()]
    janitor = ShmJanitor()
    atexit.register(_clean_at_exit, janitor)  # after Omni's exit handlers (registered later)
    folder = Path(tempfile.mkdtemp(prefix="omni-perf-payloads-"))
    procs, ray, thread = Processes(p, folder), RayState(), BlockingThread("ray")
    os.environ[RUN_MARKER] = str(folder)  # inherited by everything this run starts
    startup = None
    try:
        try:
            procs.start()
            if p.ray:
                ray.start(folder)  # while the workers start
                catch_sigterm()  # again: ray.init installs its own handler, which aborts
            janitor.watch(procs.pids())
            procs.wait()
            startup = time.perf_counter() - began
            if profiler is not None:
                profiler.enable()
            claims = trio.run(drive, p, procs, ray, thread, janitor)
        except Exception as exc:  # nothing measured: the cluster, the runtime or a deployment
            claims = {name: failed_claim(p, name, error_text(exc)) for name in CLAIMS}
        finally:
            if profiler is not None:
                profiler.disable()
        janitor.watch(procs.pids())
    finally:
        stopping = time.perf_counter()
        procs.stop()
        if thread.close():  # else Ray's processes are left to `stop_strays`
            ray.stop()
        strays = stop_strays(f"{RUN_MARKER}={folder}")  # e.g. Ray's, after a cut ray.init
        os.environ.pop(RUN_MARKER, None)
        shm_removed = janitor.clean(spare_own=True)  # this process's Omni: at its exit
        shutil.rmtree(folder, ignore_errors=True)
    timing = {"loadavg_before": load_before, "strays_stopped": strays,
              "startup_s": None if startup is None else round(startup, 1),
              "stop_s": round(time.perf_counter() - stopping, 1),
              "seconds": round(time.perf_counter() - began, 1)}
    return summarise(p, claims, procs, ray, shm_removed, timing)


def _clean_at_exit(janitor: ShmJanitor) -> None:
    """The last cleanup, after this process's Omni has unlinked its own segments at exit;
    what it still finds was left behind, and is said on stderr."""
    removed = janitor.clean()
    if removed:
        sys.stderr.write(f"perf/payloads.py: removed {len(removed)} shared-memory files left "
                         f"at exit: {summarise_names(removed)}\n")


def summarise(p: Params, claims: dict[str, Any], procs: Processes, ray: RayState,
              shm_removed: list[str], timing: dict[str, Any]) -> dict[str, Any]:
    import numpy
    import torch
    import zmq

    timing = dict(timing)
    env = {**environment(), "torch": torch.__version__, "numpy": numpy.__version__,
           "pyzmq": zmq.pyzmq_version(), "libzmq": zmq.zmq_version(), "ray": ray.version,
           "loadavg_before": timing.pop("loadavg_before"),
           "loadavg_after": [round(x, 2) for x in os.getloadavg()],
           "omni_settings": {k: v for k, v in sorted(os.environ.items())
                             if k.startswith("OMNI_")}}
    result: dict[str, Any] = {
        "benchmark": "payloads", "env": env, "params": asdict(p),
        "sizes": {"payload": size_label(p.payload_bytes), "big": size_label(p.big_bytes)},
        "ray": {"used": ray.side is not None, "version": ray.version,
                "error": ray.error if p.ray else NO_RAY_NOTE},
        **{name: claims[name] for name in CLAIMS if name in claims},
        "pids": {"driver": os.getpid(),
                 **{name: w.popen.pid for name, w in procs.workers.items()}},
        "workers": procs.report(),
        "shm_removed": summarise_names(shm_removed),
        **timing,
    }
    result["all_pass"] = all(claims[name]["pass"] for name in CLAIMS if name in claims)
    return result


NO_RAY_NOTE = "not run (--no-ray)"


# ---------------------------------------------------------------------------------------------
# Plot and command line


def _samples(entry: dict[str, Any] | None) -> Samples | None:
    return None if not entry else Samples(tuple(entry["runs"]))


def _plot(result: dict[str, Any], path: str) -> None:
    """One panel per claim with figures, in two rows: Omni against its baselines (bars:
    medians, whiskers: min..max)."""
    size = result["sizes"]["payload"]
    panels = []
    for name, title, unit in (("numpy_64mib", f"numpy {size} argument", "ms"),
                              ("torch_64mib", f"torch {size} argument", "ms"),
                              ("round_trip_64mib", f"{size} there and back", "ms"),
                              ("tcp_64mib", f"{size} over TCP", "GiB/s (higher is better)"),
                              ("call_latency", "trivial call", "µs"),
                              ("hop_latency", "pipeline hop", "µs"),
                              ("pipeline_throughput", "pipeline, 64 in flight",
                               "requests/s (higher is better)")):
        c = result.get(name, {})
        other = "pyzmq" if name == "tcp_64mib" else "Ray"
        bars = {"Omni": _samples(c.get("measured")), other: _samples(c.get("baseline"))}
        if c.get("pyzmq_curve_gib_s"):
            bars["pyzmq CURVE"] = _samples(c["pyzmq_curve_gib_s"])
        if c.get("copy"):
            bars["copy"] = _samples(c["copy"])
        panels.append((title, unit, {k: v for k, v in bars.items() if v is not None}))
    big = result.get("one_gib", {})
    rss = {f"{part[:3]} {end}": _samples(big[part]["above_idle_mib"][end])
           for part in ("argument", "result") if (big.get(part) or {}).get("above_idle_mib")
           for end in ("driver", "worker")}
    panels.append((f"{result['sizes']['big']}: RSS above idle", "MiB", rss))
    _grid(path, "Stage payloads between processes: Omni vs Ray (and vs one copy, raw pyzmq)",
          panels)


def _grid(path: str, title: str, panels: list[tuple[str, str, dict[str, Samples | None]]],
          columns: int = 4) -> None:
    """`perf._common.plot_bars` in rows of `columns` panels (eight panels in one row are
    too wide to read)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.5 * columns, 3.6 * rows), squeeze=False)
    for ax, (panel_title, ylabel, bars) in zip(axes.flat, panels, strict=False):
        labels = [k for k, v in bars.items() if v is not None]
        medians = [bars[k].median for k in labels]
        low = [bars[k].median - bars[k].min for k in labels]
        high = [bars[k].max - bars[k].median for k in labels]
        ax.bar(labels, medians, yerr=[low, high], capsize=5,
               color=["tab:blue", "tab:gray", "tab:orange", "tab:green"][: len(labels)])
        for x, top in enumerate(medians):
            ax.annotate(f"{top:,.0f}" if top >= 100 else f"{top:.3g}", (x, top), ha="center",
                        va="bottom", xytext=(0, 3), textcoords="offset points")
        if not labels:
            ax.text(0.5, 0.5, "no figures (see the JSON's error)", ha="center",
                    transform=ax.transAxes)
        ax.set_title(panel_title)
        ax.set_ylabel(ylabel)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse `argv`, run the benchmark, print (and optionally write and plot) the result."""
    parser = benchmark_parser(__doc__, repeats_help="timed rounds per measurement",
                              plot_help="write a bar chart (PNG) here",
                              profile_help="also cProfile this process (the driver) over "
                                           "the whole run (to stderr)")
    parser.add_argument("--no-ray", action="store_true",
                        help="skip the Ray baselines (the suite runs without Ray installed)")
    parser.add_argument("--only", metavar="CLAIMS", default="",
                        help="measure only these claims (comma-separated: "
                             f"{', '.join(CLAIMS)}) and those measured with them")
    args = parser.parse_args(argv)
    params = Params.small(args.seed) if args.quick else Params(seed=args.seed)
    only = tuple(name for name in args.only.split(",") if name)
    if unknown := set(only) - set(CLAIMS):
        parser.exit(2, f"perf/payloads.py: --only: no claim {', '.join(sorted(unknown))} "
                       f"(claims: {', '.join(CLAIMS)})\n")
    params = replace(params, only=only)
    if args.repeats is not None:
        params = replace(params, repeats=args.repeats)
    if args.no_ray:
        params = replace(params, ray=False)
    elif importlib.util.find_spec("ray") is None:
        parser.exit(2, "perf/payloads.py: Ray is not installed: pip install -e '.[bench]' "
                       "(or pass --no-ray)\n")
    catch_sigterm()
    profiler = cProfile.Profile() if args.profile else None
    result = measure(params, profiler)
    write_json(result, args.out)
    if args.plot:
        _plot(result, args.plot)
    if profiler is not None:
        sys.stderr.write(profile_report(profiler, 30))
    return result


def catch_sigterm() -> None:
    """SIGTERM becomes SIGINT here, so that it cleans up as Ctrl-C does (inside `trio.run`,
    trio delivers it where it is safe to)."""
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: Any) -> None:
    signal.raise_signal(signal.SIGINT)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # everything it started is stopped by now
        sys.exit("perf/payloads.py: interrupted")
