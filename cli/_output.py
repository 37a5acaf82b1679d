"""Print request results on stdout: as they are produced for people, or as JSON lines.

`HumanPrinter` prints each output when it arrives (stream items one per line); `JsonPrinter`
prints exactly one JSON object per request, in request order (values as
`omni.graph.jsonable.to_jsonable` writes them).
"""

from __future__ import annotations

import json
import sys
from typing import Any, Protocol, TextIO

from omni import Graph, NodeError, Ref
from omni.errors import summary
from omni.graph.jsonable import to_jsonable

__all__ = ["FLUSH_INTERVAL", "HumanPrinter", "JsonPrinter", "Printer", "describe_cause",
           "error_record", "human", "write_line"]


FLUSH_INTERVAL = 0.05  # seconds a printed line may wait in the buffer (see HumanPrinter)


def write_line(line: str, out: TextIO | None = None) -> None:
    """Write one line to `out` (default: stdout, looked up on each call) and flush it."""
    out = out or sys.stdout
    out.write(line + "\n")
    out.flush()


def human(value: Any) -> str:
    """How a value reads on a terminal: strings as they are, containers as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(to_jsonable(value), ensure_ascii=False)
    return str(value)


def describe_cause(error: NodeError) -> str:
    """``Type: message`` of the exception that failed the node."""
    return summary(error.cause)


def error_record(error: NodeError) -> dict[str, Any]:
    """The ``{"error": ...}`` object printed for a failed request in ``--json`` mode."""
    return {"error": {"node": error.node, "request_id": error.request_id,
                      "message": describe_cause(error)}}


class Printer(Protocol):
    """Receives results as requests run. `streams`: the printer wants items as they are
    produced (`item`); otherwise it gets each request's outputs at once (`result`)."""

    streams: bool

    def item(self, index: int, name: str, value: Any) -> None: ...

    def result(self, index: int, outputs: dict[str, Any]) -> None: ...

    def failure(self, index: int, error: NodeError) -> None: ...

    def flush(self) -> None: ...


class HumanPrinter:
    """Readable output as it arrives: the value alone for a single-output graph, ``name: value``
    lines for dict outputs, ``[n] `` before each line when several requests run.

    Lines are held and written together at most `FLUSH_INTERVAL` seconds later (the runner
    calls `flush` on that beat, and at the end), or once `BUFFER_BYTES` of them wait: a write
    and a flush per line made a stream of millions of small items spend most of its time in
    system calls (every line was one with ``PYTHONUNBUFFERED`` set), while a reader watching the
    terminal sees no difference.
    """

    streams = True
    BUFFER_BYTES = 1 << 16

    def __init__(self, graph: Graph, numbered: bool, out: TextIO | None = None):
        self._named = not isinstance(graph.output, Ref)
        self._numbered = numbered
        self._out = out
        self._held: list[str] = []
        self._held_chars = 0
        self._last: tuple[int, str] | None = None
        self._head = ""

    def item(self, index: int, name: str, value: Any) -> None:
        """Print one output value or stream item of request `index` (0-based)."""
        key = (index, name)
        if key != self._last:  # the line's head, made once per run of one output's items
            prefix = f"[{index + 1}] " if self._numbered else ""
            self._head = f"{prefix}{name}: " if self._named else prefix
            self._last = key
        kind = type(value)  # the common kinds first: `human` asks several isinstance questions
        text = value if kind is str else str(value) if kind is int or kind is float \
            else human(value)
        line = f"{self._head}{text}\n"
        self._held.append(line)
        self._held_chars += len(line)
        if self._held_chars >= self.BUFFER_BYTES:
            self.flush()

    def flush(self) -> None:
        """Write and flush the lines held since the last flush."""
        if self._held:
            out = self._out or sys.stdout
            out.write("".join(self._held))
            out.flush()
            self._held.clear()
            self._held_chars = 0

    def result(self, index: int, outputs: dict[str, Any]) -> None:
        """Not used: a streaming printer gets items."""

    def failure(self, index: int, error: NodeError) -> None:
        """Nothing on stdout: the failure line goes to stderr."""


class JsonPrinter:
    """One JSON object per request on stdout, in request order: the outputs (streams as lists;
    a single-output graph as ``{"output": value}``) or ``{"error": {...}}``.

    Why a buffer: with ``--concurrency`` requests finish out of order; a result waits in
    `_done` until every earlier request has been printed, so line i answers request i.
    """

    streams = False

    def __init__(self, out: TextIO | None = None) -> None:
        self._out = out
        self._done: dict[int, str] = {}
        self._next = 0

    def item(self, index: int, name: str, value: Any) -> None:
        """Not used: this printer gets whole results."""

    def result(self, index: int, outputs: dict[str, Any]) -> None:
        """Print (or hold back) the outputs of request `index`."""
        self._ready(index, json.dumps(to_jsonable(outputs), ensure_ascii=False))

    def failure(self, index: int, error: NodeError) -> None:
        """Print (or hold back) the error object of request `index`."""
        self._ready(index, json.dumps(to_jsonable(error_record(error)), ensure_ascii=False))

    def flush(self) -> None:
        """Nothing to do: each line is flushed when written (one per request)."""

    def _ready(self, index: int, line: str) -> None:
        self._done[index] = line
        while self._next in self._done:
            write_line(self._done.pop(self._next), self._out)
            self._next += 1
