"""The tier manager: which page lives where, and the moves that keep every tier within bounds.

Tiers are ordered fastest first (device, host, disk). A page has at most one copy in a memory
tier (its *primary*) and at most one copy on disk. A full tier evicts its policy's victim one
tier down (device -> host -> disk -> dropped); `promote` brings pages up to a target tier.
A page's disk copy is kept when the page moves up again, so an unchanged page is never
written to disk twice; a disk copy is dropped only when the disk tier needs its slot.

Pinned pages (leased) are never evicted. The manager is synchronous and not thread-safe on
its own: the store calls it with its lock held.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from omni.kv.errors import KVCapacityError
from omni.kv.layout import KVLayout
from omni.kv.policy import EvictionPolicy

__all__ = ["Placement", "TierCounters", "TierManager"]

log = logging.getLogger("omni.kv")


class _Entry:
    """Where one page is. Why slots: one per cached page, so its size is the bookkeeping cost.

    Invariant: `mem` or `disk` is set; `mem` is (tier index, slot) of a memory tier; `disk` is
    a slot of the disk tier; `pins` > 0 only while `mem` is set.
    """

    __slots__ = ("disk", "mem", "pins")

    def __init__(self) -> None:
        self.mem: tuple[int, int] | None = None
        self.disk: int | None = None
        self.pins = 0


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
    """

    __slots__ = ("_heap",)

    def __init__(self, num_slots: int) -> None:
        self._heap = list(range(num_slots))  # ascending: already a heap

    def append(self, slot: int) -> None:
        heapq.heappush(self._heap, slot)

    def pop(self) -> int:
        return heapq.heappop(self._heap)

    def lowest(self) -> int:
        return self._heap[0]

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[int]:
        return iter(self._heap)


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
        self._staging: torch.Tensor | None = None  # disk -> non-CPU memory goes through it
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

        Raises KVCapacityError when the top tier is full of pinned pages.
        """
        entry = self._entries.get(key)
        if entry is not None:
            if entry.mem is not None:
                self._tiers[entry.mem[0]].policy.touch(key)
            return False
        slot = self._allocate(0)
        state = self._tiers[0]
        try:
            self._write(0, slot, page, key)
        except OSError as exc:  # only a disk-only store writes to disk here
            state.free.append(slot)
            state.counters.write_errors += 1
            log.warning("dropping page %s: %s", key.hex(), exc)
            return False
        entry = _Entry()
        if self._is_disk(0):
            entry.disk = slot
        else:
            entry.mem = (0, slot)
        self._entries[key] = entry
        state.policy.insert(key)
        if self.on_change is not None:
            self.on_change(key, True)
        return True

    # -- pins --------------------------------------------------------------------------------

    def pin(self, key: bytes) -> None:
        self._entries[key].pins += 1

    def unpin(self, key: bytes) -> None:
        entry = self._entries[key]
        if entry.pins <= 0:
            raise AssertionError(f"page {key.hex()} is not pinned")
        entry.pins -= 1

    def is_pinned(self, key: bytes) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.pins > 0

    # -- movement ----------------------------------------------------------------------------

    def promote(self, key: bytes, target: int = 0) -> tuple[int, int] | None:
        """Bring a page up to tier `target` (or keep it where it is if higher); count the hit.

        Returns its (tier, slot), or None when it is gone or its disk copy failed verification
        (a miss: the caller recomputes). The caller must pin the page first when it needs it
        to stay; promotion itself may evict other, unpinned pages.
        """
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.mem is not None:
            tier, slot = entry.mem
            self._tiers[tier].counters.hits += 1
            if tier <= target:
                self._tiers[tier].policy.touch(key)
                return entry.mem
            return self._move_up(key, entry, tier, slot, target)
        self._tiers[self._disk].counters.hits += 1
        if self._is_disk(target):
            self._tiers[target].policy.touch(key)
            return (target, entry.disk)
        return self._load_from_disk(key, entry, target)

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

    def _load_from_disk(self, key: bytes, entry: _Entry, target: int) -> tuple[int, int] | None:
        disk = self._tiers[self._disk]
        entry.pins += 1
        try:
            new_slot = self._allocate(target)
        finally:
            entry.pins -= 1
        assert entry.disk is not None, "a pinned page's only copy is never evicted"
        dst = self._tiers[target].tier
        ok = self._read_disk(entry.disk, dst, new_slot, key)
        if not ok:
            dst_state = self._tiers[target]
            dst_state.free.append(new_slot)
            disk.counters.corrupt += 1
            log.warning("page %s failed verification on disk: dropped (a miss)", key.hex())
            self._drop_disk_copy(key, entry)
            if entry.mem is None:
                self._forget(key)
            return None
        entry.mem = (target, new_slot)
        self._tiers[target].policy.insert(key)
        self._tiers[target].counters.promotions += 1
        return entry.mem

    def _read_disk(self, disk_slot: int, dst: object, slot: int, key: bytes) -> bool:
        disk = self._tiers[self._disk].tier
        view = dst.view(slot)
        if view.device.type == "cpu":
            return disk.read_into(disk_slot, view, key)
        if self._staging is None:
            self._staging = torch.empty(self.layout.page_shape, dtype=self.layout.dtype,
                                        pin_memory=torch.cuda.is_available())
        if not disk.read_into(disk_slot, self._staging, key):
            return False
        dst.write(slot, self._staging, key)
        return True

    def _allocate(self, index: int) -> int:
        """A free slot of tier `index` with its memory reserved, evicting the tier's victim
        down a tier when it is full, or cannot reserve more memory (a full /dev/shm)."""
        state = self._tiers[index]
        if state.free and self._reserve(state, state.free.lowest()):
            return state.free.pop()
        victim = state.policy.victim(self._disk_evictable if self._is_disk(index)
                                     else self._evictable)
        if victim is None:
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
        return self._entries[key].pins == 0

    def _disk_evictable(self, key: bytes) -> bool:
        """A disk copy may go unless it is the only copy of a pinned page (one being loaded)."""
        entry = self._entries[key]
        return entry.pins == 0 or entry.mem is not None

    def _evict(self, index: int, key: bytes) -> None:
        state = self._tiers[index]
        state.counters.evictions += 1
        entry = self._entries[key]
        if self._is_disk(index):
            self._drop_disk_copy(key, entry)
            if entry.mem is None:
                self._forget(key)
            return
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

    def _demote_to_memory(self, key: bytes, entry: _Entry, index: int, slot: int, below: int
                          ) -> None:
        new_slot = self._allocate(below)
        self._tiers[below].tier.write(new_slot, self._tiers[index].tier.view(slot), key)
        self._release_slot(index, slot, key)
        entry.mem = (below, new_slot)
        self._tiers[below].policy.insert(key)
        self._tiers[below].counters.demotions += 1

    def _demote_to_disk(self, key: bytes, entry: _Entry, index: int, slot: int) -> None:
        if entry.disk is None:  # write it once; a clean copy is already there otherwise
            disk = self._tiers[self._disk]
            disk_slot = self._allocate(self._disk)
            try:
                disk.tier.write(disk_slot, self._tiers[index].tier.view(slot), key)
            except OSError as exc:
                disk.free.append(disk_slot)
                disk.counters.write_errors += 1
                log.warning("disk tier write failed, page %s dropped: %s", key.hex(), exc)
            else:
                entry.disk = disk_slot
                disk.policy.insert(key)
                disk.counters.demotions += 1
        self._release_slot(index, slot, key)
        entry.mem = None
        if entry.disk is None:
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

    def _write(self, index: int, slot: int, page: torch.Tensor, key: bytes) -> None:
        self._tiers[index].tier.write(slot, page, key)

    # -- removal -----------------------------------------------------------------------------

    def discard(self, key: bytes) -> bool:
        """Forget a page everywhere (it must not be pinned); False if it was not cached."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        if entry.pins:
            raise KVCapacityError(f"page {key.hex()} is pinned by a lease")
        if entry.mem is not None:
            self._release_slot(entry.mem[0], entry.mem[1], key)
        if entry.disk is not None:
            self._drop_disk_copy(key, entry)
        self._forget(key)
        return True

    def check(self) -> None:
        """Assert the invariants (for tests): slots are unique, policies match placements."""
        for index, state in enumerate(self._tiers):
            used = []
            for entry in self._entries.values():
                if entry.mem is not None and entry.mem[0] == index:
                    used.append(entry.mem[1])
                if self._is_disk(index) and entry.disk is not None:
                    used.append(entry.disk)
            assert len(used) == len(set(used)), f"{state.name}: a slot holds two pages"
            assert not set(used) & set(state.free), f"{state.name}: a used slot is free"
            assert len(used) + len(state.free) == state.tier.num_slots, state.name
            assert len(state.policy) == len(used), f"{state.name}: policy out of step"
            reserved = getattr(state.tier, "reserved_slots", state.tier.num_slots)
            assert all(s < reserved for s in used), f"{state.name}: a page in unreserved memory"
        for entry in self._entries.values():
            assert entry.mem is not None or entry.disk is not None
            assert entry.pins == 0 or entry.mem is not None
