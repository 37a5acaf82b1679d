"""The tier manager: which page lives where, and the moves that keep every tier within bounds.

Tiers are ordered fastest first (device, host, disk). A page has at most one copy in a memory
tier (its *primary*) and at most one copy on disk. A full tier evicts its policy's victim one
tier down (device -> host -> disk -> dropped); `promote` brings pages up to a target tier.
A page's disk copy is kept when the page moves up again, so an unchanged page is never
written to disk twice; a disk copy is dropped only when the disk tier needs its slot.

Pinned pages (leased) are never evicted or moved. The manager is synchronous and not
thread-safe on its own: the store calls it with its lock held.

Disk I/O is not done here. An operation that needs it (a page demoted to disk, a page loaded
from it, a new page of a disk-only store) plans a `Transfer` and raises `Blocked`; the store
runs the transfer with its lock released, calls `commit`, and retries the operation (a load or
a put is finished by its commit). Memory-to-memory moves (device <-> host) stay synchronous
under the lock: a page is one memmove, shorter than handing it to another thread, and keeping
them there means a page in memory is always in exactly one place.

What other threads see of a page in transit:

- being demoted to disk: it stays where it is, resident and readable (`match`, `acquire` and
  moves up serve it from memory: the disk write uses a copy taken when it was planned). It is
  not evicted again until the write commits; then it has a disk copy, and its eviction just
  frees its memory slot. A write that fails (a full disk) leaves it in memory without a disk
  copy, marked, and its next eviction drops it rather than writing again.
- being loaded from disk: `match` counts it (its bytes are on disk, verified on arrival);
  `acquire` and `promote` wait for the read to commit, so two threads wanting it cause one
  read, and it is resident only once its bytes are all in its memory slot. A read that fails
  verification is a miss for every waiter, and the page is dropped.
- a new page of a disk-only store: absent until its write commits.
- discarded while in transit: gone at once for everyone; the transfer's slots are freed when
  it commits, and its outcome is thrown away.

A waiter waits only when nothing else can be done: the page it wants is being loaded, or every
candidate victim is pinned or in transit while some transfer is in flight.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from omni.kv.errors import KVCapacityError
from omni.kv.layout import KVLayout
from omni.kv.policy import EvictionPolicy
from omni.kv.tiers.memory import copy_page
from omni.kv.transfers import Blocked, Transfer

__all__ = ["Placement", "TierCounters", "TierManager"]

log = logging.getLogger("omni.kv")


class _Entry:
    """Where one page is. Why slots: one per cached page, so its size is the bookkeeping cost.

    Invariant: `mem` or `disk` is set; `mem` is (tier index, slot) of a memory tier; `disk` is
    a slot of the disk tier; `pins` > 0 only while `mem` is set; `transfer` is the page's
    disk transfer in flight (a demotion while `mem` is set and `disk` is not, a load while
    `disk` is set and `mem` is not); `write_failed`: its last demotion's write failed.
    """

    __slots__ = ("disk", "mem", "pins", "transfer", "write_failed")

    def __init__(self) -> None:
        self.mem: tuple[int, int] | None = None
        self.disk: int | None = None
        self.pins = 0
        self.transfer: Transfer | None = None
        self.write_failed = False


@dataclass
class TierCounters:
    """Event counts of one tier; `stats()` reports them with pages and capacity."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    promotions: int = 0
    demotions: int = 0
    corrupt: int = 0
    write_errors: int = 0


@dataclass(frozen=True)
class Placement:
    """Where a page is: its memory tier and slot (or None), and its disk slot (or None)."""

    tier: str | None
    slot: int | None
    disk_slot: int | None
    pins: int


class _FreeSlots:
    """A tier's free slots, handed out lowest first.

    Why lowest first: an arena-backed tier reserves its memory from the bottom up as slots are
    needed (`MemoryTier.reserve`), so the slots in use must stay packed at the bottom; the
    slot a page leaves is the next one handed out again when it is the lowest.

    Why a heap plus a mark: every slot from `_untouched` up has never been handed out, so only
    the slots freed below it are kept one by one. A tier of millions of slots then costs
    nothing until it fills (an engine's default store is sized from free memory).
    """

    __slots__ = ("_heap", "_num_slots", "_untouched")

    def __init__(self, num_slots: int) -> None:
        self._heap: list[int] = []  # slots handed out and given back: all below `_untouched`
        self._num_slots = num_slots
        self._untouched = 0

    def append(self, slot: int) -> None:
        heapq.heappush(self._heap, slot)

    def pop(self) -> int:
        if self._heap:
            return heapq.heappop(self._heap)
        if self._untouched >= self._num_slots:
            raise IndexError("no free slot")
        self._untouched += 1
        return self._untouched - 1

    def lowest(self) -> int:
        if self._heap:
            return self._heap[0]
        if self._untouched >= self._num_slots:
            raise IndexError("no free slot")
        return self._untouched

    def __len__(self) -> int:
        return len(self._heap) + self._num_slots - self._untouched

    def __iter__(self) -> Iterator[int]:
        yield from self._heap
        yield from range(self._untouched, self._num_slots)


