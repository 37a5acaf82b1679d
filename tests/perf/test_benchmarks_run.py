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


def test_kv_benchmark_quick_mode_reports_every_claim(tmp_path):
    """perf/kv.py --quick runs end to end and reports each claim with its target, measured,
    baseline, ratio and pass (not whether it passes: the quick sizes are too small to judge)."""
    out = tmp_path / "kv.json"
    proc = subprocess.run([sys.executable, "perf/kv.py", "--quick", "--out", str(out),
                           "--dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert json.loads(proc.stdout) == report
    assert {"python", "torch", "cpu_count"} <= report["env"].keys()
    claims = ("demote_to_disk", "promote_from_disk", "handoff", "block_keys", "match_acquire",
              "bookkeeping")
    for name in claims:
        claim = report[name]
        assert {"target", "measured", "baseline", "ratio", "pass", "note"} <= claim.keys(), name
        assert isinstance(claim["pass"], bool), name
        assert claim["measured"]["median"] > 0, name
    assert report["all_pass"] == all(report[name]["pass"] for name in claims)
    assert report["promote_from_disk"]["cold"]["baseline"]["median"] > 0
    assert set(report["handoff"]["sizes"]) == {"16MiB", "64MiB"}
    assert report["handoff"]["flatness"] > 0
    assert set(report["block_keys"]["inputs"]) == {"list", "numpy"}
    assert report["bookkeeping"]["pages_stored"] == 2_000
    assert [p.name for p in tmp_path.iterdir()] == ["kv.json"]  # disk files cleaned up
