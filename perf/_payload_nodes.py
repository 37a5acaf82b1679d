"""The nodes `perf/payloads.py` runs on its cluster workers (they load this file's source).

Each node class is pinned to one worker by name (``where=``): ``w1`` serves the single-call
measurements, ``w1``/``w2``/``w3`` the three stages of the pipeline, ``wtcp`` (started with
``OMNI_PAYLOAD_SHM=0``) the TCP-path measurement, ``wtcp_plain`` (the same, and
``OMNI_DATA_PLANE=plaintext``) its plaintext data plane. The bodies do as little as possible,
so that a call's time is the cost of moving its arguments and result: a payload's size, the
payload itself, or a fresh array of a given size.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import omni

__all__ = ["WORKERS", "Echo", "Hop1", "Hop2", "Hop3", "Make", "Size", "SizeTcp",
           "SizeTcpPlain", "Tiny", "chain"]

WORKERS = ("w1", "w2", "w3", "wtcp", "wtcp_plain")


class _Size:
    """Returns the byte size of the payload it was given (a numpy array or a torch tensor)."""

    async def __call__(self, value: Any) -> int:
        return int(value.nbytes)


class _Pass:
    """Returns what it was given."""

    async def __call__(self, value: Any) -> Any:
        return value


@omni.node(where="w1")
class Size(_Size):
    pass


@omni.node(where="wtcp")
class SizeTcp(_Size):
    pass


@omni.node(where="wtcp_plain")
class SizeTcpPlain(_Size):
    pass


@omni.node(where="w1")
class Echo(_Pass):
    pass


@omni.node(where="w1")
class Tiny(_Pass):
    pass


class _Make:
    """Returns a new float32 array of `nbytes` bytes, every element 1.5 (all pages touched).
    Synchronous, so it runs in a worker thread: filling a gigabyte on the event loop would
    stall the worker's heartbeats."""

    def __call__(self, nbytes: int) -> Any:
        return np.full(nbytes // 4, 1.5, dtype=np.float32)


@omni.node(where="w1")
class Make(_Make):
    pass


@omni.node(where="wtcp")
class MakeTcp(_Make):
    pass


class _Hop:
    """Returns what it was given; synchronous, as the Ray pipeline's actor methods are (a
    chain's stages of a synchronous node run on their worker's lane)."""

    def __call__(self, value: Any) -> Any:
        return value


@omni.node(where="w1")
class Hop1(_Hop):
    pass


@omni.node(where="w2")
class Hop2(_Hop):
    pass


@omni.node(where="w3")
class Hop3(_Hop):
    pass


@omni.graph
def chain(value: Any):
    """Three stages, one per worker: the value goes driver -> w1 -> w2 -> w3 -> driver."""
    return Hop3()(Hop2()(Hop1()(value)))
