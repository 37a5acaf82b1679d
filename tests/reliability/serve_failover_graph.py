"""The chat graph the served failover tests run with `omni serve --cluster` (hand-joined or
Ray): a class node with one replica on a worker streams each reply (the graph's events cross
from the worker to the server item by item).

A message is ``FOLDER NAME``: the test's folder (a Ray actor's current folder is Ray's, so the
folder travels in the request) and the reply's name. The node notes each reply it starts in
`SERVED` there (``started NAME WORKER PID``). While `HOLD` exists there, each call notes
``holding NAME WORKER PID`` after its first event and waits until the file is gone (or its
worker is killed): a test kills the worker with streams that have passed items on in flight
on it, by condition, not by timing. Up to `IN_FLIGHT` calls run at once on the one replica.
"""

from __future__ import annotations

import math
import os
from collections.abc import AsyncIterator
from pathlib import Path

import omni
from omni.serve.openai import ChatEnd, ChatRequest, ChatStart, ChatText, chat_completions
from tests._wait import wait_until

HOLD = "hold"
SERVED = "served"
IN_FLIGHT = 8


def notes(folder: Path, what: str) -> list[tuple[str, str, int]]:
    """(name, worker, pid) of each line the node wrote in `folder` that starts with `what`."""
    path = folder / SERVED
    lines = path.read_text().splitlines() if path.exists() else []
    return [(name, worker, int(pid)) for kind, name, worker, pid in map(str.split, lines)
            if kind == what]


@omni.node(concurrency=IN_FLIGHT)
class Talk:
    async def __call__(self, request: ChatRequest) -> AsyncIterator[object]:
        worker = omni.context().runtime.name
        folder, name = "".join(request.messages[-1].parts).split()
        hold = Path(folder) / HOLD

        def note(kind: str) -> None:
            with open(Path(folder) / SERVED, "a") as f:
                f.write(f"{kind} {name} {worker} {os.getpid()}\n")

        note("started")
        yield ChatStart(1, 0)
        if hold.exists():
            note("holding")
            await wait_until(lambda: not hold.exists(), "the hold file gone", cap=math.inf)
        yield ChatText(f"{name} from {worker}")
        yield ChatEnd("stop", 1)


@chat_completions
@omni.graph
def talk(request: ChatRequest):
    return Talk()(request)
