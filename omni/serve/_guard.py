"""What every request passes before a route sees it: the API key (which names the request's
tenant; ``/metrics`` takes the operator's key instead), the body limit, the concurrency limit
and the drain. A plain ASGI middleware, so that
it wraps a streaming response to its end (a stream holds its concurrency slot until its last
event) and refuses a body before the route reads it.

The drain: once `GuardState.draining` is set, a new request is answered 503 (with
``Retry-After``) and every response says ``Connection: close``; the requests in flight go on.
`GuardState.cut` cancels those still running at the drain's timeout: each then tells its
client (a stream's last event is an ``error`` event, a request not yet answered gets a 503)
and is counted as cut, the others as finished.
"""

from __future__ import annotations

import contextlib
import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import anyio

from omni.serve._errors import error_body
from omni.serve._tenants import TENANT_STATE

__all__ = ["SHUTDOWN_CODE", "Guard", "GuardState", "until_answered"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/", "/health", "/docs", "/openapi.json", "/playground"})
UNCOUNTED_PATHS = frozenset({"/metrics"})  # behind the key, but never refused as busy
# the operator's, not a tenant's: the KV store's page counts tell a prompt's length
OPERATOR_PATHS = frozenset({"/metrics"})
SHUTDOWN_CODE = "server_shutdown"  # the error code of a request refused or cut by the drain
RETRY_SOON = (("retry-after", "1"),)
HELD_STATE = "omni_held"  # the request's `until_answered` stack, in the ASGI scope's "state"


@dataclass
class GuardState:
    """The keys, the limits, what the guard counts and the drain. Why shared: the app
    reports it (`/health`), the server drains through it (`draining`, `wait_idle`, `cut`),
    and ``omni serve`` says at its stop how many requests finished and how many were cut.

    Invariant: `in_flight` == the number of requests the guard let through and that have not
    ended; each of them has its cancel scope in `_running` while it runs the app.


    `api_keys` maps each accepted key to its tenant's name (empty: no key needed, one
    tenant). `metrics_keys` are the operator's, the only keys `/metrics` takes once the
    server has any key (without keys, a single user's server, it is open)."""

    api_keys: dict[str, str] = field(default_factory=dict)
    metrics_keys: frozenset[str] = frozenset()
    max_concurrency: int | None = None
    max_body_bytes: int = 32 * 1024 * 1024
    in_flight: int = 0
    draining: bool = False
    num_finished: int = 0  # requests that ended by themselves while draining
    num_cut: int = 0  # requests cancelled by `cut` before their response was complete
    _running: set[anyio.CancelScope] = field(default_factory=set, repr=False)
    _idle: anyio.Event | None = field(default=None, repr=False)

    async def wait_idle(self) -> None:
        """Return once no request is in flight."""
        while self.in_flight:
            if self._idle is None:
                self._idle = anyio.Event()
            await self._idle.wait()

    def cut(self) -> None:
        """Cancel every request in flight (the drain's timeout passed); each tells its
        client and counts itself in `num_cut` as it ends."""
        for scope in list(self._running):
            scope.cancel()

    def _enter(self, scope: anyio.CancelScope) -> None:
        self.in_flight += 1
        self._running.add(scope)

    def _leave(self, scope: anyio.CancelScope, *, cut: bool) -> None:
        self.in_flight -= 1
        self._running.discard(scope)
        if cut:
            self.num_cut += 1
        elif self.draining:
            self.num_finished += 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()
            self._idle = None


class Guard:
    """ASGI middleware: 401 without a key (when keys are set), 413 over the body limit, 429
    when `max_concurrency` requests are in flight, 503 while draining; the key's tenant goes
    into the request's state (`omni.serve._tenants.tenant_of`). `/health`, the playground
    and the API docs need no key and count toward no limit; `/metrics` needs an operator's
    key (`GuardState.metrics_keys`) when the server has keys: a tenant's gets 403."""

    def __init__(self, app: ASGIApp, state: GuardState):
        self.app, self.state = app, state
        self._operators = dict.fromkeys(state.metrics_keys, "operator")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        response = _Response(send, self.state)
        if scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, response.send)
            return
        headers, refusal = dict(scope["headers"]), None
        tenant = _tenant(headers, self.state.api_keys) if self.state.api_keys else ""
        if scope["path"] in OPERATOR_PATHS:
            refusal = self._operator_refusal(headers, tenant)
            tenant = ""  # the operator's request, no tenant's
        if refusal is None:
            refusal = self._refusal(scope, headers, tenant)
        if refusal is not None:
            await _refuse(response.send, refusal)
            return
        scope.setdefault("state", {})[TENANT_STATE] = tenant
        if scope["path"] in UNCOUNTED_PATHS:
            await self.app(scope, receive, response.send)
            return
        await self._call_counted(scope, receive, response)

    def _operator_refusal(self, headers: dict[bytes, bytes],
                          tenant: str | None) -> _Refusal | None:
        """Why an operator's path is refused, or None: a server with keys takes only an
        operator's key there (401 for no key of the server's, 403 for a tenant's)."""
        if not self._operators and not self.state.api_keys:
            return None  # a single user's server: its user is the operator
        if self._operators and _tenant(headers, self._operators) is not None:
            return None
        if tenant is None or not self.state.api_keys:
            return _Refusal(401, "Incorrect or missing operator key: send 'Authorization: "
                                 "Bearer KEY' with a key of the server's --metrics-key-file.")
        return _Refusal(403, "/metrics is the operator's: a tenant's API key cannot read it "
                             "(the server's --metrics-key-file holds the operator's keys).")

    def _refusal(self, scope: Scope, headers: dict[bytes, bytes],
                 tenant: str | None) -> _Refusal | None:
        """Why the request is refused, or None; `tenant` is its key's (None: no key that
        the server takes)."""
        state = self.state
        if tenant is None:
            return _Refusal(401, "Incorrect or missing API key: send 'Authorization: Bearer "
                                 "KEY'.")
        if state.draining:
            return _Refusal(503, "The server is shutting down; retry shortly (elsewhere if you "
                                 "can).", RETRY_SOON, SHUTDOWN_CODE)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > state.max_body_bytes:
            return _Refusal(413, _too_large(state.max_body_bytes))
        if (state.max_concurrency is not None and state.in_flight >= state.max_concurrency
                and scope["path"] not in UNCOUNTED_PATHS):
            return _Refusal(429, f"Too many requests in flight (the server's --max-concurrency "
                                 f"is {state.max_concurrency}); retry shortly.",
                            RETRY_SOON)
        return None

    async def _call_counted(self, scope: Scope, receive: Receive, response: _Response) -> None:
        """The app in a cancel scope the drain can cut; a request cut before its response was
        complete is told so (`_Response.end_cut`) and counted as cut."""
        state, running, cut = self.state, anyio.CancelScope(), False
        state._enter(running)
        try:
            with running:
                async with contextlib.AsyncExitStack() as held:
                    scope["state"][HELD_STATE] = held
                    await self._call_limited(scope, receive, response.send)
            cut = running.cancel_called and not response.complete
            if cut:
                with contextlib.suppress(Exception):  # the client may be gone: none to tell
                    await response.end_cut()
        finally:
            state._leave(running, cut=cut or (running.cancel_called and not response.complete))

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
                await _refuse(send, _Refusal(413, _too_large(limit)))
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


