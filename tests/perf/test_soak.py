"""The short soak: 200 requests, 16 in flight, through both example pipelines, some cancelled on
purpose; afterwards no lease, pinned page, request in flight, fd, shared-memory segment or file is
left, and nothing failed (its load in this process: ``perf/soak.py --quick --phase load``);
SIGTERM in the middle of the same load ends its process with 143 and one line, leaving nothing
(``--phase signal``: a child, the one test here that starts processes). Throughput and RSS are
not judged here (too few requests for that: `perf/soak.py` without --quick does)."""

import gc
import os
import signal
import tempfile

import pytest
import torch

from omni.kv import KVLayout, KVStore, TierConfig
from tests.perf._run import run_quick, script_globals

ZERO_CLAIMS = ("failures", "leases_open", "pinned_pages", "requests_left", "fds_leaked",
               "shm_left", "files_left", "resource_warnings")
SIGNAL_CLAIMS = ("sigterm_exit", "sigterm_stderr", "sigterm_left")


def test_short_soak_leaves_nothing_behind(tmp_path, monkeypatch, capsys):
    """The load as `make bench` runs it, here in this process: the counts are differences
    (fds after the runtime closed against before it started, this run's stores' segments and
    mappings, this run's folders), and the session's own objects are frozen out of the
    collector meanwhile, so only what the run leaves is counted."""
    monkeypatch.delenv("OMNI_MODEL", raising=False)
    report = run_quick("soak.py", tmp_path, monkeypatch, capsys, extra=["--phase", "load"])
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
    assert not set(SIGNAL_CLAIMS) & report.keys()  # the signal phase: the test below


@pytest.mark.proc  # a child process sent SIGTERM, then one sent SIGKILL: exit statuses, leftovers
def test_a_signal_mid_soak_ends_the_child_as_its_claims_say(tmp_path, monkeypatch, capsys):
    """perf/soak.py --quick --phase signal: a child runs the soak's load and gets SIGTERM once
    50 requests are done and its disk tier holds pages; it exits 143 after 'error: terminated'
    and leaves no arena, lease table, disk-tier file, payload segment or socket.

    And the phase's counts can fail: a child killed with SIGKILL mid-load (no cleanup) leaves
    its arenas, lease table and disk-tier file, and the claims say so; the phase then removes
    what it counted."""
    monkeypatch.delenv("OMNI_MODEL", raising=False)
    report = run_quick("soak.py", tmp_path, monkeypatch, capsys, extra=["--phase", "signal"])
    assert report["sigterm_exit"]["measured"]["median"] == 143, report["sigterm_exit"]
    assert report["sigterm_stderr"]["text"] == ["error: terminated"]
    left = report["sigterm_left"]
    assert left["measured"]["median"] == 0, left["names"]
    assert left["before"]["arenas"] == 2 and left["before"]["lease_tables"] == 1
    assert left["before"]["disk_files"] > 0
    at = left["at_signal"]
    assert at["done"] >= 50 and at["in_flight"] > 0 and at["pages"]["disk"] > 0
    assert report["all_pass"] is True and set(SIGNAL_CLAIMS) <= report.keys()
    assert all(report[name]["pass"] for name in SIGNAL_CLAIMS)

    soak = script_globals("soak.py", monkeypatch)
    small = soak["asdict"](soak["Params"].small())
    f = soak["measure_signalled"](small, 50, signal.SIGKILL)
    assert f["exit_status"] == -signal.SIGKILL
    assert len(f["left"]["arenas"]) == 2 and len(f["left"]["lease_tables"]) == 1
    assert f["left"]["disk_files"]
    assert not any(c["pass"] for c in soak["signal_claims"](f).values())
    assert soak["leftovers"]([f["store_id"]])["segments"] == []


def test_the_probes_see_what_a_leak_leaves(monkeypatch):
    """The soak's zero claims can fail: an fd left open, an open store's arenas and the
    mappings of a view that outlived it, and a lease dropped without release are all seen."""
    probes = script_globals("_probes.py", monkeypatch)
    Resources, leftovers, open_fds = (probes[name] for name in (
        "Resources", "leftovers", "open_fds"))
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
