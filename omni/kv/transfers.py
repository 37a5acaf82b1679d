"""Disk transfers: the I/O a tier manager plans under the store's lock and the store carries out
without it.

Why: a disk write or read takes from microseconds to seconds (a slow or failing disk), and the
store's lock serves every `match`, `acquire`, `stats` and lease of the process. So a move that
touches the disk is split in three: the manager *plans* it under the lock (reserves the slots,
marks the page in transit, copies the source page into the transfer's own buffer), the store
*runs* it with the lock released, then the manager *commits* it, or rolls it back after an I/O
error, under the lock again (`TierManager.commit`).

While it runs, a transfer touches only its own buffer and the one disk slot reserved for it:
no tier memory, no bookkeeping. Nothing another thread does can change the bytes it writes or
hand its slot to another page, and the store does not close its tiers before it has committed.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["Blocked", "Transfer"]

TransferKind = Literal["demote", "put", "load"]


class Transfer:
    """One disk I/O of one page.

    - "demote": write `buffer` (a copy of a memory page, taken under the lock) to `disk_slot`;
      the page stays in its memory slot meanwhile.
    - "put": write a new page to `disk_slot` (a store whose top tier is the disk); the page is
      not in the store until the write commits.
    - "load": read `disk_slot` into `buffer` and verify it; the commit copies it into `target`,
      the (tier, slot) reserved for it, and only then is the page in that tier.

    Why slots rather than a dataclass: one exists per page in flight, made on a hot path.
    """

    __slots__ = ("buffer", "disk", "disk_slot", "entry", "error", "key", "kind", "ok", "pin",
                 "target")

    def __init__(self, kind: TransferKind, key: bytes, entry: object, disk: object,
                 disk_slot: int, buffer: torch.Tensor, *,
                 target: tuple[int, int] | None = None, pin: bool = False) -> None:
        self.kind = kind
        self.key = key
        self.entry = entry  # the manager's entry of the page when planned (None for "put")
        self.disk = disk  # the `DiskTier`
        self.disk_slot = disk_slot
        self.buffer = buffer  # [*page_shape], CPU, owned by this transfer
        self.target = target
        self.pin = pin  # "load": pin the page when it commits (an `acquire`)
        self.ok = False
        self.error: BaseException | None = None

    def run(self) -> None:
        """Do the I/O (no lock held). An OSError of a write is kept in `error` (the commit
        rolls back); a read that fails verification leaves `ok` False (a miss)."""
        if self.kind == "load":
            self.ok = self.disk.read_into(self.disk_slot, self.buffer, self.key)
            return
        try:
            self.disk.write(self.disk_slot, self.buffer, self.key)
        except OSError as exc:
            self.error = exc
        else:
            self.ok = True

    def __repr__(self) -> str:
        state = "ok" if self.ok else ("failed" if self.error is not None else "pending")
        return f"<Transfer {self.kind} {self.key.hex()[:8]} disk_slot={self.disk_slot} {state}>"


class Blocked(Exception):
    """A manager operation cannot go on under the lock: `transfer` is disk I/O for the caller
    to run and commit, or None when it must wait for another thread's transfer to commit.

    Raised before the operation changed anything but slots reserved for `transfer` (and disk
    copies evicted to make room for it), so the caller retries the operation once the transfer
    has committed. It never leaves the store.
    """

    def __init__(self, transfer: Transfer | None) -> None:
        super().__init__(transfer)
        self.transfer = transfer
