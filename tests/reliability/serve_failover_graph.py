"""The chat graph the served failover test runs with `omni serve --cluster`: a class node with
one replica on a worker streams each reply (the graph's events cross from the worker to the
server item by item).

The node notes each reply it starts in `SERVED` (in the workers' folder, ``started TEXT
WORKER``). While `HOLD` exists, each call notes ``holding TEXT WORKER`` after its first event
and waits until the file is gone (or its worker is killed): a test kills the worker with
streams that have passed items on in flight on it, by condition, not by timing. Up to
`IN_FLIGHT` calls run at once on the one replica.
"""

from __future__ import annotations

import math
import os
from collections.abc import AsyncIterator

import omni
from omni.serve.openai import ChatEnd, ChatRequest, ChatStart, ChatText, chat_completions
from tests._wait import wait_until

HOLD = "hold"
SERVED = "served"
IN_FLIGHT = 8


def _note(line: str) -> None:
    with open(SERVED, "a") as f:
        f.write(line + "\n")


@omni.node(concurrency=IN_FLIGHT)
class Talk:
    async def __call__(self, request: ChatRequest) -> AsyncIterator[object]:
        worker = omni.context().runtime.name
        text = "".join(request.messages[-1].parts)
        _note(f"started {text} {worker}")
        yield ChatStart(1, 0)
        if os.path.exists(HOLD):
            _note(f"holding {text} {worker}")
            await wait_until(lambda: not os.path.exists(HOLD), "the hold file gone",
                             cap=math.inf)
        yield ChatText(f"{text} from {worker}")
        yield ChatEnd("stop", 1)


@chat_completions
@omni.graph
def talk(request: ChatRequest):
    return Talk()(request)
