"""`Parked`: one result that one task waits for and another hands over.

Why not a `trio.Event`: on the hot path of every call, an event per result costs measurably
more than parking the waiting task with trio's low-level primitives, which is all it needs.
"""

from __future__ import annotations

from typing import Any

import trio

__all__ = ["Parked"]


class Parked:
    """A result not in yet: `wait` parks the caller until `resolve` (from any task of the same
    run); the first resolution wins. Subclasses add the fields the result is made of."""

    __slots__ = ("done", "task")

    def __init__(self) -> None:
        self.done = False
        self.task: trio.lowlevel.Task | None = None  # the waiter, while it is parked

    def resolve(self) -> None:
        self.done = True
        if self.task is not None:
            task, self.task = self.task, None
            trio.lowlevel.reschedule(task)

    async def wait(self) -> None:
        """Until resolved, or cancelled (then `done` stays False)."""
        if self.done:
            await trio.lowlevel.checkpoint()
            return
        self.task = trio.lowlevel.current_task()

        def abort(_: Any) -> trio.lowlevel.Abort:
            self.task = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)
