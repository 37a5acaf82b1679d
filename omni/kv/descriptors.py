"""What the KV layer puts on the wire: a page layout (`LayoutSpec`) and leased pages as another
process of the machine finds them (`PageDescriptor`). Plain msgspec structs, torch-free, so
that the transport's movers can carry them without loading torch."""

from __future__ import annotations

import msgspec

__all__ = ["DESCRIPTOR_VERSION", "LayoutSpec", "PageDescriptor"]

DESCRIPTOR_VERSION = 1


class LayoutSpec(msgspec.Struct, frozen=True):
    """`KVLayout` as it travels on the wire (the dtype by name)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str


class PageDescriptor(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Leased pages as another process on the same machine finds them.

    `arena` is the shared-memory segment holding the pages, `offsets` the byte offset of each
    page in it, `lease_slot`/`lease_id` the lease's record in the store's lease table, and
    `expiry_ns` the lease's end (CLOCK_MONOTONIC ns). A few hundred bytes, whatever the pages
    weigh.
    """

    store_id: str
    tier: str
    arena: str
    offsets: list[int]
    layout: LayoutSpec
    lease_id: int
    lease_slot: int
    lease_table: str
    expiry_ns: int
    version: int = DESCRIPTOR_VERSION
