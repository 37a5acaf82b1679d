"""Scheduler overhead: what Omni adds on top of plain awaited trio calls.

Two measurements, each against a baseline in the same process and the same trio run:

1. Per-hop overhead. Sequential requests through a chain of no-op nodes, against the same
   awaits written by hand. A 1-node chain is measured too, which separates the fixed cost of a
   request (``Runtime.run``, binding inputs, the plan's set-up) from the cost of each hop.
2. Throughput. Many concurrent requests (one task each, in rounds) through a 5-node diamond with
   a switch: ``source`` -> (``left``, ``right``) in parallel -> ``join`` -> switch on the
   source's value to ``even`` or ``odd``. The baseline does the same five awaits per request,
   the parallel pair in a per-request nursery.

Claims, each a ratio to its baseline: Omni's time per node at most 15x a plain awaited call's,
and Omni's throughput at least 0.7x plain trio's.

Usage: ``python perf/scheduler.py [--quick] [--out PATH.json] [--plot PATH.png]
[--profile chain|diamond]`` (the profile, of one more Omni pass, goes to stderr).
"""

from __future__ import annotations

import cProfile
import random
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import trio

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import omni
from perf._common import (
    Samples,
    benchmark_parser,
    environment,
    params_from,
    plot_bars,
    profile_report,
    time_async,
    write_json,
)

__all__ = ["Params", "main", "measure"]

HOP_TARGET = 15.0  # Omni's time per node / a plain awaited call's, at most
THROUGHPUT_TARGET = 0.7  # Omni's node executions per second / plain trio's, at least
DIAMOND_NODES = 5  # node executions per diamond request: source, left, right, join, a branch


@dataclass(frozen=True, slots=True)
class Params:
    """The sizes of one run (`quick` shrinks them for a smoke run)."""

    seed: int = 0
    repeats: int = 5
    chain_length: int = 10
    hop_requests: int = 2_000
    concurrency: int = 256
    rounds: int = 20
    quick: bool = False

    @classmethod
    def small(cls, seed: int = 0) -> Params:
        """Sizes for a smoke run (a few seconds)."""
        return cls(seed=seed, repeats=3, hop_requests=300, rounds=2, quick=True)


# ---------------------------------------------------------------------------------------------
# The work: plain coroutine functions, called directly by the baselines and wrapped as nodes


async def noop(x: int) -> int:
    return x


async def source(x: int) -> int:
    return x & 1  # the route: 0 or 1


async def left(p: int) -> int:
    return p + 1


async def right(p: int) -> int:
    return p + 2


async def join(a: int, b: int) -> int:
    return a + b


async def even(v: int) -> int:
    return v


async def odd(v: int) -> int:
    return -v


noop_node = omni.node(noop)
source_node, left_node, right_node = omni.node(source), omni.node(left), omni.node(right)
join_node, even_node, odd_node = omni.node(join), omni.node(even), omni.node(odd)


def make_chain(length: int) -> omni.Graph:
    """A graph of `length` no-op nodes in a row."""

    def chain(x: int) -> int:
        for _ in range(length):
            x = noop_node(x)
        return x

    return omni.graph(chain, name=f"chain{length}")


@omni.graph
def diamond(x: int) -> int:
    route = source_node(x)
    joined = join_node(left_node(route), right_node(route))
    return omni.switch(route, {0: even_node, 1: odd_node}, joined)


# ---------------------------------------------------------------------------------------------
# One pass of each scenario, Omni and baseline


async def omni_chain(rt: omni.Runtime, graph: omni.Graph, xs: Sequence[int]) -> None:
    for x in xs:
        await rt.run(graph, x=x)


async def baseline_chain(length: int, xs: Sequence[int]) -> None:
    for x in xs:
        for _ in range(length):
            x = await noop(x)


async def baseline_diamond(x: int) -> int:
    route = await source(x)
    results = [0, 0]

    async def branch(i: int, fn: Any) -> None:
        results[i] = await fn(route)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(branch, 0, left)
        nursery.start_soon(branch, 1, right)
    joined = await join(*results)
    return await (even if route == 0 else odd)(joined)


