"""Eviction policies: which resident page of a tier to evict next.

A tier keeps one policy object. The policy only orders keys; it never owns pages, pins or bytes.
The tier manager tells it what happened (`insert`, `touch`, `remove`) and asks it for the next
`victim`, passing a predicate that says which keys may go (pinned pages may not).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Literal, Protocol, runtime_checkable

__all__ = ["EvictionPolicy", "LFUPolicy", "LRUPolicy", "PolicySpec", "make_policy"]


@runtime_checkable
class EvictionPolicy(Protocol):
    """What a tier needs from an eviction policy; implement it to plug in your own.

    The manager keeps the policy in step with the tier: every key resident in the tier is known
    to the policy exactly once, and only those keys. Calls come under the manager's lock, one at a
    time, so a policy needs no locking of its own. Keys are 16-byte page keys (`block_keys`).

    Contract, method by method:

    - ``insert(key)``: `key` became resident in this tier (written, promoted or demoted into it).
      It counts as the most recent use. Raises `KeyError` if `key` is already resident.
    - ``touch(key)``: `key` was used (a hit, or a lease acquired). Raises `KeyError` if absent.
    - ``remove(key)``: `key` left this tier (evicted, promoted, demoted or dropped). The policy
      forgets everything about it (an LFU count restarts on the next insert). Raises `KeyError`
      if absent.
    - ``victim(is_evictable)``: the resident key to evict next among those for which
      ``is_evictable(key)`` is true, or None when there is none. It does not remove the key (the
      manager calls `remove` once the page is gone) and does not reorder the keys it skips.
      `is_evictable` must not call back into the policy.
    - ``__len__()``: how many keys are resident.
    - ``order()``: every resident key, next victim first (ignoring pins); for tests and debugging.

    `KeyError`s flag bookkeeping bugs in the caller; a policy must raise them rather than hide
    them. One policy instance serves one tier: give `make_policy` a name or a class, not an
    instance, when several tiers are configured from one spec.
    """

    def insert(self, key: bytes) -> None: ...

    def touch(self, key: bytes) -> None: ...

    def remove(self, key: bytes) -> None: ...

    def victim(self, is_evictable: Callable[[bytes], bool]) -> bytes | None: ...

    def __len__(self) -> int: ...

    def order(self) -> list[bytes]: ...


PolicySpec = Literal["lru", "lfu"] | type[EvictionPolicy] | EvictionPolicy
"""What `make_policy` accepts: a name, a policy class (instantiated with no arguments), or an
instance (used as is)."""


class LRUPolicy:
    """Least recently used first.

    Why an OrderedDict: it is a hash map threaded on a linked list, so `insert`, `touch` (move to
    the end) and `remove` are O(1), and the front is the least recently used key. `victim` scans
    from the front past pinned keys without moving them, so it is O(1) unless the oldest keys
    are pinned, and O(number of pinned keys ahead of the victim) then.
    """

    def __init__(self) -> None:
        self._keys: OrderedDict[bytes, None] = OrderedDict()  # oldest use first

    def insert(self, key: bytes) -> None:
        """Record `key` as resident and most recently used; `KeyError` if already resident."""
        if key in self._keys:
            raise KeyError(f"page {_hex(key)} is already resident in this {self._name}")
        self._keys[key] = None

    def touch(self, key: bytes) -> None:
        """Record a use of `key`; `KeyError` if it is not resident."""
        try:
            self._keys.move_to_end(key)
        except KeyError:
            raise KeyError(f"page {_hex(key)} is not resident in this {self._name}") from None

    def remove(self, key: bytes) -> None:
        """Forget `key`; `KeyError` if it is not resident."""
        try:
            del self._keys[key]
        except KeyError:
            raise KeyError(f"page {_hex(key)} is not resident in this {self._name}") from None

    def victim(self, is_evictable: Callable[[bytes], bool]) -> bytes | None:
        """The least recently used key for which `is_evictable` is true, or None."""
        for key in self._keys:
            if is_evictable(key):
                return key
        return None

    def order(self) -> list[bytes]:
        """Resident keys, least recently used (next victim) first."""
        return list(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __repr__(self) -> str:
        return f"<{self._name} pages={len(self)}>"

    @property
    def _name(self) -> str:
        return type(self).__name__


class LFUPolicy:
    """Least frequently used first; among equally frequent keys, least recently used first.

    Why buckets: ``_buckets[n]`` is an OrderedDict of the keys used exactly n times, in the order
    of their last use (a key enters a bucket only when it is used: `insert` puts it in bucket 1,
    `touch` moves it from bucket n to the end of bucket n+1). With `_min_count` pointing at the
    lowest non-empty bucket, `insert`, `touch`, `remove` and an unobstructed `victim` are O(1);
    no heap, no sort per call. Only when the lowest bucket empties by a `remove`, or when pinned
    keys fill it, does `victim` walk the buckets in count order (sorting the distinct counts).
    Counts are forgotten when a key is removed, so a key that comes back starts at 1.
    """

    def __init__(self) -> None:
        self._counts: dict[bytes, int] = {}
        self._buckets: dict[int, OrderedDict[bytes, None]] = {}
        self._min_count = 0  # a lower bound of the non-empty counts; exact after `_fix_min`

    def insert(self, key: bytes) -> None:
        """Record `key` as resident, used once; `KeyError` if already resident."""
        if key in self._counts:
            raise KeyError(f"page {_hex(key)} is already resident in this {self._name}")
        self._counts[key] = 1
        self._buckets.setdefault(1, OrderedDict())[key] = None
        self._min_count = 1

    def touch(self, key: bytes) -> None:
        """Record one more use of `key`; `KeyError` if it is not resident."""
        count = self._pop(key)
        self._counts[key] = count + 1
        self._buckets.setdefault(count + 1, OrderedDict())[key] = None

    def remove(self, key: bytes) -> None:
        """Forget `key` and its count; `KeyError` if it is not resident."""
        self._pop(key)
        del self._counts[key]

    def victim(self, is_evictable: Callable[[bytes], bool]) -> bytes | None:
        """The least frequently (then least recently) used evictable key, or None."""
        if not self._counts:
            return None
        self._fix_min()
        for key in self._buckets[self._min_count]:
            if is_evictable(key):
                return key
        for count in sorted(self._buckets):
            if count == self._min_count:
                continue
            for key in self._buckets[count]:
                if is_evictable(key):
                    return key
        return None

    def order(self) -> list[bytes]:
        """Resident keys, next victim first."""
        return [key for count in sorted(self._buckets) for key in self._buckets[count]]

    def count(self, key: bytes) -> int:
        """How many times `key` was used since it became resident; `KeyError` if absent."""
        try:
            return self._counts[key]
        except KeyError:
            raise KeyError(f"page {_hex(key)} is not resident in this {self._name}") from None

    def __len__(self) -> int:
        return len(self._counts)

    def __contains__(self, key: object) -> bool:
        return key in self._counts

    def __repr__(self) -> str:
        return f"<{self._name} pages={len(self)}>"

    @property
    def _name(self) -> str:
        return type(self).__name__

    def _pop(self, key: bytes) -> int:
        """Take `key` out of its bucket (dropping an emptied bucket); returns its count."""
        count = self.count(key)
        bucket = self._buckets[count]
        del bucket[key]
        if not bucket:
            del self._buckets[count]
            if count == self._min_count:
                self._min_count = count + 1  # exact after a touch; a lower bound after a remove
        return count

    def _fix_min(self) -> None:
        if self._min_count not in self._buckets:
            self._min_count = min(self._buckets)


_BY_NAME: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "lfu": LFUPolicy}


def make_policy(spec: PolicySpec) -> EvictionPolicy:
    """An eviction policy from a name ("lru", "lfu"), a policy class, or a policy instance.

    A class is instantiated with no arguments; an instance is returned as is (so it must not be
    shared between tiers). Names are case-insensitive.

    Raises:
        ValueError: anything else, naming the accepted values.
    """
    if isinstance(spec, str):
        policy_class = _BY_NAME.get(spec.strip().lower())
        if policy_class is None:
            raise ValueError(f"unknown eviction policy {spec!r}; {_ACCEPTED}")
        return policy_class()
    if isinstance(spec, type):
        if not _implements(spec):
            raise ValueError(f"{spec.__name__} does not implement EvictionPolicy; {_ACCEPTED}")
        return spec()
    if isinstance(spec, EvictionPolicy):
        return spec
    raise ValueError(f"not an eviction policy: {spec!r}; {_ACCEPTED}")


_ACCEPTED = ('expected "lru", "lfu", an EvictionPolicy class, or an EvictionPolicy instance '
             "(with insert, touch, remove, victim, __len__ and order)")


def _implements(cls: type) -> bool:
    return all(callable(getattr(cls, name, None))
               for name in ("insert", "touch", "remove", "victim", "__len__", "order"))


def _hex(key: object) -> str:
    return key.hex() if isinstance(key, bytes | bytearray | memoryview) else repr(key)
