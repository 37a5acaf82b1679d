"""Hostile input from files and the command line: ``--inputs-json`` text and files, ``--input``
assignments and the requests built from them, and page keys or store ids that try path
traversal on the disk tier. Each is read as given or refused with a one-line `CliError` (or
`ValueError`), never a traceback and never a file outside the store's own folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import omni
from cli._errors import CliError
from cli._inputs import (
    Requests,
    iter_inputs_json,
    parse_assignments,
    parse_inputs_json,
    parse_value,
)
from omni._shm import Segment
from omni.kv.tiers.disk import DiskTier
from tests.reliability._support import LAYOUT, Tally, check_pages, fuzz, make_store, page_of

# Characters that trip line splitting, quoting and escaping.
TRICKY = st.sampled_from(list("\u2028\u2029\x85\x0b\x0c\x1c\x1d\x1e\r\n\t\"\\{}[]=:,\x00\ufeff"))
TEXT = st.text(st.one_of(st.characters(), TRICKY), max_size=40)
JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), TEXT,
                              st.floats(allow_nan=False, allow_infinity=False)),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(TEXT, inner, max_size=4), max_leaves=12)
HOSTILE = ["[" * 20_000, '{"a": ' + "[" * 20_000, '{"a": ' + "1" * 5000 + "}",
           '{"a": 1}\n{"b": ' + "9" * 5000 + "}", '{"a": 1}\n' + "[" * 20_000, "\ufeff{}",
           '{"a": NaN}', "\x00", "null", "[]", '"text"', "{}{}", '{"a": "\u2028"}\n{}']


def test_inputs_json_is_read_as_given_or_refused_in_one_line(tmp_path, record):
    tally = Tally()

    @fuzz(200)
    @given(st.lists(st.dictionaries(TEXT, JSON, max_size=4), min_size=1, max_size=5),
           st.booleans())
    def round_trip(objects, indent_first):
        lines = [json.dumps(o, ensure_ascii=False) for o in objects]
        if indent_first and len(objects) == 1:
            lines = [json.dumps(objects[0], ensure_ascii=False, indent=2)]
        requests = parse_inputs_json("\n".join(lines) + "\n", "in.jsonl")
        assert [r.values for r in requests] == objects
        tally("read")

    @fuzz(300)
    @given(st.one_of(TEXT, st.sampled_from(HOSTILE),
                     st.lists(TEXT, max_size=4).map("\n".join)))
    def anything(text):
        try:
            requests = parse_inputs_json(text, "in.jsonl")
        except CliError as exc:
            assert exc.message.startswith("in.jsonl")  # names where
            tally("refused")
            return
        assert requests and all(isinstance(r.values, dict) for r in requests)
        tally("read")

    @fuzz(100)
    @given(st.binary(max_size=200) | st.sampled_from([h.encode() for h in HOSTILE]))
    def files(data):
        path = tmp_path / "requests.jsonl"
        path.write_bytes(data)
        try:
            list(iter_inputs_json(str(path)))
            tally("read")
        except CliError:
            tally("refused")

    round_trip()
    anything()
    files()
    for text in HOSTILE:  # the known-bad ones, each once for sure
        try:
            parse_inputs_json(text, "x")
            tally("read")
        except CliError:
            tally("refused")
    tries = tally["read"] + tally["refused"]
    record("input.inputs_json", tries=tries,
           outcome=f"{tally['read']} read exactly as written (JSON lines with U+2028 and the "
                   f"like included), {tally['refused']} refused with a one-line error naming "
                   "the line (deep nesting and 5000-digit numbers too)")


def _limited_memory() -> None:
    """In the child: at most 3 GiB of data, so that a reader that slurps an endless input
    fails there instead of taking the machine's memory."""
    import resource

    resource.setrlimit(resource.RLIMIT_DATA, (3 << 30, 3 << 30))


@pytest.mark.proc  # the OS's endless and binary files, read under a real memory limit
def test_an_endless_or_binary_inputs_file_is_refused_at_once(tmp_path, record):
    """``--inputs-json /dev/zero`` (no line end, ever), ``/dev/urandom`` (binary) and a line
    of more than 16 MiB on stdin: each one line naming where, exit 2, nothing run."""
    root = Path(__file__).resolve().parents[2]
    graph = tmp_path / "g.py"
    graph.write_text("import omni\n\n@omni.node\nasync def echo(text: str) -> str:\n"
                     "    return text\n\n@omni.graph\ndef g(text: str):\n"
                     "    return echo(text)\n")
    long_line = b'{"text": "' + b"a" * (17 << 20) + b'"}\n'
    cases = [("/dev/zero", None, "/dev/zero:1: a line of more than 16 MiB"),
             ("/dev/urandom", None, "/dev/urandom:"),
             ("-", long_line, "<stdin>:1: a line of more than 16 MiB")]
    for path, stdin, expected in cases:
        done = subprocess.run([sys.executable, "-m", "cli", "run", str(graph),
                               "--inputs-json", path], input=stdin, cwd=root,
                              capture_output=True, timeout=120, preexec_fn=_limited_memory)
        err = done.stderr.decode(errors="replace").strip().splitlines()
        assert done.returncode == 2 and len(err) == 1, (path, done.returncode, err[-3:])
        assert err[0].startswith(f"error: {expected}"), err
        assert done.stdout == b""
    record("input.endless", tries=len(cases),
           outcome="3/3 refused in one line naming the input and line, exit 2, nothing run, "
                   "under a 3 GiB data limit: /dev/zero (a line past 16 MiB), /dev/urandom "
                   "(not UTF-8), a 17 MiB line on stdin")


