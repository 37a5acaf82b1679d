"""The balancing policies a pool can use, and what they see of a call. Plain synchronous
objects (no I/O, no awaits); `balance.py` holds the pools that use them and `kv_aware.py` the
policy that builds on these."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from omni.graph.balance import Replica

__all__ = ["Balancer", "CallInfo", "LeastLoaded", "PowerOfTwo", "RoundRobin"]


@dataclass(frozen=True, slots=True)
class CallInfo:
    """What a balancer may look at when it places one call."""

    node: str
    request_id: str
    args: tuple
    kwargs: dict[str, Any]
    attempt: int = 0


@runtime_checkable
class Balancer(Protocol):
    """Chooses a replica for a call. Must be synchronous and quick; must return an index of
    `replicas`. `replicas[i].load` (in flight + queued) and `.full` are the usual inputs."""

    def choose(self, replicas: Sequence[Replica], call: CallInfo) -> int: ...


class RoundRobin:
    """Each call goes to the next replica in turn."""

    def __init__(self) -> None:
        self._next = 0

    def choose(self, replicas: Sequence[Replica], call: CallInfo) -> int:
        index = self._next % len(replicas)
        self._next = index + 1
        return index

    def __repr__(self) -> str:
        return "RoundRobin()"


class LeastLoaded:
    """The replica with the fewest calls in flight and queued; ties go round the ring.

    The scan for the minimum starts just after the previous choice, so tied replicas take
    turns evenly whatever lies between them.
    """

    def __init__(self) -> None:
        self._start = 0

    def choose(self, replicas: Sequence[Replica], call: CallInfo) -> int:
        n = len(replicas)
        start = self._start % n
        best, best_load = start, replicas[start].load
        for offset in range(1, n):
            i = (start + offset) % n
            load = replicas[i].load
            if load < best_load:
                best, best_load = i, load
        self._start = best + 1
        return best

    def __repr__(self) -> str:
        return "LeastLoaded()"


class PowerOfTwo:
    """Two replicas drawn at random; the less loaded one wins (Mitzenmacher's two choices)."""

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self._rng = random.Random(seed)

    def choose(self, replicas: Sequence[Replica], call: CallInfo) -> int:
        n = len(replicas)
        if n == 1:
            return 0
        a, b = self._rng.sample(range(n), 2)
        return a if replicas[a].load <= replicas[b].load else b

    def __repr__(self) -> str:
        return "PowerOfTwo()" if self.seed is None else f"PowerOfTwo(seed={self.seed!r})"
