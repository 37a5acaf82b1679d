"""The benchmarks whose every mode starts processes (a consumer process, server children,
``omni run`` children), checked through what they wrote: perf/results/NAME.json as ``make
bench`` commits it has each claim with its target, measured, baseline, ratio and pass, and pass
is the claim's rule applied to the figures beside it."""

import statistics

import pytest

from tests.perf._run import check_claim, committed, samples

KV_CLAIMS = ("demote_to_disk", "promote_from_disk", "handoff", "block_keys", "match_acquire",
             "bookkeeping")


def test_kv_results_report_every_claim_by_its_rule():
    """perf/kv.py (a consumer process for the handoff, a fresh one for the bookkeeping):
    each claim with its target, measured, baseline, ratio and pass, and pass as each claim's
    rule has it."""
    report = committed("kv")
    params = report["params"]
    assert {"python", "torch", "cpu_count"} <= report["env"].keys()
    for name in KV_CLAIMS:
        check_claim(report[name], name)
        assert report[name]["measured"]["median"] > 0, name
    assert report["all_pass"] == all(report[name]["pass"] for name in KV_CLAIMS)

    for name in ("demote_to_disk", "promote_from_disk"):  # bytes/s, a ratio of medians
        claim = report[name]
        assert claim["target"] == 0.7 and claim["mib"] == params[name.split("_")[0] + "_mib"]
        assert claim["ratio"] == pytest.approx(
            claim["measured"]["median"] / claim["baseline"]["median"], rel=0.01), name
        assert claim["pass"] == (claim["ratio"] >= 0.7), name
    cold = report["promote_from_disk"]["cold"]
    assert samples(cold["measured"]) and cold["baseline"]["median"] > 0
    assert cold["pass"] == (cold["ratio"] >= 0.7)

    handoff = report["handoff"]  # x faster than a copy, at 256 MiB
    assert handoff["target"] == 20.0 and handoff["at_mib"] == 256
    assert list(handoff["sizes"]) == [f"{n}MiB" for n in params["handoff_mib"]]
    at = handoff["sizes"]["256MiB"]
    assert handoff["measured"] == at["handoff_ms"] and handoff["baseline"] == at["copy_ms"]
    assert handoff["ratio"] == pytest.approx(
        handoff["baseline"]["median"] / handoff["measured"]["median"], rel=0.01)
    assert handoff["pass"] == (handoff["ratio"] >= 20.0)
    sizes, (small, large) = handoff["sizes"], handoff["flatness_sizes_mib"]
    assert handoff["flatness"] == pytest.approx(
        sizes[f"{large}MiB"]["handoff_ms"]["median"] / sizes[f"{small}MiB"]["handoff_ms"][
            "median"], rel=0.01)

    keys = report["block_keys"]  # both inputs must reach 5 M tokens/s
    assert keys["target"] == 5e6 and set(keys["inputs"]) == {"list", "numpy"}
    assert keys["measured"] == keys["inputs"][keys["worst_input"]]["measured"]
    assert keys["pass"] == all(i["measured"]["median"] >= 5e6 for i in keys["inputs"].values())

    lookups = report["match_acquire"]
    assert lookups["target"] == 1e5 and lookups["pass"] == (lookups["measured"]["median"] >= 1e5)

    books = report["bookkeeping"]  # a fraction of the page bytes, no baseline
    assert books["baseline"] is None and books["ratio"] is None
    assert books["pages_stored"] == params["bookkeeping_pages"]
    assert books["measured"]["median"] == pytest.approx(
        books["bytes_per_page"] / books["page_bytes"], abs=1e-5)
    assert books["target"] == 0.01 and books["pass"] == (books["measured"]["median"] <= 0.01)


def test_transport_results_report_every_claim_by_its_rule():
    """perf/transport.py (a server child per side): RPC latency and payload throughput against
    raw pyzmq, and a KV fetch over shared memory against the same over TCP."""
    report = committed("transport")
    claims = ("latency", "throughput", "shared_memory")
    for name in claims:
        claim = report[name]
        check_claim(claim, name)
        assert claim["measured"]["median"] > 0 and claim["baseline"]["median"] > 0, name
    assert report["all_pass"] == all(report[name]["pass"] for name in claims)
    latency, throughput, shm = (report[name] for name in claims)
    assert latency["target"] == 2.0 and latency["pass"] == (latency["ratio"] <= 2.0)
    assert latency["ratio"] == pytest.approx(
        latency["measured"]["median"] / latency["baseline"]["median"], rel=0.01)
    assert throughput["target"] == 0.8 and throughput["pass"] == (throughput["ratio"] >= 0.8)
    assert throughput["ratio"] == pytest.approx(
        throughput["measured"]["median"] / throughput["baseline"]["median"], rel=0.01)
    assert shm["target"] == 20.0 and shm["pass"] == (shm["ratio"] >= 20.0)
    assert shm["ratio"] == pytest.approx(  # ms per fetch: TCP's over shared memory's
        shm["baseline"]["median"] / shm["measured"]["median"], rel=0.01)
    assert samples(shm["usable"]) and samples(shm["baseline_usable"])


def test_cli_output_results_count_every_item():
    """perf/cli_output.py (``omni run`` children): every item of the stream arrived as a line
    (text mode) and as one list (--json), a plain print loop's too, each counted; text mode's
    µs per item at most 1.5x --json's."""
    report = committed("cli_output")
    claim = report["stream_text_output"]
    check_claim(claim, "stream_text_output")
    items = report["params"]["items"]
    assert claim["items"] == claim["lines"] == claim["json_items"] == items == 1_000_000
    assert claim["print_loop"]["lines"] == items
    assert "cpu" in claim and samples(claim["cpu"]["text_us_per_item"])
    assert all(claim["wall_s"][k]["median"] > 0 for k in ("text", "json", "startup"))
    assert claim["target"] == 1.5
    ratio = claim["ratio"]  # None where a median per item is not positive: no verdict
    assert ratio is None or ratio == pytest.approx(
        claim["measured"]["median"] / claim["baseline"]["median"], rel=0.01)
    assert claim["pass"] == (ratio is not None and ratio <= 1.5)
    assert report["all_pass"] == claim["pass"]


def test_ray_cluster_results_compare_cluster_ray_with_omni_cluster_by_their_rule():
    """perf/ray_cluster.py (a 2-node Ray cluster and an `omni cluster`, processes): each claim
    is --cluster ray against omni cluster in the same run, Ray's own actor calls beside it,
    and passes on 5 rounds at >= 0.9x."""
    report = committed("ray_cluster")
    names = ("call_latency", "numpy_64mib", "pipeline_throughput")
    for name in names:
        claim = report["claims"][name]
        check_claim(claim, name)
        assert samples(claim["ray_actor_calls"]), name
        pairs = zip(claim["measured"]["runs"], claim["baseline"]["runs"], strict=True)
        rounds = [r / o if name == "pipeline_throughput" else o / r for r, o in pairs]
        assert claim["round_ratios"] == pytest.approx(rounds, rel=0.01), name
        assert claim["ratio"] == pytest.approx(statistics.median(rounds), rel=0.01), name
        assert claim["target"] == 0.9
        assert claim["pass"] == (claim["ratio"] >= 0.9 and report["params"]["repeats"] == 5)
    assert report["all_pass"] == all(report["claims"][n]["pass"] for n in names)
