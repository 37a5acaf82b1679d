"""`Scheduler`: which requests a step of the engine prefills and decodes, in which batch rows.

Synchronous and free of torch and trio: it decides, the model runner (`omni.compute.runner`)
computes, and the engine's trio shell (`omni.compute.engine`) drives the steps. Requests wait
in arrival order and are admitted while the decode batch has rows for all of their samples (a
request of n samples takes n rows, its lead's and its forks'); the running requests occupy rows
``0..B-1`` in `running`, and a request leaving the batch gives its row to the last one, as the
batch's KV rows do (`BatchKV.remove`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

__all__ = ["Schedulable", "Scheduler", "StepPlan"]


class Schedulable(Protocol):
    """What the scheduler reads and writes of a request."""

    row: int | None  # its batch row while it runs
    cancelled: bool

    @property
    def samples(self) -> Sequence[Schedulable]: ...  # itself first, then its forks


R = TypeVar("R", bound=Schedulable)


@dataclass
class StepPlan(Generic[R]):
    """One step: the cancelled running requests to take out first, then the requests to
    prefill (in arrival order; their rows are free once `dropped` are out), then a decode of
    whatever runs."""

    dropped: list[R] = field(default_factory=list)
    prefill: list[R] = field(default_factory=list)


class Scheduler(Generic[R]):
    """First come, first served admission into a decode batch of `max_batch` rows."""

    def __init__(self, max_batch: int) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.max_batch = max_batch
        self.waiting: list[R] = []
        self.running: list[R] = []  # by batch row

    def check_fits(self, num_samples: int) -> None:
        """ValueError unless a request of `num_samples` samples can ever be admitted."""
        if num_samples > self.max_batch:
            raise ValueError(f"n={num_samples} samples need {num_samples} batch rows; this "
                             f"engine decodes {self.max_batch} at most (max_batch)")

    def submit(self, request: R) -> None:
        """Queue a request (all of its samples) for admission."""
        self.check_fits(len(request.samples))
        self.waiting.append(request)

    def withdraw(self, request: R) -> None:
        """Take a request that was not admitted out of the queue (a no-op otherwise)."""
        if request in self.waiting:
            self.waiting.remove(request)

    def plan(self) -> StepPlan[R]:
        """The next step: cancelled requests out, then as many waiting ones in, in order, as
        the rows left allow (a request that does not fit waits, and so does everyone after
        it: no request is overtaken)."""
        dropped = [r for r in self.running if r.cancelled]
        free = self.max_batch - len(self.running) + len(dropped)
        admitted: list[R] = []
        for request in self.waiting:
            if len(request.samples) > free:
                break
            admitted.append(request)
            free -= len(request.samples)
        del self.waiting[: len(admitted)]
        return StepPlan(dropped, admitted)

    def place(self, request: R) -> int:
        """Give a request (a lead or a fork) the next batch row; returns it."""
        if len(self.running) >= self.max_batch:
            raise RuntimeError("the decode batch is full")
        request.row = len(self.running)
        self.running.append(request)
        return request.row

    def remove(self, request: R) -> int | None:
        """Take a request out of the batch (a no-op when it holds no row). The last row's
        request moves into its row: returns the row it moved from, or None."""
        row = request.row
        if row is None:
            return None
        request.row = None
        last = self.running.pop()
        if last is request:
            return None
        self.running[row] = last
        last.row = row
        return len(self.running)

    def __repr__(self) -> str:
        return f"<Scheduler running={len(self.running)} waiting={len(self.waiting)}>"
