"""Ray, the baseline of `perf/payloads.py`: a local Ray instance on 127.0.0.1 only, actors that
do what the Omni nodes of `perf/_payload_nodes.py` do, and a three-actor pipeline as a Ray
Compiled Graph (``ray.dag``), falling back to plain chained actor calls where compiled graphs
cannot run (the reason is kept).

Every function here blocks: `perf/payloads.py` calls them on one `BlockingThread`, and each
times itself, so no thread handoff is charged to Ray.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["Pipeline", "RaySide", "start_ray"]


class Stage:
    """The actor class: the same bodies as the Omni nodes."""

    def size(self, value: Any) -> int:
        return int(value.nbytes)

    def echo(self, value: Any) -> Any:
        return value

    def tiny(self, value: Any) -> Any:
        return value


def start_ray(temp_dir: Path, object_store_bytes: int) -> Any:
    """``ray.init`` of a new local instance that listens on 127.0.0.1 only, without the
    dashboard; the `ray` module.

    Why the environment variables: Ray otherwise swaps 127.0.0.1 for the machine's routable
    address and binds its servers to every interface; with clusters off it keeps to loopback.
    It is read when ray is imported, hence set first (and inherited by Ray's processes). And a
    new local instance turns Ray's token authentication on and writes a token to
    ~/.ray/auth_token, which then makes every later `ray start --head` of this user require
    tokens its `ray start --address` nodes do not send: off, for this loopback-only instance.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray

    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1",
             num_cpus=os.cpu_count() or 1, object_store_memory=object_store_bytes,
             _temp_dir=str(temp_dir), logging_level="ERROR", log_to_driver=False,
             configure_logging=True)
    address = ray.util.get_node_ip_address()
    if address != "127.0.0.1":
        ray.shutdown()
        raise RuntimeError(f"Ray started on {address}, not 127.0.0.1")
    return ray


def _median_us(durations: list[float]) -> float:
    return statistics.median(durations) * 1e6


class RaySide:
    """One actor (`Stage`) for the single-call measurements."""

    def __init__(self, ray: Any):
        self.ray = ray
        self.stage_class = ray.remote(num_cpus=0)(Stage)
        self.actor = self.stage_class.remote()
        ray.get(self.actor.tiny.remote(0))  # the actor process is up

    def call(self, method: str, value: Any, check: Callable[[Any], None]) -> float:
        """Seconds of ``ray.get(actor.<method>.remote(value))``; `check` sees the result."""
        start = time.perf_counter()
        out = self.ray.get(getattr(self.actor, method).remote(value))
        elapsed = time.perf_counter() - start
        check(out)
        return elapsed

    def latency_us(self, calls: int) -> float:
        """Median µs of `calls` sequential trivial calls."""
        durations = []
        for i in range(calls):
            start = time.perf_counter()
            out = self.ray.get(self.actor.tiny.remote(i))
            durations.append(time.perf_counter() - start)
            if out != i:
                raise RuntimeError(f"Ray's actor returned {out!r} for {i}")
        return _median_us(durations)


class Pipeline:
    """Three actors chained: a Compiled Graph when it compiles (and `compile`), else plain
    actor calls whose object refs feed the next actor (`kind` says which, `compile_error` why
    not compiled)."""

    def __init__(self, ray: Any, stage_class: Any, in_flight: int, compile: bool = True):
        self.ray = ray
        self.actors = [stage_class.remote() for _ in range(3)]
        ray.get([a.tiny.remote(0) for a in self.actors])
        self.compiled: Any = None
        self.compile_error: str | None = None
        try:
            if not compile:
                raise RuntimeError("not asked for")
            from ray.dag import InputNode

            with InputNode() as value:
                dag = value
                for actor in self.actors:
                    dag = actor.tiny.bind(dag)
            self.compiled = dag.experimental_compile(_max_inflight_executions=in_flight)
            if ray.get(self.compiled.execute(1)) != 1:
                raise RuntimeError("the compiled graph returned a wrong value")
        except Exception as exc:  # recorded: the baseline falls back to plain actor calls
            self.compile_error = f"{type(exc).__name__}: {exc}"[:1000]
            self.teardown()
        self.kind = "ray_compiled_graph" if self.compiled is not None else "ray_actors"

    def submit(self, value: Any) -> Any:
        if self.compiled is not None:
            return self.compiled.execute(value)
        ref = value
        for actor in self.actors:
            ref = actor.tiny.remote(ref)
        return ref

    def hop_latency_us(self, requests: int) -> float:
        """Median over `requests` sequential requests of end-to-end µs / 3."""
        durations = []
        for i in range(requests):
            start = time.perf_counter()
            out = self.ray.get(self.submit(i))
            durations.append(time.perf_counter() - start)
            if out != i:
                raise RuntimeError(f"Ray's pipeline returned {out!r} for {i}")
        return _median_us(durations) / 3

    def throughput(self, requests: int, in_flight: int) -> float:
        """Requests/s of `requests` with `in_flight` submitted and not yet collected."""
        window: deque[tuple[int, Any]] = deque()
        start = time.perf_counter()
        for i in range(requests):
            if len(window) >= in_flight:
                self._collect(*window.popleft())
            window.append((i, self.submit(i)))
        while window:
            self._collect(*window.popleft())
        return requests / (time.perf_counter() - start)

    def _collect(self, i: int, ref: Any) -> None:
        out = self.ray.get(ref)
        if out != i:
            raise RuntimeError(f"Ray's pipeline returned {out!r} for {i}")

    def teardown(self) -> None:
        """Tear the compiled graph down (its actors stop looping on their channels)."""
        if self.compiled is not None:
            self.compiled.teardown()
            self.compiled = None
