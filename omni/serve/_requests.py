"""What every route of ``omni serve`` does with a request: read its JSON body, run its work
until the client goes away, and turn a graph's failure into the API error a client expects.
Why a module of its own: the app (`omni.serve.app`) and the OpenAI endpoints
(`omni.serve.openai`) share them, and neither imports the other's module for them."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import msgspec
from starlette.requests import Request

from omni.errors import RemoteError, summary
from omni.graph.balance import NoLiveReplica
from omni.graph.errors import NodeError, ReplicaLost, RouteError, lost_midway
from omni.serve._errors import ApiError

__all__ = ["DONE", "LOST_RETRY_AFTER_S", "PARSE_IN_THREAD_BYTES", "graph_error", "json_body",
           "outputs", "until_disconnected"]

DONE = "[DONE]"  # a server-sent event stream's last data
# a body larger than this is parsed in a worker thread (1 MiB of JSON: ~5 ms to parse)
PARSE_IN_THREAD_BYTES = 1 << 20
# a \uD800-\uDBFF escape not followed by a \uDC00-\uDFFF one, or the second without the first
_LONE_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])|"
                             rb"(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")
LOST_RETRY_AFTER_S = 5  # Retry-After of a request its workers' loss failed: time to place anew


async def json_body(request: Request) -> dict[str, Any]:
    """The request's body as a JSON object; `ApiError` 400 naming what is wrong.

    Parsed by msgspec (2.4x the speed of json on a 30 MB body), in a worker thread when it is
    large. The parser holds the GIL, so the event loop still waits for it, but once per body
    and for ~25 ms at 30 MB."""
    raw = await request.body()
    try:
        if len(raw) > PARSE_IN_THREAD_BYTES:
            body = await anyio.to_thread.run_sync(msgspec.json.decode, raw)
        else:
            body = msgspec.json.decode(raw) if raw else {}
    except msgspec.DecodeError as exc:
        fault = ("a \\uD800-\\uDFFF escape without its other half (a lone UTF-16 "
                 "surrogate is no text)" if _LONE_SURROGATE.search(raw) else exc)
        raise ApiError(400, f"the body is not valid JSON: {fault}") from None
    except RecursionError:
        raise ApiError(400, "the body's JSON is nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(body).__name__}")
    return body


async def until_disconnected(request: Request, work: Callable[[], Awaitable[Any]]) -> Any:
    """`work()`'s result, or None once the client disconnected (the work is then cancelled,
    which releases whatever it held). Raises `ApiError` for a node's failure, and what
    `work` raised otherwise."""
    result, failure = None, None
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            result = await work()
        except Exception as exc:  # raised below, outside the task group's exception group
            failure = exc
        group.cancel_scope.cancel()
    if isinstance(failure, NodeError):
        raise graph_error(failure) from None
    if failure is not None:
        raise failure
    return result


async def outputs(runtime: Any, graph: Any, inputs: dict[str, Any], *,
                  unsent: Callable[[], bool],
                  restart: Callable[[], None] = lambda: None
                  ) -> AsyncIterator[tuple[str, Any]]:
    """The request's ``(output, item)`` pairs, as `runtime.stream` gives them. A request lost
    with a worker midway (`lost_midway`: a node's stream had passed items on inside the
    graph) runs once more from its start while `unsent()` says its caller has been sent
    nothing of it yet (a reply collected whole, a stream before its first event), as
    `omni.Runtime.run` does, after `restart()` (the caller drops what it gathered of the
    first run). A request lost again fails with that error (`graph_error`: 503, retry later)."""
    again = False
    while True:
        try:
            async with runtime.stream(graph, **inputs) as stream:
                async for pair in stream:
                    yield pair
            return
        except NodeError as exc:
            if again or not lost_midway(exc) or not unsent():
                raise
            again = True
            restart()


def graph_error(exc: NodeError) -> ApiError:
    """A failed request as an API error: a node refusing its input (a ValueError, raised here
    or on a worker; a switch without the route) is the client's 400, a node with no live
    replica left (its workers gone, none placed again within the replace timeout) or lost
    with its worker where it could not run again a 503 to retry later, anything else the
    server's 500."""
    cause = exc.cause
    text = summary(cause)
    retry = {"retry-after": str(LOST_RETRY_AFTER_S)}
    if isinstance(cause, NoLiveReplica):
        return ApiError(503, f"node '{exc.node}' failed: {text}", code="no_live_replica",
                        headers=retry)
    if isinstance(cause, ReplicaLost):
        return ApiError(503, f"node '{exc.node}' failed: {text}", code="worker_lost",
                        headers=retry)
    client = (isinstance(cause, ValueError) or isinstance(exc, RouteError)
              or (isinstance(cause, RemoteError) and cause.is_builtin(ValueError)))
    return ApiError(400 if client else 500, f"node '{exc.node}' failed: {text}",
                    code="node_failed")
