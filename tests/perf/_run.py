"""Running a benchmark of perf/ from a test: its quick mode, its JSON read back."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_quick(script: str, tmp_path: Path, timeout: float = 180, *, plot: bool = False,
              extra: Sequence[str] = ()) -> dict[str, Any]:
    """Run a benchmark in --quick mode; its stdout and its --out file hold the same JSON, and
    with `plot` its --plot PNG is written (not empty)."""
    out, png = tmp_path / "result.json", tmp_path / "result.png"
    args = [sys.executable, script, "--quick", "--out", str(out), *extra]
    if plot:
        args += ["--plot", str(png)]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert json.loads(proc.stdout) == report
    if plot:
        assert png.stat().st_size > 0
    return report
