"""perf/payloads.py (an Omni head and five workers, a driver child, Ray): what it committed,
perf/results/payloads.json, reports every claim with Omni's figures, each pass by its rule,
every worker stopped with exit 0; and its claims' rule without Ray (``--no-ray``, as the
suite's machines have no Ray): no baseline, said so, no pass."""

import pytest

from tests.perf._run import check_claim, committed, samples, script_globals

CLAIMS = {  # claim -> (target, which side of it passes)
    "numpy_64mib": (1.0, "lower"), "torch_64mib": (1.0, "lower"),
    "round_trip_64mib": (1.0, "lower"), "one_gib": (1536.0, "lower"),
    "tcp_64mib": (0.8, "higher"), "call_latency": (0.5, "lower"),
    "hop_latency": (1.0, "lower"), "pipeline_throughput": (1.0, "higher")}


def test_payloads_results_report_every_claim_by_its_rule():
    report = committed("payloads")
    assert report["ray"]["used"] is True and report["params"]["ray"] is True
    for name, (target, better) in CLAIMS.items():
        claim = report[name]
        check_claim(claim, name)
        assert "error" in claim and (claim["target"], claim["better"]) == (target, better), name
        assert claim["measured"]["median"] > 0 or name == "one_gib", (name, claim["error"])
        if name == "one_gib":  # peak RSS above idle, no baseline: the largest at most 1.5 GiB
            assert claim["baseline"] is None and claim["ratio"] is None
            rule = claim["error"] is None and claim["measured"]["max"] <= target
        else:  # Omni / the baseline, of the medians (the ratio kept to 3 decimals)
            assert claim["ratio"] == pytest.approx(
                claim["measured"]["median"] / claim["baseline"]["median"], rel=0.01,
                abs=0.0006), name
            ratio = claim["ratio"]
            rule = claim["error"] is None and (ratio <= target if better == "lower"
                                               else ratio >= target)
        assert claim["pass"] == rule, name
    payload = report["params"]["payload_bytes"]
    for name in ("numpy_64mib", "torch_64mib", "round_trip_64mib"):  # both sizes, the copy
        sizes = report[name]["sizes"]
        assert list(sizes) == ["64MiB", "64MiB-4KiB"] and payload == 64 << 20, name
        assert [s["bytes"] for s in sizes.values()] == [payload, payload - 4096], name
        assert all(s["omni_ms"]["median"] > 0 for s in sizes.values()), name
        assert report[name]["copy"]["median"] > 0, name
    assert report["tcp_64mib"]["baseline"]["median"] > 0  # raw pyzmq
    floor = report["hop_latency"]["floor"]  # the bare rings under the hop, in the same run
    assert floor["trio_us_per_hop"] > 0 and floor["blocking_us_per_hop"] > 0
    explain = report["hop_latency"]["explain"]
    for worker in ("w1", "w2", "w3"):  # the stages ran on the lanes, not the event loops
        assert explain["cluster_loop_cpu_us"][worker] < explain["cluster_cpu_us"][worker] / 4
    assert report["tcp_64mib"]["setting"] == {"OMNI_PAYLOAD_SHM": "0", "OMNI_IPC": "0",
                                              "OMNI_DATA_PLANE": "plaintext"}
    assert report["tcp_64mib"]["plaintext_gib_s"]["median"] > 0  # the plaintext data plane
    for part in ("argument", "result", "tcp_argument", "tcp_result"):
        above = report["one_gib"][part]["above_idle_mib"]
        assert above["driver"]["median"] >= 0 and samples(above["worker"]), part
    assert report["all_pass"] == all(report[name]["pass"] for name in CLAIMS)
    # everything it started was stopped: the five workers each ended by its SIGTERM, cleanly
    # (exit 143, the CLI's one line last)
    assert {name: (w["exit"], w["last"][-1:] or w["first"][-1:])
            for name, w in report["workers"].items()} == {
        name: (143, ["error: terminated"]) for name in ("w1", "w2", "w3", "wtcp", "wtcp_plain")}
    assert report["strays_stopped"] == []


def test_without_ray_the_ray_baselines_are_absent_said_so_and_fail(monkeypatch):
    """--no-ray: a claim with Omni's figure and no Ray baseline records why and cannot pass;
    the same figures against a baseline pass by the rule."""
    measures = script_globals("_payload_measures.py", monkeypatch)
    claim, samples_of, no_ray = measures["claim"], measures["Samples"], measures["NO_RAY"]
    omni = samples_of((1.0, 2.0, 3.0))
    alone = claim(unit="ms", target=1.0, better="lower", measured=omni, baseline=None,
                  error=no_ray, note="n")
    assert "--no-ray" in alone["error"]
    assert alone["baseline"] is None and alone["ratio"] is None and alone["pass"] is False
    assert alone["measured"]["median"] == 2.0
    ray = samples_of((4.0, 4.0, 4.0))
    lower = claim(unit="ms", target=1.0, better="lower", measured=omni, baseline=ray,
                  error=None, note="n")
    assert lower["ratio"] == 0.5 and lower["pass"] is True
    higher = claim(unit="GiB/s", target=0.8, better="higher", measured=omni, baseline=ray,
                   error=None, note="n")
    assert higher["ratio"] == 0.5 and higher["pass"] is False