async def omni_diamond(rt: omni.Runtime, x: int) -> int:
    return await rt.run(diamond, x=x)


async def omni_rounds(rt: omni.Runtime, batches: Sequence[Sequence[int]]) -> None:
    for batch in batches:
        async with trio.open_nursery() as nursery:
            for x in batch:
                nursery.start_soon(omni_diamond, rt, x)


async def baseline_rounds(batches: Sequence[Sequence[int]]) -> None:
    for batch in batches:
        async with trio.open_nursery() as nursery:
            for x in batch:
                nursery.start_soon(baseline_diamond, x)


# ---------------------------------------------------------------------------------------------
# Measuring


def _inputs(params: Params) -> tuple[list[int], list[list[int]]]:
    """Seeded request inputs: one per sequential request, and one batch per round (the
    parity of an input picks the diamond's branch, so both branches run, in random order)."""
    rng = random.Random(params.seed)
    xs = [rng.randrange(1 << 30) for _ in range(params.hop_requests)]
    batches = [[rng.randrange(1 << 30) for _ in range(params.concurrency)]
               for _ in range(params.rounds)]
    return xs, batches


async def _check_same_work(rt: omni.Runtime, chains: dict[int, omni.Graph],
                           xs: Sequence[int]) -> None:
    """The baselines must compute what the graphs compute, or the comparison means nothing."""
    for x in xs[:16]:
        got = [await rt.run(graph, x=x) for graph in chains.values()]
        got.append(await omni_diamond(rt, x))
        want = [x] * len(chains) + [await baseline_diamond(x)]
        if got != want:
            raise RuntimeError(f"omni and the baseline disagree for input {x}: {got} != {want}")


async def measure(params: Params) -> dict[str, Any]:
    """Run both measurements in the current trio run; return the result dict."""
    xs, batches = _inputs(params)
    chains = {n: make_chain(n) for n in sorted({1, params.chain_length})}
    long, short = chains[params.chain_length], chains[1]
    times: dict[str, list[float]] = {k: [] for k in (
        "omni_long", "base_long", "omni_short", "base_short", "omni_tp", "base_tp")}

    async with omni.Runtime(graphs=[*chains.values(), diamond]) as rt:
        await _check_same_work(rt, chains, xs)
        runs = {
            "omni_long": lambda: omni_chain(rt, long, xs),
            "base_long": lambda: baseline_chain(params.chain_length, xs),
            "omni_short": lambda: omni_chain(rt, short, xs),
            "base_short": lambda: baseline_chain(1, xs),
            "omni_tp": lambda: omni_rounds(rt, batches),
            "base_tp": lambda: baseline_rounds(batches),
        }
        for run in runs.values():  # warm-up: one untimed pass of everything
            await run()
        for r in range(params.repeats):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))  # no side always first
            for key in order:
                times[key].append(await time_async(runs[key]))
    return _summarise(params, {k: Samples(tuple(v)) for k, v in times.items()})


async def profile(params: Params, scenario: str, top: int = 25) -> str:
    """cProfile one warmed-up Omni pass of `scenario` ("chain" or "diamond"); the top
    functions by own time, as text."""
    xs, batches = _inputs(params)
    chain = make_chain(params.chain_length)
    async with omni.Runtime(graphs=[chain, diamond]) as rt:
        run = ((lambda: omni_chain(rt, chain, xs)) if scenario == "chain"
               else (lambda: omni_rounds(rt, batches)))
        await run()  # warm-up
        profiler = cProfile.Profile()
        profiler.enable()
        await run()
        profiler.disable()
    return profile_report(profiler, top)


