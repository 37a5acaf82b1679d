"""The latency measurements of `perf/payloads.py`: a trivial call, and a three-stage pipeline
(hop latency, throughput with requests in flight), Omni against Ray (a Compiled Graph for the
pipeline), alternating round by round.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

import trio

from perf import _payload_nodes as nodes
from perf._common import Samples
from perf._payload_measures import (
    CALL_LATENCY_TARGET,
    CALL_TIMEOUT_S,
    NO_RAY,
    RAY_TARGET,
    THROUGHPUT_TARGET,
    Measure,
    alternate,
    claim,
    ray_timer,
)
from perf._payload_support import BlockingThread

if TYPE_CHECKING:
    from perf.payloads import Params, RayState

__all__ = ["call_latency_section", "pipeline_section"]


async def call_latency_section(rt: Any, p: Params, ray: RayState, thread: BlockingThread
                               ) -> dict[str, Any]:
    """A trivial call (an int each way) on w1: median µs of sequential calls."""

    async def omni_us() -> float:
        durations = []
        for i in range(p.calls):
            start = time.perf_counter()
            out = await rt.run(nodes.Tiny, value=i)
            durations.append(time.perf_counter() - start)
            if out != i:
                raise RuntimeError(f"the node returned {out!r} for {i}")
        return statistics.median(durations) * 1e6

    measures: dict[str, Measure] = {"omni": omni_us}
    if ray.side is not None:
        measures["ray"] = ray_timer(thread, lambda: ray.side.latency_us(p.calls))
    samples, errors = await alternate(measures, p.repeats)
    return claim(
        unit="µs", target=CALL_LATENCY_TARGET, better="lower", measured=samples.get("omni"),
        baseline=samples.get("ray"), digits=1,
        error=errors.get("omni") or errors.get("ray") or (
            None if ray.side is not None else ray.error or NO_RAY),
        note=(f"µs per call, the median of {p.calls} sequential calls of a class node on "
              "worker w1 that returns its argument (an int); measured: Omni (`rt.run`), "
              "baseline: Ray (`ray.get(actor.tiny.remote(i))`); median of "
              f"{p.repeats} alternating rounds after a warm-up; ratio = Omni / Ray, target "
              f"<= {CALL_LATENCY_TARGET:g}"))


async def pipeline_section(rt: Any, p: Params, ray: RayState, thread: BlockingThread
                           ) -> dict[str, Any]:
    """hop_latency and pipeline_throughput: the chain of three nodes on w1, w2, w3 against a
    Ray Compiled Graph of three actors (or chained actor calls)."""
    pipeline: Any = None
    if ray.side is not None:
        from perf._payload_ray import Pipeline

        pipeline = await thread.run(
            lambda: Pipeline(ray.ray, ray.side.stage_class, p.in_flight))
    try:
        hop = await _hop_latency(rt, p, pipeline, thread)
        throughput = await _throughput(rt, p, pipeline, thread)
    finally:
        if pipeline is not None:
            await thread.run(pipeline.teardown)
    baseline = {"baseline_kind": None if pipeline is None else pipeline.kind,
                "compile_error": None if pipeline is None else pipeline.compile_error}
    no_ray = None if pipeline is not None else ray.error or NO_RAY
    kind = "a Ray Compiled Graph of three actors (ray.dag InputNode, experimental_compile"
    kind += f", _max_inflight_executions={p.in_flight})"
    if pipeline is not None and pipeline.kind == "ray_actors":
        kind = ("plain Ray actor calls chained by object refs (the compiled graph did not "
                "compile: see compile_error)")
    samples, errors = hop
    hop_claim = claim(
        unit="µs per hop", target=RAY_TARGET, better="lower", measured=samples.get("omni"),
        baseline=samples.get("ray"), digits=1,
        error=errors.get("omni") or errors.get("ray") or no_ray, **baseline,
        note=(f"a graph of three class nodes, one per worker (w1, w2, w3), each returning its "
              f"argument (an int): one request's end-to-end µs / 3, the median of "
              f"{p.hop_requests} sequential requests; baseline: {kind}, the same; median of "
              f"{p.repeats} alternating rounds after a warm-up; ratio = Omni / baseline, "
              f"target <= {RAY_TARGET:g}"))
    samples, errors = throughput
    throughput_claim = claim(
        unit="requests/s", target=THROUGHPUT_TARGET, better="higher",
        measured=samples.get("omni"), baseline=samples.get("ray"), digits=1,
        error=errors.get("omni") or errors.get("ray") or no_ray, **baseline,
        in_flight=p.in_flight, requests=p.requests,
        note=(f"the same pipeline: {p.requests} requests / wall seconds with {p.in_flight} in "
              f"flight; baseline: {kind}, the same; median of {p.repeats} alternating rounds "
              f"after a warm-up; ratio = Omni / baseline, target >= {THROUGHPUT_TARGET:g}"))
    return {"hop_latency": hop_claim, "pipeline_throughput": throughput_claim}


async def _hop_latency(rt: Any, p: Params, pipeline: Any, thread: BlockingThread
                       ) -> tuple[dict[str, Samples], dict[str, str]]:
    async def omni_us() -> float:
        durations = []
        for i in range(p.hop_requests):
            start = time.perf_counter()
            out = await rt.run(nodes.chain, value=i)
            durations.append(time.perf_counter() - start)
            if out != i:
                raise RuntimeError(f"the pipeline returned {out!r} for {i}")
        return statistics.median(durations) * 1e6 / 3

    measures: dict[str, Measure] = {"omni": omni_us}
    if pipeline is not None:
        measures["ray"] = ray_timer(thread, lambda: pipeline.hop_latency_us(p.hop_requests))
    return await alternate(measures, p.repeats)


async def _throughput(rt: Any, p: Params, pipeline: Any, thread: BlockingThread
                      ) -> tuple[dict[str, Samples], dict[str, str]]:
    async def omni_rate() -> float:
        numbers = iter(range(p.requests))

        async def client() -> None:
            for i in numbers:  # shared: each request is sent once
                out = await rt.run(nodes.chain, value=i)
                if out != i:
                    raise RuntimeError(f"the pipeline returned {out!r} for {i}")

        start = time.perf_counter()
        with trio.fail_after(CALL_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                for _ in range(p.in_flight):
                    nursery.start_soon(client)
        return p.requests / (time.perf_counter() - start)

    measures: dict[str, Measure] = {"omni": omni_rate}
    if pipeline is not None:
        measures["ray"] = ray_timer(
            thread, lambda: pipeline.throughput(p.requests, p.in_flight))
    return await alternate(measures, p.repeats)
