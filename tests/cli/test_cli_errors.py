"""User mistakes: exit status 2 and one ``error:`` line on stderr, a traceback only with --debug."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

Cli = Callable[..., subprocess.CompletedProcess[str]]

BROKEN_FILES = {
    "syntax.py": "import omni\n\ndef f(:\n    pass\n",
    "crash.py": "import omni\n\nx = 1\ny = x / 0\n",
    "invalid.py": (
        "import omni\n\n@omni.node\nasync def f(x: int) -> int:\n    return x\n\n"
        "@omni.graph\ndef g(text: str):\n    return f(text, 3)\n"),
    "empty.py": "x = 1\n",
    "needs_args.py": (
        "import omni\n\n@omni.node\nclass Model:\n    def __init__(self, path: str):\n"
        "        self.path = path\n\n    async def __call__(self, text: str) -> str:\n"
        "        return text\n"),
    "bad.jsonl": '{"text": "a"}\n{"text": }\n',
    "array.json": "[1, 2]\n",
    "unknown.jsonl": '{"text": "a"}\n{"txt": "b"}\n',
    "typed.py": (
        "import dataclasses\nfrom typing import Literal\nimport omni\n\n"
        "@dataclasses.dataclass\nclass Turn:\n    text: str\n    repeat: int = 1\n\n"
        "@omni.node\nasync def say(turn: Turn, n: int, mode: Literal['plain', 'loud'] = 'plain'"
        ") -> str:\n    return turn.text * turn.repeat * n\n\n"
        "@omni.graph\ndef typed(turn: Turn, n: int, mode: Literal['plain', 'loud'] = 'plain'):\n"
        "    return say(turn, n, mode)\n"),
    "typed.jsonl": ('{"turn": {"text": "a"}, "n": 1}\n{"turn": {"text": "b"}, "n": 2}\n'
                    '{"turn": {"text": "c"}, "n": 1, "mode": "shout"}\n'),
}

# (arguments, a fragment the error line must contain)
MISTAKES = [
    (["run", "fail.py", "--input", "text"], "--input 'text': expected KEY=VALUE"),
    (["run", "fail.py", "--input", "=x"], "the key before '=' is empty"),
    (["run", "fail.py", "--input", "txt=x"], "graph 'pipeline' has no input 'txt'"),
    (["run", "fail.py"], "graph 'pipeline' is missing input 'text'; pass it with --input"),
    (["run", "nosuch.py"], "no such file: nosuch.py"),
    (["run", "."], "not a file: ."),
    (["run", "syntax.py"], "syntax.py:3: syntax error"),
    (["run", "crash.py"], "loading crash.py failed at line 4: ZeroDivisionError"),
    (["run", "invalid.py"], "invalid.py:9: node 'f': bad arguments"),
    (["run", "empty.py"], "empty.py defines no graph"),
    (["run", "two.py"], "two.py defines several graphs; name one: first, second"),
    (["run", "two.py", "third"], "two.py has no graph named 'third' (graphs: first, second)"),
    (["run", "two.py", "suffix"], "'suffix' in two.py is not a graph or a node"),
    (["run", "needs_args.py", "Model"], "'Model' in needs_args.py is a class node that needs"),
    (["run", "fail.py", "--inputs-json", "bad.jsonl"], "bad.jsonl:2: invalid JSON"),
    (["run", "fail.py", "--inputs-json", "array.json"], "array.json:1: expected a JSON object"),
    (["run", "fail.py", "--inputs-json", "unknown.jsonl"],
     "unknown.jsonl:2: graph 'pipeline' has no input 'txt'"),
    (["run", "fail.py", "--inputs-json", "missing.jsonl"], "no such file: missing.jsonl"),
    (["run", "typed.py", "-i", 'turn={"text": "a"}', "-i", 'n="abc"'],
     "graph 'typed': input 'n': expected `int`, got `str`"),
    (["run", "typed.py", "-i", 'turn={"text": "a"}', "-i", "n=abc"],
     "graph 'typed': input 'n': expected `int`, got `str`"),
    (["run", "typed.py", "-i", 'turn={"txt": "a"}', "-i", "n=1"],
     "graph 'typed': input 'turn': object missing required field `text`"),
    (["run", "typed.py", "-i", 'turn={"text": "a", "repeat": "x"}', "-i", "n=1"],
     "graph 'typed': input 'turn.repeat': expected `int`, got `str`"),
    (["run", "typed.py", "--inputs-json", "typed.jsonl"],
     "typed.jsonl:3: graph 'typed': input 'mode': invalid enum value 'shout'"),
    (["graph", "show", "invalid.py"], "invalid.py:9: node 'f'"),
    (["graph", "show", "two.py", "third"], "no graph named 'third'"),
]


@pytest.fixture
def broken(graphs: Path) -> Path:
    for name, source in BROKEN_FILES.items():
        (graphs / name).write_text(source)
    return graphs


@pytest.mark.parametrize(("args", "fragment"), MISTAKES, ids=[" ".join(a) for a, _ in MISTAKES])
def test_mistake_is_one_line_and_exit_2(omni_cli: Cli, broken: Path, args: list[str],
                                        fragment: str) -> None:
    result = omni_cli(*args, cwd=broken)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("error: ") and fragment in line, line


@pytest.mark.parametrize("args", [["run", "crash.py"], ["graph", "show", "invalid.py"]])
def test_debug_adds_the_traceback(omni_cli: Cli, broken: Path, args: list[str]) -> None:
    result = omni_cli(*args, "--debug", cwd=broken)
    assert result.returncode == 2
    assert "Traceback" in result.stderr
    assert result.stderr.splitlines()[-1].startswith("error: ")


def test_click_usage_errors_exit_2(omni_cli: Cli, broken: Path) -> None:
    """Option values typer rejects (here --requests 0) keep click's exit status 2."""
    result = omni_cli("run", "fail.py", "--requests", "0", cwd=broken)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
