"""`omni run`'s text output of a long stream, against ``--json`` of the same stream.

A graph whose one node yields N small ints runs as a real ``python -m cli run FILE -i n=N``
subprocess, its stdout a pipe this process reads (as a program piped after ``omni run``
would), in three forms alternating round by round:

- text: one item per line, the lines counted here (all N must arrive);
- ``--json``: one JSON object, the stream collected as a list (parsed here: N items);
- startup: the same graph with ``n=0`` (process start, imports, loading the graph).

Time per item = (wall time − the median startup) / N. The claim: text mode's time per item
is at most `TARGET` × ``--json``'s. For context, not a target: a plain Python loop printing
the same N ints to the same kind of pipe (its own ``n=0`` start subtracted likewise).
Children run with the caller's environment less ``PYTHONUNBUFFERED`` (default buffering, as a
user's shell would have it). After the rounds (not in --quick), where each mode's time per item
goes is profiled once (`explain`, the claim's ``explain`` and its one-line summary ``why``).

Usage: ``python perf/cli_output.py [--quick] [--repeats N] [--out PATH.json]
[--plot PATH.png] [--profile]`` (the profile, of one more text-mode child, goes to stderr).
"""

from __future__ import annotations

import io
import json
import os
import pstats
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perf._common import (
    Samples,
    alternate,
    benchmark_parser,
    claim,
    environment,
    params_from,
    plot_bars,
    write_json,
)

__all__ = ["Params", "main", "measure"]

ROOT = Path(__file__).resolve().parent.parent
TARGET = 1.5  # text mode's time per item, at most this × --json's
READ_BYTES = 1 << 20
EXPLAIN_ITEMS = 200_000  # items of each profiled child (cProfile slows them several times)
EXPLAIN_TOP = 4  # functions named per mode in `why`
FORMS = ("text", "json", "startup", "print", "print_startup")  # the children of a round

GRAPH_SOURCE = '''\
from collections.abc import AsyncIterator

import omni


@omni.node
async def count(n: int) -> AsyncIterator[int]:
    for i in range(n):
        yield i


@omni.graph
def numbers(n: int):
    return count(n)
'''

PRINT_LOOP = "import sys\nfor i in range(int(sys.argv[1])):\n    print(i)\n"


@dataclass(frozen=True, slots=True)
class Params:
    """The sizes of one run (`quick` shrinks them for a smoke run)."""

    seed: int = 0  # unused (nothing is random); kept so every benchmark takes --seed
    repeats: int = 5
    items: int = 1_000_000
    explain: bool = True  # after the rounds, profile where each mode's time per item goes
    quick: bool = False

    @classmethod
    def small(cls, seed: int = 0) -> Params:
        """Sizes for a smoke run (about 12 s a round: each child's start is ~3 s)."""
        return cls(seed=seed, repeats=3, items=100_000, explain=False, quick=True)


@dataclass(frozen=True, slots=True)
class Run:
    """One child's wall time, its CPU time (user + system) and what it printed (`lines`:
    newlines; `tail`: its last bytes, `body`: all of them where kept)."""

    seconds: float
    cpu_seconds: float
    lines: int
    tail: bytes
    body: bytes | None


# ---------------------------------------------------------------------------------------------
# Children


def child_env() -> dict[str, str]:
    """This process's environment less ``PYTHONUNBUFFERED``. The children run in the repo root,
    so ``-m cli`` and ``omni`` are this checkout's."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}


def run_child(argv: Sequence[str], *, keep: bool = False) -> Run:
    """Run `argv` with its stdout a pipe read here to the end; its wall time from start to
    exit. RuntimeError (with its stderr) if it fails."""
    with tempfile.TemporaryFile() as err:
        cpu_before = _children_cpu()
        start = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=ROOT, env=child_env(), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=err)
        lines, tail, chunks = 0, b"", []
        fd = proc.stdout.fileno()
        while chunk := os.read(fd, READ_BYTES):
            lines += chunk.count(b"\n")
            tail = (tail + chunk)[-64:]
            if keep:
                chunks.append(chunk)
        status = proc.wait()
        seconds = time.perf_counter() - start
        cpu_seconds = _children_cpu() - cpu_before
        proc.stdout.close()
        if status != 0:
            err.seek(0)
            raise RuntimeError(f"{' '.join(argv[1:])} exited {status}: "
                               f"{err.read().decode(errors='replace')[-2000:]}")
    return Run(seconds, cpu_seconds, lines, tail, b"".join(chunks) if keep else None)


def _children_cpu() -> float:
    """User + system seconds of this process's waited-for children so far (one runs at a
    time, so the difference around a run is that child's)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def omni_argv(graph: Path, n: int, *, as_json: bool = False) -> list[str]:
    return [sys.executable, "-m", "cli", "run", str(graph), "-i", f"n={n}",
            *(["--json"] if as_json else [])]


def print_argv(n: int) -> list[str]:
    return [sys.executable, "-c", PRINT_LOOP, str(n)]


