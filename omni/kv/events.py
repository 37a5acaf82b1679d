"""Store events: which pages entered or left a `KVStore`, for whoever mirrors its contents.

Why they exist: a cluster directory keeps, for every worker, the set of keys it holds, so that
routers send a request where its prefix is cached and workers fetch pages instead of
recomputing them. Replaying a store's events in order must give its `keys()`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container

__all__ = ["Listener", "StoreEvents"]

log = logging.getLogger("omni.kv")

# fn(stored, removed): keys that entered the store, keys that left it (`KVStore.add_listener`).
Listener = Callable[[list[bytes], list[bytes]], None]


class StoreEvents:
    """The listeners of one store and the changes of the operation in progress.

    Not thread-safe on its own: the store calls it with its lock held. The tier manager
    reports each page entering or leaving (`record`); when the store operation ends, `emit`
    tells the listeners the *net* change, so a page put and evicted within one operation (or
    evicted and put back) is no event at all, and `stored` and `removed` never share a key.
    """

    def __init__(self) -> None:
        self.listeners: tuple[Listener, ...] = ()
        self.pending: list[tuple[bytes, bool]] = []  # (key, added), in order

    def add(self, fn: Listener) -> None:
        self.listeners = (*self.listeners, fn)

    def remove(self, fn: Listener) -> None:
        self.listeners = tuple(f for f in self.listeners if f is not fn)

    def record(self, key: bytes, added: bool) -> None:
        if self.listeners:  # nobody listens: nothing to keep
            self.pending.append((key, added))

    def emit(self, present: Container[bytes]) -> None:
        """Call the listeners with the net change since the last `emit`; `present` answers
        whether a key is in the store now."""
        changes, self.pending = self.pending, []
        first: dict[bytes, bool] = {}
        for key, added in changes:
            first.setdefault(key, added)  # added first: it was absent before the operation
        stored = [key for key, added in first.items() if added and key in present]
        removed = [key for key, added in first.items() if not added and key not in present]
        if not stored and not removed:
            return
        for fn in self.listeners:
            try:
                fn(stored, removed)
            except Exception:  # a listener's bug must not break the store's operation
                log.exception("a KV store listener failed")
