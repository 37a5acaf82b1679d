"""Values that cross between processes: a node's arguments, results and stream items.

msgpack through msgspec, never pickle. A value arrives as the type it left as:

- ``None``, booleans, numbers, strings, bytes, lists and dicts as themselves; tuples, sets and
  frozensets as tuples, sets and frozensets;
- dataclasses, msgspec Structs and enums as the same class, looked up by module and qualified
  name among the modules this process has loaded (`types`; a class node's module shipped to a
  worker is registered under the sender's name). A dataclass is rebuilt from its fields
  without calling ``__init__``, as it was, frozen or not;
- torch tensors and numpy arrays with their dtype, shape and strides (C order, Fortran order
  or any permutation of axes; a view with gaps or negative strides arrives compact in the same
  axis order) and their read-only flag; a CUDA tensor arrives on the same device: with
  ``cuda_ipc`` (the receiver shares the host) by CUDA IPC handle, mapping the sender's memory
  (`omni.transport.cuda`), else through host memory, moved back to the device where the
  receiver has it (a receiver without CUDA gets it in host memory);
- async iterators (streams) as a stream id the caller maps (`pack_value`'s ``streams``).

Arrays of `oob_min` bytes or more travel *out of band*: the body holds a reference, and the
bytes are handed to the caller as one buffer each (`Packed.buffers`), to move by whatever path
suits the locality (`omni.transport.movers`) without ever being copied into the body. Smaller
ones are inline.

Anything else is refused with a `TypeError` naming its type and where it sits in the value, so
a value that cannot travel is found where it is sent, not garbled where it arrives.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import math
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import msgspec

from omni.transport.errors import WireError

__all__ = ["OOB_MIN", "Packed", "TypeRegistry", "cannot_travel", "decode_value", "encode_value",
           "pack_value", "types", "unpack_value"]

OOB_MIN = 64 << 10  # arrays this large go out of band (pyzmq copies smaller frames anyway)

_TENSOR, _NDARRAY, _TUPLE, _OBJECT, _STREAM, _SET, _FROZENSET, _NPSCALAR, _PAIRS, _CUDA = \
    range(1, 11)
_DATACLASS, _STRUCT, _ENUM = 0, 1, 2
_SCALARS = frozenset((str, int, float, bool, type(None), bytes))


class Packed(NamedTuple):
    """An encoded value: the msgpack body and the out-of-band buffers its arrays refer to."""

    body: bytes
    buffers: list[memoryview]


class _Array(msgspec.Struct, array_like=True, frozen=True):
    """How an array's bytes become the array again: ``order`` lists the axes from the
    slowest-varying in memory to the fastest (the identity for C order)."""

    dtype: str
    shape: list[int]
    order: list[int]
    readonly: bool
    buffer: int  # index into the out-of-band buffers, or -1: the bytes follow inline
    data: bytes = b""
    device: str = ""  # a tensor's device when not the CPU ("cuda:1")


_array_decoder = msgspec.msgpack.Decoder(_Array)
_object_header = msgspec.msgpack.Decoder(tuple[int, str, str])


# -- types by name ---------------------------------------------------------------------------


class TypeRegistry:
    """Classes by (module, qualified name), for dataclasses, Structs and enums that travel.

    Why: a class node's module is loaded on a worker from shipped source, possibly under
    another module name than the driver's; `alias` records the sender's name for it, so that
    types resolve in both directions. Only modules already loaded in this process (or
    submodules of loaded packages) are searched: nothing from the network picks code to run.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._modules: dict[str, Any] = {}  # a sender's module name -> the module here
        self._names: dict[str, str] = {}  # a module's name here -> the sender's name

    def alias(self, name: str, module: Any) -> None:
        """Resolve `name` (as the sender calls it) to `module`, and call the module `name`."""
        with self._lock:
            self._modules[name] = module
            self._names[module.__name__] = name

    def name_of(self, cls: type) -> tuple[str, str]:
        return self._names.get(cls.__module__, cls.__module__), cls.__qualname__

    def resolve(self, module_name: str, qualname: str) -> type:
        module = self._modules.get(module_name) or sys.modules.get(module_name)
        if module is None and "." in module_name and module_name.split(".")[0] in sys.modules:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                module = None
        obj: Any = module
        for part in qualname.split("."):
            obj = getattr(obj, part, None)
        if not isinstance(obj, type):
            raise WireError(f"type {module_name}.{qualname} is not known in this process "
                            "(its module is not loaded here)")
        return obj


