"""``omni run`` end to end: outputs, inputs, many requests, failures (real subprocesses)."""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests._cli import cli_env

Cli = Callable[..., subprocess.CompletedProcess[str]]

HELLO = "examples/hello.py"


def json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines()]


def test_hello_prints_outputs_as_they_are_produced(omni_cli: Cli) -> None:
    """Dict outputs print as `name: value`; a streaming output prints one item per line."""
    result = omni_cli("run", HELLO, "--input", "text=omni runs pipelines")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "reply: OMNI RUNS PIPELINES!" in lines
    assert [line for line in lines if line.startswith("words: ")] == [
        "words: omni", "words: runs", "words: pipelines"]
    assert any(line.startswith("greeting: hello from replica") for line in lines)
    assert result.stderr == ""


def test_hello_json_collects_the_stream(omni_cli: Cli, tmp_path: Path) -> None:
    """--json prints one object; the streaming output is a list. Works from another cwd."""
    hello = Path(__file__).resolve().parents[2] / HELLO
    result = omni_cli("run", str(hello), "--input", "text=a b c d", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    [outputs] = json_lines(result.stdout)
    assert outputs["reply"] == "A (+3 words)"
    assert outputs["words"] == ["a", "b", "c", "d"]
    assert outputs["greeting"].startswith("hello from replica")


def test_input_values_are_json_when_they_parse(omni_cli: Cli, graphs: Path) -> None:
    """`3` is a number, `[1, 2]` a list, `"3"` a string, and anything else the raw text."""
    result = omni_cli("run", "echo.py", "-i", "a=3", "-i", "b=[1, 2]", "-i", 'c="3"', "--json",
                      cwd=graphs)
    assert result.returncode == 0, result.stderr
    assert json_lines(result.stdout) == [{"packed": {"a": 3, "b": [1, 2], "c": "3"}}]
    result = omni_cli("run", "echo.py", "-i", "a=hello world", "-i", "b=x=y", "-i", "c=",
                      "--json", cwd=graphs)
    assert json_lines(result.stdout) == [{"packed": {"a": "hello world", "b": "x=y", "c": ""}}]


def test_inputs_json_lines_file(omni_cli: Cli, graphs: Path) -> None:
    """Each JSON line is a request (blank lines skipped); its keys override --input."""
    (graphs / "reqs.jsonl").write_text('{"a": 1}\n\n{"a": 2, "b": "own"}\n{"a": [3]}\n')
    result = omni_cli("run", "echo.py", "--inputs-json", "reqs.jsonl", "-i", "b=shared",
                      "--json", cwd=graphs)
    assert result.returncode == 0, result.stderr
    assert [o["packed"] for o in json_lines(result.stdout)] == [
        {"a": 1, "b": "shared", "c": None}, {"a": 2, "b": "own", "c": None},
        {"a": [3], "b": "shared", "c": None}]


def test_inputs_json_from_stdin_as_one_object(omni_cli: Cli, graphs: Path) -> None:
    """`-` reads stdin; a single (pretty-printed) JSON object is one request."""
    result = omni_cli("run", "echo.py", "--inputs-json", "-", "--json", cwd=graphs,
                      stdin='{\n  "a": "x",\n  "c": {"k": true}\n}\n')
    assert result.returncode == 0, result.stderr
    assert json_lines(result.stdout) == [{"packed": {"a": "x", "b": None, "c": {"k": True}}}]


def test_human_output_numbers_requests(omni_cli: Cli, graphs: Path) -> None:
    """With several requests each line starts with the request number; a single output
    graph prints the bare value."""
    result = omni_cli("run", "fail.py", "--inputs-json", "-", cwd=graphs,
                      stdin='{"text": "a"}\n{"text": "b"}\n')
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[1] ok:a", "[2] ok:b"]


def test_requests_and_concurrency_print_a_summary(omni_cli: Cli, graphs: Path) -> None:
    """N requests cycle through the input lines; --json prints exactly N lines in request
    order; stderr ends with the summary."""
    result = omni_cli("run", "echo.py", "--inputs-json", "-", "--requests", "7",
                      "--concurrency", "3", "--json", cwd=graphs,
                      stdin='{"a": 0}\n{"a": 1}\n')
    assert result.returncode == 0, result.stderr
    outputs = json_lines(result.stdout)
    assert [o["packed"]["a"] for o in outputs] == [0, 1, 0, 1, 0, 1, 0]
    summary = result.stderr.strip().splitlines()[-1]
    for field in ("requests=7", "failures=0", "concurrency=3", "throughput=", "p50=", "p99="):
        assert field in summary
    assert "req/s" in summary and "ms" in summary
    assert "7/7" in result.stderr  # the progress bar's final state (stderr is not a tty)


def test_summary_only_with_the_load_flags(omni_cli: Cli, graphs: Path) -> None:
    """A single request without --requests/--concurrency writes nothing on stderr."""
    result = omni_cli("run", "two.py", "first", "-i", "text=hi", cwd=graphs)
    assert (result.returncode, result.stdout, result.stderr) == (0, "HI!\n", "")


def test_streaming_single_output_graph(omni_cli: Cli, graphs: Path) -> None:
    """A single streaming output prints one item per line, or a list with --json."""
    result = omni_cli("run", "two.py", "second", "-i", "text=abc", cwd=graphs)
    assert result.stdout.splitlines() == ["a", "b", "c"]
    result = omni_cli("run", "two.py", "second", "-i", "text=abc", "--json", cwd=graphs)
    assert json_lines(result.stdout) == [{"output": ["a", "b", "c"]}]


PAUSING_STREAM = """
import os, trio
from collections.abc import AsyncIterator
import omni

@omni.node
async def ticks(gate: str) -> AsyncIterator[str]:
    yield "first"
    while not os.path.exists(gate):  # pauses until the reader has seen "first"
        await trio.sleep(0.01)
    yield "second"

@omni.graph
def main(gate: str):
    return ticks(gate)
"""


@pytest.mark.proc
def test_a_line_is_seen_while_the_stream_pauses(tmp_path: Path) -> None:
    """Text output is buffered for speed, yet a line printed before a pause reaches the reader
    during the pause: the stream only goes on once the reader has seen its first item."""
    (tmp_path / "pausing.py").write_text(PAUSING_STREAM)
    gate = tmp_path / "gate"
    proc = subprocess.Popen([sys.executable, "-m", "cli", "run", "pausing.py", "-i",
                             f"gate={gate}"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=cli_env())
    try:
        assert proc.stdout is not None
        seen, _, _ = select.select([proc.stdout], [], [], 60)  # no gate yet: it pauses
        assert seen, "the first line did not arrive while the stream paused"
        assert proc.stdout.readline() == "first\n"
        gate.touch()
        rest, errors = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert (proc.returncode, rest, errors) == (0, "second\n", "")


TYPED = """
import dataclasses
import omni

@dataclasses.dataclass
class Turn:
    text: str
    repeat: int = 1

@omni.node
async def say(turn: Turn, label: str, scale: float) -> str:
    return f"{type(turn).__name__} {turn.text * turn.repeat} {label!r} {scale!r}"

@omni.graph
def typed(turn: Turn, label: str, scale: float = 1.0):
    return say(turn, label, scale)
"""


def test_inputs_arrive_as_the_annotated_types(omni_cli: Cli, tmp_path: Path) -> None:
    """A JSON object becomes the dataclass the graph declares, 2 a float where a float is
    expected, and a str input given on the command line keeps its text (123 is "123")."""
    (tmp_path / "typed.py").write_text(TYPED)
    result = omni_cli("run", "typed.py", "-i", 'turn={"text": "ab", "repeat": 2}',
                      "-i", "label=123", "-i", "scale=2", cwd=tmp_path)
    assert (result.returncode, result.stdout, result.stderr) == (0, "Turn abab '123' 2.0\n", "")
    (tmp_path / "in.jsonl").write_text('{"turn": {"text": "x"}, "label": "7"}\n')
    result = omni_cli("run", "typed.py", "--inputs-json", "in.jsonl", "-i", "label=0",
                      cwd=tmp_path)
    assert (result.returncode, result.stdout) == (0, "Turn x '7' 1.0\n"), result.stderr


def _answers(proc: subprocess.Popen, count: int) -> list[str]:
    """The next `count` lines `proc` prints, waiting for each (60 s at most)."""
    assert proc.stdout is not None
    lines = []
    for _ in range(count):
        seen, _, _ = select.select([proc.stdout], [], [], 60)
        assert seen, f"no answer within 60 s (got {lines})"
        lines.append(proc.stdout.readline())
    return lines


def _reading_stdin(graphs: Path) -> subprocess.Popen:
    """``omni run echo.py --json --inputs-json -`` with pipes on all three streams."""
    return subprocess.Popen([sys.executable, "-m", "cli", "run", "echo.py", "--json",
                             "--inputs-json", "-"], cwd=graphs, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            bufsize=1, env=cli_env())


@pytest.mark.proc
def test_requests_on_stdin_are_answered_as_they_arrive(graphs: Path) -> None:
    """``--inputs-json -`` reads a request at a time: each is answered before the next is
    written (so a stream of requests never has to end, nor be held whole), and a bad line
    ends the run after the requests before it, exit 2, one line naming it."""
    proc = _reading_stdin(graphs)
    try:
        assert proc.stdin is not None
        answers = []
        for a in range(3):
            proc.stdin.write(json.dumps({"a": a}) + "\n")
            proc.stdin.flush()
            answers += _answers(proc, 1)
        rest, errors = proc.communicate('{"a": 3}\n{"zzz": 4}\n{"a": 5}\n', timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert [json.loads(line)["packed"]["a"] for line in answers + rest.splitlines()] == [
        0, 1, 2, 3]
    assert proc.returncode == 2
    [error] = [line for line in errors.splitlines() if "error" in line]  # beside the bar
    assert error.startswith("error: <stdin>:5: graph 'echo' has no input 'zzz'"), errors


@pytest.mark.proc
def test_sigterm_while_waiting_for_stdin_ends_the_run_in_one_line(graphs: Path) -> None:
    """A run waiting for its next request on stdin (after answering one) ends on SIGTERM like
    any other: exit 143, one line, no abort of an interpreter with a reader still blocked."""
    proc = _reading_stdin(graphs)
    try:
        assert proc.stdin is not None
        proc.stdin.write('{"a": 1}\n')
        proc.stdin.flush()
        [answer] = _answers(proc, 1)  # now it waits for the next line
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)  # stdin stays open: the reader is still blocked when the run ends
        assert proc.stderr is not None
        errors = proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
    assert json.loads(answer)["packed"]["a"] == 1
    lines = [line for line in errors.splitlines() if not line.startswith("requests")]
    assert (proc.returncode, lines) == (143, ["error: terminated"]), errors


def test_a_node_can_be_run_by_name(omni_cli: Cli, graphs: Path) -> None:
    """GRAPH may name a module-level node: it runs as a one-node graph."""
    result = omni_cli("run", "two.py", "shout", "-i", "text=x", "--json", cwd=graphs)
    assert result.returncode == 0, result.stderr
    assert json_lines(result.stdout) == [{"output": "X!"}]


def test_failing_node_exits_1_and_names_the_node(omni_cli: Cli, graphs: Path) -> None:
    """The failed request prints an error object; the others still run; exit status 1."""
    result = omni_cli("run", "fail.py", "--inputs-json", "-", "--json", cwd=graphs,
                      stdin='{"text": "a"}\n{"text": "bad"}\n{"text": "c"}\n')
    assert result.returncode == 1
    outputs = json_lines(result.stdout)
    assert outputs[0] == {"output": "ok:a"} and outputs[2] == {"output": "ok:c"}
    assert outputs[1] == {"error": {"node": "classify", "request_id": "req-2",
                                    "message": "ValueError: cannot classify 'bad'"}}
    assert ("error: node 'classify' failed in request req-2: ValueError: cannot classify "
            "'bad'") in result.stderr.splitlines()
    assert "Traceback" not in result.stderr


def test_failing_node_human_mode(omni_cli: Cli, graphs: Path) -> None:
    """Without --json: one stderr line, nothing on stdout, exit 1; --debug adds the trace."""
    result = omni_cli("run", "fail.py", "-i", "text=bad", cwd=graphs)
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.splitlines() == [
        "error: node 'classify' failed in request req-1: ValueError: cannot classify 'bad'"]
    result = omni_cli("run", "fail.py", "-i", "text=bad", "--debug", cwd=graphs)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and 'raise ValueError(f"cannot' in result.stderr


def test_node_failing_at_startup_exits_1(omni_cli: Cli, graphs: Path) -> None:
    """A class node whose constructor raises fails the run before any request."""
    result = omni_cli("run", "startup.py", "-i", "text=x", cwd=graphs)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "error: node 'Loader' failed to start: RuntimeError: weights not found"]


def test_json_values_that_are_not_json_native(omni_cli: Cli, graphs: Path) -> None:
    """bytes -> base64, dataclass -> object, numpy array -> list, anything else -> str()."""
    result = omni_cli("run", "values.py", "-i", "text=hi", "--json", cwd=graphs)
    assert result.returncode == 0, result.stderr
    assert json_lines(result.stdout) == [{"output": {
        "raw": "aGk=", "box": {"label": "hi", "score": 0.5}, "array": [0, 1, 2],
        "other": "opaque!"}}]


def test_json_stdout_holds_only_json(omni_cli: Cli, tmp_path: Path) -> None:
    """Prints in the graph file or in nodes go to stderr when --json is given."""
    (tmp_path / "noisy.py").write_text(
        "import omni\nprint('loading')\n\n@omni.node\nasync def f(x: str) -> str:\n"
        "    print('working')\n    return x\n\n@omni.graph\ndef g(x: str):\n    return f(x)\n")
    result = omni_cli("run", "noisy.py", "-i", "x=1", "--json", cwd=tmp_path)
    assert json_lines(result.stdout) == [{"output": "1"}]  # x: str keeps its text
    assert result.stderr.split() == ["loading", "working"]
