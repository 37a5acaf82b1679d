"""Replicas and load balancing.

A `Pool` holds the replicas of one deployment (a class node bound to its arguments, or a
function node with `replicas`/`concurrency`). Each call asks the pool's `Balancer` for a
replica, waits in that replica's bounded queue for one of its `concurrency` slots, and runs.
When every queue is full, callers wait for space: backpressure instead of unbounded memory.
When every replica is dead (its process, a cluster worker, is gone), callers wait for one to
be put back (`Pool.replace`) for up to `replace_timeout` seconds, then fail with
`NoLiveReplica`: a lost worker delays requests by the time its replicas take to be placed
again, instead of failing every one that arrives meanwhile.

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

__all__ = ["REPLACE_TIMEOUT_S", "Balancer", "CallInfo", "LeastLoaded", "NoLiveReplica", "Pool",
           "PoolStats", "PowerOfTwo", "Replica", "RoundRobin", "make_balancer"]

REPLACE_TIMEOUT_S = 30.0  # how long a call waits for a dead pool's replicas to be replaced


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
        """False once the worker hosting this replica is gone (until it is replaced). Only a
        replica in another process (``omni_remote``) can die; a class node's own attribute
        named ``alive`` means nothing here."""
        instance = self.instance
        return not getattr(instance, "omni_remote", False) or instance.alive

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

    def count(self, *, failed: bool) -> None:
        """Count one call's outcome."""
        if failed:
            self.failed += 1
        else:
            self.completed += 1

    def __repr__(self) -> str:
        return f"<Replica {self.index} in_flight={self.in_flight} queued={self.queued}>"


