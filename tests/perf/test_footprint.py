"""perf/footprint.py: the examples as Omni runs them against the same roles as separate
services, with the same outputs, resident KV counted from the stores and peak RSS per
process (the figures' sizes are not judged here, only what they count)."""

from tests.perf._run import run_quick


def test_footprint_quick_mode_compares_one_kv_copy_with_separate_services(tmp_path):
    report = run_quick("perf/footprint.py", tmp_path, timeout=400, plot=True)
    assert report["outputs_equal"] is True
    page_bytes = report["model"]["page_bytes"]

    image = report["image"]
    omni, separate = image["processes"]["omni"], image["processes"]["separate"]
    assert [p["role"] for p in omni] == ["omni"]
    assert [p["role"] for p in separate] == ["llm", "diffusion"]
    # Omni's diffusion role leased the LLM role's pages; the separate one computed its own.
    assert omni[0]["figures"]["diffusion_tokens_reused"] > 0
    assert separate[1]["figures"]["diffusion_tokens_reused"] == 0
    pages = omni[0]["kv_pages"]
    params = report["params"]
    assert pages == (params["prompt_tokens"] + params["expand"]) // report["model"]["page_size"]
    assert separate[0]["kv_pages"] == separate[1]["kv_pages"] == pages
    assert omni[0]["kv_bytes"] == pages * page_bytes
    assert image["k"] == 2
    assert image["kv_bytes"]["ratio"] == 0.5 and image["kv_bytes"]["pass"] is True

    dialogue = report["dialogue"]
    omni, separate = dialogue["processes"]["omni"], dialogue["processes"]["separate"]
    assert [p["role"] for p in separate] == ["llm", "speech"]
    assert separate[1]["kv_pages"] == 0  # the speech decoder keeps no KV
    assert omni[0]["figures"]["cached_tokens"] == separate[0]["figures"]["cached_tokens"]
    assert sum(omni[0]["figures"]["cached_tokens"]) > 0
    assert dialogue["k"] == 1 and dialogue["kv_bytes"]["ratio"] == 1.0

    for pipeline in (image, dialogue):
        rss = pipeline["peak_rss"]
        assert {"target", "measured", "baseline", "ratio", "pass", "note",
                "above_imports"} <= rss.keys()
        assert rss["measured"]["median"] > 0 and rss["baseline"]["median"] > 0
        assert isinstance(rss["pass"], bool)
        for process in (*pipeline["processes"]["omni"], *pipeline["processes"]["separate"]):
            assert process["rss_peak_mib"]["median"] >= process["rss_after_imports_mib"]["median"]
    assert report["all_pass"] == all(report[p][c]["pass"] for p in ("image", "dialogue")
                                     for c in ("kv_bytes", "peak_rss"))
