"""The benchmarks in perf/ keep working: each runs its quick mode in this process (run as
``python perf/NAME.py --quick`` runs it) and reports its targets. serve and cluster are about
processes (servers, a head and its workers): they start them, and are marked proc."""

import importlib.util
import statistics

import pytest

from tests.perf._run import run_quick


def test_scheduler_benchmark_quick_mode_reports_both_claims(tmp_path, monkeypatch, capsys):
    report = run_quick("scheduler.py", tmp_path, monkeypatch, capsys)
    hop, throughput = report["per_hop"], report["throughput"]
    assert hop["omni"]["median"] > hop["baseline"]["median"] > 0
    # each claim is a ratio to its own baseline, measured in the same run
    assert hop["target"] == 15.0 and throughput["target"] == 0.7
    assert hop["ratio"] == pytest.approx(hop["omni"]["median"] / hop["baseline"]["median"],
                                         rel=0.01)
    assert hop["pass"] == (hop["omni"]["median"] <= 15.0 * hop["baseline"]["median"])
    assert throughput["omni"]["median"] > 0 and throughput["baseline"]["median"] > 0
    assert throughput["pass"] == (
        throughput["omni"]["median"] >= 0.7 * throughput["baseline"]["median"])


def test_prefix_reuse_benchmark_quick_mode_reports_every_turn(tmp_path, monkeypatch, capsys):
    """perf/prefix_reuse.py --quick reports per turn the cached tokens, both TTFTs, the
    speedup against the ideal FLOP ratio, and equal tokens with and without reuse."""
    report = run_quick("prefix_reuse.py", tmp_path, monkeypatch, capsys, plot=True)
    assert report["tokens_equal"] is True and report["cache_consistent"] is True
    turns = report["turns"]
    assert [t["turn"] for t in turns] == list(range(1, report["params"]["turns"] + 1))
    keys = {"prompt_tokens", "cached_tokens", "ttft_reuse_ms", "ttft_recompute_ms", "speedup",
            "token_ratio", "ideal_flop_ratio", "efficiency", "pass"}
    for turn in turns:
        assert keys <= turn.keys()
        assert turn["ttft_reuse_ms"]["median"] > 0 and turn["ttft_recompute_ms"]["median"] > 0
    assert turns[0]["cached_tokens"] == 0 and turns[0]["ideal_flop_ratio"] == 1.0
    assert all(t["cached_tokens"] > 0 and t["ideal_flop_ratio"] > 1 for t in turns[1:])
    claim = report["claim"]
    assert {"target", "aggregate", "efficiency", "lowest_efficiency", "pass"} <= claim.keys()
    assert claim["target"] == 0.8
    later = turns[1:]  # the claim is judged on the lowest turn with a cached prefix
    assert claim["lowest_efficiency"] == min(t["efficiency"] for t in later)
    # the claim is made on 15 paired runs a turn: a quick run (1) reports, never passes
    assert claim["paired_runs"] == report["params"]["repeats"] == 1
    assert claim["pass"] is False and "15" in claim["why"]


def test_decode_benchmark_quick_mode_compares_with_transformers(tmp_path, monkeypatch, capsys):
    """perf/decode.py --quick reports decode tokens/s of ours and transformers' generate at
    batch 1 and 4, with equal greedy tokens."""
    report = run_quick("decode.py", tmp_path, monkeypatch, capsys)
    assert report["tokens_equal"] is True and report["target"] == 1.0
    cases = [c for m in report["models"] for c in m["cases"]]
    assert [c["batch"] for c in cases] == [1, 4]
    for case in cases:
        rates = case["decode_tokens_per_s"]
        assert rates["ours"]["median"] > 0 and rates["transformers"]["median"] > 0
        assert case["new_tokens_each"] == [report["params"]["new_tokens"]] * case["batch"]
        assert isinstance(case["pass"], bool)
    constrained = report["constrained"]["cases"]  # JSON schema vs free, same run
    assert [c["batch"] for c in constrained] == [1, 4]
    for case in constrained:
        assert case["target"] == 0.9 and case["ratio"] > 0 and isinstance(case["pass"], bool)
        assert case["measured"]["median"] > 0 and case["baseline"]["median"] > 0


