"""Diffusion on the LLM: prompt KV reused from the store vs the prompt recomputed every step.

Claim: an `ImageGenerator` that takes the prompt's KV from the store (computed once by the LLM
role) and runs only the image tokens at each step is at least 0.8x the ideal FLOP ratio faster
than a pipeline without KV sharing, which runs prompt + image tokens through the model at
every step (`_denoise_recompute`, the same masks: text causal, image tokens see everything).

The ideal ratio is analytic, from the config: matmul FLOPs per token (q/k/v, o, gate/up, down
projections and the diffusion head) plus attention FLOPs per (query, key) pair the mask lets
through (4 x heads x head_dim per layer: QK^T and PV). Recomputation: prompt + image tokens,
causal prompt pairs plus every image x (prompt + image) pair, each step. Reuse: image tokens
and their pairs only (the prompt KV is read, not computed). The recompute baseline's SDPA also
computes masked-out pairs; they are not counted, which makes the target stricter.

Setup (default): `tiny_model(seed=0, hidden_size=256, intermediate_size=688, num_layers=4,
num_heads=8, num_kv_heads=4)` in float32 on the CPU, single-threaded (`--threads N`; 0 = torch's
default; recorded in the JSON): on a shared machine a second thread waiting for a busy core
makes every measurement noisier. 1,024 prompt tokens (seeded random byte tokens), latents
4 x 32 x 32 with patch 2 (256 image tokens), 20 Euler steps, guidance 1 (one pass per step, so
the ratio is the claim's). Both sides are whole generations (noise to decoded image), measured
alternately, median of the repeats. A second measurement times classifier-free guidance
(guidance 3, a 256-token negative prompt, then one as long as the prompt) with the two passes
batched (a batch of 2, the shorter prompt padded and masked) against one after the other.

Usage: ``python perf/diffusion_reuse.py [--quick] [--repeats N] [--threads N] [--out PATH.json]
[--plot PATH.png]``
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import trio

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from omni.compute.diffusion import PADDING_TOLERANCE, ImageGenerator, _denoise_recompute
from omni.compute.engine import TorchEngine
from omni.compute.models import DecoderConfig, tiny_config
from omni.compute.sampling import SamplingParams
from omni.kv import KVStore, TierConfig
from perf._common import Samples, environment, plot_bars, write_json

__all__ = ["Params", "ideal_flops", "main", "measure"]

TARGET_FRACTION = 0.8  # of the ideal FLOP ratio
MODEL = dict(hidden_size=256, intermediate_size=688, num_layers=4, num_heads=8, num_kv_heads=4)


@dataclass(frozen=True)
class Params:
    seed: int = 0
    repeats: int = 5
    prompt_tokens: int = 1024
    latent_size: int = 32  # latents [4, size, size], patch 2: (size / 2)^2 image tokens
    steps: int = 20
    negative_tokens: int = 256
    cfg_repeats: int = 3
    threads: int = 1  # torch intra-op threads; 0 = torch's default
    quick: bool = False

    @classmethod
    def small(cls, seed: int = 0) -> Params:
        return cls(seed=seed, repeats=2, prompt_tokens=256, latent_size=16, steps=4,
                   negative_tokens=64, cfg_repeats=1, quick=True)


def ideal_flops(config: DecoderConfig, num_prompt: int, num_image: int, steps: int,
                patch_values: int, *, recompute: bool, dense: bool = False) -> float:
    """Analytic FLOPs of one generation's forward passes (multiply-add = 2 FLOPs): the pairs
    the mask lets through, or (`dense`) every pair SDPA computes under a dense mask."""
    e, i, d = config.hidden_size, config.intermediate_size, int(config.head_dim or 0)
    h, hkv, layers = config.num_heads, config.num_kv_heads, config.num_layers
    per_token = layers * 2 * (e * (h + 2 * hkv) * d + h * d * e + e * 2 * i + i * e)
    head_per_image_token = 2 * 2 * patch_values * e  # latent_in + velocity_out
    per_pair = layers * 4 * h * d
    image_pairs = num_image * (num_prompt + num_image)
    if recompute:
        tokens = num_prompt + num_image
        pairs = tokens ** 2 if dense else num_prompt * (num_prompt + 1) // 2 + image_pairs
    else:
        tokens, pairs = num_image, image_pairs
    per_step = tokens * per_token + pairs * per_pair + num_image * head_per_image_token
    return float(steps * per_step)


def _prompt(rng: np.random.Generator, length: int) -> list[int]:
    return [int(t) for t in rng.integers(3, 259, length)]  # ByteTokenizer's byte ids


def _build(params: Params) -> tuple[TorchEngine, KVStore]:
    layout = tiny_config(**MODEL).kv_layout(16, torch.float32)
    pages = 4 * (params.prompt_tokens + params.negative_tokens) // layout.page_size + 16
    store = KVStore(layout, [TierConfig("device", pages * layout.page_bytes)])
    return TorchEngine.tiny(seed=params.seed, store=store, **MODEL), store


async def _alternate(measures: dict[str, Callable[[], Awaitable[float]]],
                     repeats: int) -> dict[str, Samples]:
    """One untimed round, then `repeats` rounds, reversing the order every round."""
    names = list(measures)
    for name in names:
        await measures[name]()
    values: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            gc.collect()
            values[name].append(await measures[name]())
    return {name: Samples(tuple(v)) for name, v in values.items()}


def _recompute_generation(gen: ImageGenerator, prompt: list[int], size: int, steps: int,
                          seed: int) -> torch.Tensor:
    """A whole generation without KV sharing: prompt + image tokens every step, then decode."""
    engine = gen.engine
    with torch.inference_mode():
        embeds = engine.runner.embed_prompt(engine.prepare(prompt), 0)
    state = gen.sampler.start((gen.head.latent_channels, size, size), steps, seed=seed)
    _denoise_recompute(gen.model, gen.head, gen.sampler, state, [embeds], 1.0)
    gen.decoder.decode(state.latents)
    return state.latents


async def _reuse_vs_recompute(params: Params, engine: TorchEngine,
                              prompt: list[int]) -> dict[str, Any]:
    gen, size, steps = ImageGenerator(engine, seed=params.seed), params.latent_size, params.steps
    await engine.generate(prompt, SamplingParams(max_new_tokens=0))  # the LLM role's prefill
    results: dict[str, Any] = {}

    async def reuse() -> float:
        start = time.perf_counter()
        results["reuse"] = await gen.generate(prompt, height=size, width=size, steps=steps,
                                              guidance=1.0, seed=params.seed)
        return time.perf_counter() - start

    async def recompute() -> float:
        start = time.perf_counter()
        results["recompute"] = await trio.to_thread.run_sync(
            _recompute_generation, gen, prompt, size, steps, params.seed)
        return time.perf_counter() - start

    samples = await _alternate({"reuse": reuse, "recompute": recompute}, params.repeats)
    num_image = (size // gen.head.patch) ** 2
    patch_values = gen.head.latent_channels * gen.head.patch ** 2
    flops = {mode: ideal_flops(engine.config, len(prompt), num_image, steps, patch_values,
                               recompute=mode == "recompute") for mode in ("recompute", "reuse")}
    ideal = flops["recompute"] / flops["reuse"]
    executed = ideal_flops(engine.config, len(prompt), num_image, steps, patch_values,
                           recompute=True, dense=True)
    speedup = samples["recompute"].median / samples["reuse"].median
    reused = results["reuse"]
    return {
        "unit": "s per generation", "reuse": samples["reuse"].to_json(4),
        "recompute": samples["recompute"].to_json(4),
        "speedup": round(speedup, 3), "ideal_flop_ratio": round(ideal, 3),
        "fraction_of_ideal": round(speedup / ideal, 3), "target_fraction": TARGET_FRACTION,
        "pass": bool(speedup >= TARGET_FRACTION * ideal),
        "gflops": {k: round(v / 1e9, 2) for k, v in flops.items()},
        "recompute_gflops_executed": round(executed / 1e9, 2),
        "executed_flop_ratio": round(executed / flops["reuse"], 3),
        "achieved_gflop_per_s": {
            "reuse": round(flops["reuse"] / samples["reuse"].median / 1e9, 1),
            "recompute": round(flops["recompute"] / samples["recompute"].median / 1e9, 1)},
        "image_tokens": num_image, "prompt_tokens_reused": reused.prompt_tokens_reused,
        "time_per_step_s": round(reused.time_per_step, 5),
        "kv_bytes_resident": reused.kv_bytes_resident,
        "kv_bytes_separate": reused.kv_bytes_separate,
        "max_abs_latent_diff": float((reused.latents - results["recompute"]).abs().max()),
    }


async def _cfg_batching(params: Params, engine: TorchEngine, prompt: list[int],
                        negative: list[int]) -> dict[str, Any]:
    """Batched vs separate CFG passes (reuse), for one negative prompt."""
    gens = {"batched": ImageGenerator(engine, seed=params.seed, batch_cfg=True),
            "separate": ImageGenerator(engine, seed=params.seed, batch_cfg=False)}
    size, steps = params.latent_size, params.steps

    def timed(gen: ImageGenerator) -> Callable[[], Awaitable[float]]:
        async def run() -> float:
            start = time.perf_counter()
            await gen.generate(prompt, height=size, width=size, steps=steps, guidance=3.0,
                               negative_prompt=negative, seed=params.seed)
            return time.perf_counter() - start
        return run

    samples = await _alternate({k: timed(g) for k, g in gens.items()}, params.cfg_repeats)
    keys = [len(prompt) + (size // 2) ** 2, len(negative) + (size // 2) ** 2]
    auto_batches = 2 * max(keys) <= PADDING_TOLERANCE * sum(keys)
    return {"negative_prompt_tokens": len(negative),
            **{k: s.to_json(4) for k, s in samples.items()},
            "faster": min(samples, key=lambda k: samples[k].median),
            "auto_chooses": "batched" if auto_batches else "separate"}


async def measure(params: Params) -> dict[str, Any]:
    """Run both measurements and return the JSON-ready result."""
    torch.manual_seed(params.seed)
    rng = np.random.default_rng(params.seed)
    prompt, negative = _prompt(rng, params.prompt_tokens), _prompt(rng, params.negative_tokens)
    engine, store = _build(params)
    try:
        main = await _reuse_vs_recompute(params, engine, prompt)
        cfg = {"unit": "s per generation (reuse, guidance 3)", "runs": [
            await _cfg_batching(params, engine, prompt, negative),
            await _cfg_batching(params, engine, prompt, _prompt(rng, params.prompt_tokens))]}
    finally:
        store.close()
    return {"benchmark": "diffusion_reuse",
            "env": {**environment(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads()},
            "model": {"tiny_model": {"seed": params.seed, **MODEL}, "dtype": "float32",
                      "device": "cpu"},
            "params": asdict(params), "reuse_vs_recompute": main, "cfg_batching": cfg}


def _plot(result: dict[str, Any], path: str) -> None:
    main, cfg = result["reuse_vs_recompute"], result["cfg_batching"]

    steps = result["params"]["steps"]

    def samples(entry: dict[str, Any]) -> Samples:
        return Samples(tuple(entry["runs"]))

    def per_step_ms(entry: dict[str, Any]) -> Samples:
        return Samples(tuple(1e3 * v / steps for v in entry["runs"]))

    plot_bars(path, f"Diffusion on the LLM: prompt KV reuse (torch threads: "
                    f"{result['env']['torch_threads']})", [
        (f"speedup {main['speedup']:.2f}x, ideal {main['ideal_flop_ratio']:.2f}x",
         "ms per denoising step (lower is better)",
         {"reuse": per_step_ms(main["reuse"]), "recompute": per_step_ms(main["recompute"])}),
        *[(f"CFG, negative prompt of {run['negative_prompt_tokens']} tokens",
           "s per generation (lower is better)",
           {"batched": samples(run["batched"]), "separate": samples(run["separate"])})
          for run in cfg["runs"]],
    ])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse `argv`, run the benchmark, print (and optionally write and plot) the result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=None, help="repeats per measurement")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1; 0 = torch's default)")
    parser.add_argument("--out", help="also write the JSON here (folders are created)")
    parser.add_argument("--plot", help="write a bar chart (PNG) here")
    args = parser.parse_args(argv)
    params = Params.small(args.seed) if args.quick else Params(seed=args.seed)
    params = Params(**{**asdict(params), "threads": args.threads,
                       **({} if args.repeats is None else {"repeats": args.repeats})})
    if params.threads > 0:
        torch.set_num_threads(params.threads)
    result = trio.run(measure, params)
    write_json(result, args.out)
    if args.plot:
        _plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
