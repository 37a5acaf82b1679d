"""Helpers shared by the benchmarks in `perf/`: environment record, repeated timing, JSON, plots.

Every benchmark prints one JSON object on stdout, can write it to a file (`--out`) and a bar
chart (`--plot`). Measurements are repeated and summarised by median and extremes, because
the machines that run them are shared and noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import datetime
import gc
import io
import json
import os
import platform
import pstats
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "Samples",
    "alternate",
    "claim",
    "environment",
    "filesystem_of",
    "gc_frozen",
    "gc_paused",
    "memory_status",
    "plot_bars",
    "time_async",
    "time_call",
    "write_json",
]


@dataclass(frozen=True, slots=True)
class Samples:
    """One quantity measured several times. Why a record: median, min and max travel together
    and JSON-ify the same way in every benchmark."""

    values: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def min(self) -> float:
        return min(self.values)

    @property
    def max(self) -> float:
        return max(self.values)

    def map(self, fn: Callable[[float], float]) -> Samples:
        """The same samples in another unit (e.g. seconds to µs per node)."""
        return Samples(tuple(fn(v) for v in self.values))

    def to_json(self, digits: int = 3) -> dict[str, Any]:
        return {"median": round(self.median, digits), "min": round(self.min, digits),
                "max": round(self.max, digits), "runs": [round(v, digits) for v in self.values]}


def environment() -> dict[str, Any]:
    """What a result depends on besides the code: interpreter, trio, machine."""
    import trio

    import omni

    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "trio": trio.__version__,
        "omni": omni.__version__,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


async def time_async(fn: Callable[[], Awaitable[Any]]) -> float:
    """Seconds one call of `fn` takes, after a full garbage collection (so that a collection
    left over from an earlier measurement is not charged to this one)."""
    gc.collect()
    start = time.perf_counter()
    await fn()
    return time.perf_counter() - start


def time_call(fn: Callable[[], Any]) -> float:
    """Seconds one call of `fn` takes: a full garbage collection first, and none during the
    call (as `timeit` does), so that no collection is charged to it."""
    with gc_paused():
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Collect garbage, then keep the collector off inside the block (timed loops)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """Collect garbage, then move every object alive into the collector's permanent
    generation (`gc.freeze`) for the block: a full collection inside (a timed call's
    `gc.collect()`) then scans only what the block made. In a process that imported
    transformers, one full collection otherwise takes ~0.25 s."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def alternate(measures: dict[str, Callable[[], float]], repeats: int, *,
              warmup: bool = True) -> dict[str, Samples]:
    """Call every measure `repeats` times, one round at a time, reversing the order each round
    (A B, B A, A B ...) so that no side always runs first on a noisy machine.

    Each measure returns its own value (seconds, bytes/s ...), so it may do untimed set-up
    around what it times. With `warmup`, one untimed round runs first.
    """
    names = list(measures)
    if warmup:
        for name in names:
            measures[name]()
    values: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            values[name].append(measures[name]())
    return {name: Samples(tuple(v)) for name, v in values.items()}


def memory_status() -> dict[str, int]:
    """This process's resident memory in bytes, from /proc/self/status: ``VmRSS`` and its
    parts ``RssAnon`` (heap: Python objects, malloc), ``RssFile`` (mapped files, libraries) and
    ``RssShmem`` (shared memory, e.g. /dev/shm arenas). Empty where there is no /proc."""
    fields = ("VmRSS", "RssAnon", "RssFile", "RssShmem")
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return {}
    out: dict[str, int] = {}
    for line in lines:
        name, _, value = line.partition(":")
        if name in fields:
            out[name] = int(value.split()[0]) * 1024  # reported in kB
    return out


def filesystem_of(path: str | os.PathLike[str]) -> str:
    """The type of the filesystem holding `path` ("ext4", "tmpfs" ...), from /proc/mounts;
    "unknown" without it. Disk benchmarks record it: on tmpfs they would measure memory."""
    target, best, kind = str(Path(path).resolve()), "", "unknown"
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return kind
    for line in mounts:
        _, mount, fs_type, *_ = line.split()
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, fs_type
    return kind


def claim(*, unit: str, target: float, measured: Samples, baseline: Samples | None,
          ratio: float | None, passed: bool, note: str, digits: int = 1,
          **extra: Any) -> dict[str, Any]:
    """One claim as JSON: target, measured and baseline samples, their ratio, pass, the
    claim's own figures (`extra`), and a note saying how it was measured."""
    return {"unit": unit, "target": target, "measured": measured.to_json(digits),
            "baseline": None if baseline is None else baseline.to_json(digits),
            "ratio": None if ratio is None else round(ratio, 3), "pass": bool(passed),
            **extra, "note": note}


def write_json(result: dict[str, Any], out: str | os.PathLike[str] | None) -> str:
    """Print `result` as one JSON object on stdout; also write it to `out`, creating folders."""
    text = json.dumps(result, indent=2, sort_keys=False)
    if out is not None:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
    return text


def plot_bars(path: str | os.PathLike[str], title: str,
              panels: Sequence[tuple[str, str, dict[str, Samples]]]) -> None:
    """A PNG with one bar chart per panel: ``(panel title, y label, {bar label: samples})``.

    Bars are medians; the whiskers span min to max of the repeats.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (panel_title, ylabel, bars) in zip(axes[0], panels, strict=True):
        labels = list(bars)
        medians = [bars[k].median for k in labels]
        low = [bars[k].median - bars[k].min for k in labels]
        high = [bars[k].max - bars[k].median for k in labels]
        ax.bar(labels, medians, yerr=[low, high], capsize=6,
               color=["tab:blue", "tab:gray", "tab:orange", "tab:green"][: len(labels)])
        for x, m in enumerate(medians):
            ax.annotate(f"{m:,.0f}" if m >= 100 else f"{m:.3g}", (x, m), ha="center", va="bottom",
                        xytext=(0, 3), textcoords="offset points")
        ax.set_title(panel_title)
        ax.set_ylabel(ylabel)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def benchmark_parser(doc: str | None, *, repeats_help: str, plot_help: str,
                     profile_help: str, profile_choices: Sequence[str] | None = None
                     ) -> argparse.ArgumentParser:
    """The options every benchmark takes: --quick, --seed, --repeats, --out, --plot, --profile."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=None, help=repeats_help)
    parser.add_argument("--out", help="also write the JSON here (folders are created)")
    parser.add_argument("--plot", help=plot_help)
    if profile_choices:
        parser.add_argument("--profile", choices=list(profile_choices), help=profile_help)
    else:
        parser.add_argument("--profile", action="store_true", help=profile_help)
    return parser


def params_from(args: argparse.Namespace, params_type: Any) -> Any:
    """The benchmark's sizes: `params_type.small(seed)` for --quick, else the defaults; then
    --repeats."""
    params = params_type.small(args.seed) if args.quick else params_type(seed=args.seed)
    if args.repeats is not None:
        params = dataclasses.replace(params, repeats=args.repeats)
    return params


def profile_report(profiler: cProfile.Profile, top: int) -> str:
    """The `top` functions of a profile by own time, as text."""
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()
