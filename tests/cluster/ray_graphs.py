"""Graphs the ``--cluster ray`` tests run: where a replica runs (its Ray node's address and its
process), and big values both ways."""

from __future__ import annotations

import dataclasses
import hashlib
import os

import numpy as np
import trio

import omni

MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Shipment:
    """A big array with a dataclass's other fields beside it."""

    label: str
    array: np.ndarray
    reply_bytes: int


@dataclasses.dataclass(frozen=True)
class Receipt:
    node_ip: str
    pid: int
    label: str
    digest: str  # of the bytes the replica got
    reply: np.ndarray


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def digest(array: np.ndarray) -> str:
    return hashlib.blake2b(memoryview(np.ascontiguousarray(array)).cast("B"),
                           digest_size=16).hexdigest()


@omni.node(resources={"node_b": 1})
class OnNodeB:
    """Pinned by the custom resource of the Ray node started with ``node_b``."""

    async def __call__(self, shipment: Shipment) -> Receipt:
        reply = np.full(shipment.reply_bytes, 7, np.uint8)
        return Receipt(node_ip(), os.getpid(), shipment.label, digest(shipment.array), reply)


@omni.graph
def ship(shipment: Shipment) -> Receipt:
    return OnNodeB()(shipment)


@omni.node(replicas=2)
class Where:
    """Where a call ran: (Ray node address, pid), after a short wait (calls overlap)."""

    async def __call__(self, i: int) -> list:
        await trio.sleep(0.02)
        return [node_ip(), os.getpid(), i]


@omni.graph
def where(i: int) -> list:
    return Where()(i)


@omni.node(resources={"node_c": 1})
class OnNodeC:
    """Pinned to a Ray node that joins while the driver runs."""

    async def __call__(self, i: int) -> str:
        return node_ip()


@omni.graph
def on_node_c(i: int) -> str:
    return OnNodeC()(i)


@omni.node(resources={"node_b": 1})
class BadWeights:
    """A replica that cannot start on its Ray node: its constructor raises, as a model's does
    for a wrong weights path."""

    def __init__(self) -> None:
        raise ValueError("bad weights path")

    async def __call__(self, i: int) -> int:
        return i


@omni.graph
def bad_weights(i: int) -> int:
    return BadWeights()(i)
