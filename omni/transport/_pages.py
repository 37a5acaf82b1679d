"""What movers exchange: page batches to send, the headers that describe them, and the pages
a receiver gets back (`ReceivedPages`). Why apart from `movers.py`: these are the values on
both sides of the wire; the movers are the behaviour."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias

import msgspec

from omni.kv.errors import KVError
from omni.kv.handle import Lease, OpenedPages, PageDescriptor
from omni.kv.layout import KVLayout, LayoutSpec
from omni.transport.errors import TransportError

if TYPE_CHECKING:
    import torch

    from omni.kv.store import KVStore

Locality = Literal["same_process", "same_machine", "remote"]
Frame: TypeAlias = Any  # bytes, memoryview or zmq.Frame: anything with the buffer protocol
PageKey = Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]
MAX_PAGES = 1 << 16  # per message: a header that claims more is refused before any allocation
COPY_MARGIN_S = 30.0  # a shared-memory lease is renewed to last at least this long per copy


@dataclass(frozen=True)
class PageBatch:
    """Pages not held by a store lease: their keys and tensor ``[n, *page_shape]``.

    `stable=True` promises that nobody writes `pages` until the send is done (the zmq
    tracker says so); `FrameMover` then sends their bytes without a copy. With the default
    `stable=False` it sends a private copy.
    """

    keys: tuple[bytes, ...]
    pages: torch.Tensor
    stable: bool = False


PageSource: TypeAlias = "Lease | PageBatch"


class _Header(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind"):
    """Fields every mover header has: the pages' layout and their 16-byte keys."""

    layout: LayoutSpec
    keys: list[PageKey]


class SameProcessHeader(_Header, frozen=True, tag="same_process"):
    """Pages registered in process `pid` (instance `process_nonce`) under `object_id`."""

    pid: int
    process_nonce: str
    object_id: int


class SharedMemoryHeader(_Header, frozen=True, tag="shared_memory"):
    """Pages in a store's shared memory on host `host` (see `host_id`)."""

    host: str
    descriptor: PageDescriptor


class FrameHeader(_Header, frozen=True, tag="frames"):
    """Pages whose bytes follow as one frame of `nbytes`; `checksum` is xxh3-128 over the
    layout, the keys and the bytes."""

    nbytes: int
    checksum: Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]


MoverHeader: TypeAlias = SameProcessHeader | SharedMemoryHeader | FrameHeader


@dataclass(frozen=True)
class MoverStats:
    """Batches packed and unpacked by a mover, pages in each direction, unpacks refused."""

    packed: int
    unpacked: int
    pages_out: int
    pages_in: int
    refused: int


class ReceivedPages:
    """Pages a mover delivered. Read them, or `put_into` a store, then close (or ``with``).

    For shared memory the pages are views of the owner's memory, valid while the lease lives:
    `pages()` and `put_into` renew it before copying so the copy cannot be torn; after
    reading `page(i)` views yourself, check `valid()`.
    """

    def __init__(self, locality: Locality, layout: KVLayout, keys: Sequence[bytes], *,
                 pages: torch.Tensor | None = None, opened: OpenedPages | None = None):
        self.locality = locality
        self.layout = layout
        self.keys = tuple(keys)
        self._pages = pages  # [n, *page_shape], or None with `opened`
        self._opened = opened
        self._closed = False

    def __len__(self) -> int:
        return len(self.keys)

    def _check(self) -> None:
        if self._closed:
            raise TransportError("these received pages were closed")

    def valid(self) -> bool:
        """True until closed (and, for shared memory, while the lease lives)."""
        if self._opened is not None:
            return self._opened.valid()
        return not self._closed

    def page(self, index: int) -> torch.Tensor:
        """Page `index` as a view, no copy."""
        self._check()
        return self._opened[index] if self._opened is not None else self._pages[index]

    def pages(self) -> torch.Tensor:
        """All pages as one tensor ``[n, *page_shape]`` (a copy for shared memory only).

        Raises:
            TransportError: closed, or the shared-memory lease ended (a miss).
        """
        self._check()
        if self._opened is None:
            return self._pages
        import torch

        self._hold_lease()
        return torch.stack(list(self._opened))

    def put_into(self, store: KVStore) -> int:
        """Store these pages in `store` (one copy); returns how many were new there."""
        self._check()
        if self._opened is None:
            return store.put(self.keys, self._pages)
        self._hold_lease()
        return sum(store.put([key], page.unsqueeze(0))
                   for key, page in zip(self.keys, self._opened, strict=True))

    def _hold_lease(self) -> None:
        remaining = (self._opened.descriptor.expiry_ns - time.monotonic_ns()) / 1e9
        try:
            self._opened.renew(max(remaining, COPY_MARGIN_S))
        except KVError as exc:
            raise TransportError(f"shared-memory pages are gone: {exc}") from exc

    def close(self) -> None:
        """Let go of the pages (gives a shared-memory lease back). Idempotent."""
        if not self._closed:
            self._closed = True
            self._pages = None
            if self._opened is not None:
                self._opened.close()

    def __enter__(self) -> ReceivedPages:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<ReceivedPages {self.locality} pages={len(self.keys)} {state}>"