def test_diffusion_benchmark_quick_mode_matches_recomputation(tmp_path, monkeypatch, capsys):
    """perf/diffusion_reuse.py --quick: reuse and recompute give the same latents."""
    report = run_quick("diffusion_reuse.py", tmp_path, monkeypatch, capsys)
    claim = report["reuse_vs_recompute"]
    assert claim["max_abs_latent_diff"] < 1e-4
    assert claim["ideal_flop_ratio"] > 1 and isinstance(claim["pass"], bool)


def test_stop_window_benchmark_quick_mode_reports_both_tokenizers(tmp_path, monkeypatch, capsys):
    """perf/stop_window.py --quick: per tokenizer, the stop check's cost with SGLang's tail
    window and with the whole output, at every output length; the claim is the whole
    output's cost over the window's at the longest."""
    report = run_quick("stop_window.py", tmp_path, monkeypatch, capsys)
    assert [c["tokenizer"] for c in report["claims"]] == ["byte", "bpe"]
    for claim in report["claims"]:
        assert [case["length"] for case in claim["cases"]] == report["params"]["lengths"]
        assert claim["measured"]["median"] > 0 and claim["baseline"]["median"] > 0
        assert claim["ratio"] == pytest.approx(
            claim["baseline"]["median"] / claim["measured"]["median"], rel=0.01)
        assert claim["target"] == 50.0 and claim["pass"] == (claim["ratio"] >= 50.0)
        assert claim["flatness"] > 0
    assert report["all_pass"] == all(c["pass"] for c in report["claims"])


def test_cpu_linear_benchmark_quick_mode_reports_every_case_for_every_backend(
        tmp_path, monkeypatch, capsys):
    """perf/cpu_linear.py --quick: each row count and whole-model call, the backend Omni picks
    for this CPU against the others in the same run, their outputs equal to float32 rounding;
    the baseline is the fastest other backend whose kernels differ in that case."""
    from omni.compute.models import default_cpu_linear_backend

    report = run_quick("cpu_linear.py", tmp_path, monkeypatch, capsys, plot=True)
    assert [c["rows"] for c in report["layer"]] == report["params"]["layer_rows"]
    assert len(report["model_cases"]) == 3
    assert report["backend"] == default_cpu_linear_backend()
    backends = {"mkl_packed", "onednn", "mkl"}
    for case in report["layer"] + report["model_cases"]:
        assert case["backend"] == report["backend"]
        assert case["baseline_backend"] in backends - {case["backend"]}
        assert case["baseline_backend"] not in case["same_kernels_as"]
        assert set(case["times_ms"]) == set(case["vs_mkl"]) == backends
        assert case["measured"]["median"] > 0 and case["baseline"]["median"] > 0
        assert isinstance(case["pass"], bool) and case["target"] == 1.0
        assert case["max_abs_diff"] < 1e-3 and case["vs_mkl"]["mkl"] == 1.0
    one_row = report["layer"][0]
    assert one_row["rows"] == 1 and report["model_cases"][2]["new_tokens"] == 1
    if report["backend"] == "mkl_packed":  # plain sgemm at 1 row: the same kernels as "mkl"
        assert one_row["same_kernels_as"] == ["mkl"]
    assert report["pass"] == all(c["pass"] for c in report["layer"] + report["model_cases"])


@pytest.mark.proc  # a head and two workers: `omni cluster start` / `join` processes
def test_cluster_benchmark_quick_mode_compares_kv_aware_with_round_robin(
        tmp_path, monkeypatch, capsys):
    """perf/cluster.py --quick: a head and 2 workers as subprocesses; KV-aware routing's hit
    rate and throughput against round-robin's, each phase serving all its requests. The
    benchmark deploys only once the head lists both workers, and measures only once each pool
    has one replica per worker (the driver moves one back to a worker that dropped out for a
    moment)."""
    report = run_quick("cluster.py", tmp_path, monkeypatch, capsys)
    for name, target in (("hit_rate", 2.0), ("throughput", 1.0)):
        claim = report[name]
        assert {"target", "measured", "baseline", "ratio", "pass", "note"} <= claim.keys(), name
        assert claim["target"] == target and isinstance(claim["pass"], bool), name
        assert claim["measured"]["median"] > 0 and claim["baseline"]["median"] >= 0, name
    assert report["all_pass"] == (report["hit_rate"]["pass"] and report["throughput"]["pass"])
    assert {"hits", "misses", "fallbacks"} <= report["hit_rate"]["balancer"].keys()
    assert all(sorted(m) == ["w1", "w2"] for m in report["cluster"]["placement"].values())
    assert report["cluster"]["capacity_pages"] > 0
    requests = report["workload"]["requests_per_phase"]
    assert [p["requests"] for p in report["phases"]] == [requests] * 2