@omni.node
async def greet(text: str, mode: str = "greet") -> str:
    return f"{mode}: {text}"


@omni.graph
def hello(text: str, mode: str = "greet"):
    return greet(text, mode)


def test_input_assignments_and_requests_are_built_or_refused(tmp_path, record):
    tally = Tally()
    name = st.sampled_from(["text", "mode", " text ", "mode\t", "text", "other"]) | TEXT
    item = st.tuples(name, st.sampled_from(["=", "=", "=", "", "=="]),
                     TEXT | JSON.map(json.dumps)).map("".join)

    @fuzz(300)
    @given(st.lists(item, max_size=4), st.none() | st.lists(st.dictionaries(
        st.sampled_from(["text", "mode", "text", "mode", "other"]) | TEXT, JSON, max_size=2),
        max_size=3))
    def build(items, lines):
        try:
            assignments = parse_assignments(items)
        except CliError:
            assert any("=" not in i or not i.partition("=")[0].strip() for i in items)
            tally("refused")
            return
        for raw in items:  # a later key wins; values are JSON when they parse
            key, _, value = raw.partition("=")
            last = [i for i in items if i.partition("=")[0].strip() == key.strip()][-1]
            if last == raw:
                assert assignments[key.strip()] == parse_value(value)
        path = None
        if lines is not None:
            path = tmp_path / "in.jsonl"
            path.write_text("".join(json.dumps(o) + "\n" for o in lines) or "\n")
        try:
            requests = list(Requests(hello, items, None if path is None else str(path), None))
        except CliError:
            tally("refused")
            return
        for values in requests:  # what was accepted runs, with the types the graph declares
            hello.plan.bind(values)
            assert all(isinstance(v, str) for v in values.values())
        tally("built")

    build()
    tries = tally["built"] + tally["refused"]
    record("input.assignments", tries=tries,
           outcome=f"{tally['built']} built into requests the graph accepts, "
                   f"{tally['refused']} refused with a one-line CliError (no '=', an empty "
                   "key, unknown or missing inputs, a value not of the annotated type)")


TRAVERSAL = st.binary(min_size=16, max_size=16) | st.lists(
    st.sampled_from([b".", b"/", b"\\", b"\x00", b"..", b"../", b"~", b"%2e", b"\xff"]),
    min_size=8, max_size=16).map(lambda parts: (b"".join(parts) * 2)[:16].ljust(16, b"."))


def test_page_keys_and_store_ids_cannot_leave_the_store_folder(tmp_path, record):
    tally = Tally()
    root = tmp_path / "kv"
    with make_store(device=1, disk=64, path=root) as store:
        folder = store._tiers[-1].directory

        @fuzz(200)
        @given(st.lists(TRAVERSAL, min_size=1, max_size=4, unique=True))
        def keys_as_paths(keys):
            for key in keys:  # through the disk tier: each put pushes the last one to disk
                store.put([key], page_of(key).unsqueeze(0))
            for key in keys:
                with store.acquire([key]) as lease:
                    check_pages([key], lease.pages())
            tally("key", len(keys))

        keys_as_paths()
        made = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
        assert made == ["kv", str(folder.relative_to(tmp_path)),
                        str((folder / "pages.bin").relative_to(tmp_path))]
    for bad in ["../../../tmp/x", "..", "/etc", "a" * 33, "0123456789abcdeg", "../0123456789ab",
                "0123456789abcdef/..", ""]:
        with pytest.raises(ValueError):
            DiskTier.create(LAYOUT, 1, root, bad)
        with pytest.raises(ValueError):
            Segment.create(f"omni-{bad}-host", 4096)
        tally("id")
    assert sorted(os.listdir(tmp_path)) == ["kv"] and not any(Path(root).iterdir())
    record("input.key_traversal", tries=tally["key"] + tally["id"],
           outcome=f"{tally['key']} keys of '../', '/', NUL and the like stored and served "
                   f"as data in the one page file; {tally['id']} store ids refused "
                   "(ValueError); no other file made")
