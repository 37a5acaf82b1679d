"""Omni's GPU paths on a CUDA machine, in one command: the CUDA tests, then one JSON object of
figures, each beside its baseline from the same run.

1. `tests`: pytest of the tests marked ``gpu`` (skipped elsewhere) in `GPU_TEST_FILES`.
2. `tier_copies`: KV pages device <-> host through the device tier and the store, vs torch's
   copy of the same bytes (perf/_gpu_transfers.py). Target: >= 0.9x, each way and both.
3. `ipc_handoff`: 256 MiB of leased CUDA pages to a second process by CUDA IPC handle, vs a copy
   through pinned shared memory. Target: >= 20x faster.
4. `stage_value`: a 256 MiB CUDA tensor as a stage's argument to a worker of this host, by IPC
   handle vs through host memory.
5. `engine`: `TorchEngine` on CUDA, bfloat16, a random Qwen3-0.6B-shaped checkpoint: decode
   tokens/s vs transformers' `generate` on the same GPU (target >= 1x), greedy tokens equal to
   transformers' and cached == recomputed (float32), prefix-reuse time to first token
   (perf/_gpu_engine.py).

The tiny Qwen3-Omni on CUDA (float32 tokens and waveform against transformers on CUDA; bfloat16
speaks) is a test file of `tests`' (`QWEN3_OMNI_TESTS`), with a claim of its own.

Without a CUDA device it says so and exits 0 (nothing to check). Each section that fails
records its error and the next one runs; the JSON is rewritten after every section, so a run
cut short keeps what it measured. Exit status 1 when a test or a target failed.

Usage: ``python perf/gpu_check.py [--quick] [--out PATH.json]`` (the pytest log goes beside
--out, as ``PATH.pytest.txt``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROOT = Path(__file__).resolve().parent.parent
# The tests that hold Qwen3-Omni on CUDA to transformers on CUDA (a claim of their own).
QWEN3_OMNI_TESTS = "tests/compute/test_qwen3_omni_cuda.py"
# Every test file holding a test marked `gpu` (tests/perf/test_gpu_check.py keeps this list
# whole).
GPU_TEST_FILES = (
    "tests/compute/test_default_store.py",
    "tests/compute/test_engine_cuda.py",
    QWEN3_OMNI_TESTS,
    "tests/kv/test_store_cuda.py",
    "tests/kv/tiers/test_segment.py",
    "tests/kv/tiers/test_memory.py",
    "tests/transport/test_cuda.py",
    "tests/cluster/test_values_cluster.py",
)
MIB = 1 << 20
SECTIONS = ("tests", "tier_copies", "ipc_handoff", "stage_value", "engine")
# ratios to reach: tier copies vs torch's copy, IPC handoff's speedup over a copy (pages and
# stage values), decode tokens/s vs transformers, cached TTFT's speedup over a recompute
# (reusing KV is never slower than computing it)
TARGETS = {"tier_copies": 0.9, "ipc_handoff": 20.0, "decode": 1.0, "prefix_reuse": 1.0}


@dataclass(frozen=True, slots=True)
class Params:
    seed: int = 0
    repeats: int = 5  # rounds of each transfer figure
    engine_repeats: int = 3  # rounds of each engine figure
    nbytes: int = 256 * MIB
    prompt_lengths: tuple[int, ...] = (2048, 8192)
    new_tokens: int = 128
    tests_timeout_s: float = 180.0

    @classmethod
    def small(cls, seed: int = 0) -> Params:
        return cls(seed=seed, repeats=2, engine_repeats=2, nbytes=32 * MIB,
                   prompt_lengths=(512,), new_tokens=16)


def device_info() -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(0)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    name, driver, memory = ([x.strip() for x in smi.stdout.split(",")] if smi.returncode == 0
                            else [props.name, None, None])
    return {"name": name, "driver": driver, "memory": memory,
            "compute_capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count, "cuda": torch.version.cuda,
            "torch": torch.__version__}


def run_tests(p: Params, log: Path) -> dict[str, Any]:
    """pytest -m gpu over `GPU_TEST_FILES`; counts and each failure's message."""
    junit = log.with_suffix(".xml")
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
           f"--junitxml={junit}", *GPU_TEST_FILES]
    began = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              timeout=p.tests_timeout_s)
        output, status = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        output, status = f"{exc.stdout or ''}{exc.stderr or ''}\ntimed out", None
    log.write_text(output if isinstance(output, str) else output.decode())
    result: dict[str, Any] = {"exit": status, "seconds": round(time.perf_counter() - began, 1),
                              "passed": [], "failed": {}, "skipped": []}
    if junit.exists():
        for case in ElementTree.parse(junit).getroot().iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            problem = case.find("failure")
            if problem is None:
                problem = case.find("error")
            if problem is not None:
                result["failed"][name] = (problem.get("message") or "")[:1500]
            elif case.find("skipped") is not None:
                result["skipped"].append(name)
            else:
                result["passed"].append(name)
        junit.unlink()
    result["tail"] = output[-3000:] if status else output[-300:]
    return result


def _section(result: dict[str, Any], name: str, fn: Callable[[], Any],
             out: str | None) -> None:
    began = time.perf_counter()
    try:
        result[name] = fn()
    except Exception as exc:  # recorded; the next section runs
        result[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000],
                        "traceback": traceback.format_exc()[-4000:]}
    result[name]["seconds"] = round(time.perf_counter() - began, 1)
    _write(result, out)


def _write(result: dict[str, Any], out: str | None) -> None:
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")