@pytest.mark.proc  # server processes loaded by a real client, stopped by SIGTERM
def test_serve_benchmark_quick_mode_loads_both_servers_without_errors(
        tmp_path, monkeypatch, capsys):
    """perf/serve.py --quick: both server processes answer every request (0 errors), both
    exit 0 on SIGTERM, and the claim reports the two rates and their ratio."""
    report = run_quick("serve.py", tmp_path, monkeypatch, capsys, plot=True)
    claim = report["claim"]
    assert claim["errors"] == 0 and claim["exit_codes"] == {"omni": 0, "constant": 0}
    assert claim["measured"]["median"] > 0 and claim["baseline"]["median"] > 0
    assert abs(claim["ratio"] - claim["measured"]["median"] / claim["baseline"]["median"]) < 0.01
    hostile = report["hostile"]  # every hostile request refused, /health answering
    assert hostile["refused"] == hostile["hostile_requests"] == report["params"][
        "hostile_requests"]
    assert hostile["measured"]["polls"] > 0 and hostile["baseline"]["polls"] > 0
    assert hostile["peak_rss_growth_mib"] <= hostile["rss_target_mib"]  # 20 images refused
    # multi-turn chats: both servers (transformers serve where its extra is installed)
    turns = report["turns"]
    assert [c["sessions"] for c in turns["cases"]] == list(report["params"]["sessions"])
    assert turns["errors"] == 0 and turns["exit_codes"]["omni"] == 0, turns
    assert turns["measured"]["median"] > 0 and turns["cases"][0]["ttft_p50_ms"]["omni"] > 0
    if importlib.util.find_spec("uvicorn") is None:
        assert turns["baseline"] is None and turns["pass"] is False
        assert "pip install" in turns["error"]
    else:
        assert turns["baseline"]["median"] > 0 and turns["error"] is None
        assert turns["ratio"] == pytest.approx(
            turns["measured"]["median"] / turns["baseline"]["median"], abs=0.01)


def test_omni_model_benchmark_quick_mode_compares_with_transformers(tmp_path, monkeypatch,
                                                                    capsys):
    """perf/omni_model.py --quick reports time to first audio, later turns' TTFT against the
    ideal FLOP ratio and thinker decode tokens/s, each against transformers in the same run,
    with equal tokens and audio; a quick run (1 round) reports, never passes."""
    report = run_quick("omni_model.py", tmp_path, monkeypatch, capsys)
    assert report["tokens_equal"] is True and report["audio_max_abs_diff"] <= 1e-4
    audio = report["first_audio"]
    assert audio["ours_ms"]["median"] > 0 and audio["theirs_ms"]["median"] > 0
    assert audio["ratio"] == pytest.approx(audio["theirs_ms"]["median"]
                                           / audio["ours_ms"]["median"], rel=0.02)
    turns = report["turns"]
    assert [t["turn"] for t in turns] == list(range(2, report["params"]["turns"] + 1))
    assert all(t["cached_tokens"] > 0 and t["ideal_flop_ratio"] > 1 for t in turns)
    assert report["turn_ttft"]["lowest_efficiency"] == min(t["efficiency"] for t in turns)
    assert report["decode"]["target"] == 1.0 and report["first_audio"]["target"] == 2.0
    assert report["claim"]["paired_runs"] == 1 and report["claim"]["all_pass"] is False
    assert not any(report[k]["pass"] for k in ("first_audio", "turn_ttft", "decode"))


@pytest.mark.proc  # a server process, two tenants' clients
def test_tenants_benchmark_quick_mode_pairs_each_round(tmp_path, monkeypatch, capsys):
    """perf/tenants.py --quick: every round times tenant B on A's items and on fresh ones,
    and A on its own again; the claim's ratio is the median of the paired ratios."""
    report = run_quick("tenants.py", tmp_path, monkeypatch, capsys, plot=True)
    claim = report["claim"]
    rounds = report["params"]["repeats"]
    assert len(claim["paired_ratios"]) == len(claim["measured"]["runs"]) == rounds
    assert len(claim["baseline"]["runs"]) == len(claim["own_items"]["runs"]) == rounds
    assert claim["ratio"] == pytest.approx(statistics.median(claim["paired_ratios"]), abs=1e-3)
    assert claim["pass"] == (claim["low"] <= claim["ratio"] <= claim["target"])
