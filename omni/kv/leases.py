"""Leases held by other processes: a small table in shared memory.

Why shared memory and not a message back to the owner: a consumer on the same machine must be
able to give a lease back (or simply die) without any channel to the store. Each record holds
the lease id, its expiry (CLOCK_MONOTONIC nanoseconds, the same clock in every process of the
machine) and the id the consumer wrote when it released the lease. The owner sweeps the table
and unpins the pages of every lease that was released or has expired, so a crashed consumer
pins nothing for longer than the lease's time to live.

Record 0 names the owner instead: a marker, its pid and its start time (so that a pid the
kernel gave to another process since is not taken for the owner). A store that starts removes
the shared memory of stores whose owner is gone (`reclaim_dead_stores`): a process killed with
SIGKILL cannot unlink its own. The owner record can never pass for a lease: its "expiry" is a
pid, long past, and holders may not release or renew record 0.

Every reading of that clock goes through `now_ns` (this module's `clock`), so that a test can
move time forward for expiries instead of waiting for it to pass.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from omni._shm import Segment, process_start_time, reclaim_dead, shm_directory
from omni.kv.errors import KVLeaseError

__all__ = ["LeaseRecord", "LeaseTable", "attach_segment", "clock", "now_ns",
           "reclaim_dead_stores"]

clock = time.monotonic_ns  # CLOCK_MONOTONIC: the same clock in every process of the machine


def now_ns() -> int:
    """The leases' clock now, in nanoseconds."""
    return clock()


# One record per exported lease; 8-byte fields so that each store is a single aligned write.
LeaseRecord = np.dtype([("lease_id", "<u8"), ("expiry_ns", "<u8"), ("released_id", "<u8")])
_OWNER = int.from_bytes(b"omni-own", "little")  # record 0's marker: (marker, pid, start time)


def attach_segment(name: str) -> Segment:
    """Map another store's segment `name` (a tier or its lease table).

    Raises:
        KVLeaseError: it is gone (its store closed) or cannot be mapped.
    """
    try:
        return Segment.attach(name)
    except FileNotFoundError:
        raise KVLeaseError(f"shared memory {name!r} does not exist (its store closed?)"
                           ) from None
    except OSError as exc:
        raise KVLeaseError(f"shared memory {name!r} cannot be mapped: {exc}") from None


def table_name(store_id: str) -> str:
    return f"omni-{store_id}-leases"


class LeaseTable:
    """The records of one store's exported leases (owner side, or attached by a consumer)."""

    def __init__(self, arena: Segment, *, owner: bool):
        self.arena = arena
        self.capacity = arena.size // LeaseRecord.itemsize
        self.records = np.frombuffer(arena.buffer, dtype=LeaseRecord, count=self.capacity)
        self._free = list(reversed(range(1, self.capacity))) if owner else []

    @classmethod
    def create(cls, store_id: str, capacity: int) -> LeaseTable:
        """The table of a new store, for `capacity` leases, its owner record written."""
        arena = Segment.create(table_name(store_id), (capacity + 1) * LeaseRecord.itemsize)
        table = cls(arena, owner=True)
        pid = os.getpid()
        table.records[0] = (_OWNER, pid, process_start_time(pid))
        return table

    @classmethod
    def attach(cls, name: str) -> LeaseTable:
        return cls(attach_segment(name), owner=False)

    # -- owner -------------------------------------------------------------------------------

    def export(self, lease_id: int, expiry_ns: int) -> int:
        """A record for a new lease; raises KVLeaseError when every record is in use."""
        if not self._free:
            raise KVLeaseError(f"too many leases handed to other processes at once "
                               f"({self.capacity}); release some or let them expire")
        slot = self._free.pop()
        self.records[slot] = (lease_id, expiry_ns, 0)
        return slot

    def finished(self, slots: list[int]) -> list[int]:
        """Those of `slots` whose lease was released by its holder or has expired."""
        if not slots:
            return []
        now = now_ns()
        rec = self.records[slots]
        done = (rec["released_id"] == rec["lease_id"]) | (rec["expiry_ns"] <= now)
        return [s for s, d in zip(slots, done.tolist(), strict=True) if d]

    def free(self, slot: int) -> None:
        self.records[slot] = (0, 0, 0)
        self._free.append(slot)

    # -- holder ------------------------------------------------------------------------------

    def check(self, slot: int, lease_id: int) -> None:
        """Raise KVLeaseError unless lease `lease_id` is live in record `slot`."""
        if not 0 < slot < self.capacity:
            raise KVLeaseError(f"lease record {slot} is out of range")
        lease, expiry, released = self.records[slot].tolist()
        if lease != lease_id or released == lease_id:
            raise KVLeaseError(f"lease {lease_id} is unknown or was released")
        if expiry <= now_ns():
            raise KVLeaseError(f"lease {lease_id} has expired")

    def release(self, slot: int, lease_id: int) -> None:
        """Give the lease back; a no-op when the record already holds another lease."""
        if 0 < slot < self.capacity and int(self.records[slot]["lease_id"]) == lease_id:
            self.records[slot]["released_id"] = lease_id

    def renew(self, slot: int, lease_id: int, expiry_ns: int) -> None:
        """Extend a live lease (raises KVLeaseError when it is no longer live)."""
        self.check(slot, lease_id)
        self.records[slot]["expiry_ns"] = expiry_ns

    def close(self) -> None:
        self.records = None  # drop the view before the mapping goes
        self.arena.close()


def reclaim_dead_stores() -> list[str]:
    """Unlink the arenas and lease tables of stores whose owner process is gone; their names.

    Only stores whose lease table carries an owner record are considered, and a table this
    process cannot read is left alone."""
    folder = shm_directory()

    def owner(table: Path) -> tuple[int, int] | None:
        try:
            with open(table, "rb") as f:
                head = f.read(LeaseRecord.itemsize)
        except OSError:
            return None
        if len(head) < LeaseRecord.itemsize:
            return None
        marker, pid, started = np.frombuffer(head, dtype=LeaseRecord)[0].tolist()
        return (pid, started) if marker == _OWNER else None

    def arenas(table: Path) -> list[Path]:
        store_id = table.name[len("omni-"):-len("-leases")]
        return [path for path in folder.glob(f"omni-{store_id}-*") if path != table]

    return reclaim_dead("omni-*-leases", owner, with_it=arenas)
