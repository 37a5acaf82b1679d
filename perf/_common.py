"""Helpers shared by the benchmarks in `perf/`: environment record, repeated timing, JSON, plots.

Every benchmark prints one JSON object on stdout, can write it to a file (`--out`) and a bar
chart (`--plot`). Measurements are repeated and summarised by median and extremes, because
the machines that run them are shared and noisy.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "Samples",
    "environment",
    "plot_bars",
    "time_async",
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
    }


async def time_async(fn: Callable[[], Awaitable[Any]]) -> float:
    """Seconds one call of `fn` takes, after a full garbage collection (so that a collection
    left over from an earlier measurement is not charged to this one)."""
    gc.collect()
    start = time.perf_counter()
    await fn()
    return time.perf_counter() - start


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
