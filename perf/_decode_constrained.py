"""`perf/decode.py`'s constrained case: decode tokens/s with a JSON schema vs without, same run.

One `TorchEngine` per model (decode.py's models, the byte tokenizer, no KV store) serves both
sides, with the same prompts and greedy parameters; the constrained side adds ``json_schema``
(compiled once in the warm-up; its matcher fills one token bitmask per row per step, which the
sampler applies). On the tiny model a step costs well under a millisecond, so the mask's fixed
cost per step weighs most there; the small model shows it against more arithmetic.

Decode rate = (tokens - batch) / (T(N) - T(1)) per round, the four calls of a round in
alternating order, with T(1) (prefill and setup) the median over rounds. The ratio is the
median over rounds of each round's constrained / unconstrained rate (the two measured a
fraction of a second apart, so a drift in the machine's speed moves both), over as many rounds
as fit in about 30 seconds (at least the other cases' count, at most 100): the effect
measured is a few percent, and one call's CPU time varies by a third on a shared machine.
T is the CPU time of the process (`time.process_time`, all its threads; torch runs one thread
here, so that no thread spins while another waits for a core): on a shared machine,
wall-clock time also counts the time other processes hold the cores, which swamps a
difference of a few percent; wall-clock rates are recorded beside. Target: constrained >=
0.9x unconstrained, per model and batch size."""

from __future__ import annotations

import gc
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch
import trio

from omni.compute.engine import TorchEngine
from omni.compute.models import tiny_model
from omni.compute.sampling import SamplingParams
from omni.compute.tokenizer import ByteTokenizer
from perf._common import Samples, claim, gc_frozen

__all__ = ["SCHEMA", "TARGET", "measure_constrained"]

TARGET = 0.9  # constrained decode tokens/s / unconstrained, at least
MAX_ROUNDS = 100  # per case at most (at least `repeats`; as many as fit in `seconds`): a
# call's CPU time varies by +-30% on a shared machine, so a median of 5 rounds moves by +-0.1
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


async def _timed(call: Callable[[], Awaitable[int]]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call, after a full collection."""
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    await call()
    return time.perf_counter() - wall, time.process_time() - cpu


async def _case(engine: TorchEngine, prompts: list[str], new_tokens: int,
                repeats: int, seconds: float) -> dict[str, Any]:
    schema = json.dumps(SCHEMA)
    sides = {"free": {}, "json": {"json_schema": schema}}
    calls: dict[str, Callable[[], Awaitable[int]]] = {}
    for side, extra in sides.items():
        for n in (new_tokens, 1):
            params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, **extra)
            calls[f"{side}_{n}"] = lambda p=params: _run(engine, prompts, p)
    tokens = {key: await call() for key, call in calls.items()}  # warm-up (and compile)
    times: dict[str, list[tuple[float, float]]] = {key: [] for key in calls}
    with gc_frozen():
        warm = {key: await _timed(call) for key, call in calls.items()}
        rounds = min(MAX_ROUNDS, max(repeats, round(seconds / sum(
            wall for wall, _ in warm.values()))))
        for r in range(rounds):
            for key in (list(calls) if r % 2 == 0 else list(reversed(calls))):
                times[key].append(await _timed(calls[key]))

    def rate(side: str, clock: int) -> Samples:
        made = tokens[f"{side}_{new_tokens}"] - tokens[f"{side}_1"]
        fixed = statistics.median(t[clock] for t in times[f"{side}_1"])  # prefill and setup
        return Samples(tuple(made / (tn[clock] - fixed) if tn[clock] > fixed
                             else float("nan") for tn in times[f"{side}_{new_tokens}"]))

    def paired(json_rate: Samples, free_rate: Samples) -> Samples:
        return Samples(tuple(j / f for j, f in zip(json_rate.values, free_rate.values,
                                                   strict=True)))

    json_cpu, free_cpu = rate("json", 1), rate("free", 1)
    json_wall, free_wall = rate("json", 0), rate("free", 0)
    ratios = paired(json_cpu, free_cpu)
    ratio = ratios.median
    return claim(unit="decode tokens per CPU second", target=TARGET, measured=json_cpu,
                 baseline=free_cpu, ratio=ratio, passed=ratio >= TARGET,
                 batch=len(prompts), rounds=len(ratios.values), ratios=ratios.to_json(3),
                 wall_tokens_per_s={"json": json_wall.to_json(1), "free": free_wall.to_json(1),
                                    "ratio": round(paired(json_wall, free_wall).median, 3)},
                 tokens_per_call={"json": tokens[f"json_{new_tokens}"],
                                  "free": tokens[f"free_{new_tokens}"]},
                 note=("greedy, ignore_eos; measured: with json_schema (a constrained request "
                       "ends when its JSON is complete, so its tokens are counted), baseline: "
                       "the same requests without it; rate = (tokens - batch) / "
                       "(T(N) - median T(1)) per round with T the process's CPU seconds; ratio: "
                       "median over rounds of the round's constrained / unconstrained rate "
                       "(wall-clock rates recorded beside)"))


async def measure_constrained(seed: int, models: dict[str, dict[str, int]],
                              batch_sizes: tuple[int, ...], new_tokens: int,
                              repeats: int, seconds: float = 30.0) -> dict[str, Any]:
    """The constrained-decoding claim for each model (`tiny_model` overrides) and batch size."""
    generator = torch.Generator().manual_seed(seed)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "zeta"]
    cases, threads = [], torch.get_num_threads()
    # one torch thread: no thread spins (burning CPU time) while another waits for a core
    torch.set_num_threads(1)
    try:
        for name, overrides in models.items():
            model, config = tiny_model(seed=seed, **overrides)
            engine = TorchEngine(model, config, tokenizer=ByteTokenizer(), model_id=name,
                                 store=None)  # rounds repeat their prompts
            for batch in batch_sizes:
                prompts = [" ".join(words[int(i)] for i in torch.randint(
                    0, len(words), (12,), generator=generator)) + "\nAs JSON:"
                    for _ in range(batch)]
                case = await _case(engine, prompts, new_tokens, repeats, seconds)
                cases.append({"model": name, **case})
    finally:
        torch.set_num_threads(threads)
    return {"tokenizer": "bytes", "schema": SCHEMA, "torch_threads": 1, "cases": cases}
