"""`perf/gpu_check.py`'s engine figures: `TorchEngine` on CUDA against transformers on the same
GPU, for a random checkpoint of Qwen3-0.6B's shape (28 layers, hidden 1,024, 16 query and 8 KV
heads of 128, vocabulary 151,936, tied embeddings: ~0.6 B parameters), saved in bfloat16 by
transformers' `save_pretrained` and loaded by both sides.

- `decode`: bfloat16, greedy, prompts of 64 random tokens, 128 new; decode tokens/s =
  batch x (N - 1) / (T(N) - min T(1)) per round, median over rounds, rounds in alternating order
  (as perf/decode.py). Ours: concurrent `generate` calls, no store; theirs: one left-padded
  `generate` batch.
- `exact`: greedy tokens of ours and transformers' in float32 on the GPU (where both round
  alike), and of a second turn that reuses the first's KV from a CUDA store against a
  recompute; the same in bfloat16, reported (kernels of another shape round otherwise there).
- `prefix_reuse`: bfloat16 time to first token of a prompt whose first L - 64 tokens are in
  the store (a fresh 64-token suffix each round) against the same prompt recomputed.
"""

from __future__ import annotations

import gc
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from omni.compute.engine import TorchEngine
from omni.compute.models import load_pretrained
from omni.compute.sampling import SamplingParams
from omni.kv import KVStore, TierConfig
from perf._common import Samples, gc_frozen
from perf.decode import Params as DecodeParams
from perf.decode import hf_generate, measure_case, ours_generate

__all__ = ["QWEN3_0_6B", "engine_figures"]

QWEN3_0_6B: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
PAD_ID = 0
SUFFIX = 64  # new tokens after the cached prefix in the prefix-reuse figure


def save_checkpoint(path: Path, seed: int) -> int:
    """A random Qwen3-0.6B-shaped checkpoint (bfloat16) at `path`; its parameter count."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_0_6B)).to(torch.bfloat16)
    model.save_pretrained(path)
    count = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    return count


def load_hf(path: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()


def _prompts(generator: torch.Generator, lengths: list[int]) -> list[list[int]]:
    vocab = QWEN3_0_6B["vocab_size"]
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


async def decode(engine: TorchEngine, hf: Any, batch: int, new_tokens: int, repeats: int,
                 generator: torch.Generator) -> dict[str, Any]:
    """perf/decode.py's case (rounds in alternating order, inside `gc_frozen`) on the GPU,
    with each side's GPU operations per decoded token."""
    prompts = _prompts(generator, [64 - 4 * i for i in range(batch)])
    case = await measure_case(engine, hf, prompts,
                              DecodeParams(repeats=repeats, new_tokens=new_tokens))
    del case["pass"]  # the claim is gpu_check's (`claims.decode`), not a second one here
    case["gpu_ops_per_token"] = {
        "ours": await _kernels_per_token(lambda n: ours_generate(engine, prompts, n)),
        "transformers": await _kernels_per_token(lambda n: _async(hf_generate, hf, prompts, n))}
    return case


async def _async(fn: Any, *args: Any) -> Any:
    return fn(*args)


