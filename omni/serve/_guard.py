"""What every request passes before a route sees it: the API key (which names the request's
tenant), the body limit, the concurrency limit and the drain. A plain ASGI middleware, so that
it wraps a streaming response to its end (a stream holds its concurrency slot until its last
event) and refuses a body before the route reads it.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from omni.serve._errors import error_body
from omni.serve._tenants import TENANT_STATE

__all__ = ["Guard", "GuardState"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/", "/health", "/docs", "/openapi.json", "/playground"})
UNCOUNTED_PATHS = frozenset({"/metrics"})  # behind the key, but never refused as busy


@dataclass
class GuardState:
    """The keys, the limits and what the guard counts. Why shared: the app reports it
    (`/health`), the server sets `draining`, and ``omni serve`` says at its stop whether
    requests were still in flight.

    `api_keys` maps each accepted key to its tenant's name (empty: no key needed, one
    tenant)."""

    api_keys: dict[str, str] = field(default_factory=dict)
    max_concurrency: int | None = None
    max_body_bytes: int = 32 * 1024 * 1024
    in_flight: int = 0
    draining: bool = False


class Guard:
    """ASGI middleware: 401 without a key (when keys are set), 413 over the body limit, 429
    when `max_concurrency` requests are in flight, 503 while draining; the key's tenant goes
    into the request's state (`omni.serve._tenants.tenant_of`). `/health`, the playground
    and the API docs need no key and count toward no limit."""

    def __init__(self, app: ASGIApp, state: GuardState):
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await self._refuse(send, *refusal)
            return
        scope.setdefault("state", {})[TENANT_STATE] = _tenant(dict(scope["headers"]),
                                                              self.state.api_keys) or ""
        if scope["path"] in UNCOUNTED_PATHS:
            await self.app(scope, receive, send)
            return
        state = self.state
        state.in_flight += 1
        try:
            await self._call_limited(scope, receive, send)
        finally:
            state.in_flight -= 1

    def _refusal(self, scope: Scope) -> tuple[int, str, dict[str, str]] | None:
        state, headers = self.state, dict(scope["headers"])
        if state.api_keys and _tenant(headers, state.api_keys) is None:
            return 401, "Incorrect or missing API key: send 'Authorization: Bearer KEY'.", {}
        if state.draining:
            return 503, "The server is shutting down.", {"retry-after": "1"}
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > state.max_body_bytes:
            return 413, _too_large(state.max_body_bytes), {}
        if (state.max_concurrency is not None and state.in_flight >= state.max_concurrency
                and scope["path"] not in UNCOUNTED_PATHS):
            return (429, f"Too many requests in flight (the server's --max-concurrency is "
                         f"{state.max_concurrency}); retry shortly.", {"retry-after": "1"})
        return None

    async def _call_limited(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app, given the whole body once it is known to be within the limit (a chunked
        body has no length to check beforehand); then `receive` as it was (a disconnect)."""
        limit, body = self.state.max_body_bytes, bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # gone before its request was complete
            body += message.get("body", b"")
            if len(body) > limit:
                await self._refuse(send, 413, _too_large(limit), {})
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send, status: int, message: str,
                      headers: dict[str, str]) -> None:
        body = json.dumps(error_body(status, message)).encode()
        raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *((k.encode(), v.encode()) for k, v in headers.items())]
        if status == 401:
            raw.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": body})


def _tenant(headers: dict[bytes, bytes], keys: dict[str, str]) -> str | None:
    """The tenant of the request's bearer key; None when it has none of `keys`. Every key is
    compared, each in constant time, so the time taken tells nothing of which was close."""
    given = headers.get(b"authorization", b"").decode("latin-1")
    scheme, _, token = given.partition(" ")
    presented = token.strip().encode()
    found = None
    for key, tenant in keys.items():
        if hmac.compare_digest(presented, key.encode()) and scheme.lower() == "bearer":
            found = tenant
    return found


def _too_large(limit: int) -> str:
    return f"The request body is larger than the server's limit of {limit} bytes."
