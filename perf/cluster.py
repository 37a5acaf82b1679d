"""Cluster: KV-aware routing against round-robin on a shared-prefix workload, 2 workers.

One head and two workers are started as subprocesses (``python -m cli cluster start`` /
``cluster join``) once; this process is the driver. Each worker keeps KV pages in a host
tier only (``--kv-host``), sized to hold the pages of half the system prompts plus half of
one prompt's pages (reported as ``cluster.capacity_pages``), and runs with ``--no-kv-fetch``:
a cached token is one the worker the request was routed to already held, so the hit rate
measures the routing. Each worker runs torch on ``worker_threads`` threads (default 1: the
two workers share a 2-core machine).

The workload: 8 system prompts of 512 random token ids (32 pages) x 24 users; a request is a
system prompt plus an 8-token user question (with the generated tokens it stays in the last,
partial page, so a request stores no pages but its system prompt's), 4 tokens generated
greedily; all requests in a seeded random order, 4 in flight (a semaphore; ``--concurrency``).
Both pools (the same node, ``replicas=2``, one replica per worker, ``balance="kv_aware"`` or
``"round_robin"``) live on the same two workers and run in alternating phases (A B, B A, ...;
one untimed warm-up phase each first). Every phase draws its own system prompts, so no phase
profits from another's pages (they only fill the stores, as LRU-oldest pages); the two phases
of a round send their system prompts in the same order, so their figures pair up.

Per phase: hit rate = sum of cached tokens / sum of prompt tokens (the engines' results);
throughput = requests / wall seconds from the first submission to the last result.

Claims: KV-aware hit rate >= 2x round-robin's, throughput >= 1x (each ratio: the median over
rounds of the paired kv_aware / round_robin ratio). For reference, ``lru_model`` gives the hit
rates an exact page-level LRU of the same capacity would see for the same request orders
served one at a time, with ideal prefix affinity (each system prompt always on the worker that
served it first) and with round-robin. With equally popular prompts and at most half of them
fitting per worker, an LRU's hit rate is about (prompts it holds) / (prompts it is sent), so
even the ideal ratio is only about 2 (a little more from round-robin's second cold miss per
prompt): the target sits at the edge of what routing can give on this workload.

Usage: ``python perf/cluster.py [--quick] [--out PATH.json] [--plot PATH.png] [--profile]
[--concurrency N]`` (the profile of the driver during one extra kv_aware phase goes to
stderr).
"""

from __future__ import annotations

import contextlib
import cProfile
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import trio

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import omni
from perf import _cluster_nodes as nodes
from perf._common import (
    Samples,
    benchmark_parser,
    claim,
    environment,
    params_from,
    plot_bars,
    profile_report,
    write_json,
)
from perf._procs import START_S, CliProcess, wait_members

__all__ = ["Params", "lru_model", "main", "measure"]

ROOT = Path(__file__).resolve().parent.parent
HIT_RATE_TARGET = 2.0  # kv_aware hit rate / round_robin hit rate, at least
THROUGHPUT_TARGET = 1.0  # kv_aware requests/s / round_robin requests/s, at least
POLICIES = ("kv_aware", "round_robin")
WORKERS = ("w1", "w2")
SPREAD_S = 60.0  # at most this long for the driver to move replicas to a worker that rejoined


@dataclass(frozen=True, slots=True)
class Params:
    """The sizes of one run (`quick` shrinks them for a smoke run)."""

    seed: int = 0
    repeats: int = 3  # timed phases per policy
    system_prompts: int = 8
    users: int = 24  # requests per system prompt per phase
    system_tokens: int = 512  # a multiple of the page size (16)
    question_tokens: int = 8  # + max_tokens - 1 < page size: no page of its own
    max_tokens: int = 4
    concurrency: int = 4  # requests in flight
    warmup_users: int = 2  # requests per system prompt in each policy's warm-up phase
    worker_threads: int = 1  # torch threads per worker process
    heartbeat: float = 0.5
    phase_timeout_s: float = 120.0
    quick: bool = False

    @classmethod
    def small(cls, seed: int = 0) -> Params:
        """Sizes for a smoke run: one phase per policy, 6 users, 256-token system prompts."""
        return cls(seed=seed, repeats=1, users=6, system_tokens=256, warmup_users=1,
                   quick=True)

    @property
    def pages_per_prompt(self) -> int:
        return self.system_tokens // nodes.PAGE_SIZE

    @property
    def capacity_pages(self) -> int:
        """Pages each worker's store holds: half the system prompts' pages plus half of one."""
        return self.system_prompts // 2 * self.pages_per_prompt + self.pages_per_prompt // 2


