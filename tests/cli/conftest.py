"""Fixtures for the CLI tests: run the ``omni`` command in this process (typer's `CliRunner`),
write graph files. Tests whose behaviour is the operating system's (signals, a pipe read as it
fills) start ``python -m cli`` as a real process themselves and are marked ``proc``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app

REPO_ROOT = Path(__file__).resolve().parents[2]

# Small graph files the tests run; each fixture call writes them all into tmp_path.
GRAPH_FILES = {
    "echo.py": '''
        from typing import Any
        import omni

        @omni.node
        async def pack(a: Any, b: Any = None, c: Any = None) -> dict:
            return {"a": a, "b": b, "c": c}

        @omni.graph
        def echo(a: Any, b: Any = None, c: Any = None):
            return {"packed": pack(a, b, c)}
    ''',
    "fail.py": '''
        import omni

        @omni.node
        async def classify(text: str) -> str:
            if text == "bad":
                raise ValueError(f"cannot classify {text!r}")
            return "ok:" + text

        @omni.graph
        def pipeline(text: str):
            return classify(text)
    ''',
    "startup.py": '''
        import omni

        @omni.node
        class Loader:
            def __init__(self) -> None:
                raise RuntimeError("weights not found")

            async def __call__(self, text: str) -> str:
                return text

        @omni.graph
        def loading(text: str):
            return Loader()(text)
    ''',
    "values.py": '''
        import dataclasses
        import numpy as np
        import omni

        @dataclasses.dataclass
        class Box:
            label: str
            score: float

        @omni.node
        async def make(text: str) -> dict:
            return {"raw": text.encode(), "box": Box(text, 0.5),
                    "array": np.arange(3), "other": object.__new__(Opaque)}

        class Opaque:
            def __str__(self) -> str:
                return "opaque!"

        @omni.graph
        def values(text: str):
            return make(text)
    ''',
    "two.py": '''
        from collections.abc import AsyncIterator
        import omni
        from helper import suffix  # a sibling module: the file's folder is on sys.path

        @omni.node
        async def shout(text: str) -> str:
            return text.upper() + suffix()

        @omni.node
        async def letters(text: str) -> AsyncIterator[str]:
            for ch in text:
                yield ch

        @omni.graph
        def first(text: str):
            return shout(text)

        @omni.graph
        def second(text: str):
            return letters(text)
    ''',
    "helper.py": '''
        def suffix() -> str:
            return "!"
    ''',
}


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(NO_COLOR="1", COLUMNS="200", PYTHONDONTWRITEBYTECODE="1")
    return env


@pytest.fixture
def graphs(tmp_path: Path) -> Path:
    """A folder holding `GRAPH_FILES`."""
    for name, source in GRAPH_FILES.items():
        (tmp_path / name).write_text(textwrap.dedent(source))
    return tmp_path


@pytest.fixture
def omni_cli(monkeypatch: pytest.MonkeyPatch) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run ``omni ARGS`` in this process (cwd: the repo root unless given); its exit code and
    text output as a `CompletedProcess`. What a graph file adds to ``sys.path`` and
    ``sys.modules`` is undone after each run, as a new process would start without it."""

    def run(*args: str, cwd: Path = REPO_ROOT, stdin: str | None = None
            ) -> subprocess.CompletedProcess[str]:
        path, modules = list(sys.path), set(sys.modules)
        with monkeypatch.context() as patch:
            patch.chdir(cwd)
            result = CliRunner().invoke(app, list(args), input=stdin or "", env=cli_env(),
                                        catch_exceptions=False, prog_name="omni")
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            if name.startswith("_omni_file_") or name in GRAPH_FILES_MODULES:
                del sys.modules[name]
        return subprocess.CompletedProcess(["omni", *args], result.exit_code, result.stdout,
                                           result.stderr)

    return run


GRAPH_FILES_MODULES = {name.removesuffix(".py") for name in GRAPH_FILES}
