"""The ``omni`` command run in this process, as a test drives it.

typer's `CliRunner` calls the command's function with captured stdin, stdout and stderr, so a
test pays no interpreter start or torch import. What running it changes in this process is
put back afterwards, as a new process would start without it: the working directory, the
environment, and the folders and modules a graph file adds to ``sys.path`` and
``sys.modules``. Tests whose behaviour is the operating system's (signals, a pipe read as it
fills, exit cleanup) start ``python -m cli`` as a real process instead and are marked ``proc``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from typer.testing import CliRunner

from cli.main import app

__all__ = ["ROOT", "cli_env", "run_omni"]

ROOT = Path(__file__).resolve().parents[1]


def cli_env(**extra: str | None) -> dict[str, str | None]:
    """The environment the command sees: no colours, wide lines, and `extra` (None: unset)."""
    return {**os.environ, "NO_COLOR": "1", "COLUMNS": "200", "PYTHONDONTWRITEBYTECODE": "1",
            **extra}


def run_omni(*args: str, cwd: Path = ROOT, stdin: str | None = None,
             env: Mapping[str, str | None] | None = None) -> subprocess.CompletedProcess[str]:
    """``omni ARGS`` in this process (cwd: the repo root unless given; `env`: variables added
    to the environment, None unsetting one): its exit code and text output as a
    `CompletedProcess`."""
    path, modules, before = list(sys.path), set(sys.modules), os.getcwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(app, list(args), input=stdin or "",
                                    env=cli_env(**(env or {})), catch_exceptions=False,
                                    prog_name="omni")
    finally:
        os.chdir(before)
        added = [Path(p).resolve() for p in set(sys.path) - set(path)]
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            file = getattr(sys.modules[name], "__file__", None)
            if name.startswith("_omni_file_") or (
                    file is not None and any(Path(file).resolve().is_relative_to(folder)
                                             for folder in added)):
                del sys.modules[name]
    return subprocess.CompletedProcess(["omni", *args], result.exit_code, result.stdout,
                                       result.stderr)
