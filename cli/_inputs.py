"""Read the inputs of each request: ``--input key=value`` pairs and ``--inputs-json``.

``--input`` values apply to every request; each JSON object of ``--inputs-json`` (one object,
or JSON lines: one object per line) is one request and its keys override ``--input``.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from cli._errors import CliError
from omni import Graph, InputError

__all__ = ["MAX_DOCUMENT_BYTES", "MAX_LINE_BYTES", "RequestInputs", "Requests",
           "iter_inputs_json", "parse_assignments", "parse_inputs_json", "parse_value"]

MAX_LINE_BYTES = 16 << 20  # one request's inputs, as one JSON line
MAX_DOCUMENT_BYTES = 64 << 20  # one JSON document spanning lines
_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number",
               float: "a number", bool: "a boolean", type(None): "null"}


@dataclass(frozen=True)
class RequestInputs:
    """One request's inputs, and where they came from (``file:line``) for error messages."""

    values: dict[str, Any]
    source: str | None = None


def parse_value(raw: str) -> Any:
    """A ``--input`` value: the JSON value when `raw` is JSON, else `raw` itself.

    ``3`` is the number 3, ``[1, 2]`` a list, ``'"3"'`` the string "3", ``hello`` the string
    "hello". NaN and Infinity stay strings.
    """
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError):  # RecursionError: nested too deeply for JSON here
        return raw


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_assignments(items: list[str]) -> dict[str, Any]:
    """``--input`` items (``key=value``) as a dict; a later key wins.

    Raises:
        CliError: an item has no ``=`` or an empty key.
    """
    values: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise CliError(f"--input {item!r}: expected KEY=VALUE (for example text=hello)")
        if not key.strip():
            raise CliError(f"--input {item!r}: the key before '=' is empty")
        values[key.strip()] = parse_value(raw)
    return values


def parse_inputs_json(text: str, label: str) -> list[RequestInputs]:
    """One JSON object, or JSON lines (blank lines skipped): one `RequestInputs` per object.

    Raises:
        CliError: invalid JSON (naming `label` and the line), a value that is not an object,
            no object at all, or more than the limits allow (see `iter_inputs_json`).
    """
    # Lines end at "\n" only: JSON strings may hold U+2028, U+0085 and the like, which
    # str.splitlines() would also split at.
    return list(_parse_lines(iter(text.split("\n")), label))


def _parse_lines(lines: Iterator[str], label: str) -> Iterator[RequestInputs]:
    """Requests from `lines` (without their "\n"), one at a time: JSON lines when the first
    non-blank line is a JSON value by itself, else one JSON document spanning the lines."""
    seen: list[str] = []
    for line in lines:
        seen.append(line)
        if line.strip():
            break
    else:
        raise CliError(f"{label}: no requests (expected a JSON object, or one per line)")
    where = f"{label}:{len(seen)}"
    try:
        first = json.loads(seen[-1])
    except json.JSONDecodeError:
        yield RequestInputs(_as_object(_document(seen, lines, label), label), label)
        return
    except (ValueError, RecursionError) as exc:
        raise _unreadable(where, exc) from None
    yield RequestInputs(_as_object(first, where), where)
    for number, line in enumerate(lines, start=len(seen) + 1):
        if not line.strip():
            continue
        where = f"{label}:{number}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CliError(f"{where}: invalid JSON: {exc.msg} (column {exc.colno})") from exc
        except (ValueError, RecursionError) as exc:
            raise _unreadable(where, exc) from None
        yield RequestInputs(_as_object(value, where), where)


def _document(seen: list[str], lines: Iterator[str], label: str) -> Any:
    """The one JSON document that `seen` begins and `lines` goes on with (at most
    `MAX_DOCUMENT_BYTES`)."""
    parts, size = list(seen), sum(len(line) + 1 for line in seen)
    for line in lines:
        size += len(line) + 1
        if size > MAX_DOCUMENT_BYTES:
            raise CliError(f"{label}: a JSON document of more than {_mib(MAX_DOCUMENT_BYTES)} "
                           "(put one request per line instead)")
        parts.append(line)
    try:
        return json.loads("\n".join(parts))
    except json.JSONDecodeError as exc:
        raise CliError(f"{label}:{exc.lineno}: invalid JSON: {exc.msg} "
                       f"(column {exc.colno})") from exc
    except (ValueError, RecursionError) as exc:
        raise _unreadable(label, exc) from None