@dataclass
class _TierState:
    tier: object  # a `Tier` (memory tiers also have `view(slot)`, arena ones `reserve(slot)`)
    policy: EvictionPolicy
    free: _FreeSlots
    counters: TierCounters = field(default_factory=TierCounters)

    @property
    def name(self) -> str:
        return self.tier.name


class TierManager:
    """Placement and movement of pages across `tiers` (see the module docstring)."""

    def __init__(self, layout: KVLayout, tiers: Sequence[object],
                 policies: Sequence[EvictionPolicy]):
        self.layout = layout
        self._tiers = [_TierState(t, p, _FreeSlots(t.num_slots))
                       for t, p in zip(tiers, policies, strict=True)]
        self._disk = next((i for i, t in enumerate(self._tiers) if t.name == "disk"), None)
        if self._disk is not None and self._disk != len(self._tiers) - 1:
            raise ValueError("the disk tier must be the last tier")
        self._entries: dict[bytes, _Entry] = {}
        self._transfers: set[Transfer] = set()  # planned, not yet committed
        # (key, True) when a page enters, (key, False) when its last copy goes (eviction,
        # discard, corruption, a failed write): the store's events. Tier moves are not.
        self.on_change: Callable[[bytes, bool], None] | None = None

    # -- queries -----------------------------------------------------------------------------

    @property
    def tier_names(self) -> list[str]:
        return [t.name for t in self._tiers]

    @property
    def top(self) -> int:
        return 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def keys(self) -> list[bytes]:
        """Every key with a page in some tier."""
        return list(self._entries)

    def index(self, name: str) -> int:
        for i, t in enumerate(self._tiers):
            if t.name == name:
                return i
        raise KeyError(name)

    def tier(self, index: int) -> object:
        return self._tiers[index].tier

    def placement(self, key: bytes) -> Placement | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        tier, slot = entry.mem if entry.mem is not None else (None, None)
        return Placement(None if tier is None else self._tiers[tier].name, slot, entry.disk,
                         entry.pins)

    def in_memory(self, key: bytes, target: int) -> bool | None:
        """Whether `promote(key, target)` would find the page already in memory at tier
        `target` or above, with nothing to move or read (None: no such page)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        return entry.mem is not None and entry.mem[0] <= target and entry.transfer is None

    def resident(self, index: int) -> list[bytes]:
        """Keys in tier `index`, next victim first (the policy's order)."""
        return self._tiers[index].policy.order()

    def counters(self, index: int) -> TierCounters:
        return self._tiers[index].counters

    def num_used(self, index: int) -> int:
        state = self._tiers[index]
        return state.tier.num_slots - len(state.free)

    def num_pinned(self) -> int:
        return sum(1 for e in self._entries.values() if e.pins)

    @property
    def num_transfers(self) -> int:
        """Disk transfers planned and not yet committed."""
        return len(self._transfers)

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading keys have a page in some tier; the first absent key is a miss."""
        entries = self._entries
        for n, key in enumerate(keys):
            if key not in entries:
                for state in self._tiers:
                    state.counters.misses += 1
                return n
        return len(keys)

    # -- writes ------------------------------------------------------------------------------

    def put(self, key: bytes, page: torch.Tensor) -> bool:
        """Store a new page in the top tier (evicting as needed); False if already cached.

        Raises KVCapacityError when the top tier is full of pinned pages, and `Blocked` when
        disk I/O is needed first (for a disk-only store, the commit finishes the put).
        """
        entry = self._entries.get(key)
        if entry is not None:
            if entry.mem is not None:
                self._tiers[entry.mem[0]].policy.touch(key)
            return False
        if self._is_disk(0):
            self._plan_write("put", key, None, page)
        slot = self._allocate(0)
        self._tiers[0].tier.write(slot, page, key)
        entry = _Entry()
        entry.mem = (0, slot)
        self._add(key, entry, 0)
        return True

    def _add(self, key: bytes, entry: _Entry, index: int) -> None:
        self._entries[key] = entry
        self._tiers[index].policy.insert(key)
        if self.on_change is not None:
            self.on_change(key, True)

    # -- pins --------------------------------------------------------------------------------

    def pin(self, keys: Iterable[bytes]) -> None:
        entries = self._entries
        for key in keys:
            entries[key].pins += 1

    def unpin(self, keys: Iterable[bytes]) -> None:
        entries = self._entries
        for key in keys:
            entry = entries[key]
            if entry.pins <= 0:
                raise AssertionError(f"page {key.hex()} is not pinned")
            entry.pins -= 1

    def is_pinned(self, key: bytes) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.pins > 0

    # -- movement ----------------------------------------------------------------------------

    def pin_resident(self, keys: Sequence[bytes]) -> list[int] | None:
        """`promote(key, 0, pin=True)` of the leading keys present, in one step, when every
        one of their pages is in the top tier with no transfer in flight: each touched (the
        policy) and pinned, a hit counted for each, and a miss for the first absent key.
        Returns their top-tier slots, or None, changing nothing, when a page would have to
        move or be read from disk. Why one step: a lease of pages already in memory (the
        common case of a warm fetch) would otherwise cost several calls per page."""
        found = []
        get = self._entries.get
        for key in keys:
            entry = get(key)
            if entry is None:
                self.match([key])  # counts the miss
                break
            mem = entry.mem
            if mem is None or mem[0] != 0 or entry.transfer is not None:
                return None
            found.append(entry)
        top = self._tiers[0]
        touch = top.policy.touch
        for key, entry in zip(keys, found, strict=False):  # found: the leading run
            touch(key)
            entry.pins += 1
        top.counters.hits += len(found)
        return [entry.mem[1] for entry in found]  # type: ignore[index]

    def promote(self, key: bytes, target: int = 0, *, pin: bool = False
                ) -> tuple[int, int] | None:
        """Bring a page up to tier `target` (or keep it where it is if higher); count the hit;
        pin it too when `pin` (in the same step, so nothing evicts it in between).

        Returns its (tier, slot), or None when it is gone or its disk copy failed verification
        (a miss: the caller recomputes). Promotion may evict other, unpinned pages. Raises
        `Blocked` when disk I/O is needed (a load: its commit returns what this would have) or
        another thread is loading the page.
        """
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.transfer is not None and entry.transfer.kind == "load":
            raise Blocked(None)  # one read per page: wait for it to commit
        if entry.mem is None and not self._is_disk(target):
            return self._plan_load(key, entry, target, pin)
        if entry.mem is None:
            self._tiers[target].policy.touch(key)
            where = (target, entry.disk)
            source = target
        else:
            source, slot = entry.mem
            if source <= target:
                self._tiers[source].policy.touch(key)
                where = entry.mem
            else:
                where = self._move_up(key, entry, source, slot, target)
        self._tiers[source].counters.hits += 1
        if pin:
            entry.pins += 1
        return where

    def _move_up(self, key: bytes, entry: _Entry, tier: int, slot: int, target: int
                 ) -> tuple[int, int]:
        entry.pins += 1  # the page must not be chosen as a victim while room is made for it
        try:
            new_slot = self._allocate(target)
        finally:
            entry.pins -= 1
        self._tiers[target].tier.write(new_slot, self._tiers[tier].tier.view(slot), key)
        self._release_slot(tier, slot, key)
        entry.mem = (target, new_slot)
        self._tiers[target].policy.insert(key)
        self._tiers[target].counters.promotions += 1
        return entry.mem

    def _plan_load(self, key: bytes, entry: _Entry, target: int, pin: bool) -> None:
        """Reserve a slot of tier `target` for the page and raise `Blocked` with its read."""
        entry.pins += 1  # its disk copy, the only one, must stay while room is made for it
        try:
            new_slot = self._allocate(target)
        finally:
            entry.pins -= 1
        assert entry.disk is not None, "a pinned page's only copy is never evicted"
        disk = self._tiers[self._disk]
        disk.counters.hits += 1
        buffer = torch.empty(self.layout.page_shape, dtype=self.layout.dtype)
        transfer = Transfer("load", key, entry, disk.tier, entry.disk, buffer,
                            target=(target, new_slot), pin=pin)
        entry.transfer = transfer
        self._transfers.add(transfer)
        raise Blocked(transfer)

    def _plan_write(self, kind: str, key: bytes, entry: _Entry | None, page: torch.Tensor
                    ) -> None:
        """Reserve a disk slot, copy `page` for the write, raise `Blocked` with it."""
        disk = self._tiers[self._disk]
        disk_slot = self._allocate(self._disk)  # may drop another page's disk copy: no I/O
        buffer = torch.empty(self.layout.page_shape, dtype=self.layout.dtype)
        copy_page(buffer, page)
        transfer = Transfer(kind, key, entry, disk.tier, disk_slot, buffer)
        if entry is not None:
            entry.transfer = transfer
        self._transfers.add(transfer)
        raise Blocked(transfer)

    def _allocate(self, index: int) -> int:
        """A free slot of tier `index` with its memory reserved, evicting the tier's victim
        down a tier when it is full, or cannot reserve more memory (a full /dev/shm)."""
        state = self._tiers[index]
        if state.free and self._reserve(state, state.free.lowest()):
            return state.free.pop()
        victim = state.policy.victim(self._disk_evictable if self._is_disk(index)
                                     else self._evictable)
        if victim is None:
            if self._transfers:  # one of them may free a victim when it commits
                raise Blocked(None)
            raise KVCapacityError(
                f"KV tier '{state.name}' is full ({self.num_used(index)} pages) and every page "
                "in it is pinned by a lease; release leases or give the tier more capacity")
        self._evict(index, victim)
        # The victim's slot, reserved since it held a page, is now the lowest free one: the
        # slots above the reserved ones are the only others free.
        return state.free.pop()

    @staticmethod
    def _reserve(state: _TierState, slot: int) -> bool:
        reserve = getattr(state.tier, "reserve", None)
        return reserve is None or reserve(slot)

    def _evictable(self, key: bytes) -> bool:
        entry = self._entries[key]
        return entry.pins == 0 and entry.transfer is None

    def _disk_evictable(self, key: bytes) -> bool:
        """A disk copy may go unless it is the only copy of a pinned page, or being loaded."""
        entry = self._entries[key]
        return entry.transfer is None and (entry.pins == 0 or entry.mem is not None)

    def _evict(self, index: int, key: bytes) -> None:
        """Move `key` out of tier `index` (may raise `Blocked` before changing anything)."""
        state = self._tiers[index]
        entry = self._entries[key]
        if self._is_disk(index):
            self._drop_disk_copy(key, entry)
            if entry.mem is None:
                self._forget(key)
        else:
            slot = entry.mem[1]
            below = index + 1
            if below < len(self._tiers) and not self._is_disk(below):
                self._demote_to_memory(key, entry, index, slot, below)
            elif below < len(self._tiers):
                self._demote_to_disk(key, entry, index, slot)
            else:
                self._release_slot(index, slot, key)
                entry.mem = None
                if entry.disk is None:
                    self._forget(key)
        state.counters.evictions += 1

    def _demote_to_memory(self, key: bytes, entry: _Entry, index: int, slot: int, below: int
                          ) -> None:
        new_slot = self._allocate(below)
        self._tiers[below].tier.write(new_slot, self._tiers[index].tier.view(slot), key)
        self._release_slot(index, slot, key)
        entry.mem = (below, new_slot)
        self._tiers[below].policy.insert(key)
        self._tiers[below].counters.demotions += 1

    def _demote_to_disk(self, key: bytes, entry: _Entry, index: int, slot: int) -> None:
        if entry.disk is None and not entry.write_failed:
            # Written once; a clean copy is already there otherwise. The page stays here,
            # readable, until the write commits; the eviction is then retried.
            self._plan_write("demote", key, entry, self._tiers[index].tier.view(slot))
        entry.write_failed = False
        self._release_slot(index, slot, key)
        entry.mem = None
        if entry.disk is None:  # its write failed: the page is dropped
            self._forget(key)

    def _release_slot(self, index: int, slot: int, key: bytes) -> None:
        state = self._tiers[index]
        state.policy.remove(key)
        state.free.append(slot)

    def _drop_disk_copy(self, key: bytes, entry: _Entry) -> None:
        self._release_slot(self._disk, entry.disk, key)
        entry.disk = None

    def _forget(self, key: bytes) -> None:
        """The page's last copy is gone: drop its entry and report it."""
        del self._entries[key]
        if self.on_change is not None:
            self.on_change(key, False)

    def _is_disk(self, index: int) -> bool:
        return index == self._disk

    # -- commits -----------------------------------------------------------------------------

    def commit(self, transfer: Transfer) -> tuple[bool, object]:
        """Apply a transfer that has run (or roll it back); returns (finished, result).

        `finished`: the transfer completed the operation that planned it, and `result` is what
        that operation returns (a load: `promote`'s, a put: `put`'s); otherwise (a demotion)
        the caller retries the operation. Never raises `Blocked`.
        """
        self._transfers.remove(transfer)
        entry = transfer.entry
        orphan = entry is not None and self._entries.get(transfer.key) is not entry
        if entry is not None and not orphan:
            entry.transfer = None
        if transfer.kind == "load":
            return True, self._commit_load(transfer, entry, orphan)
        disk = self._tiers[self._disk]
        if not transfer.ok:
            disk.free.append(transfer.disk_slot)
            disk.counters.write_errors += 1
            log.warning("disk tier write failed, page %s dropped: %s", transfer.key.hex(),
                        transfer.error)
            if entry is not None and not orphan:
                entry.write_failed = True  # its retried eviction drops it
            return transfer.kind == "put", False
        if transfer.kind == "put":
            if transfer.key in self._entries:  # another thread put it meanwhile
                disk.free.append(transfer.disk_slot)
                return True, False
            entry = _Entry()
            entry.disk = transfer.disk_slot
            self._add(transfer.key, entry, self._disk)
            return True, True
        if orphan:  # discarded while it was written
            disk.free.append(transfer.disk_slot)
        else:
            entry.disk = transfer.disk_slot
            disk.policy.insert(transfer.key)
            disk.counters.demotions += 1
        return False, None

    def _commit_load(self, transfer: Transfer, entry: _Entry, orphan: bool
                     ) -> tuple[int, int] | None:
        tier, slot = transfer.target
        state = self._tiers[tier]
        if orphan or not transfer.ok:
            state.free.append(slot)
            if not orphan:
                self._tiers[self._disk].counters.corrupt += 1
                log.warning("page %s failed verification on disk: dropped (a miss)",
                            transfer.key.hex())
                self._drop_disk_copy(transfer.key, entry)
                self._forget(transfer.key)
            return None
        state.tier.write(slot, transfer.buffer, transfer.key)
        entry.mem = (tier, slot)
        state.policy.insert(transfer.key)
        state.counters.promotions += 1
        if transfer.pin:
            entry.pins += 1
        return entry.mem

    # -- removal -----------------------------------------------------------------------------

    def discard(self, key: bytes) -> bool:
        """Forget a page everywhere (it must not be pinned); False if it was not cached.

        A page in transit goes too: its transfer keeps the slots it reserved until it commits.
        """
        entry = self._entries.get(key)
        if entry is None:
            return False
        if entry.pins:
            raise KVCapacityError(f"page {key.hex()} is pinned by a lease")
        if entry.mem is not None:
            self._release_slot(entry.mem[0], entry.mem[1], key)
        if entry.disk is not None:
            # A load reading this slot may now race a write of another page into it: it fails
            # verification then, and its outcome is thrown away anyway (an orphan).
            self._drop_disk_copy(key, entry)
        self._forget(key)
        return True

    def check(self) -> None:
        """Assert the invariants (for tests): slots are unique, policies match placements,
        slots reserved for transfers in flight are neither free nor another page's."""
        held: dict[int, list[int]] = {i: [] for i in range(len(self._tiers))}
        for transfer in self._transfers:
            if transfer.kind == "load":
                held[transfer.target[0]].append(transfer.target[1])
            else:
                held[self._disk].append(transfer.disk_slot)
        for index, state in enumerate(self._tiers):
            used = []
            for entry in self._entries.values():
                if entry.mem is not None and entry.mem[0] == index:
                    used.append(entry.mem[1])
                if self._is_disk(index) and entry.disk is not None:
                    used.append(entry.disk)
            busy = used + held[index]
            assert len(busy) == len(set(busy)), f"{state.name}: a slot holds two pages"
            assert not set(busy) & set(state.free), f"{state.name}: a used slot is free"
            assert len(busy) + len(state.free) == state.tier.num_slots, state.name
            assert len(state.policy) == len(used), f"{state.name}: policy out of step"
            reserved = getattr(state.tier, "reserved_slots", state.tier.num_slots)
            assert all(s < reserved for s in busy), f"{state.name}: a page in unreserved memory"
        for entry in self._entries.values():
            assert entry.mem is not None or entry.disk is not None
            assert entry.pins == 0 or entry.mem is not None
            if entry.transfer is not None:
                assert entry.transfer in self._transfers, "a page marked by a finished transfer"