def claims(result: dict[str, Any]) -> dict[str, Any]:
    """Each figure against its target, one claim each (a dict with a boolean "pass", the
    shape perf/report.py reads); a section that failed or did not run fails its claims."""
    def get(*path: str) -> Any:
        node: Any = result
        for key in path:
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return node

    def at_least(target: float, ratio: Any, **figures: Any) -> dict[str, Any]:
        ok = isinstance(ratio, int | float) and ratio >= target
        return {"target": target, "ratio": ratio, **figures, "pass": ok}

    tests = result.get("tests") or {}
    out: dict[str, Any] = {"gpu_tests": {
        "passed": len(tests.get("passed", [])), "failed": sorted(tests.get("failed", {})),
        "pass": tests.get("exit") == 0 and bool(tests.get("passed"))
        and not tests.get("failed")}}
    omni_module = QWEN3_OMNI_TESTS.removesuffix(".py").replace("/", ".") + "::"
    omni_tests = {kind: sorted(n for n in tests.get(kind, ()) if n.startswith(omni_module))
                  for kind in ("passed", "failed", "skipped")}
    out["qwen3_omni_equals_transformers"] = {
        **omni_tests, "pass": bool(omni_tests["passed"]) and not omni_tests["failed"]
        and not omni_tests["skipped"]}
    tiers = get("tier_copies", "vs_torch")
    out["tier_copies"] = at_least(
        TARGETS["tier_copies"], None if tiers is None else min(
            tiers["h2d"], tiers["d2h"], tiers["store_acquire"]),
        unit="x torch's copy", each=tiers)
    for name in ("ipc_handoff", "stage_value"):
        ms = get(name, "ms") or {}
        baseline = ms.get("copy", ms.get("host"))
        out[name] = at_least(TARGETS["ipc_handoff"], get(name, "speedup"), unit="ms",
                             measured=ms.get("ipc"), baseline=baseline)
    out["decode"] = [at_least(TARGETS["decode"], case["ratio"], batch=case["batch"],
                              unit="tokens/s",
                              measured=case["decode_tokens_per_s"]["ours"],
                              baseline=case["decode_tokens_per_s"]["transformers"])
                     for case in get("engine", "decode") or [{"ratio": None, "batch": None,
                                                             "decode_tokens_per_s": {
                                                                 "ours": None,
                                                                 "transformers": None}}]]
    fp32 = get("engine", "exact", "float32") or {}
    out["greedy_tokens_equal_transformers"] = {
        "dtype": "float32", "pass": fp32.get("tokens_equal_transformers") is True}
    out["cached_equals_recomputed"] = {
        "dtype": "float32", "cached_tokens": fp32.get("second_turn_cached_tokens"),
        "pass": fp32.get("cached_equals_recomputed") is True}
    out["prefix_reuse"] = [at_least(TARGETS["prefix_reuse"], case["speedup"], unit="ms",
                                    prompt_tokens=case["prompt_tokens"],
                                    cached_tokens=case["cached_tokens"],
                                    measured=case["ttft_ms"]["cached"],
                                    baseline=case["ttft_ms"]["recomputed"])
                           for case in get("engine", "prefix_reuse") or []]
    return out


def all_pass(found: dict[str, Any]) -> bool:
    """Whether every claim of `claims` passed."""
    return all(c["pass"] for v in found.values() for c in (v if isinstance(v, list) else [v]))


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--out", help="also write the JSON here (folders are created)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"which to run, comma-separated (default: all of {SECTIONS})")
    args = parser.parse_args(argv)
    sections = [name.strip() for name in args.sections.split(",") if name.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}: choose from {SECTIONS}")
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check (perf/gpu_check.py runs on a GPU machine)",
              file=sys.stderr)
        return 0
    import trio

    from perf import _gpu_engine, _gpu_transfers
    from perf._common import environment

    os.environ["PYTHONPATH"] = os.pathsep.join(  # for the subprocesses: -m cli, -m perf...
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    p = Params.small() if args.quick else Params()
    layout = _layout()
    log = Path(args.out).with_suffix(".pytest.txt") if args.out else ROOT / "gpu_check.pytest.txt"
    import transformers

    env = {**environment(), "torch": torch.__version__, "transformers": transformers.__version__}
    result: dict[str, Any] = {"benchmark": "gpu_check", "env": env,
                              "device": device_info(), "params": asdict(p)}
    runs: dict[str, Callable[[], Any]] = {
        "tests": lambda: run_tests(p, log),
        "tier_copies": lambda: _gpu_transfers.tier_copies(layout, p.nbytes, p.repeats),
        "ipc_handoff": lambda: _gpu_transfers.ipc_handoff(layout, p.nbytes, p.repeats),
        "stage_value": lambda: trio.run(_gpu_transfers.stage_value, p.nbytes, p.repeats),
        "engine": lambda: trio.run(_gpu_engine.engine_figures, p.seed, p.engine_repeats,
                                   p.prompt_lengths, p.new_tokens),
    }
    for name in SECTIONS:
        if name in sections:
            _section(result, name, runs[name], args.out)
    result["claims"] = claims(result)
    result["all_pass"] = all_pass(result["claims"])
    _write(result, args.out)
    print(json.dumps(result, indent=2))
    return 0 if result["all_pass"] else 1


def _layout() -> Any:
    """The KV layout of the engine's Qwen3-0.6B shape (bfloat16, 16-token pages)."""
    import torch

    from omni.kv import KVLayout
    from perf._gpu_engine import QWEN3_0_6B

    return KVLayout(QWEN3_0_6B["num_hidden_layers"], QWEN3_0_6B["num_key_value_heads"],
                    QWEN3_0_6B["head_dim"], 16, torch.bfloat16)


if __name__ == "__main__":
    sys.exit(main())