# ---------------------------------------------------------------------------------------------
# The cluster: a head and two workers as subprocesses


@contextlib.contextmanager
def cluster(params: Params, folder: Path) -> Iterator[tuple[str, list[CliProcess]]]:
    """A head and workers `WORKERS` started in `folder`; yields the head's address and the
    processes (head first), which are stopped on exit."""
    token = str(folder / "cluster.token")
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": str(params.worker_threads),
           "MKL_NUM_THREADS": str(params.worker_threads)}
    heartbeat = str(params.heartbeat)
    capacity = params.capacity_pages * nodes.kv_layout().page_bytes
    procs: list[CliProcess] = []
    try:
        head = CliProcess(["cluster", "start", "--bind", "tcp://127.0.0.1:*", "--token-file", token,
                      "--heartbeat", heartbeat], ROOT, env)
        procs.append(head)
        address = head.wait_line(r"head at (tcp://\S+)").group(1)
        for name in WORKERS:  # they import torch side by side
            procs.append(CliProcess(["cluster", "join", address, "--token-file", token, "--name",
                                name, "--heartbeat", heartbeat, "--kv-host", str(capacity),
                                "--no-kv-fetch", "--timeout", str(START_S)], ROOT, env))
        for proc in procs[1:]:
            proc.wait_line(r"joined .* as")
        wait_members(address, token, dict(zip(WORKERS, procs[1:], strict=True)), cwd=ROOT,
                     env=env)
        yield address, procs
    finally:
        for proc in reversed(procs):  # workers first, then the head
            proc.stop()


# ---------------------------------------------------------------------------------------------
# The workload


def phase_requests(params: Params, round_: str, policy: str,
                   users: int) -> list[tuple[int, list[int]]]:
    """One phase's requests in their seeded random order: (system prompt index, token ids).

    Every phase draws its own system prompts and questions (seeded by round and policy), so
    it finds no pages of another; both policies' phases of a round send them in the same
    order of system prompts (seeded by the round), so their hit rates pair up.
    """
    vocab = nodes.MODEL["vocab_size"]
    rng = random.Random(f"{params.seed}/{round_}/{policy}")

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    systems = [tokens(params.system_tokens) for _ in range(params.system_prompts)]
    order = [i for i in range(params.system_prompts) for _ in range(users)]
    random.Random(f"{params.seed}/{round_}").shuffle(order)
    return [(i, systems[i] + tokens(params.question_tokens)) for i in order]


@dataclass(slots=True)
class Phase:
    """One phase: every request of one policy's workload, and what the driver saw."""

    policy: str
    label: str
    requests: int
    wall_s: float
    prompt_tokens: int
    cached_tokens: int
    latencies_s: list[float]
    by_worker: dict[str, int]
    off_home: int  # requests not served on their system prompt's most frequent worker
    balancer: dict[str, int] | None = None
    lru_model: dict[str, float] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens

    @property
    def throughput(self) -> float:
        return self.requests / self.wall_s

    def to_json(self) -> dict[str, Any]:
        return {"policy": self.policy, "phase": self.label, "requests": self.requests,
                "wall_s": round(self.wall_s, 3), "hit_rate": round(self.hit_rate, 4),
                "throughput_rps": round(self.throughput, 2),
                "latency_ms_median": round(statistics.median(self.latencies_s) * 1e3, 1),
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "requests_by_worker": self.by_worker,
                "off_home_requests": self.off_home, "balancer": self.balancer,
                "lru_model": self.lru_model}


def _counters(pool: Any) -> dict[str, int] | None:
    balancer = pool.balancer
    if not hasattr(balancer, "hits"):
        return None
    return {"hits": balancer.hits, "misses": balancer.misses, "fallbacks": balancer.fallbacks}


