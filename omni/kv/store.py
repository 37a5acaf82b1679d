"""`KVStore`: the process's paged KV cache, thread-safe, over device / host / disk tiers.

One lock guards the store's state, and no disk I/O happens under it: an operation that needs a
page written to or read from disk lets the tier manager plan the transfer, runs it with the
lock released, and commits it under the lock (`omni.kv.manager` says what other threads see of
a page meanwhile). So `match`, `acquire` of pages in memory, `stats` and the leases of other
processes never wait for a disk, however slow or faulty. Copies between memory tiers stay
under the lock (a memmove of one page).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import secrets
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from omni.kv.descriptors import PageDescriptor
from omni.kv.errors import KVError
from omni.kv.events import Listener, StoreEvents
from omni.kv.handle import Lease
from omni.kv.keys import check_keys
from omni.kv.layout import KVLayout, parse_size
from omni.kv.leases import LeaseTable, now_ns, reclaim_dead_stores
from omni.kv.manager import TierManager
from omni.kv.peers import PeerSource
from omni.kv.policy import EvictionPolicy, make_policy
from omni.kv.probe import tier_error
from omni.kv.tiers.device import DeviceTier
from omni.kv.tiers.disk import DiskTier
from omni.kv.tiers.host import HostTier
from omni.kv.tiers.memory import batched_copies, slots_for
from omni.kv.transfers import Blocked, Transfer

__all__ = ["KVConfig", "KVStore", "TierConfig"]

TierName = Literal["device", "host", "disk"]
_ORDER = {"device": 0, "host": 1, "disk": 2}


log = logging.getLogger("omni.kv")
_reclaim_lock = threading.Lock()
_reclaimed = False


def _reclaim_once() -> None:
    """The first store of a process removes the shared memory of stores whose owner process
    is gone (killed before it could), and says so in one line."""
    global _reclaimed
    with _reclaim_lock:
        if _reclaimed:
            return
        _reclaimed = True
    removed = reclaim_dead_stores()
    if removed:
        stores = sorted({name.rsplit("-", 1)[0] for name in removed})
        log.warning("removed the shared memory of %d KV store(s) whose process is gone: %s",
                    len(stores), ", ".join(stores))


@dataclass(frozen=True)
class TierConfig:
    """One tier of a store: its name, capacity in bytes ("8GiB" or an int), the directory of a
    disk tier (default: under the user's cache directory) and its eviction policy (default:
    the store's)."""

    name: TierName
    capacity: int | str
    path: str | os.PathLike[str] | None = None
    policy: str | EvictionPolicy | type | None = None

    def __post_init__(self) -> None:
        if self.name not in _ORDER:
            raise ValueError(f"unknown KV tier {self.name!r}; tiers are device, host, disk")
        if self.path is not None and self.name != "disk":
            raise ValueError(f"only the disk tier takes a path, not {self.name!r}")
        if parse_size(self.capacity) > _MAX_TIER_BYTES:
            raise ValueError(f"{self.capacity!r} is more than a machine holds (at most 65536TiB)")


_MAX_TIER_BYTES = 1 << 56
DEFAULT_TIERS = (TierConfig("device", "256MiB"), TierConfig("host", "1GiB"))


@dataclass(frozen=True)
class KVConfig:
    """A store to build later: what ``omni.Runtime(kv=...)`` and ``omni run --kv-*`` take.

    The runtime builds the store when it starts and closes it when it stops.
    """

    layout: KVLayout
    tiers: tuple[TierConfig, ...] | None = None
    policy: str = "lru"

    def check(self) -> None:
        """Raise ValueError now for a tier that could not hold a page (nothing is allocated)."""
        for config in self.tiers or DEFAULT_TIERS:
            num_slots(config, self.layout)

    def build(self) -> KVStore:
        return KVStore(self.layout, self.tiers, self.policy)


def num_slots(config: TierConfig, layout: KVLayout) -> int:
    """Pages a tier of `config` holds (ValueError when not even one)."""
    unit = DiskTier.slot_bytes_for(layout) if config.name == "disk" else layout.page_bytes
    return slots_for(parse_size(config.capacity), unit, config.name)


class KVStore:
    """Pages of KV, one copy each, spilling device -> host -> disk (see `omni.kv`).

    Args:
        layout: the shape of a page.
        tiers: `TierConfig`s (any order; a store needs at least one). Default: a 256 MiB device
            tier and a 1 GiB host tier.
        policy: the default eviction policy of every tier: "lru", "lfu", or an object with the
            `EvictionPolicy` protocol.
        lease_ttl: seconds a lease handed to another process lives unless released sooner.
        max_exported: how many such leases may be live at once.
        device: where the device tier lives (default: CUDA when available, else the CPU; a
            CPU device tier is a shared-memory arena like the host tier, never page-locked).

    Attributes:
        peers: where `prefetch` gets pages this store lacks (a `PeerSource`, e.g. the
            cluster's `PeerFetcher`); None (the default): nowhere, they are recomputed.

    Raises:
        ValueError: a tier smaller than one page, a duplicate tier, an unwritable disk path.
    """

    def __init__(self, layout: KVLayout, tiers: Sequence[TierConfig] | None = None,
                 policy: str | EvictionPolicy | type = "lru", *, lease_ttl: float = 30.0,
                 max_exported: int = 1024, device: torch.device | str | None = None):
        configs = sorted(DEFAULT_TIERS if tiers is None else tiers, key=lambda t: _ORDER[t.name])
        names = [c.name for c in configs]
        if not configs or len(set(names)) != len(names):
            raise ValueError(f"a KV store needs distinct tiers, got {names}")
        if lease_ttl <= 0:
            raise ValueError(f"lease_ttl must be > 0 seconds, got {lease_ttl!r}")
        self.layout = layout
        self.store_id = secrets.token_hex(8)
        self.lease_ttl = lease_ttl
        self._device = device
        self._lock = threading.RLock()
        # Notified whenever a disk transfer commits: what waiters for a page in transit, or
        # for room that only a transfer can free, and `close`, wait on.
        self._moved = threading.Condition(self._lock)
        # Lease ids start at random: a descriptor retargeted at another store (its id, arena
        # and lease table) must not find a live lease of the same number there.
        self._lease_ids = itertools.count(secrets.randbits(48) + 1)
        self._num_leases = 0
        self._exported: dict[int, tuple[int, list[bytes]]] = {}  # record -> (lease id, keys)
        self._closed = False
        self.peers: PeerSource | None = None
        self._events = StoreEvents()
        self._peer_fetches = self._peer_pages = 0
        self._tiers: list[Any] = []
        _reclaim_once()
        # The lease table first: its owner record is what lets the arenas made next be
        # reclaimed should this process be killed.
        self._table = LeaseTable.create(self.store_id, max_exported)
        try:
            for config in configs:
                try:
                    self._tiers.append(self._build_tier(config))
                except (OSError, ValueError, OverflowError) as exc:
                    raise tier_error(config.name, exc) from exc
            policies = [make_policy(c.policy if c.policy is not None else policy)
                        for c in configs]
            self._manager = TierManager(layout, self._tiers, policies)
            self._manager.on_change = self._events.record
        except BaseException:
            for tier in self._tiers:
                tier.close()
            self._table.close()  # the owner unlinks it
            raise

    def _build_tier(self, config: TierConfig) -> Any:
        slots = num_slots(config, self.layout)
        if config.name == "device":
            return DeviceTier.create(self.layout, slots, self.store_id, self._device)
        if config.name == "host":
            return HostTier.create(self.layout, slots, self.store_id)
        return DiskTier.create(self.layout, slots, config.path, self.store_id)

    # -- the API -----------------------------------------------------------------------------

    def put(self, keys: Sequence[bytes], pages: torch.Tensor) -> int:
        """Store pages (a tensor ``[len(keys), *layout.page_shape]``) under their keys.

        Pages already cached are left as they are. Returns how many were new.

        Raises:
            ValueError: wrong keys, or pages of the wrong shape or dtype.
            KVCapacityError: the top tier is full of pinned pages.
        """
        check_keys(keys)
        expected = (len(keys), *self.layout.page_shape)
        if not isinstance(pages, torch.Tensor) or tuple(pages.shape) != expected:
            got = tuple(pages.shape) if isinstance(pages, torch.Tensor) else type(pages).__name__
            raise ValueError(f"pages must have shape {list(expected)} ([n, *page_shape] for "
                             f"{self.layout}), got {got}")
        if pages.dtype != self.layout.dtype:
            raise ValueError(f"pages must have dtype {self.layout.dtype}, got {pages.dtype}")
        put = self._manager.put
        with self._emitting(), batched_copies():
            return sum(self._run(functools.partial(put, key, pages[i]))
                       for i, key in enumerate(keys))

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading keys have a page in some tier (a prefix hit)."""
        with self._lock:
            self._check_open()
            return self._manager.match(keys)

    def acquire(self, keys: Sequence[bytes]) -> Lease:
        """Pin the pages of `keys` in the top tier and return the `Lease` that holds them.

        The lease covers the longest prefix of `keys` that is present and valid, which is all
        of them after a `match` unless a page was evicted or found corrupt since.

        Raises:
            KVCapacityError: the top tier cannot hold them all unpinned pages aside; nothing
                stays pinned then.
        """
        check_keys(keys)
        manager = self._manager
        with self._emitting(), batched_copies():
            with self._lock:
                self._check_open()
                self._sweep()
            held: list[bytes] = []
            slots: list[int] = []
            try:
                for key in keys:  # each pinned as it comes: a load lets other threads in
                    where = self._run(functools.partial(manager.promote, key, 0, pin=True))
                    if where is None:
                        with self._lock:
                            manager.match([key])  # counts the miss
                        break
                    held.append(key)
                    slots.append(where[1])
                with self._lock:
                    self._check_open()
                    self._num_leases += 1
            except BaseException:
                with self._lock:
                    manager.unpin(held)
                raise
            return Lease(self, held, slots)

    async def prefetch(self, keys: Sequence[bytes], *,
                       recompute_page_s: float | None = None) -> int:
        """Get the pages of `keys` ready for `acquire`; return how many leading keys are now
        in the store.

        First the local pages: the leading run present here is brought up from disk in a
        worker thread (so the event loop never waits on I/O), stopping at the first key
        missing (or found corrupt). Then, when `peers` is set and keys are still missing,
        ``await peers.fetch(self, rest, recompute_page_s=...)`` brings what it can of the
        rest from other workers, unless it judges that slower than recomputing
        `recompute_page_s` seconds per page (None: unknown, so it fetches). Await it before
        `match` and `acquire`.
        """
        from omni._openmp import run_in_worker  # imports trio: only where it is needed

        check_keys(keys)
        keys = list(keys)
        n = self._prefetch_in_memory(keys)
        if n is None:  # a page to read from disk or to move between tiers
            n = await run_in_worker(self._prefetch_sync, keys, keep_pool=False)
        if self.peers is None or n >= len(keys):
            return n
        got = await self.peers.fetch(self, keys[n:], recompute_page_s=recompute_page_s)
        with self._lock:
            self._peer_fetches += 1
            self._peer_pages += got
        return n + got

    def _prefetch_target(self) -> int:
        names = self._manager.tier_names
        return names.index("host") if "host" in names else 0

    def _prefetch_in_memory(self, keys: list[bytes]) -> int | None:
        """`_prefetch_sync` without a worker thread when the leading run's pages are already
        where it would put them (the common case of a warm store: a thread hop then costs
        more than the prefetch). None when some page needs a move or a disk read, or when
        another thread holds the store: the caller's event loop never waits for the lock.
        (Nothing here changes a placement, so there is nothing to tell the listeners.)"""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            self._check_open()
            target = self._prefetch_target()
            run = self._ready_run(keys, target)
            if run is None:
                return None
            for key in run:
                self._manager.promote(key, target)  # touches the policy and counts the hit
            return len(run)
        finally:
            self._lock.release()

    def acquire_now(self, keys: Sequence[bytes]) -> Lease | None:
        """`acquire` for an event loop: the lease when the leading run of `keys` present is
        in the top tier already (nothing to read from disk or to move, so nothing to wait
        for), else None, as when another thread holds the store: `acquire` in a worker
        thread then. Why: a thread hop costs more than leasing pages already in memory."""
        check_keys(keys)
        if not self._lock.acquire(blocking=False):
            return None
        try:
            self._check_open()
            self._sweep()
            slots = self._manager.pin_resident(keys)  # counts hits and the miss, as `acquire`
            if slots is None:
                return None
            self._num_leases += 1
        finally:
            self._lock.release()
        return Lease(self, list(keys[:len(slots)]), slots)

    def _ready_run(self, keys: Sequence[bytes], target: int) -> list[bytes] | None:
        """The leading keys present, when all their pages are in memory at tier `target` or
        above (None when one must move or be read from disk). Under the lock."""
        run = []
        for key in keys:
            ready = self._manager.in_memory(key, target)
            if ready is None:
                break
            if not ready:
                return None
            run.append(key)
        return run

    def _prefetch_sync(self, keys: list[bytes]) -> int:
        target = self._prefetch_target()
        with self._emitting(), batched_copies():
            for n, key in enumerate(keys):
                if self._run(functools.partial(self._manager.promote, key, target)) is None:
                    return n
        return len(keys)

    def discard(self, keys: Sequence[bytes]) -> int:
        """Forget the pages of `keys` in every tier; returns how many went. Pages pinned by
        a lease stay (they are in use); absent keys are ignored."""
        check_keys(keys)
        with self._mutating():
            self._check_open()
            manager = self._manager
            return sum(manager.discard(key) for key in keys if not manager.is_pinned(key))

    def keys(self) -> list[bytes]:
        """Every key with a page in some tier, now (a snapshot: what a resync sends)."""
        with self._lock:
            self._check_open()
            return self._manager.keys()

    def add_listener(self, fn: Listener) -> Callable[[], None]:
        """Call ``fn(stored, removed)`` whenever pages enter or leave the store; returns the
        function that removes it.

        `stored` holds keys that are new to the store (in any tier), `removed` keys whose
        last copy went (evicted from the last tier, discarded, dropped as corrupt or after a
        failed write); the two never share a key, and one call covers one store operation.
        Moves between tiers are not events. Why: a cluster directory mirrors which pages
        each worker holds, and replaying these events must give `keys()`.

        `fn` runs under the store's lock, in whatever thread changed the store: it must be
        quick and must not call the store. An exception from it is logged and ignored. While
        an operation waits for a disk transfer, another operation's call may carry its
        changes so far: the calls still replay to `keys()`.
        """
        with self._lock:
            self._events.add(fn)

        def remove() -> None:
            with self._lock:
                self._events.remove(fn)

        return remove

    def stats(self) -> dict[str, dict[str, int]]:
        """Per tier: pages (slots in use, a slot reserved for a disk transfer in flight too),
        capacity, hits, misses, evictions, promotions, demotions, corrupt,
        write_errors, and for memory tiers reserved (the pages whose memory is reserved: a
        shared-memory tier grows to its capacity as pages arrive, and stops short of it when
        /dev/shm is full); "leases": open, exported, pinned_pages; and once `peers` is set,
        "peers": fetches (prefetches that asked it) and pages (that it brought)."""
        with self._lock:
            self._sweep()
            out: dict[str, dict[str, int]] = {}
            for i, name in enumerate(self._manager.tier_names):
                counters = self._manager.counters(i)
                tier = self._manager.tier(i)
                out[name] = {"pages": self._manager.num_used(i), "capacity": tier.num_slots,
                             **vars(counters)}
                if hasattr(tier, "reserved_slots"):
                    out[name]["reserved"] = tier.reserved_slots
            out["leases"] = {"open": self._num_leases, "exported": len(self._exported),
                             "pinned_pages": self._manager.num_pinned()}
            if self.peers is not None or self._peer_fetches:
                out["peers"] = {"fetches": self._peer_fetches, "pages": self._peer_pages}
            return out

    def close(self) -> None:
        """Free every tier's memory and files (idempotent).

        Disk transfers in flight are let finish first (their I/O uses the disk tier's file
        descriptor, which must not be closed and reused under them); the operations that
        started them then raise KVError, as does everything after.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._moved.notify_all()  # waiters find the store closed
            while self._manager.num_transfers:
                self._moved.wait()
            for tier in self._tiers:
                tier.close()
            self._table.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._closed:
            return "<KVStore closed>"
        with self._lock:
            parts = [f"{name}={self._manager.num_used(i)}/{self._manager.tier(i).num_slots}"
                     for i, name in enumerate(self._manager.tier_names)]
        return f"<KVStore {' '.join(parts)}>"

    # -- disk transfers ----------------------------------------------------------------------

    def _run(self, op: Callable[[], Any]) -> Any:
        """`op()` (one tier manager operation) under the lock, with the disk transfers it needs
        run outside the lock and committed; retried until it completes.

        Raises KVError once the store is closed, and whatever `op` raises.
        """
        while True:
            with self._lock:
                self._check_open()
                try:
                    return op()
                except Blocked as blocked:
                    transfer = blocked.transfer
                    if transfer is None:  # another thread's transfer must commit first
                        self._moved.wait()
                        continue
            finished, result = self._carry_out(transfer)
            if finished:
                with self._lock:
                    self._check_open()
                return result

    def _carry_out(self, transfer: Transfer) -> tuple[bool, object]:
        """Run `transfer` without the lock, then commit it under the lock (always: even an
        unexpected error must give its slots back and wake `close`)."""
        try:
            transfer.run()
        finally:
            with self._lock:
                outcome = self._manager.commit(transfer)
                self._moved.notify_all()
        return outcome

    # -- events ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _emitting(self) -> Iterator[None]:
        """The listeners told what changed when the operation ends (even when it fails
        half-way: pages may have been evicted before a KVCapacityError).

        Why at the end and not after each locked step: one operation, one call. The pending
        changes are the store's, not the operation's, so whichever operation ends first tells
        the listeners all changes since the last call, each under the lock, in order.
        """
        try:
            yield
        finally:
            # Read unlocked first: this thread's own changes are visible to it, and changes
            # that another thread is recording are emitted when that thread's operation ends.
            if self._events.pending:
                with self._lock:
                    if self._events.pending:
                        self._events.emit(self._manager)

    @contextlib.contextmanager
    def _mutating(self) -> Iterator[None]:
        """The lock for an operation without disk I/O, and the listeners told at its end."""
        with self._emitting(), self._lock:
            yield

    # -- for leases --------------------------------------------------------------------------

    def _top_tier(self) -> Any:
        return self._tiers[0]

    def _release(self, keys: list[bytes]) -> None:
        with self._lock:
            if self._closed:
                return
            self._manager.unpin(keys)
            self._num_leases -= 1

    def _export(self, keys: list[bytes], slots: list[int], ttl: float | None) -> PageDescriptor:
        top = self._top_tier()
        if getattr(top, "arena_name", None) is None:
            raise KVError(f"pages in the {top.name} tier on {top.pool.device} cannot be mapped "
                          "by another process")
        seconds = self.lease_ttl if ttl is None else ttl
        if seconds <= 0:
            raise ValueError(f"ttl must be > 0 seconds, got {ttl!r}")
        with self._lock:
            self._check_open()
            self._sweep()  # records that holders gave back are free again
            lease_id = next(self._lease_ids)
            expiry = now_ns() + int(seconds * 1e9)
            record = self._table.export(lease_id, expiry)
            self._manager.pin(keys)
            self._exported[record] = (lease_id, list(keys))
        return PageDescriptor(
            store_id=self.store_id, tier=top.name, arena=top.arena_name,
            offsets=top.offsets(slots), layout=self.layout.to_spec(),
            lease_id=lease_id, lease_slot=record, lease_table=self._table.arena.name,
            expiry_ns=expiry)

    def _sweep(self) -> None:
        """Unpin the pages of exported leases that were released or have expired."""
        if not self._exported:
            return
        for record in self._table.finished(list(self._exported)):
            _, keys = self._exported.pop(record)
            self._manager.unpin(keys)
            self._table.free(record)

    def _check_open(self) -> None:
        if self._closed:
            raise KVError("the KV store is closed")

