"""The engine's scheduler on its own: admission order, batch rows, cancelled requests; what
the scheduler and the runner may import."""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass, field

import pytest

import omni.compute.runner as runner_module
import omni.compute.scheduler as scheduler_module
from omni.compute.scheduler import Scheduler


@dataclass(eq=False)
class Req:
    name: str
    forks: list[Req] = field(default_factory=list)
    row: int | None = None
    cancelled: bool = False

    @property
    def samples(self) -> list[Req]:
        return [self, *self.forks]


def request(name: str, n: int = 1) -> Req:
    return Req(name, [Req(f"{name}.{i}") for i in range(1, n)])


def admit(scheduler: Scheduler[Req]) -> list[str]:
    """Plan a step and place what it admits, as the runner does; returns the names."""
    plan = scheduler.plan()
    for r in plan.dropped:
        scheduler.remove(r)
    for r in plan.prefill:
        for sample in r.samples:
            scheduler.place(sample)
    return [r.name for r in plan.prefill]


def test_requests_are_admitted_in_arrival_order_while_rows_are_free() -> None:
    scheduler: Scheduler[Req] = Scheduler(max_batch=3)
    for name in "abcd":
        scheduler.submit(request(name))
    assert admit(scheduler) == ["a", "b", "c"]
    assert [r.name for r in scheduler.waiting] == ["d"]
    assert [(r.name, r.row) for r in scheduler.running] == [("a", 0), ("b", 1), ("c", 2)]
    assert admit(scheduler) == []  # the batch is full: d waits


def test_a_request_of_n_samples_takes_n_rows_and_is_never_overtaken() -> None:
    scheduler: Scheduler[Req] = Scheduler(max_batch=4)
    scheduler.submit(request("a", n=2))
    scheduler.submit(request("b", n=3))  # does not fit beside a
    scheduler.submit(request("c"))  # would fit, but b came first
    assert admit(scheduler) == ["a"]
    assert [r.name for r in scheduler.running] == ["a", "a.1"]
    assert [r.name for r in scheduler.waiting] == ["b", "c"]


def test_a_leaving_request_gives_its_row_to_the_last_one() -> None:
    scheduler: Scheduler[Req] = Scheduler(max_batch=4)
    for name in "abc":
        scheduler.submit(request(name))
    admit(scheduler)
    a, b, c = scheduler.running
    assert scheduler.remove(a) == 2  # c moved from row 2 into row 0
    assert (c.row, b.row, a.row) == (0, 1, None)
    assert scheduler.running == [c, b]
    assert scheduler.remove(b) is None  # the last row: nothing moves
    assert scheduler.remove(b) is None and scheduler.running == [c]  # twice: a no-op


def test_cancelled_running_requests_leave_first_and_their_rows_admit_others() -> None:
    scheduler: Scheduler[Req] = Scheduler(max_batch=2)
    for name in "abc":
        scheduler.submit(request(name))
    admit(scheduler)
    scheduler.running[0].cancelled = True
    plan = scheduler.plan()
    assert [r.name for r in plan.dropped] == ["a"] and [r.name for r in plan.prefill] == ["c"]


def test_a_withdrawn_request_is_never_admitted() -> None:
    scheduler: Scheduler[Req] = Scheduler(max_batch=2)
    a, b = request("a"), request("b")
    scheduler.submit(a)
    scheduler.submit(b)
    scheduler.withdraw(a)
    scheduler.withdraw(a)  # twice: a no-op
    assert admit(scheduler) == ["b"]


def test_more_samples_than_rows_are_refused_at_submission() -> None:
    scheduler: Scheduler[Req] = Scheduler(max_batch=2)
    with pytest.raises(ValueError, match="n=3 samples need 3 batch rows; this engine decodes "
                                         "2 at most"):
        scheduler.submit(request("a", n=3))
    assert scheduler.waiting == []
    with pytest.raises(RuntimeError, match="full"):
        for name in "xyz":
            scheduler.place(request(name))


def imports_of(module: object) -> set[str]:
    tree = ast.parse(inspect.getsource(module))
    imported = {alias.name for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    return imported | {node.module or "" for node in ast.walk(tree)
                       if isinstance(node, ast.ImportFrom)}


def test_the_scheduler_imports_neither_torch_nor_trio_and_the_runner_no_trio() -> None:
    assert imports_of(scheduler_module) <= {"__future__", "collections.abc", "dataclasses",
                                            "typing"}
    assert not {name for name in imports_of(runner_module) if name.split(".")[0] == "trio"}
