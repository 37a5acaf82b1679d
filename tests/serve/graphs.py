"""Graphs the core serving tests serve: an echo, a stream, a request that waits for a gate,
and nodes that fail as a client's mistake and as the server's."""

from __future__ import annotations

import math
import os
from collections.abc import AsyncIterator
from pathlib import Path

import trio

import omni
from tests._wait import wait_until

GATE = Path(os.environ.get("OMNI_TEST_GATE", "/nonexistent-gate"))  # `held` waits for it


@omni.node
async def shout(text: str) -> str:
    return text.upper() + "!"


@omni.node
async def count(n: int) -> AsyncIterator[int]:
    for i in range(n):
        yield i
        await trio.sleep(0)


@omni.node
async def hold(text: str) -> str:
    """Waits until the gate file exists (or the request is cancelled); notes both in files."""
    (GATE.parent / f"started-{text}").touch()
    try:
        await wait_until(GATE.exists, "the gate file", cap=math.inf)
    except trio.Cancelled:
        (GATE.parent / f"cancelled-{text}").touch()
        raise
    return text


@omni.node
async def refuse(text: str) -> str:
    raise ValueError(f"cannot take {text!r}")


@omni.node
async def crash(text: str) -> str:
    raise RuntimeError("the node broke")


@omni.graph
def echo(text: str):
    return shout(text)


@omni.graph
def numbers(n: int):
    return {"first": shout("go"), "items": count(n)}


@omni.graph
def held(text: str):
    return hold(text)


@omni.graph
def refused(text: str):
    return refuse(text)


@omni.graph
def crashed(text: str):
    return crash(text)
