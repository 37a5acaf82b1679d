"""perf/payloads.py keeps working: its quick mode, without Ray, reports every claim with
Omni's figures, and leaves no process behind. Not whether the claims pass: the quick sizes on
a shared test machine say nothing about speed."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLAIMS = ("numpy_64mib", "torch_64mib", "round_trip_64mib", "one_gib", "tcp_64mib",
          "call_latency", "hop_latency", "pipeline_throughput")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"


def test_payloads_benchmark_quick_mode_without_ray_reports_every_claim(tmp_path):
    out = tmp_path / "payloads.json"
    proc = subprocess.run([sys.executable, "perf/payloads.py", "--quick", "--no-ray",
                           "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert json.loads(proc.stdout) == report
    assert report["ray"]["used"] is False and report["params"]["ray"] is False
    for name in CLAIMS:
        claim = report[name]
        assert {"target", "measured", "baseline", "ratio", "pass", "error", "note"} <= (
            claim.keys()), name
        assert isinstance(claim["pass"], bool), name
        assert isinstance(claim["measured"]["median"], int | float), (name, claim["error"])
        assert claim["measured"]["median"] > 0 or name == "one_gib", name
    for name in ("numpy_64mib", "torch_64mib", "round_trip_64mib"):  # both sizes, the copy
        sizes = report[name]["sizes"]
        assert list(sizes) == ["16MiB", "16MiB-4KiB"], name
        assert all(s["omni_ms"]["median"] > 0 for s in sizes.values()), name
        assert report[name]["copy"]["median"] > 0, name
    # Without Ray, the Ray baselines are absent, said so, and those claims cannot pass.
    for name in ("numpy_64mib", "call_latency", "hop_latency", "pipeline_throughput"):
        assert report[name]["baseline"] is None and report[name]["pass"] is False, name
        assert "--no-ray" in report[name]["error"], name
    assert report["tcp_64mib"]["baseline"]["median"] > 0  # raw pyzmq needs no Ray
    assert report["tcp_64mib"]["setting"] == {"OMNI_PAYLOAD_SHM": "0", "OMNI_IPC": "0"}
    for part in ("argument", "result"):
        above = report["one_gib"][part]["above_idle_mib"]
        assert above["driver"]["median"] >= 0 and above["worker"]["median"] >= 0, part
    assert report["all_pass"] is False
    assert not [name for name, pid in report["pids"].items() if _alive(pid)]