async def run_phase(rt: omni.Runtime, node: Any, policy: str, label: str,
                    requests: list[tuple[int, list[int]]], params: Params) -> Phase:
    """Send `requests` in order, `params.concurrency` in flight; collect the results."""
    pool = rt.pool_for(node)
    before = _counters(pool)
    results: list[dict[str, Any] | None] = [None] * len(requests)
    latencies = [0.0] * len(requests)
    slots = trio.Semaphore(params.concurrency)

    async def one(i: int, prompt: list[int]) -> None:
        try:
            began = time.perf_counter()
            results[i] = await rt.run(node, prompt=prompt, max_tokens=params.max_tokens)
            latencies[i] = time.perf_counter() - began
        finally:
            slots.release()

    with trio.fail_after(params.phase_timeout_s):
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i, (_, prompt) in enumerate(requests):
                await slots.acquire()  # submitted in the workload's order
                nursery.start_soon(one, i, prompt)
        wall = time.perf_counter() - start
    done = [r for r in results if r is not None]
    after = _counters(pool)
    counters = None if before is None or after is None else {
        k: after[k] - before[k] for k in after}
    homes: dict[int, Counter[str]] = {}
    for (system, _), r in zip(requests, results, strict=True):
        if r is not None:
            homes.setdefault(system, Counter())[r["worker"]] += 1
    off_home = sum(c.total() - max(c.values()) for c in homes.values())
    return Phase(policy, label, len(done), wall, sum(r["prompt_tokens"] for r in done),
                 sum(r["cached_tokens"] for r in done), latencies,
                 dict(sorted(Counter(r["worker"] for r in done).items())),
                 off_home, counters, lru_model(requests, params))


# ---------------------------------------------------------------------------------------------
# The reference: an exact LRU model of the workers' stores


def lru_model(requests: Sequence[tuple[int, list[int]]], params: Params) -> dict[str, float]:
    """Hit rates (cached / prompt tokens) of `requests` served one at a time on two page-level
    LRU stores of `params.capacity_pages`, as `TorchEngine` uses its store (the longest cached
    prefix of the pages before the last token, then every full page put back): with ideal
    prefix affinity (each system prompt on the worker its first request went to, first
    requests alternating) and with round-robin."""
    page = nodes.PAGE_SIZE
    out = {}
    for policy in ("affinity", "round_robin"):
        stores: list[OrderedDict[bytes, None]] = [OrderedDict(), OrderedDict()]
        home: dict[int, int] = {}
        cached = total = 0
        for n, (system, prompt) in enumerate(requests):
            if policy == "round_robin":
                worker = n % 2
            else:
                worker = home.setdefault(system, len(home) % 2)
            store = stores[worker]
            keys = nodes.prompt_keys(prompt)
            usable = keys[: (len(prompt) - 1) // page]
            hit = 0
            while hit < len(usable) and usable[hit] in store:
                hit += 1
            for key in usable[:hit]:
                store.move_to_end(key)
            stored = (len(prompt) + params.max_tokens - 1) // page  # pages put back
            fresh = keys[hit:stored] + [os.urandom(16) for _ in range(stored - len(keys))]
            for key in fresh:
                if len(store) >= params.capacity_pages:
                    store.popitem(last=False)
                store[key] = None
            cached += hit * page
            total += len(prompt)
        out[policy] = round(cached / total, 4)
    return out


# ---------------------------------------------------------------------------------------------
# The run


async def drive(params: Params, address: str, token_file: str,
                profiler: cProfile.Profile | None = None) -> dict[str, Any]:
    """Deploy both pools on the cluster at `address`; warm up; run the alternating phases."""
    pools = {"kv_aware": nodes.ChatKVAware(seed=params.seed),
             "round_robin": nodes.ChatRoundRobin(seed=params.seed)}
    phases: list[Phase] = []
    async with omni.Runtime(cluster=address, token_file=token_file, kv=nodes.kv_layout(),
                            min_workers=len(WORKERS)) as rt:
        for node in pools.values():
            await rt.deploy(node)
        placement = await spread_placement(rt, pools)
        for policy, node in pools.items():
            await run_phase(rt, node, policy, f"warmup-{policy}",
                            phase_requests(params, "warmup", policy, params.warmup_users),
                            params)
        load_before = os.getloadavg()
        for r in range(params.repeats):
            for policy in POLICIES if r % 2 == 0 else reversed(POLICIES):
                phases.append(await run_phase(
                    rt, pools[policy], policy, f"{r}-{policy}",
                    phase_requests(params, str(r), policy, params.users), params))
        load_after = os.getloadavg()
        if profiler is not None:
            requests = phase_requests(params, "profile", "kv_aware", params.users)
            profiler.enable()
            try:
                await run_phase(rt, pools["kv_aware"], "kv_aware", "profile-kv_aware",
                                requests, params)
            finally:
                profiler.disable()
    return {"phases": phases, "placement": placement,
            "loadavg": [[round(x, 2) for x in load_before], [round(x, 2) for x in load_after]]}


async def spread_placement(rt: omni.Runtime, pools: dict[str, Any]) -> dict[str, list[str]]:
    """Each pool's workers, once each has one replica per worker. The head spreads a pool's
    replicas over the members; should a worker have dropped out for a moment while they were
    placed, the driver moves a replica to it when it is back: wait for that (`SPREAD_S`).

    Raises:
        RuntimeError: a pool is still not one replica per worker after `SPREAD_S` seconds.
    """
    def placement() -> dict[str, list[str]]:
        return {policy: [r.member for r in rt.pool_for(node).replicas]
                for policy, node in pools.items()}

    with trio.move_on_after(SPREAD_S):
        while any(sorted(m) != sorted(WORKERS) for m in placement().values()):
            await trio.sleep(0.1)
    for policy, members in placement().items():
        if sorted(members) != sorted(WORKERS):
            raise RuntimeError(f"{policy}'s replicas are on {members}, not one per worker "
                               f"(after {SPREAD_S:g} s)")
    return placement()


def measure(params: Params, profiler: cProfile.Profile | None = None) -> dict[str, Any]:
    """Start the cluster, drive both policies, stop the cluster; the result dict."""
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="omni-perf-cluster-") as folder:
        with cluster(params, Path(folder)) as (address, procs):
            run = trio.run(drive, params, address, str(Path(folder) / "cluster.token"),
                           profiler)
    # What the workers logged (warnings such as KV pages not cached would show here).
    run["worker_stderr"] = {name: {"lines": len(proc.err),
                                   "first": [line.rstrip()[:200] for line in proc.err[:3]]}
                            for name, proc in zip(WORKERS, procs[1:], strict=True)}
    return _summarise(params, run, time.perf_counter() - began)


