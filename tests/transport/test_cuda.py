"""CUDA tensors between processes: by CUDA IPC handle on one host (the receiver maps the
sender's device memory), else through host memory and back onto the device.

The tests that need a GPU run only where torch sees one; the others check, everywhere, what
a process without CUDA does with what a GPU process sends it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import msgspec
import pytest
import torch

from omni.transport import values
from omni.transport.cuda import CudaHandle
from omni.transport.errors import WireError
from omni.transport.values import pack_value, unpack_value


def _tensor_header_for(device: str, tensor: torch.Tensor) -> bytes:
    """The body a GPU process sends for `tensor` on `device` through host memory."""
    data = tensor.numpy().tobytes()
    header = values._Array("float32", list(tensor.shape), list(range(tensor.dim())), False, -1,
                           data, device)
    return msgspec.msgpack.encode(msgspec.msgpack.Ext(values._TENSOR,
                                                      msgspec.msgpack.encode(header)))


def test_a_cuda_tensor_sent_through_host_memory_arrives_on_its_device_where_there_is_one():
    sent = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    out = unpack_value(_tensor_header_for("cuda:0", sent))
    assert out.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert torch.equal(out.cpu(), sent)


def test_a_cuda_ipc_handle_that_cannot_open_here_is_a_wire_error_naming_why():
    handle = CudaHandle("float32", [4], [1], 0, "GPU-00000000-0000-0000-0000-000000000000",
                        b"\x00" * 64, 16, 0, b"ref", 0, b"", False)
    body = msgspec.msgpack.encode(msgspec.msgpack.Ext(values._CUDA,
                                                      msgspec.msgpack.encode(handle)))
    expected = "does not see" if torch.cuda.is_available() else "no CUDA device"
    with pytest.raises(WireError, match=expected):
        unpack_value(body)
    with pytest.raises(WireError):  # a handle that is not one
        unpack_value(msgspec.msgpack.encode(msgspec.msgpack.Ext(values._CUDA, b"\x93\x01")))


@pytest.mark.gpu
def test_a_cuda_tensor_by_ipc_handle_maps_the_senders_memory_in_another_process():
    """The receiver's tensor is the sender's memory: what it writes, the sender reads."""
    sent = torch.arange(1 << 20, dtype=torch.float32, device="cuda").reshape(1024, 1024).t()
    packed = pack_value(sent, cuda_ipc=True)
    assert packed.buffers == []  # no byte leaves the device
    code = textwrap.dedent("""
        import sys, torch
        from omni.transport.values import unpack_value
        got = unpack_value(sys.stdin.buffer.read())
        assert got.is_cuda and got.shape == (1024, 1024) and got.stride() == (1, 1024), got
        assert float(got[3, 2]) == 2 * 1024 + 3
        got[0, 0] = -7.0
        torch.cuda.synchronize()
        print("ok", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", code], input=packed.body,
                          capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert float(sent[0, 0]) == -7.0


@pytest.mark.gpu
def test_without_ipc_a_cuda_tensor_round_trips_through_host_memory():
    sent = torch.randn(64, 64, device="cuda")
    packed = pack_value(sent, cuda_ipc=False)
    out = unpack_value(packed.body, packed.buffers)
    assert out.is_cuda and torch.equal(out, sent)
