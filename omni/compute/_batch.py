"""The decode batch's KV: one row per running request, rows kept contiguous.

Why rows in one buffer per layer: a decode step attends over ``k[:B, :, :T]`` for every
request at once, which is a view, not a copy. A finishing request's row is filled by moving
the last row into it, so the running requests always occupy rows ``0..B-1``. Each row holds
its request's KV for positions ``0..length-1``; positions past a row's length are garbage
that the attention mask hides.
"""

from __future__ import annotations

import torch

__all__ = ["BatchKV"]


class BatchKV:
    """Per-layer K and V buffers ``[max_batch, H_kv, capacity, D]`` with per-row lengths."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_batch: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", capacity: int = 256):
        self.max_batch = max_batch
        self.capacity = capacity
        self._shape = (max_batch, num_kv_heads, capacity, head_dim)
        self.k = [torch.zeros(self._shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(self._shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths: list[int] = []  # per occupied row

    @property
    def size(self) -> int:
        return len(self.lengths)

    def _ensure(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        capacity = max(needed, 2 * self.capacity)
        for layer in range(len(self.k)):
            for buffers in (self.k, self.v):
                old = buffers[layer]
                new = old.new_zeros((old.shape[0], old.shape[1], capacity, old.shape[3]))
                new[:, :, : self.capacity] = old
                buffers[layer] = new
        self.capacity = capacity

    def add(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Put a request's KV (per layer ``[1, H, T, D]``) in a new row; return the row."""
        if self.size >= self.max_batch:
            raise RuntimeError("the decode batch is full")
        length = kv[0][0].shape[2]
        self._ensure(length + 1)
        row = self.size
        for layer, (k, v) in enumerate(kv):
            self.k[layer][row, :, :length] = k[0]
            self.v[layer][row, :, :length] = v[0]
        self.lengths.append(length)
        return row

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
            moved = last
        self.lengths.pop()
        return moved

    def past(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views ``[B, H, T_max, D]`` per layer over the occupied rows."""
        b, t = self.size, max(self.lengths)
        return [(k[:b, :, :t], v[:b, :, :t]) for k, v in zip(self.k, self.v, strict=True)]

    def mask(self) -> torch.Tensor | None:
        """``[B, 1, 1, T_max + 1]`` (True = attend) for one new token per row; None when every
        row has the same length (plain causal attention is then right)."""
        if len(set(self.lengths)) <= 1:
            return None
        lengths = torch.tensor(self.lengths)
        t = int(lengths.max())
        past = torch.arange(t)[None, :] < lengths[:, None]  # [B, T_max]
        mask = torch.cat([past, torch.ones(len(self.lengths), 1, dtype=torch.bool)], dim=1)
        return mask[:, None, None, :]

    def append(self, new_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write each row's new token (per layer ``[B, H, 1, D]``) at its length; lengths += 1."""
        self._ensure(max(self.lengths) + 2)
        b = self.size
        if len(set(self.lengths)) == 1:
            t = self.lengths[0]
            for layer, (k, v) in enumerate(new_kv):
                self.k[layer][:b, :, t] = k[:, :, 0]
                self.v[layer][:b, :, t] = v[:, :, 0]
        else:
            rows = torch.arange(b)
            cols = torch.tensor(self.lengths)
            for layer, (k, v) in enumerate(new_kv):
                self.k[layer][rows, :, cols] = k[:, :, 0]
                self.v[layer][rows, :, cols] = v[:, :, 0]
        self.lengths = [n + 1 for n in self.lengths]

    def row_kv(self, row: int, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A row's KV for positions ``[start, end)``, per layer ``[1, H, end - start, D]``."""
        return [(k[row: row + 1, :, start:end], v[row: row + 1, :, start:end])
                for k, v in zip(self.k, self.v, strict=True)]