def check_text(run: Run, n: int, what: str) -> int:
    """All `n` lines arrived, the last one n − 1; their count."""
    last = run.tail.rstrip(b"\n").rsplit(b"\n", 1)[-1]
    if run.lines != n or (n and last != str(n - 1).encode()):
        raise RuntimeError(f"{what}: {run.lines:,} lines ending {last!r}, not {n:,} ending "
                           f"{n - 1}")
    return run.lines


def check_json(run: Run, n: int) -> int:
    """The --json child printed one object whose output is the whole stream; its length."""
    assert run.body is not None
    doc = json.loads(run.body)
    if run.lines != 1 or doc.get("output") != list(range(n)):
        raise RuntimeError(f"--json: {run.lines} lines, not one object with {n:,} items")
    return len(doc["output"])


# ---------------------------------------------------------------------------------------------
# Measuring


def measure(params: Params) -> dict[str, Any]:
    """Alternate the five children `params.repeats` times; the result dict."""
    n = params.items
    counts: dict[str, int] = {}
    cpu: dict[str, list[float]] = {k: [] for k in FORMS}
    with tempfile.TemporaryDirectory(prefix="omni-cli-output-") as folder:
        graph = Path(folder) / "numbers.py"
        graph.write_text(GRAPH_SOURCE)
        argvs = {"text": omni_argv(graph, n), "json": omni_argv(graph, n, as_json=True),
                 "startup": omni_argv(graph, 0), "print": print_argv(n),
                 "print_startup": print_argv(0)}

        def timed(key: str) -> Callable[[], float]:
            """One child's wall time; what it printed checked (its count kept in `counts`),
            its CPU time kept in `cpu`."""
            def once() -> float:
                run = run_child(argvs[key], keep=key == "json")
                counts[key] = (check_json(run, n) if key == "json" else
                               check_text(run, 0 if key.endswith("startup") else n, key))
                cpu[key].append(run.cpu_seconds)
                return run.seconds
            return once

        timed("startup")()  # warm-up: the page cache and bytecode, untimed
        cpu["startup"].clear()
        load_before = os.getloadavg()
        walls = alternate({k: timed(k) for k in FORMS}, params.repeats, warmup=False)
        load_after = os.getloadavg()
    cpus = {k: Samples(tuple(v)) for k, v in cpu.items()}
    result = _summarise(params, walls, cpus, counts, (load_before, load_after))
    if params.explain:
        explained = explain(params)
        result["stream_text_output"].update(explain=explained, why=_why(explained))
    return result


def per_item_us(runs: Samples, startup: Samples, n: int) -> Samples:
    """Each run's time per item in µs, the median startup taken off."""
    return runs.map(lambda s: (s - startup.median) / n * 1e6)


def ratio_of(text: Samples, as_json: Samples) -> float | None:
    """Median over median; None where either is not positive (a startup that varied by more
    than the stream's own time: the run says nothing)."""
    return text.median / as_json.median if text.median > 0 and as_json.median > 0 else None


def _summarise(params: Params, walls: dict[str, Samples], cpus: dict[str, Samples],
               counts: dict[str, int], load: tuple[Sequence[float], Sequence[float]]
               ) -> dict[str, Any]:
    n = params.items
    text, as_json = (per_item_us(walls[k], walls["startup"], n) for k in ("text", "json"))
    cpu_text, cpu_json = (per_item_us(cpus[k], cpus["startup"], n) for k in ("text", "json"))
    loop = per_item_us(walls["print"], walls["print_startup"], n)
    ratio = ratio_of(text, as_json)
    cpu_ratio = ratio_of(cpu_text, cpu_json)
    env = {**environment(), "loadavg_before": [round(v, 2) for v in load[0]],
           "loadavg_after": [round(v, 2) for v in load[1]]}
    stream = claim(
        unit="us per item", target=TARGET, measured=text, baseline=as_json, ratio=ratio,
        passed=ratio is not None and ratio <= TARGET, digits=3, items=n, lines=counts["text"],
        json_items=counts["json"],
        wall_s={k: walls[k].to_json(3) for k in ("text", "json", "startup")},
        cpu={"text_us_per_item": cpu_text.to_json(3), "json_us_per_item": cpu_json.to_json(3),
             "ratio": None if cpu_ratio is None else round(cpu_ratio, 3),
             "seconds": {k: cpus[k].to_json(3) for k in ("text", "json", "startup")}},
        print_loop={"us_per_item": loop.to_json(3), "lines": counts["print"],
                    "wall_s": walls["print"].to_json(3),
                    "startup_s": walls["print_startup"].to_json(3)},
        note=(f"`python -m cli run FILE -i n={n}` of a graph whose one node yields {n:,} ints, "
              "stdout a pipe read to the end by the benchmark; text mode (one line per item, "
              "the lines counted) against --json (one object, the stream as a list, parsed), "
              f"{params.repeats} alternating rounds with a startup run (n=0) in each; per item "
              "= (wall − median startup) / N; cpu: the same from the child's user + system "
              "time (less sensitive to other load on the machine); print_loop: a plain Python "
              "loop printing the same ints to the same pipe, its own start subtracted "
              "(context, not a target)"))
    return {"benchmark": "cli_output", "env": env, "params": asdict(params),
            "stream_text_output": stream, "all_pass": stream["pass"]}


