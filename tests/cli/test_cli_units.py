"""The CLI's pieces in process: input parsing, JSON conversion, printers, stats, loading."""

from __future__ import annotations

import dataclasses
import io
import math
import sys
import textwrap
import types
from pathlib import Path

import pytest

import omni
from cli._errors import CliError
from cli._inputs import parse_assignments, parse_inputs_json, parse_value
from cli._load import load_module, select_graph
from cli._output import JsonPrinter, human
from cli._report import Outcome, percentile, summary_line
from omni.graph.jsonable import to_jsonable


@pytest.mark.parametrize(("raw", "value"), [
    ("3", 3), ("2.5", 2.5), ("true", True), ("null", None), ("[1, 2]", [1, 2]),
    ('{"k": 1}', {"k": 1}), ('"3"', "3"), ("hello", "hello"), ("", ""), ("NaN", "NaN"),
    ("Infinity", "Infinity"), ("{not json", "{not json"),
])
def test_parse_value_is_json_when_it_parses(raw: str, value: object) -> None:
    assert parse_value(raw) == value


def test_parse_assignments() -> None:
    assert parse_assignments(["a=1", "b = x=y", "a=2"]) == {"a": 2, "b": " x=y"}
    with pytest.raises(CliError, match="expected KEY=VALUE"):
        parse_assignments(["novalue"])


def test_inputs_json_one_object_spanning_lines() -> None:
    [request] = parse_inputs_json('{\n  "a": 1,\n  "b": [1,\n 2]\n}\n', "in.json")
    assert request.values == {"a": 1, "b": [1, 2]} and request.source == "in.json"


def test_inputs_json_lines_skip_blanks_and_name_lines() -> None:
    requests = parse_inputs_json('\n{"a": 1}\n   \n{"a": 2}\n', "r.jsonl")
    assert [(r.values, r.source) for r in requests] == [({"a": 1}, "r.jsonl:2"),
                                                        ({"a": 2}, "r.jsonl:4")]


@pytest.mark.parametrize(("text", "message"), [
    ('{"a": 1}\n{"a": 2,}\n', "r.jsonl:2: invalid JSON"),
    ('{\n  "a": 1,\n  "b": oops\n}', "r.jsonl:3: invalid JSON"),
    ('{"a": 1}\n"text"\n', "r.jsonl:2: expected a JSON object of inputs, got a string"),
    ("   \n", "r.jsonl: no requests"),
])
def test_inputs_json_errors_name_the_line(text: str, message: str) -> None:
    with pytest.raises(CliError, match=message):
        parse_inputs_json(text, "r.jsonl")


@dataclasses.dataclass
class Point:
    x: int
    tags: tuple[str, ...]


def test_to_jsonable() -> None:
    value = {"b": b"\x00\xff", 1: {2.5}, "p": Point(1, ("a",)), "nan": math.nan,
             "inf": -math.inf, "t": (1, None), "o": object}
    assert to_jsonable(value) == {"b": "AP8=", "1": [2.5], "p": {"x": 1, "tags": ["a"]},
                                  "nan": "nan", "inf": "-inf", "t": [1, None],
                                  "o": "<class 'object'>"}


def test_to_jsonable_numpy_without_importing_it_in_cli() -> None:
    np = pytest.importorskip("numpy")
    assert to_jsonable({"a": np.arange(4).reshape(2, 2), "s": np.float32(0.5)}) == {
        "a": [[0, 1], [2, 3]], "s": 0.5}


def test_human_formats() -> None:
    assert human("text") == "text"
    assert human({"a": [1, "é"]}) == '{"a": [1, "é"]}'
    assert human(3.5) == "3.5"


def test_json_printer_keeps_request_order() -> None:
    """Results finishing out of order are held back until the earlier ones are printed."""
    out = io.StringIO()
    printer = JsonPrinter(out)
    printer.result(2, {"v": 2})
    printer.result(1, {"v": 1})
    assert out.getvalue() == ""
    printer.result(0, {"v": 0})
    assert out.getvalue().splitlines() == ['{"v": 0}', '{"v": 1}', '{"v": 2}']


def test_percentile_and_summary() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 99), percentile([], 50)) == (
        50.0, 99.0, 0.0)
    outcome = Outcome(latencies=[0.001, 0.003], num_failed=1, elapsed=0.5)
    line = summary_line(outcome, 2)
    assert line.startswith("summary: requests=2 failures=1 concurrency=2 ")
    assert "throughput=4.0 req/s" in line and "p50=1.00 ms" in line and "p99=3.00 ms" in line


def _graph_module(name: str, **values: object) -> types.ModuleType:
    module = types.ModuleType(name)
    vars(module).update(values)
    return module


@omni.node
async def twice(text: str) -> str:
    return text * 2


def test_select_prefers_graphs_defined_in_the_file() -> None:
    own = omni.graph(lambda text: twice(text), name="own")
    own.__module__ = "user_file"
    imported = omni.Graph.of(twice)
    module = _graph_module("user_file", own=own, imported=imported, twice=twice)
    assert select_graph(module, None, "f.py") is own
    assert select_graph(module, "imported", "f.py") is imported
    assert select_graph(module, "twice", "f.py").name == "twice"


def test_files_with_the_same_name_load_as_different_modules(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_module adds each file's folder
    for folder, word in (("one", "first"), ("two", "second")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "pipeline.py").write_text(textwrap.dedent(f"""
            WORD = {word!r}
        """))
    first = load_module(str(tmp_path / "one" / "pipeline.py"))
    second = load_module(str(tmp_path / "two" / "pipeline.py"))
    assert (first.WORD, second.WORD) == ("first", "second")
    assert first.__name__ != second.__name__
