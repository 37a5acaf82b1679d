"""perf/footprint.py: the image example as Omni runs it against the same roles as separate
services, with the same outputs, resident KV counted from the stores and peak RSS per process
(the figures' sizes are not judged here, only what they count)."""

from tests.perf._run import run_quick


def test_footprint_quick_mode_compares_one_kv_copy_with_separate_services(tmp_path):
    report = run_quick("perf/footprint.py", tmp_path, timeout=400, plot=True)
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
    assert image["k"] == 2
    assert image["kv_bytes"]["ratio"] == 0.5 and image["kv_bytes"]["pass"] is True

    rss = image["peak_rss"]
    assert {"target", "measured", "baseline", "ratio", "pass", "note",
            "above_imports"} <= rss.keys()
    assert rss["measured"]["median"] > 0 and rss["baseline"]["median"] > 0
    assert isinstance(rss["pass"], bool)
    for process in (*omni, *separate):
        assert process["rss_peak_mib"]["median"] >= process["rss_after_imports_mib"]["median"]
    assert report["all_pass"] == (image["kv_bytes"]["pass"] and rss["pass"])
