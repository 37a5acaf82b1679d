"""CUDA tensors between processes of one host, by CUDA IPC handle: the receiver maps the
sender's device memory, and no byte is copied (`omni.transport.values` calls this for a CUDA
tensor when the receiver shares the host).

torch does the sharing (`torch.multiprocessing.reductions`: ``reduce_tensor`` on the way out,
``rebuild_cuda_tensor`` on the way in), including its reference counts: the sender's memory
stays allocated while a receiver holds the tensor, even after the sender dropped its own, as
long as the sending process lives. What travels is a `CudaHandle` (msgpack, never pickle),
and the device by its UUID, so that processes with different ``CUDA_VISIBLE_DEVICES`` agree
on which GPU it is. ``OMNI_CUDA_IPC=0`` sends CUDA tensors' bytes through host memory instead
(they arrive on the same device index where the receiver has it).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import msgspec

from omni.transport.errors import WireError

__all__ = ["CudaHandle", "cuda_ipc_enabled", "open_handle", "share"]


class CudaHandle(msgspec.Struct, array_like=True, frozen=True):
    """A CUDA tensor as its receiver opens it: the tensor's geometry, the device, and what
    torch's ``reduce_tensor`` gives for its storage."""

    dtype: str
    size: list[int]
    stride: list[int]
    offset: int  # elements into the storage
    device_uuid: str
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


def cuda_ipc_enabled() -> bool:
    """Whether CUDA tensors travel by IPC handle on one host (``OMNI_CUDA_IPC=0``: no)."""
    return os.environ.get("OMNI_CUDA_IPC", "").strip().lower() not in ("0", "false", "no", "off")


@functools.cache
def _uuids() -> tuple[str, ...]:
    import torch

    return tuple(str(torch.cuda.get_device_properties(i).uuid)
                 for i in range(torch.cuda.device_count()))


def share(tensor: Any) -> CudaHandle:
    """The handle of CUDA tensor `tensor` (detached) for a process of this host."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(tensor)
    (_, size, stride, offset, _, dtype, device, storage_handle, storage_size_bytes,
     storage_offset_bytes, _, ref_counter_handle, ref_counter_offset, event_handle,
     event_sync_required) = args
    return CudaHandle(
        str(dtype).removeprefix("torch."), list(size), list(stride), int(offset),
        _uuids()[device], bytes(storage_handle or b""), int(storage_size_bytes),
        int(storage_offset_bytes), bytes(ref_counter_handle or b""), int(ref_counter_offset),
        bytes(event_handle or b""), bool(event_sync_required))


def open_handle(handle: CudaHandle) -> Any:
    """The tensor `handle` stands for, mapped from its sender's memory.

    Raises:
        WireError: this process has no CUDA, or does not see the device, or the handle does
            not open.
    """
    import torch

    if not torch.cuda.is_available():
        raise WireError("a CUDA tensor arrived by IPC handle, but this process has no CUDA "
                        "device (run it where the sender's GPU is visible, or set "
                        "OMNI_CUDA_IPC=0 on the sender)")
    try:
        device = _uuids().index(handle.device_uuid)
    except ValueError:
        raise WireError(f"a CUDA tensor arrived from GPU {handle.device_uuid}, which this "
                        "process does not see (check CUDA_VISIBLE_DEVICES)") from None
    dtype = getattr(torch, handle.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise WireError(f"unknown tensor dtype {handle.dtype!r}")
    if len(handle.size) != len(handle.stride) or min([handle.offset, *handle.size,
                                                       *handle.stride]) < 0:
        raise WireError(f"a CUDA tensor handle has size {handle.size} and stride "
                        f"{handle.stride}")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size(handle.size), tuple(handle.stride), handle.offset,
            torch.storage.TypedStorage, dtype, device, handle.storage_handle or None,
            handle.storage_size_bytes, handle.storage_offset_bytes, False,
            handle.ref_counter_handle, handle.ref_counter_offset, handle.event_handle,
            handle.event_sync_required)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise WireError(f"a CUDA tensor handle does not open: {exc}") from None
