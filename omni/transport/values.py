"""Values that cross between processes: a node's arguments and results.

msgpack through msgspec, never pickle: ``None``, booleans, numbers, strings, bytes, lists,
dicts, and, as msgpack extension types, torch tensors and numpy arrays (dtype, shape and raw
bytes; copied once on arrival). Tuples arrive as lists; dataclasses and msgspec Structs arrive
as dicts of their fields. Anything else is refused with a `TypeError` naming its type, so a
value that cannot travel is found where it is sent, not garbled where it arrives.
"""

from __future__ import annotations

import math
import struct
import sys
from typing import Any

import msgspec

from omni.transport.errors import WireError

__all__ = ["decode_value", "encode_value"]

_TENSOR, _NDARRAY = 1, 2
_HEADER = struct.Struct("<I")  # the length of the (dtype, shape) header before the bytes
_header = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(tuple[str, list[int]])


def _enc_hook(obj: Any) -> Any:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return msgspec.msgpack.Ext(_TENSOR, _pack(dtype, list(t.shape), raw))
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.ndarray):
        a = numpy.ascontiguousarray(obj)
        if a.dtype.hasobject:
            raise TypeError("a numpy array of Python objects cannot travel between processes")
        return msgspec.msgpack.Ext(_NDARRAY, _pack(a.dtype.str, list(a.shape), a.tobytes()))
    raise TypeError(f"a value of type {type(obj).__qualname__} cannot travel between processes "
                    "(send str, bytes, numbers, lists, dicts, tensors or numpy arrays)")


def _pack(dtype: str, shape: list[int], raw: bytes) -> bytes:
    header = _header.encode((dtype, shape))
    return _HEADER.pack(len(header)) + header + raw


def _ext_hook(code: int, data: memoryview) -> Any:
    if code not in (_TENSOR, _NDARRAY) or len(data) < _HEADER.size:
        raise WireError(f"unknown value extension {code}")
    (size,) = _HEADER.unpack_from(data)
    dtype, shape = _header_decoder.decode(data[_HEADER.size:_HEADER.size + size])
    raw = bytearray(data[_HEADER.size + size:])
    import numpy

    if code == _NDARRAY:
        array = numpy.frombuffer(raw, dtype=numpy.dtype(dtype))
        return array.reshape(shape)
    import torch

    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise WireError(f"unknown tensor dtype {dtype!r}")
    if not raw:  # only an empty tensor comes without bytes: never uninitialised memory
        if math.prod(shape) != 0:
            raise WireError(f"a tensor of shape {shape} arrived without its bytes")
        return torch.empty(shape, dtype=torch_dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(torch_dtype).reshape(shape)


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoder = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


def encode_value(value: Any) -> bytes:
    """`value` as bytes.

    Raises:
        TypeError: the value (or something inside it) cannot travel; the message names it.
    """
    return _encoder.encode(value)


def decode_value(data: Any) -> Any:
    """The value `encode_value` made.

    Raises:
        WireError: the bytes are not such a value.
    """
    try:
        return _decoder.decode(data)
    except WireError:
        raise
    except (msgspec.DecodeError, ValueError, TypeError, RuntimeError) as exc:
        raise WireError(f"a value does not decode: {exc}") from None
