"""Fixtures for the CLI tests: run the ``omni`` command in this process (typer's `CliRunner`),
write graph files. Tests whose behaviour is the operating system's (signals, a pipe read as it
fills) start ``python -m cli`` as a real process themselves and are marked ``proc``."""

from __future__ import annotations

import subprocess
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from tests._cli import run_omni

__all__ = ["GRAPH_FILES"]

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


@pytest.fixture
def graphs(tmp_path: Path) -> Path:
    """A folder holding `GRAPH_FILES`."""
    for name, source in GRAPH_FILES.items():
        (tmp_path / name).write_text(textwrap.dedent(source))
    return tmp_path


@pytest.fixture
def omni_cli() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run ``omni ARGS`` in this process (`tests._cli.run_omni`)."""
    return run_omni
