"""perf/gpu_check.py without a GPU: it says there is nothing to check and exits 0; its list of
GPU test files is whole; a section that failed fails its claims instead of passing them."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from tests.perf._run import ROOT, run_script, script_globals


@pytest.fixture
def gpu_check(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """perf/gpu_check.py's names (the file run, not imported)."""
    return SimpleNamespace(**script_globals("gpu_check.py", monkeypatch))


def test_every_test_file_with_a_gpu_test_is_run_by_the_gpu_check(gpu_check) -> None:
    marked = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")
                    if re.search(r"pytest\.mark\.gpu\b", path.read_text()))
    assert sorted(gpu_check.GPU_TEST_FILES) == marked


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_it_says_so_and_exits_0(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_script("gpu_check.py", [], monkeypatch, capsys)
    assert status == 0
    assert out == "" and "no CUDA device" in err


def test_claims_fail_where_a_section_failed_and_pass_where_targets_are_met(gpu_check) -> None:
    samples = {"median": 1.0}
    omni = gpu_check.QWEN3_OMNI_TESTS.removesuffix(".py").replace("/", ".")
    measured = {
        "tests": {"exit": 0, "passed": ["t", f"{omni}::test_a", f"{omni}::test_b"],
                  "failed": {}, "skipped": []},
        "tier_copies": {"vs_torch": {"h2d": 0.95, "d2h": 0.91, "store_acquire": 0.93,
                                     "h2d_waiting_each": 0.6}},
        "ipc_handoff": {"speedup": 25.0, "ms": {"ipc": samples, "copy": samples}},
        "stage_value": {"speedup": 140.0, "ms": {"ipc": samples, "host": samples}},
        "engine": {"decode": [{"batch": b, "ratio": r, "decode_tokens_per_s": {
                       "ours": samples, "transformers": samples}} for b, r in ((1, 1.2),
                                                                              (4, 1.05))],
                   "exact": {"float32": {"tokens_equal_transformers": True,
                                         "cached_equals_recomputed": True}},
                   "prefix_reuse": [{"prompt_tokens": 2048, "cached_tokens": 1984,
                                     "speedup": 3.0, "ttft_ms": {"cached": samples,
                                                                 "recomputed": samples}}]},
    }
    assert gpu_check.all_pass(gpu_check.claims(measured))
    assert gpu_check.claims(measured)["qwen3_omni_equals_transformers"]["passed"] == [
        f"{omni}::test_a", f"{omni}::test_b"]
    measured["tier_copies"] = {"error": "RuntimeError: boom"}
    measured["engine"]["decode"][1]["ratio"] = 0.99
    verdict = gpu_check.claims(measured)
    assert not gpu_check.all_pass(verdict)
    assert not verdict["tier_copies"]["pass"] and not verdict["decode"][1]["pass"]
    assert verdict["decode"][0]["pass"] and verdict["ipc_handoff"]["pass"]
    assert verdict["gpu_tests"]["pass"] and verdict["prefix_reuse"][0]["pass"]
    del measured["engine"]  # a section that did not run fails its claims
    verdict = gpu_check.claims(measured)
    assert not verdict["decode"][0]["pass"]
    assert not verdict["greedy_tokens_equal_transformers"]["pass"]


def test_the_qwen3_omni_claim_passes_only_when_its_cuda_tests_all_ran_and_passed(
        gpu_check) -> None:
    omni = gpu_check.QWEN3_OMNI_TESTS.removesuffix(".py").replace("/", ".")

    def verdict(passed: list[str], failed: dict[str, str], skipped: list[str]) -> bool:
        tests = {"exit": 0 if not failed else 1, "passed": passed, "failed": failed,
                 "skipped": skipped}
        return gpu_check.claims({"tests": tests})["qwen3_omni_equals_transformers"]["pass"]

    assert verdict([f"{omni}::a", f"{omni}::b"], {}, [])
    assert not verdict([f"{omni}::a"], {f"{omni}::b": "tokens differ"}, [])
    assert not verdict([f"{omni}::a"], {}, [f"{omni}::b"])
    assert not verdict(["tests.kv.test_store_cuda::x"], {}, [])  # none of its tests ran
    assert not verdict([], {}, [])  # the tests section failed or did not run