def _profiled(graph: Path, n: int, *, as_json: bool, folder: Path) -> dict[str, float]:
    """Own seconds per function (`_label`) of one cProfile'd ``omni run`` child of `n` items."""
    path = folder / f"{'json' if as_json else 'text'}-{n}.prof"
    argv = omni_argv(graph, n, as_json=as_json)
    run_child([sys.executable, "-m", "cProfile", "-o", str(path), *argv[1:]])
    own: dict[str, float] = {}
    for func, row in pstats.Stats(str(path)).stats.items():  # row: cc, nc, tottime, ...
        own[_label(func)] = own.get(_label(func), 0.0) + row[2]
    return own


def _label(func: tuple[str, int, str]) -> str:
    filename, _, name = func
    return name if filename == "~" else f"{Path(filename).name}:{name}"


def explain(params: Params) -> dict[str, Any]:
    """Where each mode's time per item goes: a cProfile'd child of each at up to
    `EXPLAIN_ITEMS` items, less a profiled start of the same mode (n=0), so what is left
    grew with the items; per mode the `EXPLAIN_TOP` functions that grew most, µs per item (no
    total: on a loaded machine two children's import times differ by more than the stream's)."""
    n = min(params.items, EXPLAIN_ITEMS)
    out: dict[str, Any] = {"items": n}
    with tempfile.TemporaryDirectory(prefix="omni-cli-output-") as name:
        folder = Path(name)
        graph = folder / "numbers.py"
        graph.write_text(GRAPH_SOURCE)
        for key, as_json in (("text", False), ("json", True)):
            startup = _profiled(graph, 0, as_json=as_json, folder=folder)
            own = _profiled(graph, n, as_json=as_json, folder=folder)
            grown = {f: (t - startup.get(f, 0.0)) / n * 1e6 for f, t in own.items()}
            top = sorted(grown.items(), key=lambda ft: -ft[1])[:EXPLAIN_TOP]
            out[key] = [{"function": f, "us_per_item": round(v, 3)} for f, v in top]
    return out


def _why(explained: dict[str, Any]) -> str:
    """One line from `explain`'s figures."""
    def mode(key: str, title: str) -> str:
        return f"{title}: " + ", ".join(f"{t['function']} {t['us_per_item']:.2f}"
                                        for t in explained[key])

    return (f"under cProfile ({explained['items']:,} items, each mode's profiled n=0 start "
            "taken off), µs per item in the functions that grew most: "
            f"{mode('text', 'text mode')}; {mode('json', '--json')}")


def profile(params: Params, top: int = 25) -> str:
    """cProfile one text-mode child (stdout read here as in the claim); the top functions by
    own time, as text."""
    with tempfile.TemporaryDirectory(prefix="omni-cli-output-") as folder:
        graph, stats = Path(folder) / "numbers.py", Path(folder) / "text.prof"
        graph.write_text(GRAPH_SOURCE)
        argv = omni_argv(graph, params.items)
        run_child([sys.executable, "-m", "cProfile", "-o", str(stats), *argv[1:]])
        out = io.StringIO()
        pstats.Stats(str(stats), stream=out).sort_stats("tottime").print_stats(top)
        return out.getvalue()


def _plot(result: dict[str, Any], path: str) -> None:
    c = result["stream_text_output"]

    def samples(entry: dict[str, Any]) -> Samples:
        return Samples(tuple(entry["runs"]))

    plot_bars(path, f"omni run, a stream of {c['items']:,} ints to a pipe "
                    f"(Python {result['env']['python']}, {result['env']['cpu_count']} CPUs)", [
        (f"per item, startup subtracted (target: text ≤ {c['target']:g}× --json)",
         "µs per item (lower is better)",
         {"text": samples(c["measured"]), "--json": samples(c["baseline"]),
          "print loop": samples(c["print_loop"]["us_per_item"])}),
        ("wall time of a child", "s (lower is better)",
         {"text": samples(c["wall_s"]["text"]), "--json": samples(c["wall_s"]["json"]),
          "n=0": samples(c["wall_s"]["startup"])}),
    ])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse `argv`, run the benchmark, print (and optionally write and plot) the result."""
    parser = benchmark_parser(__doc__, repeats_help="rounds of the five children",
                              plot_help="write a bar chart (PNG) here",
                              profile_help="also cProfile one text-mode child (to stderr)")
    args = parser.parse_args(argv)
    params = params_from(args, Params)
    result = measure(params)
    write_json(result, args.out)
    if args.plot:
        _plot(result, args.plot)
    if args.profile:
        sys.stderr.write(profile(params))
    return result


if __name__ == "__main__":
    main()
