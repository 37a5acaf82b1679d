"""The tier manager against a reference model: which pages live where, in LRU order, pinned.

The reference keeps each tier as an OrderedDict in LRU order (first = next victim) and
replays the documented rules: a full tier evicts its least recently used unpinned page one
tier down (device -> host -> disk -> dropped); acquiring brings pages to the top tier and
pins them; a page keeps its disk copy when it moves up, so it is never written twice; a disk
copy is evicted unless it is the only copy of a pinned page. Page contents are checked against
what was put (recomputation is the oracle for anything cached).

Disk I/O runs outside the store's lock, so readers run beside the writer: one rule parks a
put's disk write and looks at the store meanwhile (it must see every page cached both before
and after the put), and a separate test lets reader threads acquire pages while a writer puts,
promotes, demotes and discards, every page read compared with the bytes that were put.
"""

import copy
import random
import tempfile
import threading
from collections import Counter, OrderedDict

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from omni.kv import KVCapacityError, KVLayout, KVStore, TierConfig
from omni.kv.tiers import DiskTier
from tests.kv._gates import CAP, Gate, Worker

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

    @rule(key=st.sampled_from(KEYS))
    def put_while_a_reader_looks(self, key):
        """A put whose disk write is parked: meanwhile `match` finds every page cached before
        and after the put (and none cached in neither), and `stats` answers."""
        after = copy.deepcopy(self.ref)
        try:
            after.put(key)
        except KVCapacityError:
            after = None
        progress = threading.Event()  # the write parked, or the put ended without one
        gate = Gate("pwritev")
        with gate.patch():
            writer = Worker(lambda: self.store.put([key], page_of(key)[None]), done=progress)
            gate.parked = progress
            writer.start()
            assert progress.wait(CAP)
            if gate.calls:
                for k in KEYS:
                    before_and_after = self.ref.cached(k) and (after is None or after.cached(k))
                    if before_and_after:
                        assert self.store.match([k]) == 1, "a page vanished during a write"
                    elif not self.ref.cached(k) and not (after and after.cached(k)):
                        assert self.store.match([k]) == 0, "a page appeared from nowhere"
                assert self.store.stats()["leases"]["open"] == len(self.open_leases)
                assert not gate.returned and writer.is_alive()
            gate.go.set()
            if after is None:
                with pytest.raises(KVCapacityError):
                    writer.finish()
                return
            writer.finish()
        self.ref = after

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


def test_readers_see_only_the_bytes_put_while_pages_move_between_tiers(tmp_path):
    """Reader threads acquire and read pages while a writer puts, promotes (from disk too),
    demotes (to disk too) and discards: every page read is the page put under its key, and
    afterwards nothing is pinned and the placement invariants hold."""
    pages = LAYOUT.page_bytes
    store = KVStore(LAYOUT, [TierConfig("device", 4 * pages), TierConfig("host", 3 * pages),
                             TierConfig("disk", 6 * SLOT, path=tmp_path)])
    writing = threading.Event()
    writing.set()
    reads = Counter()

    def writer() -> None:
        rng = random.Random(7)
        try:
            for _ in range(600):
                key = rng.choice(KEYS)
                action = rng.random()
                try:
                    if action < 0.5:
                        store.put([key], page_of(key)[None])
                    elif action < 0.9:
                        with store.acquire([key]) as lease:
                            for i, k in enumerate(lease.keys):
                                assert torch.equal(lease.page(i), page_of(k))
                    else:
                        store.discard([key])
                except KVCapacityError:
                    reads["writer_full"] += 1  # every device page pinned by a reader
        finally:
            writing.clear()

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        while writing.is_set() or reads[seed] < 50:
            keys = rng.sample(KEYS, 2)
            n = store.match(keys)
            assert 0 <= n <= 2
            try:
                with store.acquire(keys[:1]) as lease:
                    for i, k in enumerate(lease.keys):
                        assert torch.equal(lease.page(i), page_of(k)), "a wrong page was read"
            except KVCapacityError:
                continue  # pins of the others fill the device: a clear error
            reads[seed] += 1

    threads = [Worker(writer)] + [Worker(lambda s=s: reader(s)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.finish()
    stats = store.stats()
    assert stats["leases"] == {"open": 0, "exported": 0, "pinned_pages": 0}
    assert stats["disk"]["demotions"] > 0 and stats["disk"]["hits"] > 0  # writes, loads
    assert all(reads[s] >= 50 for s in range(3))
    store._manager.check()
    for key in KEYS:  # (one acquire may evict another page: ask for each in turn)
        held = store.match([key])
        with store.acquire([key]) as lease:
            assert len(lease) == held
            assert not held or torch.equal(lease.page(0), page_of(key))
    assert store.stats()["disk"]["corrupt"] == 0  # no read ever met a half-written slot
    store.close()