# ---------------------------------------------------------------------------------------------
# Summary


def _paired(phases: list[Phase], value: str) -> tuple[Samples, Samples, Samples]:
    """Per policy the samples of `value` over rounds, and the per-round kv / rr ratios."""
    kv = [getattr(p, value) for p in phases if p.policy == "kv_aware"]
    rr = [getattr(p, value) for p in phases if p.policy == "round_robin"]
    ratios = [a / b if b else float("inf") for a, b in zip(kv, rr, strict=True)]
    return Samples(tuple(kv)), Samples(tuple(rr)), Samples(tuple(ratios))


def _summarise(params: Params, run: dict[str, Any], seconds: float) -> dict[str, Any]:
    import torch

    phases: list[Phase] = run["phases"]
    kv_hit, rr_hit, hit_ratios = _paired(phases, "hit_rate")
    kv_tp, rr_tp, tp_ratios = _paired(phases, "throughput")
    layout = nodes.kv_layout()
    kv_phases = [p for p in phases if p.policy == "kv_aware"]
    balancer = {k: sum(p.balancer[k] for p in kv_phases if p.balancer) for k in
                ("hits", "misses", "fallbacks")}
    balancer["first_requests"] = params.system_prompts * len(kv_phases)  # misses at best
    off_home = {policy: [p.off_home for p in phases if p.policy == policy]
                for policy in POLICIES}
    model = {policy: Samples(tuple(p.lru_model[key] for p in phases if p.policy == policy))
             for policy, key in (("kv_aware", "affinity"), ("round_robin", "round_robin"))}
    model_ratio = Samples(tuple(a / b for a, b in zip(model["kv_aware"].values,
                                                      model["round_robin"].values,
                                                      strict=True)))
    hit_ratio, tp_ratio = hit_ratios.median, tp_ratios.median
    requests = params.system_prompts * params.users
    result = {
        "benchmark": "cluster",
        "env": {**environment(), "torch": torch.__version__,
                "worker_torch_threads": params.worker_threads,
                "loadavg_before": run["loadavg"][0], "loadavg_after": run["loadavg"][1]},
        "params": asdict(params),
        "model": {"architecture": "llama", **nodes.MODEL, "page_size": nodes.PAGE_SIZE,
                  "dtype": "float32"},
        "cluster": {"workers": list(WORKERS), "placement": run["placement"],
                    "kv_fetch": False, "page_bytes": layout.page_bytes,
                    "pages_per_system_prompt": params.pages_per_prompt,
                    "capacity_pages": params.capacity_pages,
                    "kv_host_bytes": params.capacity_pages * layout.page_bytes,
                    "capacity_in_system_prompts": round(
                        params.capacity_pages / params.pages_per_prompt, 2)},
        "workload": {"system_prompts": params.system_prompts, "users": params.users,
                     "requests_per_phase": requests,
                     "prompt_tokens": params.system_tokens + params.question_tokens,
                     "max_hit_rate": round(params.system_tokens
                                           / (params.system_tokens + params.question_tokens), 4),
                     "concurrency": params.concurrency},
        "hit_rate": claim(
            unit="cached / prompt tokens", target=HIT_RATE_TARGET, measured=kv_hit,
            baseline=rr_hit, ratio=hit_ratio, passed=hit_ratio >= HIT_RATE_TARGET, digits=4,
            ratios=hit_ratios.to_json(3),
            ratio_of_medians=round(kv_hit.median / rr_hit.median, 3) if rr_hit.median else None,
            balancer=balancer, off_home_requests=off_home,
            lru_model={"kv_aware": model["kv_aware"].to_json(4),
                       "round_robin": model["round_robin"].to_json(4),
                       "ratio": round(model_ratio.median, 3)},
            note=("per phase: sum of cached tokens / sum of prompt tokens over its "
                  f"{requests} requests (GenerateResult.cached_tokens on the worker; "
                  "--no-kv-fetch, so only pages the routed worker held count); measured: "
                  "kv_aware, baseline: round_robin, each phase with its own system prompts; "
                  "ratio: median over rounds of the paired kv_aware / round_robin ratio, "
                  f"target >= {HIT_RATE_TARGET}. balancer: KVAware's hits/misses/fallbacks "
                  "summed over the timed phases (first_requests: the misses it cannot avoid); "
                  "off_home_requests: per phase, the requests not served on their system "
                  "prompt's most frequent worker (ideal affinity: 0). lru_model: the same "
                  "request orders served one at a time on exact page-level LRU stores of the "
                  "same capacity, with ideal prefix affinity (kv_aware) and round-robin: the "
                  "ratio's expected value with no directory lag and no load balancing")),
        "throughput": claim(
            unit="requests/s", target=THROUGHPUT_TARGET, measured=kv_tp, baseline=rr_tp,
            ratio=tp_ratio, passed=tp_ratio >= THROUGHPUT_TARGET, digits=2,
            ratios=tp_ratios.to_json(3),
            ratio_of_medians=round(kv_tp.median / rr_tp.median, 3),
            note=(f"per phase: {requests} requests / wall seconds from the first submission "
                  f"to the last result, {params.concurrency} in flight, {params.max_tokens} "
                  "tokens generated greedily each; ratio: median over rounds of the paired "
                  f"kv_aware / round_robin ratio, target >= {THROUGHPUT_TARGET}")),
        "phases": [p.to_json() for p in phases],
        "worker_stderr": run["worker_stderr"],
        "seconds": round(seconds, 1),
    }
    result["all_pass"] = result["hit_rate"]["pass"] and result["throughput"]["pass"]
    return result


