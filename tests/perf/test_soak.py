"""The short soak: 200 requests, 16 in flight, through both example pipelines, some cancelled on
purpose; afterwards no lease, pinned page, request in flight, fd, shared-memory segment or file is
left, and nothing failed; SIGTERM in the middle of the same load ends its process with 143 and
one line, leaving nothing. Throughput and RSS are not judged here (too few requests for that:
`perf/soak.py` without --quick does)."""

import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from omni.kv import KVLayout, KVStore, TierConfig
from perf._probes import Resources, leftovers, open_fds
from perf._soak_signal import claims, measure_signalled
from perf.soak import Params

ROOT = Path(__file__).resolve().parents[2]
ZERO_CLAIMS = ("failures", "leases_open", "pinned_pages", "requests_left", "fds_leaked",
               "shm_left", "files_left", "resource_warnings", "sigterm_left")
SIGNAL_CLAIMS = ("sigterm_exit", "sigterm_stderr", "sigterm_left")


def test_short_soak_leaves_nothing_behind(tmp_path):
    """In a fresh process (the counts are the process's own), as `make bench` runs it."""
    out = tmp_path / "soak.json"
    env = {k: v for k, v in os.environ.items() if k != "OMNI_MODEL"}
    proc = subprocess.run([sys.executable, "perf/soak.py", "--quick", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert json.loads(proc.stdout) == report
    overall = report["overall"]
    assert overall["requests"] == 200 and report["params"]["concurrency"] == 16
    assert overall["completed"] + overall["cancelled"] + overall["failures"] == 200
    assert overall["cancelled"] > 0  # the cancellation path ran
    assert overall["completed"] > 150 and overall["p99_ms"] > 0
    for kind in ("dialogue", "image"):
        assert report["pipelines"][kind]["completed"] > 0, kind
    assert report["kv"]["disk"]["demotions"] > 0  # pages went through every tier
    for name in ZERO_CLAIMS:
        claim = report[name]
        assert claim["target"] == 0 and claim["measured"]["median"] == 0, (name, claim)
        assert claim["pass"] is True, name
    assert report["sessions_held"]["pass"] is True
    assert {"target", "measured", "pass", "note"} <= report["rss_growth"].keys()
    assert isinstance(report["rss_growth"]["pass"], bool)
    assert report["timeline"] and report["timeline"][-1]["done"] == 200
    assert all(report[name]["pass"] for name in SIGNAL_CLAIMS)


def test_sigterm_mid_soak_exits_143_after_one_line_leaving_nothing(tmp_path):
    """perf/soak.py --quick --phase signal: a child runs the soak's load and gets SIGTERM once
    50 requests are done and its disk tier holds pages; it exits 143 after 'error: terminated'
    and leaves no arena, lease table, disk-tier file, payload segment or socket."""
    out = tmp_path / "signal.json"
    env = {k: v for k, v in os.environ.items() if k != "OMNI_MODEL"}
    proc = subprocess.run([sys.executable, "perf/soak.py", "--quick", "--phase", "signal",
                           "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert json.loads(proc.stdout) == report
    assert report["sigterm_exit"]["measured"]["median"] == 143, report["sigterm_exit"]
    assert report["sigterm_stderr"]["text"] == ["error: terminated"]
    left = report["sigterm_left"]
    assert left["measured"]["median"] == 0, left["names"]
    assert left["before"]["arenas"] == 2 and left["before"]["lease_tables"] == 1
    assert left["before"]["disk_files"] > 0
    at = left["at_signal"]
    assert at["done"] >= 50 and at["in_flight"] > 0 and at["pages"]["disk"] > 0
    assert report["all_pass"] is True and set(SIGNAL_CLAIMS) <= report.keys()


def test_the_signal_phase_sees_what_a_killed_process_leaves():
    """The signal phase's counts can fail: a child killed with SIGKILL mid-load (no cleanup)
    leaves its arenas, lease table and disk-tier file, and the claims say so; the phase then
    removes what it counted."""
    f = measure_signalled(asdict(Params.small()), 50, signal.SIGKILL)
    assert f["exit_status"] == -signal.SIGKILL
    assert len(f["left"]["arenas"]) == 2 and len(f["left"]["lease_tables"]) == 1
    assert f["left"]["disk_files"]
    assert not any(c["pass"] for c in claims(f).values())
    assert leftovers([f["store_id"]])["segments"] == []


def test_the_probes_see_what_a_leak_leaves():
    """The soak's zero claims can fail: an fd left open, an open store's arenas and the
    mappings of a view that outlived it, and a lease dropped without release are all seen."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, page_size=4,
                      dtype=torch.float32)
    before = open_fds()
    fd = os.open(tempfile.gettempdir(), os.O_RDONLY)
    try:
        assert fd in open_fds() and fd not in before
    finally:
        os.close(fd)
    store = KVStore(layout, [TierConfig("host", 4 * layout.page_bytes)])  # CPU, GPU or not
    keys = [bytes([i]) * 16 for i in range(2)]
    store.put(keys, torch.zeros(2, *layout.page_shape))
    try:
        with Resources() as resources:
            view = store.acquire(keys).page(0)  # a lease dropped unreleased; a view of a page
        assert sum(resources.seen.values()) == 1
        assert store.stats()["leases"] == {"open": 0, "exported": 0, "pinned_pages": 0}
        assert len(leftovers([store.store_id])["segments"]) == 2  # the host arena, the leases
        store.close()
        left = leftovers([store.store_id])
        assert left["segments"] == [] and len(left["mappings"]) == 1  # the view's arena
        del view
        gc.collect()
        assert leftovers([store.store_id]) == {"segments": [], "mappings": []}
    finally:
        store.close()
