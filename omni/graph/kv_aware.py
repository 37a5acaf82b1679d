"""`balance="kv_aware"`: send a call where its prompt's KV pages already are.

The reference is the cache-aware routers of SGLang and NVIDIA Dynamo: score each replica by the
prefix pages it holds against its load, and fall back to least-loaded when loads are uneven.
Two details matter as much as the score on a real cluster:

- Workers report pages only once a prefill has stored them, so a second call for a new prompt
  that arrives meanwhile would find it nowhere and land on another replica: both would then
  keep that prompt, and each holds less of the rest. The balancer remembers where it sent each
  page for `memory_s` seconds and counts that as held until the directory catches up.
- When several replicas hold the whole prefix, the choice between them is stable (by the
  prefix's first key), so the extra copies age out instead of being refreshed in turn.
- A prefix nobody holds goes round the ring, whatever the loads of the moment (within
  `max_imbalance`): what decides later hits is that each replica gets an even share of the
  prompts, and a momentarily idle replica would otherwise collect them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from omni.graph._balancers import CallInfo, LeastLoaded

if TYPE_CHECKING:
    from omni.graph.balance import Replica

__all__ = ["KVAware", "PrefixIndex"]


class PrefixIndex(Protocol):
    """Who holds which KV pages (the cluster's KV directory answers it)."""

    def prefix_len(self, member: str, keys: Sequence[bytes]) -> int: ...


class KVAware:
    """Prefix overlap against load (see the module docstring).

    The cost of a replica, in pages of prefill work, is the pages of the call's prefix it does
    not hold plus `load_weight` × its load × the call's pages: the cheapest wins. With the
    default 0.1 a warm replica stays preferred until it has about ten calls more in flight
    than a cold one; calls on a warm replica cost little beyond their own new tokens, and each
    diversion costs a prefill and evicts a prompt elsewhere. When loads differ by more than
    `max_imbalance` calls, the least loaded replica wins outright (a replica that rejoins empty
    must not be starved, nor a hot one flooded).

    It needs a `PrefixIndex`, the member each replica runs on (``replica.member``), and the
    call's page keys (`keys_of(call)`); the cluster runtime binds them (`bind`), with the keys
    from the node class's ``kv_keys`` static method. Without them it is `LeastLoaded`.
    """

    def __init__(self, *, load_weight: float = 0.1, max_imbalance: int = 8,
                 memory_s: float = 2.0, memory_pages: int = 1 << 16):
        self.load_weight = load_weight
        self.max_imbalance = max_imbalance
        self.memory_s = memory_s
        self.memory_pages = memory_pages
        self.index: PrefixIndex | None = None
        self.keys_of: Any = None
        self.hits = self.misses = self.fallbacks = 0
        self._least = LeastLoaded()
        self._start = 0
        self._sent: OrderedDict[bytes, tuple[str, float]] = OrderedDict()  # page -> (member, when)

    def bind(self, index: PrefixIndex | None, keys_of: Any) -> None:
        """Give the balancer its KV index and the function that computes a call's keys."""
        self.index = index
        self.keys_of = keys_of

    def choose(self, replicas: Sequence[Replica], call: CallInfo) -> int:
        if self.index is None or self.keys_of is None or len(replicas) == 1:
            return self._least.choose(replicas, call)
        loads = [r.load for r in replicas]
        if max(loads) - min(loads) > self.max_imbalance:
            self.fallbacks += 1
            return self._least.choose(replicas, call)
        keys = self.keys_of(call)
        total = len(keys)
        n = len(replicas)
        now = time.monotonic()
        overlaps = [self._overlap(getattr(r, "member", None), keys, now) for r in replicas]
        if not any(overlaps):  # a new prefix: round the ring, so working sets split evenly
            best = self._start % n
            self._start = best + 1
        else:
            costs = [(total - overlaps[i]) + self.load_weight * loads[i] * max(total, 1)
                     for i in range(n)]
            tied = [i for i in range(n) if costs[i] == min(costs)]
            # holders that tie: a stable pick per prefix, so the extra copies age out
            best = tied[int.from_bytes(keys[0][:4], "little") % len(tied)]
        if overlaps[best]:
            self.hits += 1
        else:
            self.misses += 1
        self._remember(getattr(replicas[best], "member", None), keys, now)
        return best

    def _overlap(self, member: str | None, keys: Sequence[bytes], now: float) -> int:
        if member is None or not keys:
            return 0
        held = self.index.prefix_len(member, keys)  # type: ignore[union-attr]
        sent = self._sent
        cutoff = now - self.memory_s
        n = held
        while n < len(keys):  # pages sent there lately count until the directory hears of them
            entry = sent.get(keys[n])
            if entry is None or entry[0] != member or entry[1] < cutoff:
                break
            n += 1
        return n

    def _remember(self, member: str | None, keys: Sequence[bytes], now: float) -> None:
        if member is None:
            return
        sent = self._sent
        for key in keys:
            sent[key] = (member, now)
            sent.move_to_end(key)
        while len(sent) > self.memory_pages:
            sent.popitem(last=False)

    def __repr__(self) -> str:
        return f"KVAware(load_weight={self.load_weight}, max_imbalance={self.max_imbalance})"
