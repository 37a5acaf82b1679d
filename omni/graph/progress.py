"""How far long node calls have come: the steps they report (`omni.Context.progress`), as a
runtime's ``/metrics`` shows them.

Why: a denoising loop of 50 steps runs for seconds to minutes inside one node call; an
operator watching a server should see that work move (steps done per node, steps left in the
calls running), not only a request in flight. A node reports after each step, often from a
worker thread (where its loop runs), so the record is locked. A call's record goes once it
reports its last step, or when its request ends (a call cut short reports no last step).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

__all__ = ["Progress"]

Sample = tuple[str, str, str, dict[str, Any], float]


class Progress:
    """The steps reported by the node calls of one process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[tuple[str, str | None], tuple[int, int]] = {}  # -> (done, total)
        self._done: Counter[str] = Counter()  # steps done, by node

    def note(self, node: str, request_id: str | None, done: int, total: int) -> None:
        """Call (`node`, `request_id`) has done `done` of its `total` steps.

        Raises:
            ValueError: not ints with 0 <= done <= total and total >= 1.
        """
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (done, total)) or \
                not 0 <= done <= total or total < 1:
            raise ValueError(f"progress is 0 <= done <= total steps (ints, total >= 1), got "
                             f"done={done!r}, total={total!r}")
        key = (node, request_id)
        with self._lock:
            before, _ = self._running.get(key, (0, total))
            self._done[node] += max(0, done - before)
            if done >= total:
                self._running.pop(key, None)
            else:
                self._running[key] = (done, total)

    def forget(self, request_id: str) -> None:
        """Drop the records of request `request_id`'s calls (and of its run again, if any):
        it has ended. On every request's path: nothing to do (no call reported steps) costs
        one look."""
        if not self._running:
            return
        with self._lock:
            for key in [k for k in self._running
                        if k[1] == request_id or (k[1] or "").startswith(request_id + "-")]:
                del self._running[key]

    def samples(self) -> list[Sample]:
        """``omni_node_steps_total`` (counter) and ``omni_node_steps_remaining`` and
        ``omni_node_calls_stepping`` (gauges), per node that ever reported."""
        with self._lock:
            remaining: Counter[str] = Counter()
            calls: Counter[str] = Counter()
            for (node, _), (done, total) in self._running.items():
                remaining[node] += total - done
                calls[node] += 1
            nodes = sorted(self._done.keys() | remaining.keys())
            done_by_node = dict(self._done)
        out: list[Sample] = []
        for node in nodes:
            labels = {"node": node}
            out.append(("omni_node_steps_total", "counter",
                        "Steps node calls reported done (omni.Context.progress).", labels,
                        done_by_node.get(node, 0)))
            out.append(("omni_node_steps_remaining", "gauge",
                        "Steps left in the node calls now running that report steps.",
                        labels, remaining[node]))
            out.append(("omni_node_calls_stepping", "gauge",
                        "Node calls now running that report steps.", labels, calls[node]))
        return out
