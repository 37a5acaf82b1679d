"""Decode throughput: `TorchEngine` vs transformers' `generate` on the same weights.

One random Llama per model size is saved with `save_pretrained` and loaded by both sides:
ours with `TorchEngine.from_pretrained` (no KV store, temperature 0, `ignore_eos`), theirs with
`AutoModelForCausalLM.from_pretrained(dir, dtype=float32)` and `generate(do_sample=False,
max_new_tokens=N, eos_token_id=None)`. Prompts of ~64 random tokens, 128 new tokens.

- batch 1: one request;
- batch 4: ours four concurrent `generate` calls (the engine batches them per decode step);
  theirs one left-padded batch of four (prompt lengths 64, 60, 56, 52, so padding is real).

Prefill is taken out by difference: each side also runs with ``max_new_tokens=1`` (prefill and
the first token) in the same rounds, and decode tokens/s = batch x (N - 1) / (T(N) - min T(1)),
per round, then the median over rounds. The fixed cost taken out is the fastest T(1) of the
side's rounds: one slow T(1) on a loaded machine would otherwise make its round's decode look
free (T(N) <= T(1)). Tokens/s of the whole call (batch x N / T(N)) are
reported too. The four calls of a round run in alternating order. Target: ours >= 1.0x theirs
in decode tokens/s, for every model and batch size. Tokens must be equal (greedy).

Constrained decoding (`constrained`): each model with the byte tokenizer, decode tokens per CPU
second of the process with a JSON schema vs the same requests without one, per batch size
(perf/_decode_constrained.py). Target: >= 0.9x.

Models: "tiny" (`tiny_config()`: hidden 64, 2 layers: per-step overhead dominates) and
"small" (hidden 256, 4 layers, MLP 768: the matmuls weigh more). Torch threads: the default.

Usage: ``python perf/decode.py [--quick] [--out PATH.json] [--plot PATH.png] [--profile]``
(the profile of our decode loop, batch 1 on the tiny model, goes to stderr).
"""

from __future__ import annotations

import cProfile
import gc
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import trio

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from omni.compute.engine import TorchEngine
from omni.compute.models import save_pretrained, tiny_model
from omni.compute.sampling import SamplingParams
from perf._common import (
    Samples,
    benchmark_parser,
    environment,
    gc_frozen,
    params_from,
    plot_bars,
    profile_report,
    write_json,
)
from perf._decode_constrained import measure_constrained

__all__ = ["MODELS", "Params", "main", "measure"]

TARGET = 1.0  # our decode tokens/s / transformers', at least
PAD_ID = 0
PAD_STEP = 4  # prompt i of a batch is PAD_STEP * i tokens shorter than the first

MODELS: dict[str, dict[str, int]] = {  # tiny_model overrides
    "tiny": {},
    "small": {"hidden_size": 256, "intermediate_size": 768, "num_layers": 4, "num_heads": 4,
              "num_kv_heads": 2},
}


@dataclass(frozen=True, slots=True)
class Params:
    """The sizes of one run (`quick` shrinks them for a smoke run)."""

    seed: int = 0
    repeats: int = 5
    prompt_tokens: int = 64
    new_tokens: int = 128
    batch_sizes: tuple[int, ...] = (1, 4)
    models: tuple[str, ...] = field(default_factory=lambda: tuple(MODELS))
    constrained_seconds: float = 30.0  # rounds of each constrained case fill about this long
    quick: bool = False

    @classmethod
    def small(cls, seed: int = 0) -> Params:
        """Sizes for a smoke run (a few seconds)."""
        # 32 tokens, 3 rounds: decode then outlasts T(1)'s noise (at 16 tokens, 1 round, one
        # loaded-machine hiccup in the prefill left nothing to divide by); the constrained
        # cases: as many rounds as fit in a second, at least 3 (their T(1) is a median)
        return cls(seed=seed, repeats=3, new_tokens=32, models=("tiny",),
                   constrained_seconds=1.0, quick=True)


# ---------------------------------------------------------------------------------------------
# The two sides


