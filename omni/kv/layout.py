"""The shape of one KV page, and byte sizes written as text ("8GiB")."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from omni._units import parse_size
from omni.kv.descriptors import LayoutSpec

__all__ = ["KVLayout", "parse_size"]

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
    torch.float8_e4m3fn, torch.float8_e5m2)}


@dataclass(frozen=True)
class KVLayout:
    """The KV of `page_size` tokens of every layer: one page.

    A page is a tensor of `page_shape` = ``[num_layers, 2, page_size, num_kv_heads, head_dim]``
    (the 2 is K then V), `page_bytes` bytes, stored contiguously.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVLayout.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.dtype, torch.dtype) or self.dtype not in _DTYPES.values():
            raise ValueError(f"KVLayout.dtype must be one of {', '.join(sorted(_DTYPES))}, "
                             f"got {self.dtype!r}")

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """``(num_layers, 2, page_size, num_kv_heads, head_dim)``."""
        return (self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def page_numel(self) -> int:
        """Elements in one page."""
        return math.prod(self.page_shape)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes in one page."""
        return self.page_numel * self.itemsize

    def to_spec(self) -> LayoutSpec:
        """This layout as a wire struct."""
        return LayoutSpec(self.num_layers, self.num_kv_heads, self.head_dim, self.page_size,
                          str(self.dtype).removeprefix("torch."))

    @classmethod
    def from_spec(cls, spec: LayoutSpec) -> KVLayout:
        """Raises ValueError for an unknown dtype name or invalid sizes."""
        if spec.dtype not in _DTYPES:
            raise ValueError(f"unknown KV dtype {spec.dtype!r}")
        return cls(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.page_size,
                   _DTYPES[spec.dtype])