class NoLiveReplica(RuntimeError):
    """Every replica of a pool stayed dead (its worker gone, none placed in its stead) for the
    pool's `replace_timeout` seconds while a call waited. `pool` names the node, `waited` is
    that timeout."""

    def __init__(self, pool: str, replicas: Sequence[Replica], waited: float):
        self.pool = pool
        self.waited = waited
        members = ", ".join(sorted({r.member or "?" for r in replicas}))
        super().__init__(f"no live replica of '{pool}' within the replace timeout of "
                         f"{waited:g} s: its workers ({members}) are gone and no other "
                         "could host it")


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot of a pool: per replica (in_flight, queued, completed, failed), the callers
    waiting for space, and those waiting for a live replica (`waiting_for_replica`)."""

    name: str
    balancer: str
    replicas: tuple[tuple[int, int, int, int], ...]
    waiting: int
    waiting_for_replica: int = 0


class Pool:
    """The replicas of one deployment, with its balancer, the backpressure wait and the wait
    for replicas to be replaced.

    Args:
        replace_timeout: seconds a call waits for a live replica when every replica is dead,
            before it fails with `NoLiveReplica` (0: at once).
    """

    def __init__(self, name: str, instances: Sequence[Any], *, balancer: Any,
                 concurrency: int | None, max_queue: int,
                 replace_timeout: float = REPLACE_TIMEOUT_S):
        if not replace_timeout >= 0:  # NaN too
            raise ValueError(f"pool '{name}': replace_timeout must be >= 0 seconds, got "
                             f"{replace_timeout!r}")
        self.name = name
        self.replicas = [Replica(i, inst, concurrency, max_queue)
                         for i, inst in enumerate(instances)]
        self.balancer = make_balancer(balancer)
        self.replace_timeout = replace_timeout
        self._space = trio.lowlevel.ParkingLot()  # callers waiting for a slot to free up
        self._revived = trio.lowlevel.ParkingLot()  # callers waiting for a live replica

    @property
    def live(self) -> bool:
        """True when at least one replica is alive."""
        return any(r.alive for r in self.replicas)

    def _place(self, call: CallInfo) -> Replica | None:
        """The replica for `call`: the balancer's choice among the live replicas, or the least
        loaded live replica with room when that one is full; None when every live replica is
        full or none is alive (the caller waits: `_choose`).

        Raises:
            RuntimeError: the balancer returned something that is not a replica index.
        """
        replicas = self.replicas
        for replica in replicas:  # (a loop: cheaper than all() over a generator, per call)
            if not replica.alive:
                replicas = [r for r in replicas if r.alive]
                if not replicas:
                    return None
                break
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

    async def _choose(self, call: CallInfo) -> Replica:
        """A live replica with room for `call`, once there is one: waits for space while
        every live replica is full, and for a replacement while none is alive.

        Raises:
            NoLiveReplica: no replica came alive within `replace_timeout` seconds.
        """
        deadline: float | None = None  # set when this call first finds no live replica
        while True:
            replica = self._place(call)
            if replica is not None:
                return replica
            if self.live:
                await self._space.park()
                continue
            if deadline is None:
                deadline = trio.current_time() + self.replace_timeout
            with trio.move_on_at(deadline):
                await self._revived.park()
            if trio.current_time() >= deadline and not self.live:
                raise NoLiveReplica(self.name, self.replicas, self.replace_timeout)

    async def queue_on(self, call: CallInfo) -> Replica:
        """Choose a live replica with room for `call`, waiting for room as `acquire` does,
        and count the call as queued on it, without taking a slot: the replica's process
        holds its calls to its concurrency itself (a chain's stages). Pair it with
        `leave_queue` once the call is done.

        Why not a context manager: a chain queues on one pool per stage, on the hot path of
        every request, where a context manager per stage costs more than the bookkeeping.

        Raises:
            NoLiveReplica: as for `acquire`.
        """
        replica = self._place(call) or await self._choose(call)
        replica.queued += 1
        return replica

    def queue_now(self, call: CallInfo) -> Replica | None:
        """`queue_on` without waiting: None when no live replica has room now."""
        replica = self._place(call)
        if replica is not None:
            replica.queued += 1
        return replica

    def leave_queue(self, replica: Replica, *, failed: bool) -> None:
        """The call `queue_on` counted on `replica` is done: count its outcome and make
        room."""
        replica.queued -= 1
        replica.count(failed=failed)
        if self._space:  # someone waits for room
            self._space.unpark()

    @asynccontextmanager
    async def acquire(self, call: CallInfo) -> AsyncIterator[Replica]:
        """Hold a slot on a live replica for the duration of one call.

        Raises:
            NoLiveReplica: every replica is dead and none was replaced within
                `replace_timeout` seconds.
        """
        while True:
            replica = self._place(call)  # the hot path: a replica with room, no wait
            if replica is None:
                replica = await self._choose(call)
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
            if replica.alive:
                break
            # Its worker died while this call queued for the slot: nothing was sent there.
            # Give the slot back and place the call again (on a live replica, or wait).
            if replica._slots is not None:
                replica._slots.release()
            self._space.unpark()
        replica.in_flight += 1
        failed = True
        try:
            yield replica
            failed = False
        finally:
            replica.count(failed=failed)
            replica.in_flight -= 1
            if replica._slots is not None:
                replica._slots.release()
            self._space.unpark()

    def replace(self, index: int, instance: Any) -> None:
        """Put a new instance in replica `index` (one on another worker, after a loss); the
        calls waiting for a live replica or for space try again."""
        replica = self.replicas[index]
        replica.instance = instance
        replica.member = getattr(instance, "member", None)
        self.wake()

    def wake(self) -> None:
        """Let every waiting call look again: a replica may have come back to life without
        being replaced (its worker answered again)."""
        self._revived.unpark_all()
        self._space.unpark_all()

    def stats(self) -> PoolStats:
        """A snapshot of every replica's counters and of the callers waiting for space or
        for a live replica."""
        return PoolStats(self.name, repr(self.balancer),
                         tuple((r.in_flight, r.queued, r.completed, r.failed)
                               for r in self.replicas),
                         len(self._space), len(self._revived))

    def __repr__(self) -> str:
        loads = " ".join(f"{r.in_flight}+{r.queued}" for r in self.replicas)
        dead = sum(1 for r in self.replicas if not r.alive)
        lost = f" dead={dead}" if dead else ""
        return f"<Pool {self.name} replicas={len(self.replicas)} load=[{loads}]{lost}>"
