"""Replicas and load balancing.

A `Pool` holds the replicas of one deployment (a class node bound to its arguments, or a
function node with `replicas`/`concurrency`). Each call asks the pool's `Balancer` for a
replica, waits in that replica's bounded queue for one of its `concurrency` slots, and runs.
When every queue is full, callers wait for space: backpressure instead of unbounded memory.

Balancers are plain synchronous objects (no I/O, no awaits) so that they are easy to test and
so that a KV-aware balancer can be added without touching the scheduler.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from omni.graph._balancers import Balancer, CallInfo, LeastLoaded, PowerOfTwo, RoundRobin
from omni.graph.kv_aware import KVAware

__all__ = ["Balancer", "CallInfo", "LeastLoaded", "Pool", "PoolStats", "PowerOfTwo", "Replica",
           "RoundRobin", "make_balancer"]


_BUILTIN = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "power_of_two": PowerOfTwo}


def make_balancer(spec: Any) -> Balancer:
    """A fresh balancer for a pool from a name, a Balancer class, or an instance."""
    if spec == "kv_aware":
        return KVAware()
    if isinstance(spec, str):
        return _BUILTIN[spec]()
    if isinstance(spec, type):
        return spec()
    return spec


class Replica:
    """One instance of a deployment and its load. Why: the balancer reads `load`/`full`, the pool
    keeps them true. Invariant: 0 <= in_flight <= concurrency, 0 <= queued."""

    def __init__(self, index: int, instance: Any, concurrency: int | None, max_queue: int):
        self.index = index
        self.instance = instance
        self.concurrency = concurrency
        self.max_queue = max_queue
        self.in_flight = 0
        self.queued = 0
        self.completed = 0
        self.failed = 0
        self.member: str | None = getattr(instance, "member", None)  # its cluster worker
        self._slots = trio.Semaphore(concurrency) if concurrency is not None else None

    @property
    def alive(self) -> bool:
        """False once the worker hosting this replica is gone (until it is replaced)."""
        return getattr(self.instance, "alive", True)

    @property
    def load(self) -> int:
        """Calls this replica holds: in flight plus queued for a slot."""
        return self.in_flight + self.queued

    @property
    def full(self) -> bool:
        """True when a new call would exceed this replica's bound of `concurrency` calls in
        flight plus `max_queue` queued. Compared on `load`, not per counter: a released slot is
        handed to a queued caller that still counts as queued until it runs, and that caller
        must not leave room for one more."""
        if self.concurrency is None:
            return False
        return self.load >= self.concurrency + self.max_queue

    def __repr__(self) -> str:
        return f"<Replica {self.index} in_flight={self.in_flight} queued={self.queued}>"


class NoLiveReplica(RuntimeError):
    """Every replica of a pool is on a worker that is gone."""

    def __init__(self, pool: str, replicas: Sequence[Replica]):
        members = ", ".join(sorted({r.member or "?" for r in replicas}))
        super().__init__(f"no live replica of '{pool}': its workers ({members}) are gone")


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot of a pool: per replica (in_flight, queued, completed, failed)."""

    name: str
    balancer: str
    replicas: tuple[tuple[int, int, int, int], ...]
    waiting: int


class Pool:
    """The replicas of one deployment, with its balancer and the backpressure wait."""

    def __init__(self, name: str, instances: Sequence[Any], *, balancer: Any,
                 concurrency: int | None, max_queue: int):
        self.name = name
        self.replicas = [Replica(i, inst, concurrency, max_queue)
                         for i, inst in enumerate(instances)]
        self.balancer = make_balancer(balancer)
        self._space = trio.lowlevel.ParkingLot()

    def _place(self, call: CallInfo) -> Replica | None:
        """The replica for `call`: the balancer's choice, or the least loaded replica with room
        when that one is full; None when every replica is full (the caller waits).

        Raises:
            RuntimeError: the balancer returned something that is not a replica index.
        """
        replicas = self.replicas
        if not all(r.alive for r in replicas):
            replicas = [r for r in replicas if r.alive]
            if not replicas:
                raise NoLiveReplica(self.name, self.replicas)
        index = self.balancer.choose(replicas, call)
        num_replicas = len(replicas)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < num_replicas:
            raise RuntimeError(f"pool '{self.name}': balancer {self.balancer!r} returned "
                               f"{index!r}, not a replica index (an int in 0..{num_replicas - 1})")
        replica = replicas[index]
        if not replica.full:
            return replica
        open_ = [r for r in replicas if not r.full]
        return min(open_, key=lambda r: r.load) if open_ else None

    @asynccontextmanager
    async def acquire(self, call: CallInfo) -> AsyncIterator[Replica]:
        """Hold a slot on a replica for the duration of one call."""
        replica = self._place(call)
        while replica is None:
            await self._space.park()
            replica = self._place(call)
        replica.queued += 1
        try:
            if replica._slots is not None:
                await replica._slots.acquire()
        except BaseException:
            # Left the queue without a slot (cancelled, timed out): that made room, so a
            # caller waiting for space must hear of it now, not when a call finishes.
            self._space.unpark()
            raise
        finally:
            replica.queued -= 1
        replica.in_flight += 1
        try:
            yield replica
        except BaseException:
            replica.failed += 1
            raise
        else:
            replica.completed += 1
        finally:
            replica.in_flight -= 1
            if replica._slots is not None:
                replica._slots.release()
            self._space.unpark()

    def replace(self, index: int, instance: Any) -> None:
        """Put a new instance in replica `index` (one on another worker, after a loss)."""
        replica = self.replicas[index]
        replica.instance = instance
        replica.member = getattr(instance, "member", None)
        self._space.unpark_all()

    def stats(self) -> PoolStats:
        """A snapshot of every replica's counters and of the callers waiting for space."""
        return PoolStats(self.name, repr(self.balancer),
                         tuple((r.in_flight, r.queued, r.completed, r.failed)
                               for r in self.replicas),
                         len(self._space))

    def __repr__(self) -> str:
        loads = " ".join(f"{r.in_flight}+{r.queued}" for r in self.replicas)
        return f"<Pool {self.name} replicas={len(self.replicas)} load=[{loads}]>"
