"""A chat graph whose reply waits for a gate file after its first event (noting that it waits
in a file beside the gate): a test looks at what a request holds while its reply is under
way."""

from __future__ import annotations

import math
import os
from collections.abc import AsyncIterator
from pathlib import Path

import omni
from omni.serve.openai import ChatEnd, ChatRequest, ChatStart, ChatText, chat_completions
from tests._wait import wait_until

GATE = Path(os.environ.get("OMNI_TEST_GATE", "/nonexistent-gate"))


@omni.node
async def wait_for_gate(request: ChatRequest) -> AsyncIterator[object]:
    yield ChatStart(prompt_tokens=1, cached_tokens=0)
    (GATE.parent / "waiting").touch()
    await wait_until(GATE.exists, "the gate file", cap=math.inf)
    yield ChatText("done")
    yield ChatEnd("stop", 1)


@chat_completions
@omni.graph
def held(request: ChatRequest):
    return wait_for_gate(request)
