"""Run the app inside the caller's trio program, and drain it when told to stop.

`serve` binds, reports the URL and answers until `stop` is set. Then it drains: new requests
get 503 with ``Retry-After`` (the listener stays open to say so), connections waiting idle
are closed, and the requests in flight may finish for up to `drain_timeout` seconds. Those
still running then are cut: each is cancelled (which releases its KV leases) and told so, a
stream by a last ``error`` event (code ``server_shutdown``), a request not yet answered by a
503. `serve` returns as soon as no request is in flight, closing every connection; the
`GuardState` counts the requests that finished and those that were cut.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import trio
from hypercorn.config import Config

from omni.graph.dsl import Graph
from omni.serve._files import FilePolicy
from omni.serve._guard import GuardState
from omni.serve._http import http_server
from omni.serve.app import build_app
from omni.serve.openai import ChatPolicy, MediaPolicy

__all__ = ["DRAIN_TIMEOUT_S", "serve"]

DRAIN_TIMEOUT_S = 30.0


async def serve(runtime: Any, graphs: Mapping[str, Graph], stop: trio.Event, *,
                host: str = "127.0.0.1", port: int = 8000, state: GuardState | None = None,
                drain_timeout: float = DRAIN_TIMEOUT_S, metrics_app: Any = None,
                on_ready: Callable[[str], None] | None = None,
                media: MediaPolicy | None = None, files: FilePolicy | None = None,
                chat: ChatPolicy | None = None) -> None:
    """Serve `graphs` on `runtime` at ``http://host:port`` until `stop` is set, then drain.

    Args:
        port: 0 takes a free port; `on_ready` gets the URL actually bound.
        state: the API key and limits (see `GuardState`); after the drain, its
            `num_finished` and `num_cut` say how the requests in flight ended.
        drain_timeout: seconds in-flight requests get to finish once `stop` is set.
        media: what the OpenAI chat endpoint takes of a message's media (`MediaPolicy`).
        files: the policy for graphs' file inputs (see `FilePolicy`).
        chat: the chat endpoint's system prompt and JSON whitespace (`ChatPolicy`).

    Raises:
        OSError: the address cannot be bound (in use, not this machine's).
    """
    state = state or GuardState()
    app = build_app(runtime, graphs, state, metrics_app=metrics_app,
                    media=media, files=files, chat=chat)
    async with http_server(app, _config(host, port)) as server:
        if on_ready is not None:
            on_ready(server.urls[0])
        await stop.wait()
        await drain(state, server.close_idle, drain_timeout)


async def drain(state: GuardState, close_idle: Callable[[], Any], timeout: float) -> None:
    """Refuse new requests, close idle connections, wait up to `timeout` seconds for the
    requests in flight, cut the rest; return once none is in flight."""
    state.draining = True  # first: a request on a connection about to close is refused
    await close_idle()
    with trio.move_on_after(timeout):
        await state.wait_idle()
    state.cut()
    await state.wait_idle()  # the cut requests tell their clients


def _config(host: str, port: int) -> Config:
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.loglevel = "WARNING"  # the command prints its own one-line start
    config.accesslog = None
    logging.getLogger("hypercorn.error").setLevel(logging.WARNING)
    return config
