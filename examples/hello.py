"""The smallest Omni pipeline: fan-out, a switch, a stateful replicated node and a stream.

    omni run examples/hello.py --input text="omni runs pipelines"
    omni graph show examples/hello.py --format mermaid
"""

from collections.abc import AsyncIterator

import omni


@omni.node
async def upper(text: str) -> str:
    return text.upper()


@omni.node
async def classify(text: str) -> str:
    return "short" if len(text.split()) <= 3 else "long"


@omni.node
async def shout(text: str) -> str:
    return text + "!"


@omni.node
async def summarize(text: str) -> str:
    first, *rest = text.split()
    return f"{first} (+{len(rest)} words)"


@omni.node(replicas=2, balance="least_loaded")
class Greeter:
    """A stateful node: one instance per replica, built when the runtime starts."""

    def __init__(self, greeting: str = "hello") -> None:
        self.greeting = greeting
        self.replica = omni.context().replica

    async def __call__(self, text: str) -> str:
        return f"{self.greeting} from replica {self.replica}: {text}"


@omni.node
async def words(text: str) -> AsyncIterator[str]:
    for word in text.split():
        yield word


@omni.graph
def hello(text: str):
    loud = upper(text)
    kind = classify(loud)
    reply = omni.switch(kind, {"short": shout, "long": summarize}, loud)
    return {"reply": reply, "greeting": Greeter()(text), "words": words(text)}