class _Response:
    """What a request has sent so far. Why: a request cut by the drain ends its response
    in the way its client understands (an ``error`` event for a stream, a 503 before
    anything was sent), and a response started while draining closes its connection."""

    def __init__(self, send: Send, state: GuardState):
        self._send, self._state = send, state
        self.started = self.complete = self.event_stream = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", ()))
            self.event_stream = any(k.lower() == b"content-type"
                                    and v.startswith(b"text/event-stream") for k, v in headers)
            if self._state.draining and not any(k.lower() == b"connection" for k, _ in headers):
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            self.started = True
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
            # The server closes a draining connection inside this send, once the response
            # is whole; a stream's own task group cancels its tasks as its last event goes
            # (sse_starlette), which would cut that close halfway and leave the connection
            # open and deaf: a client's next request on it would wait for the drain's end.
            with anyio.CancelScope(shield=True):
                await self._send(message)
            return
        await self._send(message)

    async def end_cut(self) -> None:
        """Tell the client its request was cut: a 503, or a stream's last event; a response
        of another kind that had started is left incomplete (the connection closes)."""
        message = "The server shut down before this request finished (its drain timeout passed)."
        if not self.started:
            await _refuse(self.send, _Refusal(503, message, RETRY_SOON, SHUTDOWN_CODE))
        elif self.event_stream:
            data = json.dumps(error_body(503, message, code=SHUTDOWN_CODE))
            await self.send({"type": "http.response.body", "more_body": False,
                             "body": f"event: error\r\ndata: {data}\r\n\r\n".encode()})


class _Refusal(NamedTuple):
    """An answer the guard gives instead of the app's."""

    status: int
    message: str
    headers: tuple[tuple[str, str], ...] = ()
    code: str | None = None


async def _refuse(send: Send, refusal: _Refusal) -> None:
    status = refusal.status
    body = json.dumps(error_body(status, refusal.message, code=refusal.code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
           *((k.encode(), v.encode()) for k, v in refusal.headers)]
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


def until_answered(request: Any) -> contextlib.AsyncExitStack | None:
    """The request's stack of what it holds until its response has ended, however it ends
    (sent whole, a stream's last event, a client gone, cut by the drain): a route enters a
    reservation on it (`omni.serve.openai`'s media budget) that a streamed response must
    keep past the route's return. None outside the guard's counted requests."""
    return request.scope.get("state", {}).get(HELD_STATE)
