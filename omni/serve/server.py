"""Run the app on hypercorn's trio worker, inside the caller's trio program.

`serve` binds, reports the URL, answers until `stop` is set, then drains: it refuses new
requests (503), lets the ones in flight finish for up to `drain_timeout` seconds and cancels
what is left (which releases their KV leases), and returns.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from omni.graph.dsl import Graph
from omni.serve._files import FilePolicy
from omni.serve._guard import GuardState
from omni.serve.app import build_app
from omni.serve.openai import MediaPolicy

__all__ = ["DRAIN_TIMEOUT_S", "serve"]

DRAIN_TIMEOUT_S = 30.0


async def serve(runtime: Any, graphs: Mapping[str, Graph], stop: trio.Event, *,
                host: str = "127.0.0.1", port: int = 8000, state: GuardState | None = None,
                drain_timeout: float = DRAIN_TIMEOUT_S, metrics_app: Any = None,
                on_ready: Callable[[str], None] | None = None,
                media: MediaPolicy | None = None, files: FilePolicy | None = None) -> None:
    """Serve `graphs` on `runtime` at ``http://host:port`` until `stop` is set, then drain.

    Args:
        port: 0 takes a free port; `on_ready` gets the URL actually bound.
        state: the API key and limits (see `GuardState`).
        drain_timeout: seconds in-flight requests get to finish once `stop` is set.
        media: what the OpenAI chat endpoint takes of a message's media (`MediaPolicy`).
        files: the policy for graphs' file inputs (see `FilePolicy`).

    Raises:
        OSError: the address cannot be bound (in use, not this machine's).
    """
    state = state or GuardState()
    app = build_app(runtime, graphs, state, metrics_app=metrics_app,
                    media=media, files=files)
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.graceful_timeout = drain_timeout
    config.loglevel = "WARNING"  # the command prints its own one-line start
    config.accesslog = None
    logging.getLogger("hypercorn.error").setLevel(logging.WARNING)

    async def shutdown_trigger() -> None:
        await stop.wait()
        state.draining = True

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(_serve, app, config, shutdown_trigger)
        if on_ready is not None:
            on_ready(binds[0])


async def _serve(app: Any, config: Config, shutdown_trigger: Callable[[], Any],
                 task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    await hypercorn_serve(app, config, shutdown_trigger=shutdown_trigger,
                          task_status=task_status)
