"""`perf/serve.py`'s servers: the no-op graph ``omni serve`` serves, and, run as a script, the
same server stack answering a constant (a runtime that returns the input at once)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import trio

import omni


@omni.node
async def same(x: int) -> int:
    return x


@omni.graph
def noop(x: int):
    return same(x)


class ConstantRuntime:
    """Answers every request with its input, without running a graph."""

    async def run(self, graph: Any, /, **inputs: Any) -> Any:
        return inputs["x"]


async def _serve_constant() -> None:
    from omni.serve import serve

    def ready(url: str) -> None:
        sys.stderr.write(f"omni serve: {url}  graphs: noop (constant)\n")
        sys.stderr.flush()

    stop = trio.Event()
    with trio.open_signal_receiver(2, 15) as signals:
        async with trio.open_nursery() as nursery:

            async def stop_on_signal() -> None:
                async for _ in signals:
                    stop.set()
                    return

            nursery.start_soon(stop_on_signal)
            await serve(ConstantRuntime(), {"noop": noop}, stop, port=0, on_ready=ready)
            nursery.cancel_scope.cancel()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    trio.run(_serve_constant)
