"""perf/footprint.py: the image example as Omni runs it against the same roles as separate
services, with the same outputs, resident KV counted from the stores and peak RSS per process.
Each role is a process of its own (what is measured is per process), so the suite checks what
the benchmark committed, perf/results/footprint.json: what the figures count, and each claim's
pass by its rule."""

import pytest

from tests.perf._run import check_claim, committed, samples


def test_footprint_results_compare_one_kv_copy_with_separate_services():
    report = committed("footprint")
    assert report["outputs_equal"] is True
    page_bytes = report["model"]["page_bytes"]

    image = report["image"]
    assert image["outputs_equal"] is True
    omni, separate = image["processes"]["omni"], image["processes"]["separate"]
    assert [p["role"] for p in omni] == ["omni"]
    assert [p["role"] for p in separate] == ["llm", "diffusion"]
    # Omni's diffusion role leased the LLM role's pages; the separate one computed its own.
    assert omni[0]["figures"]["diffusion_tokens_reused"] > 0
    assert separate[1]["figures"]["diffusion_tokens_reused"] == 0
    pages = omni[0]["kv_pages"]
    params = report["params"]
    assert report["requests"]["image_prompt_chars"] == params["prompt_tokens"]
    assert pages == (params["prompt_tokens"] + params["expand"]) // report["model"]["page_size"]
    assert separate[0]["kv_pages"] == separate[1]["kv_pages"] == pages
    assert omni[0]["kv_bytes"] == pages * page_bytes

    kv = image["kv_bytes"]  # resident KV: Omni's at most 1/k of the separate services'
    check_claim(kv, "kv_bytes")
    assert image["k"] == kv["k"] == 2 and kv["target"] == 0.5
    assert kv["measured"]["median"] == pytest.approx(
        sum(p["kv_bytes"] for p in omni) / 2**20, rel=1e-3)
    assert kv["baseline"]["median"] == pytest.approx(
        sum(p["kv_bytes"] for p in separate) / 2**20, rel=1e-3)
    assert kv["ratio"] == 0.5 and kv["pass"] is True

    rss = image["peak_rss"]  # peak RSS summed over the variant's processes: Omni's below
    check_claim(rss, "peak_rss")
    assert "above_imports" in rss and rss["target"] == 1.0
    assert rss["measured"]["median"] > 0 and rss["baseline"]["median"] > 0
    assert rss["ratio"] == pytest.approx(
        rss["measured"]["median"] / rss["baseline"]["median"], rel=0.01)
    assert rss["pass"] == (image["outputs_equal"] and rss["ratio"] < 1)
    for process in (*omni, *separate):
        assert samples(process["rss_peak_mib"]) and samples(process["rss_after_imports_mib"])
        assert process["rss_peak_mib"]["median"] >= process["rss_after_imports_mib"]["median"]
    assert report["all_pass"] == (kv["pass"] and rss["pass"])