async def _gpu_ops(call: Any) -> int:
    """GPU operations (kernels, copies) that ``await call()`` ran, from torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        await call()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if str(e.device_type).endswith("CUDA"))


async def _kernels_per_token(generate: Any) -> float | str:
    """GPU operations per decoded token: those of 9 new tokens less those of 1, over 8. Small
    models decode at the speed their CPU launches these; the count says where one side does
    more."""
    try:
        one, nine = await _gpu_ops(lambda: generate(1)), await _gpu_ops(lambda: generate(9))
    except Exception as exc:  # a diagnostic: its failure is reported, not fatal
        return f"not counted: {type(exc).__name__}: {exc}"[:300]
    return round((nine - one) / 8, 1)


def _first_difference(a: list[list[int]], b: list[list[int]]) -> int | None:
    """The first token index where any row differs (None: all equal)."""
    for row_a, row_b in zip(a, b, strict=True):
        for i, (x, y) in enumerate(zip(row_a, row_b, strict=False)):
            if x != y:
                return i
    return None


async def exact(path: Path, dtype: torch.dtype, generator: torch.Generator,
                hf: Any | None = None) -> dict[str, Any]:
    """Greedy tokens vs transformers, and a reusing second turn vs a recompute, in `dtype`."""
    model, config = load_pretrained(path, dtype=dtype, device="cuda")
    layout = config.kv_layout(16, dtype)
    greedy = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
    with KVStore(layout, [TierConfig("device", 1 << 30)], device="cuda") as store:
        cached = TorchEngine(model, config, store=store, model_id="qwen3-shape")
        fresh = TorchEngine(model, config, store=None, model_id="qwen3-shape")
        prompt = _prompts(generator, [64])[0]
        ours = await fresh.generate(prompt, greedy)
        hf = hf if hf is not None else load_hf(path, dtype)
        theirs = hf_generate(hf, [prompt], greedy.max_new_tokens)[0]
        first_turn = _prompts(generator, [512])[0]
        first = await cached.generate(first_turn, greedy)
        second_turn = first_turn + first.token_ids + _prompts(generator, [37])[0]
        second = await cached.generate(second_turn, greedy)
        recomputed = await fresh.generate(second_turn, greedy)
    return {"dtype": str(dtype).removeprefix("torch."),
            "tokens_equal_transformers": ours.token_ids == theirs,
            "first_difference_transformers": _first_difference([ours.token_ids], [theirs]),
            "second_turn_cached_tokens": second.cached_tokens,
            "cached_equals_recomputed": second.token_ids == recomputed.token_ids,
            "first_difference_recomputed": _first_difference([second.token_ids],
                                                             [recomputed.token_ids])}


async def prefix_reuse(model: Any, config: Any, length: int, repeats: int,
                       generator: torch.Generator) -> dict[str, Any]:
    one = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    layout = config.kv_layout(16, torch.bfloat16)
    with KVStore(layout, [TierConfig("device", 4 << 30)], device="cuda") as store:
        # one request at a time: 4 rows (not 16) of a batch KV of `length` positions
        cached = TorchEngine(model, config, store=store, model_id="qwen3-shape", max_batch=4)
        fresh = TorchEngine(model, config, store=None, model_id="qwen3-shape", max_batch=4)
        base = _prompts(generator, [length - SUFFIX])[0]
        await cached.generate(base, one)  # the prefix's pages go into the store
        times: dict[str, list[float]] = {"cached": [], "recomputed": []}
        hits: list[int] = []
        with gc_frozen():
            for r in range(repeats + 1):
                prompt = base + _prompts(generator, [SUFFIX])[0]
                order = ("cached", "recomputed") if r % 2 == 0 else ("recomputed", "cached")
                for side in order:
                    gc.collect()
                    start = time.perf_counter()
                    result = await (cached if side == "cached" else fresh).generate(prompt, one)
                    if r:  # the first round warms up
                        times[side].append(time.perf_counter() - start)
                    if side == "cached":
                        hits.append(result.cached_tokens)
        ops: dict[str, int | str] = {}
        for side, engine in (("cached", cached), ("recomputed", fresh)):
            prompt = base + _prompts(generator, [SUFFIX])[0]
            try:  # what each side launches for one first token (a diagnostic)
                ops[side] = await _gpu_ops(lambda e=engine, p=prompt: e.generate(p, one))
            except Exception as exc:
                ops[side] = f"not counted: {type(exc).__name__}: {exc}"[:300]
    ms = {side: Samples(tuple(t)).map(lambda s: s * 1e3) for side, t in times.items()}
    return {"prompt_tokens": length, "cached_tokens": min(hits), "gpu_ops": ops,
            "ttft_ms": {side: s.to_json(2) for side, s in ms.items()},
            "speedup": round(ms["recomputed"].median / ms["cached"].median, 2),
            "ideal": round(length / (length - min(hits)), 1)}


async def engine_figures(seed: int, repeats: int, lengths: tuple[int, ...],
                         new_tokens: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    with tempfile.TemporaryDirectory(prefix="omni-gpu-qwen3-") as tmp:
        path = Path(tmp)
        parameters = save_checkpoint(path, seed)
        model, config = load_pretrained(path, dtype=torch.bfloat16, device="cuda")
        hf = load_hf(path, torch.bfloat16)
        engine = TorchEngine(model, config, store=None, model_id="qwen3-shape")
        cases = [await decode(engine, hf, batch, new_tokens, repeats, generator)
                 for batch in (1, 4)]
        exact_bf16 = await exact(path, torch.bfloat16, generator, hf)
        del hf
        reuse = [await prefix_reuse(model, config, n, repeats, generator) for n in lengths]
        del model, engine
        torch.cuda.empty_cache()
        exact_fp32 = await exact(path, torch.float32, generator)
    return {"model": {"shape": "Qwen3-0.6B", "parameters": parameters, **QWEN3_0_6B},
            "decode": cases, "exact": {"float32": exact_fp32, "bfloat16": exact_bf16},
            "prefix_reuse": reuse}
