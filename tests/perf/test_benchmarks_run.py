"""The benchmarks in perf/ keep working: each runs in its quick mode and reports its targets."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_scheduler_benchmark_quick_mode_reports_both_claims(tmp_path):
    out = tmp_path / "scheduler.json"
    proc = subprocess.run([sys.executable, "perf/scheduler.py", "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert json.loads(proc.stdout) == report
    assert report["per_hop"]["omni"]["median"] > report["per_hop"]["baseline"]["median"] > 0
    assert report["per_hop"]["target_us"] == 20.0
    assert report["throughput"]["omni"]["median"] > 0
    assert isinstance(report["throughput"]["pass"], bool)
