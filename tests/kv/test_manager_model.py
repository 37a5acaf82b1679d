"""The tier manager against a reference model: which pages live where, in LRU order, pinned.

The reference keeps each tier as an OrderedDict in LRU order (first = next victim) and
replays the documented rules: a full tier evicts its least recently used unpinned page one
tier down (device -> host -> disk -> dropped); acquiring brings pages to the top tier and
pins them; a page keeps its disk copy when it moves up, so it is never written twice; a disk
copy is evicted unless it is the only copy of a pinned page. Page contents are checked against
what was put (recomputation is the oracle for anything cached).
"""

import tempfile
from collections import Counter, OrderedDict

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from omni.kv import KVCapacityError, KVLayout, KVStore, TierConfig
from omni.kv.tiers import DiskTier

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, page_size=2, dtype=torch.float32)
SLOT = DiskTier.slot_bytes_for(LAYOUT)  # a disk slot: header + page, 4 KiB aligned
CAPACITY = {"device": 3, "host": 2, "disk": 3}
KEYS = [bytes([i]) * 16 for i in range(12)]


def page_of(key: bytes) -> torch.Tensor:
    """The page a key stands for: derived from the key, so it can be recomputed."""
    return torch.full(LAYOUT.page_shape, float(key[0]) + 0.5)


class Reference:
    """The rules, written as plainly as possible."""

    def __init__(self) -> None:
        self.mem = {"device": OrderedDict(), "host": OrderedDict()}
        self.disk: OrderedDict = OrderedDict()
        self.pins: Counter = Counter()

    def where(self, key):
        return next((t for t, keys in self.mem.items() if key in keys), None)

    def cached(self, key) -> bool:
        return self.where(key) is not None or key in self.disk

    def put(self, key) -> None:
        tier = self.where(key)
        if tier is not None:
            self.mem[tier].move_to_end(key)
        elif key not in self.disk:
            self._room("device")
            self.mem["device"][key] = None

    def _room(self, tier) -> None:
        if tier == "disk":
            if len(self.disk) >= CAPACITY["disk"]:
                victim = next((k for k in self.disk
                               if not self.pins[k] or self.where(k) is not None), None)
                if victim is None:
                    raise KVCapacityError("disk")
                del self.disk[victim]
            return
        keys = self.mem[tier]
        if len(keys) < CAPACITY[tier]:
            return
        victim = next((k for k in keys if not self.pins[k]), None)
        if victim is None:
            raise KVCapacityError(tier)
        del keys[victim]
        if tier == "device":
            self._room("host")
            self.mem["host"][victim] = None
        elif victim not in self.disk:
            self._room("disk")
            self.disk[victim] = None

    def promote(self, key) -> bool:
        tier = self.where(key)
        if tier == "device":
            self.mem["device"].move_to_end(key)
            return True
        if tier is None and key not in self.disk:
            return False
        self.pins[key] += 1  # it must not be the victim of the room made for it
        try:
            self._room("device")
        finally:
            self.pins[key] -= 1
        if tier is not None:
            del self.mem[tier][key]
        self.mem["device"][key] = None
        return True

    def acquire(self, keys) -> list:
        held = []
        try:
            for key in keys:
                if not self.promote(key):
                    break
                self.pins[key] += 1
                held.append(key)
        except KVCapacityError:
            for key in held:
                self.pins[key] -= 1
            raise
        return held

    def release(self, keys) -> None:
        for key in keys:
            self.pins[key] -= 1


class TierManagerMachine(RuleBasedStateMachine):
    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        pages = LAYOUT.page_bytes
        self.store = KVStore(LAYOUT, [
            TierConfig("device", CAPACITY["device"] * pages),
            TierConfig("host", CAPACITY["host"] * pages),
            TierConfig("disk", CAPACITY["disk"] * SLOT, path=self.tmp.name),
        ])
        self.ref = Reference()
        self.open_leases: list = []

    def teardown(self) -> None:
        for lease in self.open_leases:
            lease.release()
        self.store.close()
        self.tmp.cleanup()

    @rule(key=st.sampled_from(KEYS))
    def put(self, key):
        try:
            self.ref.put(key)
        except KVCapacityError:
            with pytest.raises(KVCapacityError):
                self.store.put([key], page_of(key)[None])
            return
        self.store.put([key], page_of(key)[None])

    @rule(target=leases, keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3))
    def acquire(self, keys):
        try:
            expected = self.ref.acquire(keys)
        except KVCapacityError:
            with pytest.raises(KVCapacityError):
                self.store.acquire(keys)
            return None
        lease = self.store.acquire(keys)
        assert lease.keys == expected
        for i, key in enumerate(lease.keys):
            assert torch.equal(lease.page(i), page_of(key)), "a cached page changed"
        self.open_leases.append(lease)
        return lease

    @precondition(lambda self: self.open_leases)
    @rule(index=st.integers(min_value=0))
    def release(self, index):
        lease = self.open_leases.pop(index % len(self.open_leases))
        self.ref.release(lease.keys)
        lease.release()

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def match(self, keys):
        expected = next((i for i, k in enumerate(keys) if not self.ref.cached(k)), len(keys))
        assert self.store.match(keys) == expected

    @invariant()
    def placement_matches_the_reference(self):
        manager = self.store._manager
        assert manager.resident(0) == list(self.ref.mem["device"])
        assert manager.resident(1) == list(self.ref.mem["host"])
        assert manager.resident(2) == list(self.ref.disk)
        for key in KEYS:
            assert manager.is_pinned(key) == (self.ref.pins[key] > 0)
        manager.check()

    @invariant()
    def stats_count_pages_and_pins(self):
        stats = self.store.stats()
        assert stats["device"]["pages"] == len(self.ref.mem["device"])
        assert stats["disk"]["pages"] == len(self.ref.disk)
        assert stats["leases"]["open"] == len(self.open_leases)


TierManagerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                                deadline=None)
test_tier_manager_follows_the_reference_model = TierManagerMachine.TestCase
