"""Eviction policies: LRU and LFU order, pinned keys, bookkeeping errors, `make_policy`."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from omni.kv.policy import EvictionPolicy, LFUPolicy, LRUPolicy, make_policy

A, B, C, D = (bytes([i]) * 16 for i in range(1, 5))


def _filled(policy_class: type, *keys: bytes) -> LRUPolicy | LFUPolicy:
    policy = policy_class()
    for key in keys:
        policy.insert(key)
    return policy


def _all(key: bytes) -> bool:
    return True


# --- LRU ----------------------------------------------------------------------------------------


def test_lru_evicts_least_recently_inserted_or_touched_first() -> None:
    """Insert order is the victim order until a touch moves a key to the back."""
    policy = _filled(LRUPolicy, A, B, C)
    assert policy.order() == [A, B, C]
    policy.touch(A)
    assert policy.order() == [B, C, A]
    assert policy.victim(_all) == B


def test_lru_victim_skips_pinned_keys_without_reordering_them() -> None:
    """Pinned keys are passed over, keep their place, and are chosen once unpinned."""
    policy = _filled(LRUPolicy, A, B, C)
    pinned = {A, B}
    assert policy.victim(lambda key: key not in pinned) == C
    assert policy.order() == [A, B, C]
    pinned.clear()
    assert policy.victim(lambda key: key not in pinned) == A


def test_victim_is_none_when_empty_or_everything_is_pinned() -> None:
    """No evictable key: None, for both built-in policies."""
    for policy_class in (LRUPolicy, LFUPolicy):
        assert policy_class().victim(_all) is None
        assert _filled(policy_class, A, B).victim(lambda key: False) is None


def test_victim_does_not_remove_the_key() -> None:
    """`victim` only names a key; the caller removes it."""
    for policy_class in (LRUPolicy, LFUPolicy):
        policy = _filled(policy_class, A, B)
        assert policy.victim(_all) == A
        assert len(policy) == 2 and A in policy


def test_removed_then_reinserted_key_is_most_recent() -> None:
    """A key that left the tier and came back is at the back of the LRU order."""
    policy = _filled(LRUPolicy, A, B, C)
    policy.remove(A)
    policy.insert(A)
    assert policy.order() == [B, C, A]


# --- LFU ----------------------------------------------------------------------------------------


def test_lfu_evicts_least_frequently_used_first() -> None:
    """More touches keep a key longer, regardless of insertion order."""
    policy = _filled(LFUPolicy, A, B, C)
    policy.touch(A)
    policy.touch(A)
    policy.touch(B)
    assert policy.order() == [C, B, A]
    assert [policy.count(key) for key in (A, B, C)] == [3, 2, 1]
    assert policy.victim(_all) == C


def test_lfu_breaks_ties_by_least_recent_use() -> None:
    """Among keys used equally often, the one used longest ago goes first."""
    policy = _filled(LFUPolicy, A, B, C)
    policy.touch(B)
    policy.touch(A)  # A and B both at 2; B's last use is older
    assert policy.order() == [C, B, A]
    policy.remove(C)
    assert policy.victim(_all) == B


def test_lfu_count_restarts_after_remove() -> None:
    """A removed key that comes back starts again at count 1."""
    policy = _filled(LFUPolicy, A, B)
    for _ in range(5):
        policy.touch(A)
    policy.remove(A)
    policy.insert(A)
    assert policy.count(A) == 1
    assert policy.order() == [B, A]


def test_lfu_victim_walks_up_the_counts_past_pinned_keys() -> None:
    """With the least used keys pinned, the victim comes from the next count up."""
    policy = _filled(LFUPolicy, A, B, C)
    policy.touch(C)
    policy.touch(C)
    policy.touch(B)
    assert policy.victim(lambda key: key != A) == B
    assert policy.victim(lambda key: key == C) == C
    assert policy.order() == [A, B, C]


def test_lfu_victim_after_the_least_used_keys_are_removed() -> None:
    """Removing every key of the lowest count moves the victim to the next count present."""
    policy = _filled(LFUPolicy, A, B, C)
    for key, touches in ((B, 3), (C, 2)):
        for _ in range(touches):
            policy.touch(key)
    policy.remove(A)  # counts left: C=3, B=4; none at 1 or 2
    assert policy.victim(_all) == C
    policy.insert(D)
    assert policy.victim(_all) == D


# --- bookkeeping errors and repr ----------------------------------------------------------------


@pytest.mark.parametrize("policy_class", [LRUPolicy, LFUPolicy])
def test_bookkeeping_misuse_raises_key_error_naming_the_key_in_hex(policy_class: type) -> None:
    """insert of a resident key, touch/remove of an absent key: KeyError with the key's hex."""
    policy = _filled(policy_class, A)
    with pytest.raises(KeyError, match=A.hex()):
        policy.insert(A)
    with pytest.raises(KeyError, match=B.hex()):
        policy.touch(B)
    with pytest.raises(KeyError, match=B.hex()):
        policy.remove(B)
    assert policy.order() == [A]


