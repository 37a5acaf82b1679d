"""`perf/decode.py`'s constrained case: decode tokens/s with a JSON schema vs without, same run.

One `TorchEngine` (the tiny model and the byte tokenizer, no KV store) serves both sides, with
the same prompts and greedy parameters; the constrained side adds ``json_schema`` (compiled
once in the warm-up; its matcher fills one token bitmask per row per step, which the sampler
applies). Decode tokens/s = (tokens - batch) / (T(N) - T(1)) per round, as for the other
cases; the four calls of a round run in alternating order. The claim's ratio compares the best
rates, each from the fastest T(N) and T(1) over the rounds (as `timeit` takes the minimum: on
a shared machine load from elsewhere only adds time); the medians' ratio and each round's ratio
are recorded too. Target: constrained >= 0.9x unconstrained, per batch size.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import torch
import trio

from omni.compute.engine import TorchEngine
from omni.compute.models import tiny_model
from omni.compute.sampling import SamplingParams
from omni.compute.tokenizer import ByteTokenizer
from perf._common import Samples, claim, time_async

__all__ = ["SCHEMA", "TARGET", "measure_constrained"]

TARGET = 0.9  # constrained decode tokens/s / unconstrained, at least
SCHEMA = {  # an object with free text, numbers, an enum and a list: a typical extraction
    "type": "object", "additionalProperties": False,
    "required": ["id", "title", "score", "kind", "tags"],
    "properties": {"id": {"type": "integer"}, "title": {"type": "string"},
                   "score": {"type": "number"}, "kind": {"enum": ["book", "film", "song"]},
                   "tags": {"type": "array", "items": {"type": "string"}}}}


async def _run(engine: TorchEngine, prompts: list[str], params: SamplingParams) -> int:
    """All prompts as concurrent requests; the number of tokens they generated."""
    counts = [0] * len(prompts)

    async def one(i: int) -> None:
        counts[i] = len((await engine.generate(prompts[i], params)).token_ids)

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return sum(counts)


async def _case(engine: TorchEngine, prompts: list[str], new_tokens: int,
                repeats: int) -> dict[str, Any]:
    schema = json.dumps(SCHEMA)
    sides = {"free": {}, "json": {"json_schema": schema}}
    calls: dict[str, Callable[[], Awaitable[int]]] = {}
    for side, extra in sides.items():
        for n in (new_tokens, 1):
            params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, **extra)
            calls[f"{side}_{n}"] = lambda p=params: _run(engine, prompts, p)
    tokens = {key: await call() for key, call in calls.items()}  # warm-up (and compile)
    times: dict[str, list[float]] = {key: [] for key in calls}
    for r in range(repeats):
        for key in (list(calls) if r % 2 == 0 else list(reversed(calls))):
            times[key].append(await time_async(calls[key]))

    def rate(side: str) -> Samples:
        made = tokens[f"{side}_{new_tokens}"] - tokens[f"{side}_1"]
        return Samples(tuple(made / (tn - t1) if tn > t1 else float("nan")
                             for tn, t1 in zip(times[f"{side}_{new_tokens}"],
                                               times[f"{side}_1"], strict=True)))

    def best(side: str) -> float:  # the quietest rounds: load from elsewhere only adds time
        made = tokens[f"{side}_{new_tokens}"] - tokens[f"{side}_1"]
        return made / (min(times[f"{side}_{new_tokens}"]) - min(times[f"{side}_1"]))

    json_rate, free_rate = rate("json"), rate("free")
    ratios = Samples(tuple(j / f for j, f in zip(json_rate.values, free_rate.values,
                                                 strict=True)))
    ratio = best("json") / best("free")
    return claim(unit="decode tokens/s", target=TARGET, measured=json_rate,
                 baseline=free_rate, ratio=ratio, passed=ratio >= TARGET,
                 batch=len(prompts), best_tokens_per_s={"json": round(best("json"), 1),
                                                        "free": round(best("free"), 1)},
                 median_ratio=round(json_rate.median / free_rate.median, 3),
                 round_ratios=ratios.to_json(3),
                 tokens_per_call={"json": tokens[f"json_{new_tokens}"],
                                  "free": tokens[f"free_{new_tokens}"]},
                 note=("greedy, ignore_eos; measured: with json_schema (a constrained request "
                       "ends when its JSON is complete, so its tokens are counted), baseline: "
                       "the same requests without it; tokens/s = (tokens - batch) / "
                       "(T(N) - T(1)) per round; ratio: of the best rates, each from the "
                       "fastest T(N) and T(1) over the rounds (as timeit takes the minimum: "
                       "a shared machine's load only adds time); median_ratio: of the "
                       "medians"))


async def measure_constrained(seed: int, batch_sizes: tuple[int, ...], new_tokens: int,
                              repeats: int) -> dict[str, Any]:
    """The constrained-decoding claim for each batch size, on the tiny model."""
    model, config = tiny_model(seed=seed)
    engine = TorchEngine(model, config, tokenizer=ByteTokenizer(), model_id="tiny-json")
    generator = torch.Generator().manual_seed(seed)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "zeta"]
    cases = []
    for batch in batch_sizes:
        prompts = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (12,),
                                                                 generator=generator))
                   + "\nAs JSON:" for _ in range(batch)]
        cases.append(await _case(engine, prompts, new_tokens, repeats))
    return {"model": "tiny", "tokenizer": "bytes", "schema": SCHEMA, "cases": cases}
