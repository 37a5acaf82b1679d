"""What ``omni run`` writes on stderr while requests run: progress, failures, the summary.

stdout carries results only; everything here goes to stderr. The progress bar (rich) is shown
when stderr is a terminal or when more than one request runs; on a terminal it redraws in
place (and vanishes after a single request), elsewhere rich prints its final state once.
"""

from __future__ import annotations

import math
import sys
import traceback
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from omni import NodeError

__all__ = ["MAX_FAILURE_LINES", "Outcome", "Reporter", "percentile", "summary_line"]

MAX_FAILURE_LINES = 10  # failure lines printed before the rest are only counted


@dataclass
class Outcome:
    """What a batch of requests did: one latency (seconds) per finished request, and the
    wall time from the first request's start to the last one's end (the Runtime's startup,
    which builds the replicas, is not counted)."""

    latencies: list[float] = field(default_factory=list)
    num_failed: int = 0
    elapsed: float = 0.0

    @property
    def num_requests(self) -> int:
        return len(self.latencies)


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank `q`-th percentile (0 < q <= 100) of `values`; 0.0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def summary_line(outcome: Outcome, concurrency: int) -> str:
    """``summary: requests=N failures=F ...``: counts, throughput and p50/p99 latency in ms."""
    throughput = outcome.num_requests / outcome.elapsed if outcome.elapsed > 0 else 0.0
    p50 = percentile(outcome.latencies, 50) * 1000
    p99 = percentile(outcome.latencies, 99) * 1000
    return (f"summary: requests={outcome.num_requests} failures={outcome.num_failed} "
            f"concurrency={concurrency} elapsed={outcome.elapsed:.3f}s "
            f"throughput={throughput:.1f} req/s p50={p50:.2f} ms p99={p99:.2f} ms")


class Reporter:
    """The stderr side of a run, used as a context manager around the requests."""

    def __init__(self, num_requests: int | None, *, debug: bool):
        """`num_requests`: how many will run, or None when not known yet (requests on stdin)."""
        self._debug = debug
        self._num_failures = 0
        self._done = 0
        self._progress: Any = None
        self._task: Any = None
        if sys.stderr.isatty() or num_requests != 1:
            self._progress = _make_progress(num_requests)
            self._task = self._progress.add_task("requests", total=num_requests)

    def __enter__(self) -> Reporter:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._progress is not None:
            if exc is not None and self._done == 0:  # failed before a request ran: no bar
                self._progress.live.transient = True
            self._progress.stop()
        hidden = self._num_failures - MAX_FAILURE_LINES
        if hidden > 0:
            self.write(f"error: {hidden} more failed requests not shown")

    def request_done(self) -> None:
        """Advance the progress bar by one request."""
        self._done += 1
        if self._progress is not None:
            self._progress.advance(self._task)

    def failure(self, error: NodeError) -> None:
        """Report a failed request: one line naming the node and the cause (+ traceback)."""
        self._num_failures += 1
        if self._num_failures > MAX_FAILURE_LINES:
            return
        if self._debug:
            self.write("".join(traceback.format_exception(error.cause)).rstrip("\n"))
        self.write(f"error: {' '.join(str(error).splitlines())}")

    def write(self, text: str) -> None:
        """Write text to stderr (above the progress bar while it is shown)."""
        if self._progress is not None and self._progress.live.is_started:
            self._progress.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()


def _make_progress(num_requests: int | None) -> Any:
    from rich.console import Console  # imported only when a bar is shown
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True, highlight=False)
    # Redirecting stdout through rich keeps results above the bar, but only when both
    # streams are the same terminal; otherwise results must stay on stdout untouched.
    same_terminal = console.is_terminal and sys.stdout.isatty()
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=num_requests == 1,
                    redirect_stdout=same_terminal, redirect_stderr=False)