@pytest.mark.parametrize("policy_class", [LRUPolicy, LFUPolicy])
def test_repr_counts_pages(policy_class: type) -> None:
    """repr is a one-line summary: <LRUPolicy pages=N>."""
    policy = _filled(policy_class, A, B)
    assert repr(policy) == f"<{policy_class.__name__} pages=2>"
    assert len(policy) == 2


# --- make_policy --------------------------------------------------------------------------------


class NewestFirst:
    """A user policy: evict the most recently inserted key (MRU)."""

    def __init__(self) -> None:
        self.keys: list[bytes] = []

    def insert(self, key: bytes) -> None:
        self.keys.append(key)

    def touch(self, key: bytes) -> None:
        pass

    def remove(self, key: bytes) -> None:
        self.keys.remove(key)

    def victim(self, is_evictable: Callable[[bytes], bool]) -> bytes | None:
        return next((key for key in reversed(self.keys) if is_evictable(key)), None)

    def __len__(self) -> int:
        return len(self.keys)

    def order(self) -> list[bytes]:
        return self.keys[::-1]


def test_make_policy_from_names_case_insensitive() -> None:
    """"lru" and "lfu" (any case) build fresh policies."""
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy("LFU"), LFUPolicy)
    assert make_policy("lru") is not make_policy("lru")


def test_make_policy_accepts_a_custom_class_or_instance() -> None:
    """A user class is instantiated; an instance (built-in or custom) is used as is."""
    built = make_policy(NewestFirst)
    assert isinstance(built, NewestFirst) and isinstance(built, EvictionPolicy)
    built.insert(A)
    built.insert(B)
    assert built.victim(_all) == B
    instance = NewestFirst()
    assert make_policy(instance) is instance
    lru = LRUPolicy()
    assert make_policy(lru) is lru
    assert isinstance(make_policy(LFUPolicy), LFUPolicy)


@pytest.mark.parametrize("spec", ["fifo", "", 42, None, object(), dict, object])
def test_make_policy_rejects_anything_else_naming_the_accepted_values(spec: object) -> None:
    """Unknown names, non-policy objects and classes: ValueError listing "lru" and "lfu"."""
    with pytest.raises(ValueError, match='"lru", "lfu"'):
        make_policy(spec)  # type: ignore[arg-type]


# --- a state machine against a naive reference --------------------------------------------------

KEYS = [bytes([i]) * 16 for i in range(5)]


class PolicyMachine(RuleBasedStateMachine):
    """Random insert/touch/remove/victim sequences (random pinned sets) against a naive reference.

    The reference is a dict of last-use times and use counts, sorted on every check.
    """

    policy_class: type = LRUPolicy

    def __init__(self) -> None:
        super().__init__()
        self.policy = self.policy_class()
        self.clock = 0
        self.last_use: dict[bytes, int] = {}
        self.uses: dict[bytes, int] = {}

    def reference_rank(self, key: bytes) -> tuple[int, ...]:
        return (self.last_use[key],)

    def reference_order(self) -> list[bytes]:
        return sorted(self.last_use, key=self.reference_rank)

    def _use(self, key: bytes) -> None:
        self.clock += 1
        self.last_use[key] = self.clock
        self.uses[key] = self.uses.get(key, 0) + 1

    @rule(key=st.sampled_from(KEYS))
    def insert(self, key: bytes) -> None:
        if key in self.last_use:
            with pytest.raises(KeyError):
                self.policy.insert(key)
            return
        self.policy.insert(key)
        self.uses[key] = 0
        self._use(key)

    @rule(key=st.sampled_from(KEYS))
    def touch(self, key: bytes) -> None:
        if key not in self.last_use:
            with pytest.raises(KeyError):
                self.policy.touch(key)
            return
        self.policy.touch(key)
        self._use(key)

    @rule(key=st.sampled_from(KEYS))
    def remove(self, key: bytes) -> None:
        if key not in self.last_use:
            with pytest.raises(KeyError):
                self.policy.remove(key)
            return
        self.policy.remove(key)
        del self.last_use[key], self.uses[key]

    @rule(pinned=st.sets(st.sampled_from(KEYS)))
    def victim(self, pinned: set[bytes]) -> None:
        evictable = [key for key in self.reference_order() if key not in pinned]
        expected = evictable[0] if evictable else None
        assert self.policy.victim(lambda key: key not in pinned) == expected

    @invariant()
    def same_order_and_size(self) -> None:
        assert self.policy.order() == self.reference_order()
        assert len(self.policy) == len(self.last_use)


class LFUMachine(PolicyMachine):
    policy_class = LFUPolicy

    def reference_rank(self, key: bytes) -> tuple[int, ...]:
        return (self.uses[key], self.last_use[key])


_machine_settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestLRUAgainstReference = PolicyMachine.TestCase
TestLRUAgainstReference.settings = _machine_settings
TestLFUAgainstReference = LFUMachine.TestCase
TestLFUAgainstReference.settings = _machine_settings