def _mib(n: int) -> str:
    return f"{n >> 20} MiB"


def _unreadable(where: str, exc: Exception) -> CliError:
    """Valid JSON that Python's parser refuses: nested too deeply, or an integer too long."""
    why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc).split(";")[0]
    return CliError(f"{where}: cannot read this JSON: {why}")


def _as_object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        kind = _JSON_TYPES.get(type(value), type(value).__name__)
        raise CliError(f"{where}: expected a JSON object of inputs, got {kind}")
    return value


def iter_inputs_json(path: str) -> Iterator[RequestInputs]:
    """The requests in `path` (``-``: stdin), read and yielded one at a time, so that no more
    than one request's input is held: a line may hold at most `MAX_LINE_BYTES` and one document
    spanning lines `MAX_DOCUMENT_BYTES`, and an endless or binary input (``/dev/zero``,
    ``/dev/urandom``) is refused at once instead of filling memory.

    Raises:
        CliError: the file cannot be read, or its content is not valid (see above).
    """
    if path == "-":
        yield from _parse_lines(_lines(_stdin(), "<stdin>"), "<stdin>")
        return
    try:
        with open(path, "rb") as file:
            yield from _parse_lines(_lines(file, path), path)
    except FileNotFoundError:
        raise CliError(f"--inputs-json: no such file: {path}") from None
    except IsADirectoryError:
        raise CliError(f"--inputs-json: not a file: {path}") from None
    except OSError as exc:
        raise CliError(f"--inputs-json: cannot read {path}: {exc.strerror}") from exc


def _stdin() -> BinaryIO | _Unbuffered:
    """stdin, read from its file descriptor; where it has none (the command invoked inside
    another program that replaced ``sys.stdin``, as click's test runner does), its buffer."""
    try:
        return _Unbuffered(sys.stdin.fileno())
    except (AttributeError, OSError):  # io.UnsupportedOperation is an OSError
        return sys.stdin.buffer


class _Unbuffered:
    """``readline`` over a file descriptor with `os.read`.

    Why not ``sys.stdin.buffer``: a run reads stdin in a worker thread, which may be blocked in
    a read when Ctrl-C or SIGTERM ends the run; a buffered reader holds its lock while it
    waits, and the interpreter, flushing stdin as it exits, then aborts ("could not acquire
    lock ... at interpreter shutdown"). Nothing here holds a lock.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._held = bytearray()
        self._ended = False

    def readline(self, limit: int) -> bytes:
        """The next line with its "\n", or at most `limit` bytes of it; b"" at the end."""
        while True:
            end = self._held.find(b"\n", 0, limit)
            if end >= 0 or len(self._held) >= limit or self._ended:
                size = end + 1 if end >= 0 else min(limit, len(self._held))
                line = bytes(self._held[:size])
                del self._held[:size]
                return line
            chunk = os.read(self._fd, 1 << 16)
            if chunk:
                self._held += chunk
            else:
                self._ended = True


def _lines(file: BinaryIO | _Unbuffered, label: str) -> Iterator[str]:
    """`file`'s lines as text, without their "\n", each checked against the limits."""
    number = 0
    while True:
        raw = file.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        number += 1
        if len(raw) > MAX_LINE_BYTES:
            raise CliError(f"{label}:{number}: a line of more than {_mib(MAX_LINE_BYTES)} (one "
                           f"request's inputs go on one line of at most that)")
        try:
            yield raw.removesuffix(b"\n").decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CliError(f"{label}:{number}: not UTF-8 text ({exc.reason})") from None


