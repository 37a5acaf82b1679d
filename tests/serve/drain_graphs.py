"""Graphs the drain tests serve: streams that run until they are cut, a stream that waits for
a gate file, and a chat graph (for the official client) that talks until it is cut. Each
notes in a file beside the gate that it started, so a test waits for that, never for time."""

from __future__ import annotations

import math
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import trio

import omni
from omni.serve.openai import ChatRequest, ChatStart, ChatText, chat_completions
from tests._wait import wait_until

GATE = Path(os.environ.get("OMNI_TEST_GATE", "/nonexistent-gate"))


def _started(name: str) -> None:
    (GATE.parent / f"started-{name}").touch()


@omni.node
async def endless(text: str) -> AsyncIterator[str]:
    """`text`-0, `text`-1, ... until cancelled."""
    _started(text)
    i = 0
    while True:
        yield f"{text}-{i}"
        i += 1
        await trio.lowlevel.checkpoint()


@omni.node
async def gated(text: str) -> AsyncIterator[str]:
    """"before", then "after" once the gate file exists."""
    yield "before"
    _started(text)
    await wait_until(GATE.exists, "the gate file", cap=math.inf)
    yield "after"


@omni.node
async def talker(request: ChatRequest) -> AsyncIterator[Any]:
    """A reply that never ends: one word after another until cancelled."""
    yield ChatStart(prompt_tokens=1, cached_tokens=0)
    _started(str(request.messages[-1].parts[0]))
    while True:
        yield ChatText("word ")
        await trio.lowlevel.checkpoint()


@omni.graph
def forever(text: str):
    return endless(text)


@omni.graph
def waiting(text: str):
    return gated(text)


@chat_completions
@omni.graph
def talk(request: ChatRequest):
    return talker(request)
