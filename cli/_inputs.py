"""Read the inputs of each request: ``--input key=value`` pairs and ``--inputs-json``.

``--input`` values apply to every request; each JSON object of ``--inputs-json`` (one object,
or JSON lines: one object per line) is one request and its keys override ``--input``.
"""

from __future__ import annotations

import inspect
import json
import sys
from dataclasses import dataclass
from typing import Any

from cli._errors import CliError
from omni import Graph, InputError

__all__ = ["RequestInputs", "build_requests", "parse_assignments", "parse_inputs_json",
           "parse_value", "read_inputs_json", "validate_requests"]

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
            or no object at all.
    """
    if not text.strip():
        raise CliError(f"{label}: no requests (expected a JSON object, or one per line)")
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        if not exc.msg.startswith("Extra data"):  # not several values: one broken document
            raise CliError(f"{label}:{exc.lineno}: invalid JSON: {exc.msg} "
                           f"(column {exc.colno})") from exc
        return _json_lines(text, label)
    except (ValueError, RecursionError) as exc:
        raise _unreadable(label, exc) from None
    return [RequestInputs(_as_object(document, label), label)]


def _json_lines(text: str, label: str) -> list[RequestInputs]:
    requests = []
    # Lines end at "\n" only: JSON strings may hold U+2028, U+0085 and the like, which
    # str.splitlines() would also split at.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{label}:{number}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CliError(f"{where}: invalid JSON: {exc.msg} (column {exc.colno})") from exc
        except (ValueError, RecursionError) as exc:
            raise _unreadable(where, exc) from None
        requests.append(RequestInputs(_as_object(value, where), where))
    return requests


def _unreadable(where: str, exc: Exception) -> CliError:
    """Valid JSON that Python's parser refuses: nested too deeply, or an integer too long."""
    why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc).split(";")[0]
    return CliError(f"{where}: cannot read this JSON: {why}")


def _as_object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        kind = _JSON_TYPES.get(type(value), type(value).__name__)
        raise CliError(f"{where}: expected a JSON object of inputs, got {kind}")
    return value


def read_inputs_json(path: str) -> list[RequestInputs]:
    """Read `path` (``-``: stdin) with `parse_inputs_json`.

    Raises:
        CliError: the file cannot be read, or its content is not valid (see above).
    """
    if path == "-":
        return parse_inputs_json(sys.stdin.read(), "<stdin>")
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except FileNotFoundError:
        raise CliError(f"--inputs-json: no such file: {path}") from None
    except IsADirectoryError:
        raise CliError(f"--inputs-json: not a file: {path}") from None
    except UnicodeDecodeError as exc:
        raise CliError(f"--inputs-json: {path} is not UTF-8 text ({exc.reason})") from exc
    except OSError as exc:
        raise CliError(f"--inputs-json: cannot read {path}: {exc.strerror}") from exc
    return parse_inputs_json(text, path)


def build_requests(assignments: dict[str, Any], inputs_json: str | None) -> list[RequestInputs]:
    """The distinct requests: one per JSON object (merged over `assignments`), or just one."""
    if inputs_json is None:
        return [RequestInputs(dict(assignments))]
    return [RequestInputs({**assignments, **r.values}, r.source)
            for r in read_inputs_json(inputs_json)]


def validate_requests(graph: Graph, requests: list[RequestInputs]) -> None:
    """Check every request's inputs against the graph before anything runs.

    Raises:
        CliError: an unknown input name or a missing required input (with its source).
    """
    for request in requests:
        try:
            graph.plan.bind(request.values)
        except InputError as exc:
            where = f"{request.source}: " if request.source else ""
            names = {i.name for i in graph.inputs}
            unknown = [k for k in request.values if k not in names]
            missing = [i.name for i in graph.inputs if i.name not in request.values
                       and i.default is inspect.Parameter.empty]
            hint = f"; pass it with --input {missing[0]}=VALUE" if missing and not unknown else ""
            raise CliError(f"{where}{exc}{hint}") from exc
