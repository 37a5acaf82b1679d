"""Running a benchmark of perf/ from a test, in this process: the script run as ``python
perf/NAME.py ARGS`` runs it (`runpy.run_path`, ``__name__ == "__main__"``), nothing imported
from perf/ by the test; its stdout and its --out file read back. And the committed results in
perf/results/, for the benchmarks whose quick mode starts processes."""

from __future__ import annotations

import json
import platform
import runpy
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "perf" / "results"
CLAIM_KEYS = {"target", "measured", "baseline", "ratio", "pass", "note"}

# Every benchmark records `platform.platform()`, whose first call in a process runs `uname -p`
# (then cached): done once here, as the tests are collected, so that a benchmark run in a test
# starts no process of its own doing.
platform.platform()


@contextmanager
def _script_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """What a script run as a file changes in this process, put back after: sys.path (it
    inserts the repository's root), the perf modules it imports, torch's threads and RNG."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    modules = set(sys.modules)
    threads, rng = torch.get_num_threads(), torch.random.get_rng_state()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng)
        for name in set(sys.modules) - modules:
            if name == "perf" or name.startswith("perf."):
                del sys.modules[name]


def run_script(script: str, args: Sequence[str], monkeypatch: pytest.MonkeyPatch,
               capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run perf/`script` as ``python perf/SCRIPT ARGS`` does, in this process: its exit
    status (0 where it returns), stdout and stderr."""
    path = ROOT / "perf" / script
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    capsys.readouterr()
    status = 0
    # perf/_common.gc_frozen: this process's objects out of the collector meanwhile, so that a
    # benchmark's gc.collect() before each timed call scans only its own (a full collection
    # of the test session takes ~0.1 s), and garbage other tests left is not counted by a
    # benchmark that counts what the collector finds
    gc_frozen = script_globals("_common.py", monkeypatch)["gc_frozen"]
    with _script_state(monkeypatch), gc_frozen():
        try:
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out, err = capsys.readouterr()
    return status, out, err


def script_globals(script: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """perf/`script`'s names, run as a file under a name other than __main__ (its main does
    not run): what a test calls a script's functions through, without importing perf/."""
    with _script_state(monkeypatch):
        return runpy.run_path(str(ROOT / "perf" / script), run_name=f"perf_{Path(script).stem}")


def run_quick(script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
              capsys: pytest.CaptureFixture[str], *, plot: bool = False,
              extra: Sequence[str] = ()) -> dict[str, Any]:
    """Run a benchmark in --quick mode in this process; its stdout and its --out file hold the
    same JSON, and with `plot` its --plot PNG is written (not empty)."""
    out, png = tmp_path / "result.json", tmp_path / "result.png"
    args = ["--quick", "--out", str(out), *extra, *(["--plot", str(png)] if plot else [])]
    status, stdout, stderr = run_script(script, args, monkeypatch, capsys)
    assert status == 0, stderr
    report = json.loads(out.read_text())
    assert json.loads(stdout) == report
    if plot:
        assert png.stat().st_size > 0
    return report


def committed(name: str) -> dict[str, Any]:
    """perf/results/`name`.json, as `make bench` wrote it: a full-size run."""
    report = json.loads((RESULTS / f"{name}.json").read_text())
    assert report.get("benchmark", name) == name  # (perf/transport.py writes no name)
    assert report["params"]["quick"] is False
    return report


def samples(entry: Any) -> bool:
    """Whether `entry` is a summary of repeated samples: median, min, max and the runs."""
    if not (isinstance(entry, dict) and {"median", "min", "max", "runs"} <= entry.keys()):
        return False
    runs = entry["runs"]
    return (isinstance(runs, list) and len(runs) > 0
            and all(isinstance(v, int | float) for v in runs)
            and min(runs) == entry["min"] and max(runs) == entry["max"]
            and entry["min"] <= entry["median"] <= entry["max"])


def check_claim(claim: dict[str, Any], name: str) -> None:
    """A claim as perf/_common.claim writes it: target, measured and baseline samples (the
    baseline may be absent: None), their ratio, a boolean pass, a note."""
    assert CLAIM_KEYS <= claim.keys(), name
    assert isinstance(claim["target"], int | float) and not isinstance(claim["target"], bool)
    assert samples(claim["measured"]), name
    assert claim["baseline"] is None or samples(claim["baseline"]), name
    assert claim["ratio"] is None or isinstance(claim["ratio"], int | float), name
    assert isinstance(claim["pass"], bool), name
    assert isinstance(claim["note"], str) and claim["note"], name