types = TypeRegistry()


# -- encoding --------------------------------------------------------------------------------


def _place(where: Any) -> str:
    """A place in a value as `_Lowering.lower` keeps it, spelled out: ``value[0].name``
    (a place is the root's name, or (the parent's place, an index, key or field name, whether
    it is a field))."""
    parts = []
    while type(where) is tuple:
        where, key, field = where
        parts.append(f".{key}" if field else f"[{key!r}]")
    return where + "".join(reversed(parts))


class _Lowering:
    """One encode: turns a value into msgpack-native data, collecting out-of-band buffers."""

    def __init__(self, oob_min: int | None, streams: Callable[[Any], int] | None,
                 cuda_ipc: bool):
        self.oob_min = oob_min
        self.streams = streams
        self.cuda_ipc = cuda_ipc
        self.buffers: list[memoryview] = []

    def lower(self, value: Any, where: Any) -> Any:
        """`value` lowered; `where` is its place in the whole value, as `_place` spells it
        (built only when something cannot travel: this runs for every value sent)."""
        kind = type(value)
        if kind in _SCALARS:
            return value
        if kind is list:
            for x in value:  # (a loop: cheaper than all() over a generator, on short lists)
                if type(x) not in _SCALARS:
                    return [self.lower(x, (where, i, False)) for i, x in enumerate(value)]
            return value
        if kind is dict:
            if not value:
                return value
            if all(type(k) in _SCALARS for k in value):
                return {k: self.lower(v, (where, k, False)) for k, v in value.items()}
            pairs = [(k, v) for k, v in value.items()]  # keys that msgpack maps cannot hold
            return self._nested(_PAIRS, pairs, where)
        if kind is tuple:
            return self._nested(_TUPLE, value, where)
        if kind is set or kind is frozenset:
            return self._nested(_SET if kind is set else _FROZENSET, value, where)
        return self._special(value, where)

    def _nested(self, code: int, items: Any, where: Any) -> msgspec.msgpack.Ext:
        lowered = [self.lower(x, (where, i, False)) for i, x in enumerate(items)]
        return msgspec.msgpack.Ext(code, _plain.encode(lowered))

    def _special(self, value: Any, where: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(value, torch.Tensor):
            return self._tensor(value)
        numpy = sys.modules.get("numpy")
        if numpy is not None and isinstance(value, numpy.ndarray):
            if value.dtype.hasobject:
                raise TypeError(f"{_place(where)}: a numpy array of Python objects cannot travel "
                                "between processes")
            return self._array(_NDARRAY, value, value.dtype.str, not value.flags.writeable)
        if numpy is not None and isinstance(value, numpy.generic) and not isinstance(
                value, numpy.object_):
            return self._array(_NPSCALAR, numpy.asarray(value), value.dtype.str, False)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = {f.name: self.lower(getattr(value, f.name), (where, f.name, True))
                      for f in dataclasses.fields(value)}
            return self._object(_DATACLASS, type(value), fields)
        if isinstance(value, msgspec.Struct):
            fields = {name: self.lower(getattr(value, name), (where, name, True))
                      for name in value.__struct_fields__}
            return self._object(_STRUCT, type(value), fields)
        if isinstance(value, enum.Enum):
            return self._object(_ENUM, type(value), self.lower(value.value, where))
        if hasattr(value, "__aiter__"):
            if self.streams is None:
                raise TypeError(f"{_place(where)}: a stream can travel only as a node's "
                                "argument")
            return msgspec.msgpack.Ext(_STREAM, _plain.encode(self.streams(value)))
        raise TypeError(f"{_place(where)}: a value of type {type(value).__qualname__} cannot "
                        "travel between processes (send str, bytes, numbers, lists, tuples, "
                        "dicts, dataclasses, msgspec Structs, enums, tensors or numpy arrays)")

    def _object(self, kind: int, cls: type, fields: Any) -> msgspec.msgpack.Ext:
        module, qualname = types.name_of(cls)
        if "<locals>" in qualname:
            raise TypeError(f"{qualname} is defined inside a function: only classes defined "
                            "at a module's top level can travel between processes")
        return msgspec.msgpack.Ext(_OBJECT, _plain.encode(((kind, module, qualname), fields)))

    def _tensor(self, tensor: Any) -> msgspec.msgpack.Ext:
        import torch

        t = tensor.detach()
        device = "" if t.device.type == "cpu" else str(t.device)
        if device.startswith("cuda") and self.cuda_ipc:
            from omni.transport.cuda import cuda_ipc_enabled, share

            if cuda_ipc_enabled():
                return msgspec.msgpack.Ext(_CUDA, _plain.encode(share(t)))
        if device:
            t = t.cpu()
        dtype = str(t.dtype).removeprefix("torch.")
        order = list(range(t.dim())) if t.is_contiguous() else _order(list(t.stride()),
                                                                          list(t.shape))
        dense = t.permute(order)
        if not dense.is_contiguous():
            dense = dense.contiguous()
        raw = dense.reshape(-1).view(torch.uint8).numpy() if dense.numel() else None
        return self._pack_array(_TENSOR, dtype, list(dense.shape), order, False, raw, device)

    def _array(self, code: int, array: Any, dtype: str, readonly: bool) -> msgspec.msgpack.Ext:
        import numpy

        order = list(range(array.ndim)) if array.flags.c_contiguous else \
            _order(list(array.strides), list(array.shape))
        dense = array.transpose(order)
        if not dense.flags.c_contiguous:
            dense = numpy.ascontiguousarray(dense)
        raw = dense.reshape(-1).view(numpy.uint8) if dense.size else None
        return self._pack_array(code, dtype, list(dense.shape), order, readonly, raw)

    def _pack_array(self, code: int, dtype: str, shape: list[int], order: list[int],
                    readonly: bool, raw: Any, device: str = "") -> msgspec.msgpack.Ext:
        nbytes = 0 if raw is None else raw.nbytes
        if raw is not None and self.oob_min is not None and nbytes >= self.oob_min:
            self.buffers.append(memoryview(raw).cast("B"))
            header = _Array(dtype, shape, order, readonly, len(self.buffers) - 1, b"", device)
        else:
            data = b"" if raw is None else raw.tobytes()
            header = _Array(dtype, shape, order, readonly, -1, data, device)
        return msgspec.msgpack.Ext(code, _plain.encode(header))


def _order(strides: list[int], shape: list[int]) -> list[int]:
    """The axes from the largest stride to the smallest (size-1 axes last, ties in place):
    transposing by it gives a C-contiguous array when the memory has no gaps."""
    return sorted(range(len(shape)), key=lambda a: -abs(strides[a]) if shape[a] > 1 else 0)


_plain = msgspec.msgpack.Encoder()


def pack_value(value: Any, *, oob_min: int | None = OOB_MIN,
               streams: Callable[[Any], int] | None = None, cuda_ipc: bool = False) -> Packed:
    """`value` as a body and out-of-band buffers.

    Args:
        oob_min: arrays of this many bytes or more go out of band (None: all inline).
        streams: gives the id of each async iterator found in the value (None: refused).
        cuda_ipc: the receiver is on this host: CUDA tensors go by CUDA IPC handle, unless
            ``OMNI_CUDA_IPC=0`` (`cuda_ipc_enabled`, looked up only when one is found).

    Raises:
        TypeError: the value (or something inside it) cannot travel; the message names it.
    """
    lowering = _Lowering(oob_min, streams, cuda_ipc)
    body = _plain.encode(lowering.lower(value, "value"))
    return Packed(body, lowering.buffers)


def encode_value(value: Any) -> bytes:
    """`value` as one self-contained body (arrays inline). Raises `TypeError` like
    `pack_value`."""
    return pack_value(value, oob_min=None).body


def cannot_travel(annotation: Any) -> str | None:
    """Why a value annotated `annotation` cannot travel between processes, or None if it can
    (or may: ``Any`` and unannotated values are checked when they are sent).

    Plain data, containers of what can travel, dataclasses, Structs, enums, tensors, arrays and
    async iterators of what can travel can; so can a plain class whose subclasses are
    dataclasses or Structs (a base of the values actually sent). Callables, and classes that
    are none of these, cannot.
    """
    import collections.abc as abc
    import typing

    if annotation is Any or annotation is None or annotation is type(None) \
            or isinstance(annotation, (str, typing.TypeVar)):
        return None
    origin = typing.get_origin(annotation)
    if origin is not None:
        if origin is abc.Callable:
            return f"{_type_name(annotation)} is a callable"
        if origin is typing.Literal:
            return None
        for arg in typing.get_args(annotation):
            if arg is not Ellipsis and (reason := cannot_travel(arg)) is not None:
                return reason
        return None
    if not isinstance(annotation, type):
        return None  # e.g. a NewType or a string left unresolved: checked when sent
    if annotation in _SCALARS or annotation in (list, dict, tuple, set, frozenset, object):
        return None
    if issubclass(annotation, (abc.AsyncIterator, abc.AsyncIterable, enum.Enum, msgspec.Struct)):
        return None
    if dataclasses.is_dataclass(annotation):
        if "<locals>" in annotation.__qualname__:
            return f"{annotation.__qualname__} is defined inside a function"
        return None
    module = annotation.__module__.split(".")[0]
    if module in ("torch", "numpy") and annotation.__name__ in ("Tensor", "ndarray"):
        return None
    if any(dataclasses.is_dataclass(c) or issubclass(c, msgspec.Struct)
           for c in _subclasses(annotation)):
        return None
    return (f"{_type_name(annotation)} is not plain data, a container, a dataclass, a msgspec "
            "Struct, an enum, a tensor or a numpy array")


def _subclasses(cls: type) -> list[type]:
    found, todo = [], list(cls.__subclasses__())
    while todo:
        sub = todo.pop()
        found.append(sub)
        todo.extend(sub.__subclasses__())
    return found


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__qualname__
    return str(annotation).replace("typing.", "")


# -- decoding --------------------------------------------------------------------------------


class _Raising:
    """One decode's out-of-band buffers and stream resolver, for the extension hook."""

    def __init__(self, buffers: Sequence[Any], streams: Callable[[int], Any] | None):
        self.buffers = buffers
        self.streams = streams
        self.used: set[int] = set()


_state = threading.local()


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == _TUPLE:
        return tuple(_decoder.decode(data))
    if code == _SET:
        return set(_decoder.decode(data))
    if code == _FROZENSET:
        return frozenset(_decoder.decode(data))
    if code == _PAIRS:
        return dict(_decoder.decode(data))
    if code in (_TENSOR, _NDARRAY, _NPSCALAR):
        return _raise_array(code, _array_decoder.decode(data))
    if code == _CUDA:
        from omni.transport.cuda import CudaHandle, open_handle

        return open_handle(msgspec.msgpack.decode(data, type=CudaHandle))
    if code == _OBJECT:
        return _raise_object(data)
    if code == _STREAM:
        state: _Raising | None = getattr(_state, "current", None)
        if state is None or state.streams is None:
            raise WireError("a stream arrived where none can be")
        stream_id = _decoder.decode(data)
        if not isinstance(stream_id, int):
            raise WireError("a stream id is not an integer")
        return state.streams(stream_id)
    raise WireError(f"unknown value extension {code}")


def _raise_object(data: memoryview) -> Any:
    header, fields = _decoder.decode(data)
    kind, module, qualname = _object_header.decode(_plain.encode(header))
    cls = types.resolve(module, qualname)
    if kind == _ENUM and issubclass(cls, enum.Enum):
        return cls(fields)
    if not isinstance(fields, dict):
        raise WireError(f"the fields of {qualname} are not a map")
    if kind == _STRUCT and issubclass(cls, msgspec.Struct):
        return cls(**fields)
    if kind == _DATACLASS and dataclasses.is_dataclass(cls):
        names = {f.name for f in dataclasses.fields(cls)}
        if set(fields) != names:
            raise WireError(f"{qualname} arrived with fields {sorted(fields)}, expected "
                            f"{sorted(names)} (do both sides run the same code?)")
        obj = cls.__new__(cls)
        for name, value in fields.items():
            object.__setattr__(obj, name, value)  # as it was: no __init__, frozen or not
        return obj
    raise WireError(f"{module}.{qualname} is not the kind of class it was sent as")


def _raise_array(code: int, header: _Array) -> Any:
    import numpy

    shape, order = header.shape, header.order
    if any(n < 0 for n in shape) or sorted(order) != list(range(len(shape))):
        raise WireError(f"an array header has shape {shape} and axis order {order}")
    if header.buffer >= 0:
        raw = _buffer(header.buffer)
    else:
        raw = numpy.frombuffer(bytearray(header.data), numpy.uint8)  # writable, owned
    if code != _TENSOR:
        dtype = numpy.dtype(header.dtype)
        if dtype.hasobject:
            raise WireError("an array of Python objects cannot arrive")
        _check_size(raw, math.prod(shape) * dtype.itemsize, shape)
        array = raw.view(dtype).reshape(shape) if math.prod(shape) else \
            numpy.empty(shape, dtype)
        array = array.transpose(numpy.argsort(order))
        if header.readonly:
            array.setflags(write=False)
        return array[()] if code == _NPSCALAR else array
    import torch

    dtype = getattr(torch, header.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise WireError(f"unknown tensor dtype {header.dtype!r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    _check_size(raw, math.prod(shape) * itemsize, shape)
    if not math.prod(shape):
        tensor = torch.empty(shape, dtype=dtype)
    else:
        tensor = torch.from_numpy(raw).view(dtype).reshape(shape)
    tensor = tensor.permute(numpy.argsort(order).tolist())
    return _on_device(tensor, header.device) if header.device else tensor


def _on_device(tensor: Any, device: str) -> Any:
    """`tensor` moved to `device` (a CUDA device this process has), else left in host memory."""
    import torch

    try:
        target = torch.device(device)
    except RuntimeError:
        raise WireError(f"a tensor arrived for device {device!r}") from None
    if target.type == "cuda" and torch.cuda.is_available() \
            and (target.index or 0) < torch.cuda.device_count():
        return tensor.to(target)
    return tensor


def _buffer(index: int) -> Any:
    import numpy

    state: _Raising | None = getattr(_state, "current", None)
    if state is None or not 0 <= index < len(state.buffers) or index in state.used:
        raise WireError(f"an array refers to out-of-band buffer {index}, which did not arrive")
    state.used.add(index)
    buffer = state.buffers[index]
    return buffer if isinstance(buffer, numpy.ndarray) else numpy.frombuffer(buffer, numpy.uint8)


def _check_size(raw: Any, expected: int, shape: list[int]) -> None:
    if raw.nbytes != expected:
        raise WireError(f"an array of shape {shape} arrived with {raw.nbytes} bytes, "
                        f"expected {expected}")


_decoder = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


def unpack_value(body: Any, buffers: Sequence[Any] = (), *,
                 streams: Callable[[int], Any] | None = None) -> Any:
    """The value `pack_value` made, its arrays viewing `buffers` (no copy).

    Args:
        buffers: the out-of-band buffers, in order (writable ones give writable arrays).
        streams: maps a stream id to the async iterator that stands for it here.

    Raises:
        WireError: the bytes are not such a value, or refer to what did not arrive.
    """
    previous = getattr(_state, "current", None)
    _state.current = _Raising(buffers, streams)
    try:
        return _decoder.decode(body)
    except WireError:
        raise
    except (msgspec.DecodeError, ValueError, TypeError, RuntimeError, AttributeError) as exc:
        raise WireError(f"a value does not decode: {exc}") from None
    finally:
        _state.current = previous


def decode_value(data: Any) -> Any:
    """The value `encode_value` made. Raises `WireError` like `unpack_value`."""
    return unpack_value(data)
