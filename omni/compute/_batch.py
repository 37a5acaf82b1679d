"""The decode batch's KV: one row per running request, rows kept contiguous.

Why rows in one buffer per layer: a decode step attends over ``k[:B, :, :T]`` for every
request at once, which is a view, not a copy. A finishing request's row is filled by moving
the last row into it, so the running requests always occupy rows ``0..B-1``. Each row holds
its request's KV for positions ``0..length-1``; positions past a row's length are garbage
that the attention mask hides.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["BatchKV"]


class BatchKV:
    """Per-layer K and V buffers ``[max_batch, H_kv, capacity, D]`` with per-row lengths."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_batch: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", capacity: int = 256):
        self.max_batch = max_batch
        self.capacity = capacity
        self._shape = (max_batch, num_kv_heads, capacity, head_dim)
        # empty, not zeros (zero-filling a large buffer costs more than a prefill): positions a
        # decode step reads past a row's length are made finite first (see `_clean`)
        self.k = [torch.empty(self._shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(self._shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths: list[int] = []  # per occupied row
        # per row: positions [0, clean) hold finite values (KV or zeros). A masked position
        # still enters attention as 0 * V, and 0 * NaN from uninitialised memory is NaN.
        self._clean = [0] * max_batch

    @property
    def size(self) -> int:
        return len(self.lengths)

    def _ensure(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        capacity = max(needed, 2 * self.capacity)
        rows, used = self.size, max(self.lengths, default=0)
        for buffers in (self.k, self.v):
            for layer, old in enumerate(buffers):
                new = old.new_empty((old.shape[0], old.shape[1], capacity, old.shape[3]))
                new[:rows, :, :used] = old[:rows, :, :used]  # only what is occupied
                buffers[layer] = new
        self._clean = [min(c, used) if i < rows else 0 for i, c in enumerate(self._clean)]
        self.capacity = capacity

    def open_row(self, reserve: int) -> int:
        """A new, empty row with room for `reserve` positions; returns the row."""
        if self.size >= self.max_batch:
            raise RuntimeError("the decode batch is full")
        self._ensure(reserve + 1)
        self.lengths.append(0)
        return self.size - 1

    def fork(self, row: int) -> int:
        """A new row holding a copy of `row`'s KV (n samples of one prompt, one prefill)."""
        length = self.lengths[row]
        new = self.open_row(length)
        for buffers in (self.k, self.v):
            for buf in buffers:
                buf[new, :, :length] = buf[row, :, :length]
        self.lengths[new] = length
        self._clean[new] = max(self._clean[new], length)
        return new

    def write_pages(self, row: int, layer_pages: Callable[[int], torch.Tensor]) -> None:
        """Fill an empty row from KV pages, one layer at a time: ``layer_pages(layer)`` gives
        that layer's ``[n, 2, P, H, D]`` (e.g. `Lease.pages`); one copy per layer's K and V.

        Why per layer: a gather of one layer's pages is small enough to still be in cache
        when it is copied into the row (gathering every layer first reads and writes the whole
        prefix twice from memory).
        """
        length = 0
        for layer in range(len(self.k)):
            pages = layer_pages(layer)
            n, _, page_size, num_heads, head_dim = pages.shape
            length = n * page_size
            for which, buffers in enumerate((self.k, self.v)):
                # [n, P, H, D] -> the row's [H, n * P, D] seen as [H, n, P, D]: one copy, into
                # place (a reshape of the permuted pages would copy them once more first)
                buffers[layer][row, :, :length].view(num_heads, n, page_size, head_dim).copy_(
                    pages[:, which].permute(2, 0, 1, 3))
        self.lengths[row] = length
        self._clean[row] = max(self._clean[row], length)

    def extend(self, row: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append a row's new tokens' KV (per layer ``[1, H, T, D]``) after its length."""
        start = self.lengths[row]
        end = start + kv[0][0].shape[2]
        self._ensure(end + 1)
        for layer, (k, v) in enumerate(kv):
            self.k[layer][row, :, start:end] = k[0]
            self.v[layer][row, :, start:end] = v[0]
        self.lengths[row] = end
        self._clean[row] = max(self._clean[row], end)

    def remove(self, row: int) -> int | None:
        """Free `row`; returns the row that moved into it (the old last row), or None."""
        last = self.size - 1
        moved = None
        if row != last:
            length = self.lengths[last]
            for buffers in (self.k, self.v):
                for layer_buf in buffers:
                    layer_buf[row, :, :length] = layer_buf[last, :, :length]
            self.lengths[row] = length
            self._clean[row] = max(self._clean[row], length)
            moved = last
        self.lengths.pop()
        return moved

    def swap(self, a: int, b: int) -> None:
        """Exchange two rows (their KV and lengths): a step over the first rows only can
        then take the rows it needs to the front."""
        if a == b:
            return
        length = max(self.lengths[a], self.lengths[b])
        for buffers in (self.k, self.v):
            for buf in buffers:
                buf[[a, b], :, :length] = buf[[b, a], :, :length]
        self.lengths[a], self.lengths[b] = self.lengths[b], self.lengths[a]
        # each row now holds the other's first `length` positions: finite as far as those were
        self._clean[a], self._clean[b] = (min(self._clean[b], length),
                                          min(self._clean[a], length))

    def past(self, rows: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views ``[B, H, T_max, D]`` per layer over the occupied rows (the first `rows`)."""
        b = self.size if rows is None else rows
        t = max(self.lengths[:b])
        for row in range(b):
            if self._clean[row] < t:  # garbage this step would read masked: zero it once
                for buffers in (self.k, self.v):
                    for buf in buffers:
                        buf[row, :, self._clean[row]:t] = 0
                self._clean[row] = t
        return [(k[:b, :, :t], v[:b, :, :t]) for k, v in zip(self.k, self.v, strict=True)]

    def mask(self, rows: int | None = None) -> torch.Tensor | None:
        """``[B, 1, 1, T_max + 1]`` (True = attend) for one new token per row (the first
        `rows`); None when they all have the same length (plain causal attention is right)."""
        lengths = self.lengths if rows is None else self.lengths[:rows]
        if len(set(lengths)) <= 1:
            return None
        device = self.k[0].device
        t = max(lengths)
        lens = torch.tensor(lengths, device=device)
        past = torch.arange(t, device=device)[None, :] < lens[:, None]  # [B, T_max]
        mask = torch.cat([past, torch.ones(len(lengths), 1, dtype=torch.bool,
                                           device=device)], dim=1)
        return mask[:, None, None, :]

    def append(self, new_kv: list[tuple[torch.Tensor, torch.Tensor]],
               rows: int | None = None) -> None:
        """Write each row's new token (per layer ``[B, H, 1, D]``) at its length; lengths += 1
        (of the first `rows`)."""
        b = self.size if rows is None else rows
        self._ensure(max(self.lengths[:b]) + 2)
        lengths = self.lengths[:b]
        if len(set(lengths)) == 1:
            t = lengths[0]
            for layer, (k, v) in enumerate(new_kv):
                self.k[layer][:b, :, t] = k[:, :, 0]
                self.v[layer][:b, :, t] = v[:, :, 0]
        else:
            index = torch.arange(b, device=self.k[0].device)
            cols = torch.tensor(lengths, device=self.k[0].device)
            for layer, (k, v) in enumerate(new_kv):
                self.k[layer][index, :, cols] = k[:, :, 0]
                self.v[layer][index, :, cols] = v[:, :, 0]
        for row in range(b):
            self.lengths[row] += 1
            self._clean[row] = max(self._clean[row], self.lengths[row])

    def row_kv(self, row: int, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A row's KV for positions ``[start, end)``, per layer ``[1, H, end - start, D]``."""
        return [(k[row: row + 1, :, start:end], v[row: row + 1, :, start:end])
                for k, v in zip(self.k, self.v, strict=True)]