def load_hf(path: Path) -> Any:
    """transformers' model of the checkpoint at `path`, float32, eval mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def prompts_for(params: Params, batch: int, generator: torch.Generator,
                vocab_size: int) -> list[list[int]]:
    """`batch` random prompts (ids past 0..2), the i-th PAD_STEP * i tokens shorter."""
    return [torch.randint(3, vocab_size, (params.prompt_tokens - PAD_STEP * i,),
                          generator=generator).tolist() for i in range(batch)]


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [B, T_max], padded on the left as HF generate expects."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids, mask


def hf_generate(hf: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy generation of every prompt in one padded batch, on the model's
    device."""
    ids, mask = left_padded(prompts)
    out = hf.generate(ids.to(hf.device), attention_mask=mask.to(hf.device), do_sample=False,
                      max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=PAD_ID)
    return out[:, ids.shape[1]:].tolist()


async def ours_generate(engine: TorchEngine, prompts: list[list[int]],
                        new_tokens: int) -> list[list[int]]:
    """Our greedy generation of every prompt, as concurrent requests."""
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    out: list[list[int]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        out[i] = (await engine.generate(prompts[i], sampling)).token_ids

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return out


# ---------------------------------------------------------------------------------------------
# Measuring


async def _timed(fn: Callable[[], Awaitable[Any] | Any]) -> float:
    """Seconds one call of `fn` takes (awaited if it returns an awaitable), after a full
    garbage collection."""
    gc.collect()
    start = time.perf_counter()
    result = fn()
    if hasattr(result, "__await__"):
        await result
    return time.perf_counter() - start


async def measure_case(engine: TorchEngine, hf: Any, prompts: list[list[int]],
                       params: Params) -> dict[str, Any]:
    """One model at one batch size: the four calls per round, alternating order."""
    n, batch = params.new_tokens, len(prompts)
    ours_tokens = await ours_generate(engine, prompts, n)  # also the warm-up
    hf_tokens = hf_generate(hf, prompts, n)
    await ours_generate(engine, prompts, 1)
    hf_generate(hf, prompts, 1)
    calls = {
        "ours_n": lambda: ours_generate(engine, prompts, n),
        "ours_1": lambda: ours_generate(engine, prompts, 1),
        "hf_n": lambda: hf_generate(hf, prompts, n),
        "hf_1": lambda: hf_generate(hf, prompts, 1),
    }
    times: dict[str, list[float]] = {k: [] for k in calls}
    with gc_frozen():
        for r in range(params.repeats):
            for key in (list(calls) if r % 2 == 0 else list(reversed(calls))):
                times[key].append(await _timed(calls[key]))
    return _case_summary(times, batch, n, ours_tokens, hf_tokens)


def _case_summary(times: dict[str, list[float]], batch: int, n: int,
                  ours_tokens: list[list[int]], hf_tokens: list[list[int]]) -> dict[str, Any]:
    def decode_rate(side: str) -> Samples:
        t1 = min(times[f"{side}_1"])  # the fixed cost: a round's T(N) includes one, so is above
        return Samples(tuple(batch * (n - 1) / (tn - t1) for tn in times[f"{side}_n"]))

    def call_rate(side: str) -> Samples:
        return Samples(tuple(batch * n / t for t in times[f"{side}_n"]))

    ours, theirs = decode_rate("ours"), decode_rate("hf")
    ratio = ours.median / theirs.median
    return {
        "batch": batch,
        "decode_tokens_per_s": {"ours": ours.to_json(1), "transformers": theirs.to_json(1)},
        "call_tokens_per_s": {"ours": call_rate("ours").to_json(1),
                              "transformers": call_rate("hf").to_json(1)},
        "prefill_and_first_token_ms": {
            "ours": Samples(tuple(times["ours_1"])).map(lambda s: s * 1e3).to_json(2),
            "transformers": Samples(tuple(times["hf_1"])).map(lambda s: s * 1e3).to_json(2)},
        "ratio": round(ratio, 3),
        "call_ratio": round(call_rate("ours").median / call_rate("hf").median, 3),
        "pass": ratio >= TARGET,
        "tokens_equal": ours_tokens == hf_tokens,
        "new_tokens_each": [len(t) for t in ours_tokens],
    }


async def measure_model(name: str, params: Params, directory: Path) -> dict[str, Any]:
    """Save one model, load it on both sides, measure every batch size."""
    model, config = tiny_model(seed=params.seed, **MODELS[name])
    path = directory / name
    save_pretrained(model, config, path)
    engine = TorchEngine.from_pretrained(path, store=None)  # rounds repeat their prompts
    hf = load_hf(path)
    generator = torch.Generator().manual_seed(params.seed)
    cases = []
    for batch in params.batch_sizes:
        prompts = prompts_for(params, batch, generator, config.vocab_size)
        cases.append(await measure_case(engine, hf, prompts, params))
    return {"model": name, "config": {**config.to_hf(), "architectures": None},
            "parameters": sum(p.numel() for p in model.parameters()), "cases": cases}


async def measure(params: Params) -> dict[str, Any]:
    """Every model and batch size; the result dict."""
    torch.manual_seed(params.seed)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="omni-decode-") as tmp:
        models = [await measure_model(name, params, Path(tmp)) for name in params.models]
    constrained = await measure_constrained(
        params.seed, {name: MODELS[name] for name in params.models}, params.batch_sizes,
        params.new_tokens, params.repeats, params.constrained_seconds)
    import transformers

    cases = [c for m in models for c in m["cases"]]
    return {
        "benchmark": "decode",
        "env": {**environment(), "torch": torch.__version__,
                "transformers": transformers.__version__,
                "torch_threads": torch.get_num_threads(),
                "loadavg_before": [round(x, 2) for x in load_before],
                "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
        "params": asdict(params),
        "target": TARGET,
        "models": models,
        "constrained": constrained,
        "pass": all(c["pass"] for c in cases + constrained["cases"]),
        "tokens_equal": all(c["tokens_equal"] for c in cases),
        "note": ("decode tokens/s = batch x (N - 1) / (T(N) - min T(1)) per round, median over "
                 "rounds; ratio = ours / transformers of those medians. Ours: TorchEngine, no "
                 "KV store, concurrent generate calls for batch > 1. Theirs: generate() on a "
                 "left-padded batch, default DynamicCache. Same process, same threads."),
    }


# ---------------------------------------------------------------------------------------------
# Plot and profile


def _plot(result: dict[str, Any], path: str) -> None:
    panels = []
    for m in result["models"]:
        for case in m["cases"]:
            rates = case["decode_tokens_per_s"]
            panels.append((f"{m['model']}, batch {case['batch']} (x{case['ratio']})",
                           "decode tokens/s (higher is better)",
                           {"omni": Samples(tuple(rates["ours"]["runs"])),
                            "transformers": Samples(tuple(rates["transformers"]["runs"]))}))
    env = result["env"]
    plot_bars(path, f"Decode: TorchEngine vs transformers {env['transformers']} "
                    f"({env['cpu_count']} CPUs, torch {env['torch']})", panels)


async def profile(params: Params, top: int = 30) -> str:
    """cProfile our engine's steps (worker threads) for one batch-1 generation, tiny model."""
    model, config = tiny_model(seed=params.seed, **MODELS["tiny"])
    engine = TorchEngine(model, config, store=None)
    prompts = prompts_for(params, 1, torch.Generator().manual_seed(params.seed),
                          config.vocab_size)
    await ours_generate(engine, prompts, params.new_tokens)  # warm-up
    profiler = cProfile.Profile()
    step = engine.runner.execute

    def profiled_step(plan: Any) -> None:
        profiler.enable()  # in the worker thread that runs the step
        try:
            step(plan)
        finally:
            profiler.disable()

    engine.runner.execute = profiled_step  # type: ignore[method-assign]
    await ours_generate(engine, prompts, params.new_tokens)
    return profile_report(profiler, top)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse `argv`, run the benchmark, print (and optionally write and plot) the result."""
    parser = benchmark_parser(__doc__, repeats_help="rounds per measurement",
                              plot_help="write a bar chart (PNG) here",
                              profile_help="also cProfile our decode loop (to stderr)")
    args = parser.parse_args(argv)
    params = params_from(args, Params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        result = trio.run(measure, params)
    write_json(result, args.out)
    if args.plot:
        _plot(result, args.plot)
    if args.profile:
        sys.stderr.write(trio.run(profile, params))
    return result


if __name__ == "__main__":
    main()
