"""Ray as Omni's cluster: ``--cluster ray`` against ``omni cluster``, with Ray's own actor calls
beside them, in one run.

Started here: a two-node Ray cluster on loopback (127.0.0.2 and 127.0.0.3, as the tests start
it: tests/cluster/_ray.py) and an Omni head with two workers (``omni cluster start`` /
``omni cluster join`` processes on 127.0.0.1). This process drives three sides:

- ``ray``: ``omni.Runtime(cluster="ray")``, Omni's `OmniWorker` actors on the two Ray nodes;
- ``omni``: ``omni.Runtime(cluster=ADDRESS)`` on the two hand-joined workers;
- ``ray_actors``: Ray's own actor calls (``ray.get(actor.method.remote(x))``; three actors
  chained by object refs: `perf/_payload_ray.py`; not a Compiled Graph, whose actors poll
  their channels and would slow the other sides on a small machine). Ray's object store: 1 GiB
  per node, so that a 64 MiB argument is not spilled.

The nodes (`perf/_ray_cluster_nodes.py`) are not pinned, so both clusters place them alike.
Measured, each side in turn round by round (the order reversed every round) after one
warm-up round; medians of `repeats` rounds:

1. ``call_latency``: a trivial call (an int each way), median µs of `calls` sequential calls.
2. ``numpy_64mib``: a call whose argument is a 64 MiB float32 array and whose result its size.
3. ``pipeline_throughput``: three stages chained, requests/s with `in_flight` in flight.

Claims: ``--cluster ray`` at least 0.9x ``omni cluster`` in each (time ratio omni / ray for
1 and 2, throughput ratio ray / omni for 3; each round's ratio, the median over rounds): Ray
places and restarts the workers, and adds nothing on the data path. Each claim is made on 5
rounds (`--repeats` other than 5 reports, never passes). Ray's own actor calls are reported
beside them, not a target. Everything started is stopped on exit, Ctrl-C included.

Usage: ``python perf/ray_cluster.py [--quick] [--repeats N] [--out PATH.json]``
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import trio

if __package__ in (None, ""):  # run as a script: make `perf`, `tests` and `omni` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import omni
from perf import _ray_cluster_nodes as nodes
from perf._common import Samples, benchmark_parser, claim, environment, params_from, write_json
from perf._payload_ray import Pipeline, RaySide
from perf._payload_support import BlockingThread
from tests.cluster._ray import RayNodes
from tests.cluster._real import Cluster

__all__ = ["Params", "main", "measure"]

ROOT = Path(__file__).resolve().parent.parent
MIB, GIB = 1 << 20, 1 << 30
PAIRED_RUNS = 5
TARGET = 0.9  # --cluster ray at least this fraction of omni cluster's speed
SIDES = ("ray", "omni", "ray_actors")


@dataclass(frozen=True, slots=True)
class Params:
    seed: int = 0
    repeats: int = PAIRED_RUNS
    calls: int = 500
    payload_bytes: int = 64 * MIB
    payload_calls: int = 5  # per sample (median)
    requests: int = 512
    in_flight: int = 64
    quick: bool = False

    @classmethod
    def small(cls, seed: int = 0) -> Params:
        return cls(seed=seed, repeats=1, calls=30, payload_bytes=8 * MIB, payload_calls=2,
                   requests=64, in_flight=16, quick=True)


# ---------------------------------------------------------------------------------------------
# The measures: each returns one sample (µs, ms or requests/s)


def _check(out: Any, expected: Any) -> None:
    if out != expected:
        raise RuntimeError(f"got {out!r}, expected {expected!r}")


async def _median_call(rt: Any, graph: Any, calls: int, scale: float,
                       value_of: Callable[[int], tuple[Any, Any]]) -> float:
    """The median time (x `scale`) of `calls` sequential requests of `graph`; call i sends
    ``value_of(i)[0]`` and must get ``value_of(i)[1]`` back."""
    times = []
    for i in range(calls):
        value, expected = value_of(i)
        start = time.perf_counter()
        out = await rt.run(graph, value=value)
        times.append(time.perf_counter() - start)
        _check(out, expected)
    return statistics.median(times) * scale


def omni_measures(rt: Any, p: Params, array: np.ndarray
                  ) -> dict[str, Callable[[], Awaitable[float]]]:
    async def latency() -> float:
        return await _median_call(rt, nodes.tiny, p.calls, 1e6, lambda i: (i, i))

    async def payload() -> float:
        return await _median_call(rt, nodes.size, p.payload_calls, 1e3,
                                  lambda _: (array, array.nbytes))

    async def throughput() -> float:
        limiter = trio.CapacityLimiter(p.in_flight)

        async def one(i: int) -> None:
            async with limiter:
                _check(await rt.run(nodes.chain, value=i), i)

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(p.requests):
                nursery.start_soon(one, i)
        return p.requests / (time.perf_counter() - start)

    return {"call_latency": latency, "numpy_64mib": payload, "pipeline_throughput": throughput}


def ray_measures(thread: BlockingThread, side: RaySide, pipeline: Pipeline, p: Params,
                 array: np.ndarray) -> dict[str, Callable[[], Awaitable[float]]]:
    def payload() -> float:
        times = [side.call("size", array, lambda out: _check(out, array.nbytes))
                 for _ in range(p.payload_calls)]
        return statistics.median(times) * 1e3

    async def run(fn: Callable[[], float]) -> float:
        return float(await thread.run(fn))

    return {"call_latency": lambda: run(lambda: side.latency_us(p.calls)),
            "numpy_64mib": lambda: run(payload),
            "pipeline_throughput": lambda: run(
                lambda: pipeline.throughput(p.requests, p.in_flight))}


# ---------------------------------------------------------------------------------------------
# The run


async def _rounds(measures: dict[str, dict[str, Callable[[], Awaitable[float]]]], name: str,
                  repeats: int) -> dict[str, Samples]:
    """Every side's `name` measure, one warm-up round, then `repeats` rounds, the sides'
    order reversed every round."""
    values: dict[str, list[float]] = {side: [] for side in measures}
    for r in range(-1, repeats):
        order = list(measures) if r % 2 == 0 else list(reversed(measures))
        for side in order:
            value = await measures[side][name]()
            if r >= 0:
                values[side].append(value)
        print(f"{name}: round {r + 1}/{repeats}", file=sys.stderr, flush=True)
    return {side: Samples(tuple(v)) for side, v in values.items()}


def _claim(name: str, samples: dict[str, Samples], repeats: int) -> dict[str, Any]:
    """The claim: the median over rounds of each round's ratio (the two sides measured back to
    back in it), so that the machine getting slower or faster across rounds moves both
    sides of a ratio, not one median."""
    ray, omni_, actors = samples["ray"], samples["omni"], samples["ray_actors"]
    higher = name == "pipeline_throughput"
    pairs = zip(ray.values, omni_.values, strict=True)
    rounds = [r / o if higher else o / r for r, o in pairs]
    ratio = statistics.median(rounds)
    unit = {"call_latency": "µs", "numpy_64mib": "ms", "pipeline_throughput": "requests/s"}
    return claim(unit=unit[name], target=TARGET, measured=ray, baseline=omni_, ratio=ratio,
                 passed=repeats == PAIRED_RUNS and ratio >= TARGET, digits=2,
                 round_ratios=[round(r, 3) for r in rounds],
                 ratio_of_medians=round(ray.median / omni_.median if higher
                                        else omni_.median / ray.median, 3),
                 ray_actor_calls=actors.to_json(2),
                 note=(f"measured: --cluster ray (OmniWorker actors); baseline: omni cluster "
                       f"(hand-joined workers); ratio: {'ray / omni' if higher else 'omni / ray'}"
                       f" in each round, median over rounds; target >= {TARGET} on "
                       f"{PAIRED_RUNS} rounds; ray_actor_calls: Ray's own actor calls, beside "
                       "them"))


async def measure(params: Params) -> dict[str, Any]:
    paths = list(filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    if str(ROOT) not in paths:  # the Ray nodes' processes import perf.* (they inherit it)
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *paths])
    array = np.random.default_rng(params.seed).random(params.payload_bytes // 4,
                                                      dtype=np.float32)
    thread = BlockingThread("ray")
    with tempfile.TemporaryDirectory(prefix="omni-perf-ray-") as folder:
        ray_nodes = RayNodes(object_store_bytes=GIB)  # Ray's own calls: no spilling
        joined = Cluster(Path(folder))  # `omni cluster start` and two `join` processes
        try:
            def start_joined() -> None:  # (it waits with trio.run of its own: in a thread)
                joined.head()
                joined.worker("w1")
                joined.worker("w2")

            await trio.to_thread.run_sync(start_joined)
            assert joined.address is not None
            import ray

            await thread.run(lambda: ray.init(address=ray_nodes.address, log_to_driver=False,
                                              logging_level="ERROR"))
            side = await thread.run(lambda: RaySide(ray))
            # plain actor calls: a Compiled Graph's actors poll their channels, and on a
            # small machine that would slow the other sides' rounds
            pipeline = await thread.run(lambda: Pipeline(ray, side.stage_class,
                                                         params.in_flight, compile=False))
            async with omni.Runtime(cluster="ray") as on_ray, \
                    omni.Runtime(cluster=joined.address, token_file=joined.token) as on_omni:
                measures = {"ray": omni_measures(on_ray, params, array),
                            "omni": omni_measures(on_omni, params, array),
                            "ray_actors": ray_measures(thread, side, pipeline, params, array)}
                claims = {name: _claim(name, await _rounds(measures, name, params.repeats),
                                       params.repeats)
                          for name in ("call_latency", "numpy_64mib", "pipeline_throughput")}
            await thread.run(pipeline.teardown)
            version = ray.__version__
            await thread.run(ray.shutdown)
        finally:
            thread.close()
            joined.close()
            ray_nodes.close()
    return {"benchmark": "ray_cluster", "env": {**environment(), "ray": version},
            "params": asdict(params), "pipeline_baseline": pipeline.kind,
            "claims": claims, "all_pass": all(c["pass"] for c in claims.values())}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = benchmark_parser(__doc__, repeats_help=f"rounds (claims need {PAIRED_RUNS})",
                              plot_help="(no plot)", profile_help="(no profile)")
    args = parser.parse_args(argv)
    result = trio.run(measure, params_from(args, Params))
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