class Requests:
    """The inputs of every request of one ``omni run``, each checked and converted against the
    graph (`Graph.convert_inputs`) before it runs, read lazily from ``--inputs-json``.

    - No file: one request of the ``--input`` values (``-n N``: N of it).
    - A file: read once to check every line before anything runs (and to count them), then
      again as the requests run (and again for each cycle of ``-n``); one line held at a time.
    - stdin: checked as it arrives; a bad line ends the run after the requests before it.
      Cycling it (``-n``) holds its requests, at most `MAX_DOCUMENT_BYTES` of them.

    `count`: how many requests will run, or None for stdin (known only when it ends).
    `numbered`: whether output lines need the request's number (more than one, or stdin).
    `blocking`: iterating may wait for input (stdin), so it should not run on an event loop.

    Raises (constructing and iterating):
        CliError: a bad ``--input``, an unreadable file or line, an unknown, missing or
            mistyped input, naming where (``FILE:LINE``) and the input.
    """

    def __init__(self, graph: Graph, items: list[str], inputs_json: str | None,
                 num_requests: int | None) -> None:
        self._graph = graph
        self._assigned = parse_assignments(items)
        # A str input given on the command line keeps its text: `--input text=123` is "123".
        texts = {i.name for i in graph.inputs if i.type is str}
        self._texts = {k: v for k, v in _raw_assignments(items).items() if k in texts}
        self._path = inputs_json
        self._limit = num_requests
        self._held: list[dict[str, Any]] | None = None
        self._stream: Iterator[dict[str, Any]] | None = None
        self.count: int | None
        if inputs_json is None:
            self._held = [self._check(RequestInputs({}))]
            self.count = num_requests or 1
        elif inputs_json != "-":
            lines = 0
            for request in iter_inputs_json(inputs_json):
                self._check(request)
                lines += 1
            self.count = num_requests or lines
        elif num_requests is not None:
            self._held = [self._check(r) for r in _bounded(iter_inputs_json("-"))]
            self.count = num_requests
        else:
            self._stream = (self._check(r) for r in iter_inputs_json("-"))
            self._first = next(self._stream)  # an empty or bad start is refused before a run
            self.count = None
        self.numbered = self.count is None or self.count > 1
        self.blocking = self._stream is not None  # the next request may be a wait away

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._stream is not None:
            yield self._first
            yield from self._stream
            return
        assert self.count is not None
        for index, inputs in enumerate(self._cycle()):
            if index == self.count:
                return
            yield inputs

    def _cycle(self) -> Iterator[dict[str, Any]]:
        while True:
            if self._held is not None:
                yield from self._held
            else:
                assert self._path is not None
                yield from (self._check(r) for r in iter_inputs_json(self._path))

    def _check(self, request: RequestInputs) -> dict[str, Any]:
        values = {**self._assigned, **request.values}
        for name, text in self._texts.items():
            if name not in request.values:
                values[name] = text
        try:
            return self._graph.convert_inputs(values)
        except InputError as exc:
            where = f"{request.source}: " if request.source else ""
            missing = [i.name for i in self._graph.inputs if i.name not in values
                       and i.default is inspect.Parameter.empty]
            unknown = [k for k in values if k not in {i.name for i in self._graph.inputs}]
            hint = f"; pass it with --input {missing[0]}=VALUE" if missing and not unknown else ""
            raise CliError(f"{where}{exc}{hint}") from None


def _raw_assignments(items: list[str]) -> dict[str, str]:
    """``--input`` items as the text after ``=`` (a later key wins); see `parse_assignments`."""
    return {key.strip(): raw for key, _, raw in (i.partition("=") for i in items)}


def _bounded(requests: Iterator[RequestInputs]) -> list[RequestInputs]:
    """The requests from stdin, held to be cycled: at most `MAX_DOCUMENT_BYTES` of JSON."""
    held, size = [], 0
    for request in requests:
        held.append(request)
        size += len(json.dumps(request.values))
        if size > MAX_DOCUMENT_BYTES:
            raise CliError(f"--requests with --inputs-json -: more than "
                           f"{_mib(MAX_DOCUMENT_BYTES)} of requests on stdin to cycle through "
                           "(put them in a file)")
    return held
