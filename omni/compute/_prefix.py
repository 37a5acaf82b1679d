"""A batch row and the KV store: the longest cached prefix into a row, a row's full pages
into the store. Shared by the engine's runner and the talker's batch."""

from __future__ import annotations

import logging

import torch

from omni.compute._batch import BatchKV
from omni.compute.models import DecoderLM
from omni.kv import KVCapacityError, KVStore

__all__ = ["load_prefix", "put_pages", "store_pages"]

log = logging.getLogger("omni.compute")


def load_prefix(store: KVStore | None, batch: BatchKV, row: int, keys: list[bytes],
                page_size: int) -> int:
    """Copy the pages of the longest prefix of `keys` the store holds into `row` (empty);
    how many tokens. 0 when it holds none or cannot lend them now (then they are computed)."""
    if store is None or not keys:
        return 0
    try:
        lease = store.acquire(keys[: store.match(keys)])
    except KVCapacityError as exc:
        log.warning("KV prefix not reused: %s", exc)
        return 0
    with lease:
        if not len(lease):
            return 0
        batch.write_pages(row, lease.pages)
        return len(lease) * page_size


def store_pages(store: KVStore | None, batch: BatchKV, row: int, keys: list[bytes],
                first: int, page_size: int) -> None:
    """Put `row`'s full pages `first` .. len(keys) - 1 (named by `keys`, one per page from
    the row's start) into the store (best effort: a full store keeps them out, said in the
    log)."""
    if store is None or len(keys) <= first:
        return
    kv = batch.row_kv(row, 0, len(keys) * page_size)
    put_pages(store, keys[first:], DecoderLM.kv_to_pages(kv, first * page_size, page_size))


def put_pages(store: KVStore, keys: list[bytes], pages: torch.Tensor) -> None:
    """Put `pages` under `keys` into the store (best effort: a full store keeps them out,
    said in the log)."""
    try:
        store.put(keys, pages.contiguous())
    except KVCapacityError as exc:
        log.warning("KV pages not cached: %s", exc)