def _plot(result: dict[str, Any], path: str) -> None:
    """Hit rate and throughput per policy (bars: medians, whiskers: min..max)."""

    def samples(claim_: dict[str, Any], key: str) -> Samples:
        return Samples(tuple(claim_[key]["runs"]))

    hit, tp = result["hit_rate"], result["throughput"]
    env = result["env"]
    plot_bars(path, f"KV-aware vs round-robin routing, 2 workers, {env['cpu_count']} CPUs "
                    f"(hit ratio {hit['ratio']}, throughput ratio {tp['ratio']})", [
        ("KV cache hit rate", "cached / prompt tokens (higher is better)",
         {"kv_aware": samples(hit, "measured"), "round_robin": samples(hit, "baseline")}),
        ("throughput", "requests/s (higher is better)",
         {"kv_aware": samples(tp, "measured"), "round_robin": samples(tp, "baseline")}),
    ])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse `argv`, run the benchmark, print (and optionally write and plot) the result."""
    parser = benchmark_parser(__doc__, repeats_help="timed phases per policy",
                              plot_help="write a bar chart (PNG) here",
                              profile_help="also cProfile the driver during one extra "
                                           "kv_aware phase (to stderr)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help=f"requests in flight (default {Params.concurrency})")
    args = parser.parse_args(argv)
    params = params_from(args, Params)
    if args.concurrency is not None:
        params = replace(params, concurrency=args.concurrency)
    profiler = cProfile.Profile() if args.profile else None
    result = measure(params, profiler)
    write_json(result, args.out)
    if args.plot:
        _plot(result, args.plot)
    if profiler is not None:
        sys.stderr.write(profile_report(profiler, 30))
    return result


if __name__ == "__main__":
    main()