def _summarise(params: Params, t: dict[str, Samples]) -> dict[str, Any]:
    n, length = params.hop_requests, params.chain_length
    per_node = {k: t[f"{k}_long"].map(lambda s: s / (n * length) * 1e6) for k in ("omni", "base")}
    overhead = per_node["omni"].median - per_node["base"].median
    num_nodes = params.concurrency * params.rounds * DIAMOND_NODES
    rate = {k: t[f"{k}_tp"].map(lambda s: num_nodes / s) for k in ("omni", "base")}
    return {
        "benchmark": "scheduler",
        "env": environment(),
        "params": asdict(params),
        "per_hop": {
            "description": f"{n} sequential requests through a chain of {length} no-op nodes",
            "unit": "us per node",
            "target": HOP_TARGET,
            "omni": per_node["omni"].to_json(),
            "baseline": per_node["base"].to_json(),
            "overhead_us": round(overhead, 3),
            "overhead_us_min": round(per_node["omni"].min - per_node["base"].min, 3),
            "ratio": round(per_node["omni"].median / per_node["base"].median, 2),
            "pass": per_node["omni"].median <= HOP_TARGET * per_node["base"].median,
            "split": _split(params, t),
        },
        "throughput": {
            "description": (f"{params.concurrency} concurrent requests x {params.rounds} rounds "
                            f"through a {DIAMOND_NODES}-node diamond with a switch"),
            "unit": "node executions per second",
            "target": THROUGHPUT_TARGET,
            "omni": rate["omni"].to_json(0),
            "baseline": rate["base"].to_json(0),
            "ratio": round(rate["omni"].median / rate["base"].median, 3),
            "pass": rate["omni"].median >= THROUGHPUT_TARGET * rate["base"].median,
        },
    }


def _split(params: Params, t: dict[str, Samples]) -> dict[str, Any]:
    """Fixed cost per request and marginal cost per node, from the long and the 1-node chain.

    Model: time per request = fixed + length * per_node; solved per repeat, then medians.
    """
    n, extra = params.hop_requests, params.chain_length - 1
    out: dict[str, Any] = {}
    for key, name in (("omni", "omni"), ("base", "baseline")):
        pairs = list(zip(t[f"{key}_long"].values, t[f"{key}_short"].values, strict=True))
        marginal = Samples(tuple((lo - sh) / (n * extra) * 1e6 for lo, sh in pairs))
        fixed = Samples(tuple(sh / n * 1e6 - m for (_, sh), m in zip(pairs, marginal.values,
                                                                       strict=True)))
        out[name] = {"marginal_us_per_node": marginal.to_json(),
                     "fixed_us_per_request": fixed.to_json()}
    out["marginal_overhead_us"] = round(out["omni"]["marginal_us_per_node"]["median"]
                                        - out["baseline"]["marginal_us_per_node"]["median"], 3)
    out["fixed_overhead_us"] = round(out["omni"]["fixed_us_per_request"]["median"]
                                     - out["baseline"]["fixed_us_per_request"]["median"], 3)
    return out


def _plot(result: dict[str, Any], path: str) -> None:
    hop, tp = result["per_hop"], result["throughput"]

    def samples(entry: dict[str, Any]) -> Samples:
        return Samples(tuple(entry["runs"]))

    plot_bars(path, f"Omni scheduler vs plain trio (Python {result['env']['python']}, "
                    f"{result['env']['cpu_count']} CPUs)", [
        (f"per hop (target: ≤ {hop['target']:g}× the baseline)", "µs per node (lower is better)",
         {"omni": samples(hop["omni"]), "baseline": samples(hop["baseline"])}),
        (f"throughput (target: ≥ {tp['target']:g}× the baseline)",
         "node executions/s (higher is better)",
         {"omni": samples(tp["omni"]), "baseline": samples(tp["baseline"])}),
    ])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse `argv`, run the benchmark, print (and optionally write and plot) the result."""
    parser = benchmark_parser(__doc__, repeats_help="repeats per measurement",
                              plot_help="write a bar chart (PNG) here",
                              profile_help="also cProfile one Omni pass of a scenario "
                                           "(to stderr)", profile_choices=["chain", "diamond"])
    args = parser.parse_args(argv)
    params = params_from(args, Params)
    result = trio.run(measure, params)
    write_json(result, args.out)
    if args.plot:
        _plot(result, args.plot)
    if args.profile:
        sys.stderr.write(trio.run(profile, params, args.profile))
    return result


if __name__ == "__main__":
    main()
