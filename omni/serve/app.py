"""The ASGI app of ``omni serve``: graphs over HTTP, OpenAI-shaped.

Routes:

- ``POST /v1/graphs/{name}``: body ``{"inputs": {...}, "stream": false, "cache_salt":
  "..."}``. The inputs are checked against the graph's annotations (as ``omni run`` checks
  them) and the answer is the request's outputs as ``omni run --json`` prints them
  (``{"output": value}`` for a graph with one output). With ``"stream": true`` the answer is
  a server-sent event stream: one event ``{"output": NAME, "item": VALUE}`` per output item
  as it is produced, then ``[DONE]``. File inputs follow the server's `FilePolicy` (output
  files come back under ``"files"``); an `omni.CacheSalt` input gets the request's salt
  (its tenant's and its ``cache_salt``), an ``omni.CacheSalt(per="tenant")`` one its
  tenant's alone.
- ``GET /v1/models``: the graphs served, as OpenAI's model list (each with the path its
  requests go to, an Omni field: ``"omni": {"endpoint": "/v1/chat/completions"}``);
  ``GET /v1/models/{id}``: one of them (404 for another id).
- ``POST /v1/chat/completions``, ``POST /v1/images/generations``: for graphs marked with
  them (`omni.serve.openai`); ``POST /v1/images/edits`` (multipart/form-data) for image graphs
  that take an image.
- ``GET /health``: ``{"status": "ok", "in_flight": N}`` (``"draining"``, status 503, while
  shutting down).
- ``GET /metrics``: the runtime's Prometheus metrics, when it keeps them (the operator's:
  behind ``GuardState.metrics_keys`` on a server with keys).
- ``GET /docs``, ``GET /openapi.json``: the API's description.
- ``GET /``: the playground, a page to chat with a chat graph (text, images, audio in,
  spoken replies out) and to generate images (static HTML and JS, no build step).

Every error is OpenAI's error object with the status a client expects (400 bad inputs or a
node refusing them, 401, 404, 413, 429, 503, 500 a node that failed); a client that goes away
cancels its request, which releases what it held (KV leases included).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

from omni.graph.dsl import Graph, Ref
from omni.graph.errors import InputError, NodeError
from omni.graph.jsonable import to_jsonable
from omni.graph.marks import OutputFile, file_role
from omni.serve._errors import ApiError, api_error_handler, error_body, error_response
from omni.serve._files import FILES_KEY, FilePolicy, RequestFiles
from omni.serve._guard import Guard, GuardState
from omni.serve._requests import DONE, graph_error, json_body, outputs, until_disconnected
from omni.serve._tenants import requested_salt, tenant_of, with_cache_salts

if TYPE_CHECKING:
    from omni.serve.openai import ChatPolicy, MediaPolicy

__all__ = ["build_app", "error_response"]

PLAYGROUND = Path(__file__).with_name("static") / "index.html"  # the page at /
SCHEMA_REF = "#/components/schemas/{name}"


def build_app(runtime: Any, graphs: Mapping[str, Graph], state: GuardState | None = None,
              *, metrics_app: Any = None, media: MediaPolicy | None = None,
              files: FilePolicy | None = None, chat: ChatPolicy | None = None) -> Any:
    """The ASGI app serving `graphs` (by name) on a started `runtime`.

    Args:
        runtime: an entered `omni.Runtime` that knows every graph in `graphs`.
        graphs: the graphs to serve, by the name their route uses.
        state: the API key and limits (`GuardState`); defaults: no key, no limit.
        metrics_app: an ASGI app answering ``/metrics`` (the runtime's metrics), or None
            (then the runtime's own, when it keeps metrics).
        media: what the OpenAI chat endpoint takes of a message's images and audio
            (`omni.serve.openai.MediaPolicy`: remote URLs, pixels, bytes); default: data
            URLs only, the default limits.
        files: the policy for graphs' file inputs (`FilePolicy`); default: clients name no
            input file, output files go to the system's temporary folder.
        chat: the chat endpoint's system prompt and JSON whitespace
            (`omni.serve.openai.ChatPolicy`); default: none, any.

    Raises:
        ValueError: a graph with output files and an output named like the answer's
            ``"files"``.
    """
    state = state or GuardState()
    files = files or FilePolicy()
    created = int(time.time())
    if metrics_app is None and getattr(runtime, "metrics", None) is not None:
        metrics_app = runtime.metrics.asgi_app()
    app = FastAPI(title="Omni", version=_version(),
                  description="Graphs served over HTTP: OpenAI-compatible endpoints and "
                              "/v1/graphs/{name} for any graph.")
    _add_error_handlers(app)

    @app.get("/", include_in_schema=False)
    async def playground() -> Response:
        return FileResponse(PLAYGROUND, media_type="text/html")

    @app.get("/health", summary="Whether the server takes requests")
    async def health() -> Response:
        status = "draining" if state.draining else "ok"
        return JSONResponse({"status": status, "in_flight": state.in_flight},
                            status_code=503 if state.draining else 200)

    def model(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": created, "owned_by": "omni",
                "omni": {"endpoint": _endpoint(name, graphs[name])}}

    @app.get("/v1/models", summary="The graphs served, as OpenAI's model list")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model(name) for name in graphs]}

    @app.get("/v1/models/{model_id}", summary="One graph served, as OpenAI's model object")
    async def one_model(model_id: str) -> dict[str, Any]:
        if model_id not in graphs:
            raise ApiError(404, f"The model {model_id!r} does not exist here; this server "
                                f"serves: {', '.join(graphs) or 'none'}", param="model",
                           code="model_not_found")
        return model(model_id)

    components: dict[str, Any] = {}
    for name, graph in graphs.items():
        _check_files_key(graph)
        app.add_api_route(f"/v1/graphs/{name}", _graph_route(runtime, graph, files),
                          methods=["POST"],
                          summary=f"Run graph '{name}'", response_model=None,
                          openapi_extra=_graph_openapi(graph, components),
                          name=f"graph:{name}")
    _with_components(app, components)

    from omni.serve.openai import add_openai_routes  # imported here: it uses this module

    add_openai_routes(app, runtime, graphs, media=media, chat=chat)

    @app.post("/v1/graphs/{name}", include_in_schema=False)
    async def unknown_graph(name: str) -> Response:
        raise ApiError(404, f"no graph named {name!r} here; this server serves: "
                            f"{', '.join(graphs) or 'none'}", code="graph_not_found")

    if metrics_app is not None:  # an object, not a function: Starlette then calls it as ASGI
        app.add_route("/metrics", _Asgi(metrics_app), include_in_schema=False)
    return Guard(app, state)


def _endpoint(name: str, graph: Graph) -> str:
    """The path a client sends `graph`'s requests to: its OpenAI endpoint when it is marked
    for one (`omni.serve.openai`'s mark, read by name: that package builds on this module),
    else its own route."""
    marked = getattr(graph, "openai_endpoint", None)
    return f"/v1/{marked.replace('.', '/')}" if marked else f"/v1/graphs/{name}"


class _Asgi:
    """An ASGI app as a route's endpoint (exactly its path, no redirect to a trailing /)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


def _version() -> str:
    try:
        return importlib.metadata.version("omni")
    except importlib.metadata.PackageNotFoundError:
        return "0"


def _add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, api_error_handler)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        message = ("No route " + request.url.path if exc.status_code == 404
                   else str(exc.detail))
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code,
                            headers=exc.headers)

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return JSONResponse(error_body(400, f"{where or 'body'}: {first.get('msg', exc)}",
                                       param=where or None), status_code=400)

    async def server_error(request: Request, exc: Exception) -> Response:
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"),
                            status_code=500)

    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, server_error)
    app.add_exception_handler(RequestValidationError, validation_error)


def _check_files_key(graph: Graph) -> None:
    names = [graph.output] if isinstance(graph.output, Ref) else list(graph.output)
    if FILES_KEY in names and any(
            isinstance(file_role(i.type), OutputFile) for i in graph.inputs):
        raise ValueError(f"graph '{graph.name}' writes output files, which its answers carry "
                         f"under \"{FILES_KEY}\": rename its output '{FILES_KEY}'")


def _graph_route(runtime: Any, graph: Graph,
                 policy: FilePolicy) -> Callable[[Request], Awaitable[Response]]:
    async def run_graph(request: Request) -> Response:
        raw, stream, salt = await _graph_body(request)
        raw = with_cache_salts(graph, raw, tenant_of(request), salt)
        files = policy.open_request(graph, raw)
        try:
            inputs = _converted(graph, files.inputs)
            if stream:
                owned, files = files, None  # the stream closes them when it ends
                return EventSourceResponse(_graph_events(runtime, graph, inputs, owned),
                                           ping=15)
            result = await until_disconnected(request, lambda: runtime.run(graph, **inputs))
            if result is None:
                return Response(status_code=499)  # nobody is there to read it
            outputs = {"output": result} if isinstance(graph.output, Ref) else result
            answer = files.rewrite(to_jsonable(outputs))
            written = await files.collect()
            if written:
                answer[FILES_KEY] = written
            return JSONResponse(answer)
        finally:
            if files is not None:
                files.close()

    run_graph.__doc__ = (graph.fn.__doc__ if graph.fn is not None else None) or (
        f"Run graph '{graph.name}' on the inputs given.")
    return run_graph


async def _graph_body(request: Request) -> tuple[dict[str, Any], bool, str]:
    """The request's inputs (as sent), its stream flag and its cache salt."""
    body = await json_body(request)
    unknown = sorted(set(body) - {"inputs", "stream", "cache_salt"})
    if unknown:
        raise ApiError(400, f"unknown field(s) {', '.join(unknown)}: the body is "
                            '{"inputs": {...}, "stream": false, "cache_salt": "..."}',
                       param=unknown[0])
    inputs, stream = body.get("inputs", {}), body.get("stream", False)
    if not isinstance(inputs, dict):
        raise ApiError(400, f"inputs must be a JSON object, got {type(inputs).__name__}",
                       param="inputs")
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", param="stream")
    return inputs, stream, requested_salt(body.get("cache_salt"))


def _converted(graph: Graph, inputs: dict[str, Any]) -> dict[str, Any]:
    """`inputs` checked against the graph's annotations (`ApiError` 400 naming what is
    wrong)."""
    try:
        return graph.convert_inputs(inputs)
    except InputError as exc:
        raise ApiError(400, str(exc), param="inputs") from None


async def _graph_events(runtime: Any, graph: Graph, inputs: dict[str, Any],
                        files: RequestFiles) -> AsyncIterator[dict[str, str]]:
    """One event per output item, then the output files (``{"files": {...}}``) if any, then
    ``[DONE]``; a failure as an ``error`` event. Closes `files` when it ends. A request lost
    with a worker midway runs again if no event was sent yet (`outputs`)."""
    sent = 0

    def unsent() -> bool:
        return sent == 0

    try:
        async for name, item in outputs(runtime, graph, inputs, unsent=unsent):
            sent += 1
            yield {"data": json.dumps({"output": name,
                                       "item": files.rewrite(to_jsonable(item))},
                                      ensure_ascii=False)}
        written = await files.collect()
        if written:
            yield {"data": json.dumps({FILES_KEY: written})}
    except (NodeError, ApiError) as exc:
        error = graph_error(exc) if isinstance(exc, NodeError) else exc
        yield {"event": "error", "data": json.dumps(error_body(
            error.status, error.message, code=error.code))}
        return
    finally:
        files.close()
    yield {"data": DONE}


def _graph_openapi(graph: Graph, components: dict[str, Any]) -> dict[str, Any]:
    """The route's request body in the OpenAPI description: each input with its annotation's
    JSON schema (msgspec's, as the inputs are checked), its default, and which are required.
    Named types (dataclasses, structs) go into `components`."""
    typed = [i for i in graph.inputs if i.type not in (inspect.Parameter.empty, Any)]
    try:
        schemas, defs = msgspec.json.schema_components([i.type for i in typed],
                                                       ref_template=SCHEMA_REF)
    except (TypeError, ValueError):  # a type msgspec cannot describe: names only
        schemas, defs = [{} for _ in typed], {}
    components.update(defs)
    properties: dict[str, Any] = {i.name: {"title": i.name} for i in graph.inputs}
    for i, schema in zip(typed, schemas, strict=True):
        properties[i.name].update(schema)
    for i in graph.inputs:
        if i.default is not inspect.Parameter.empty:
            properties[i.name]["default"] = to_jsonable(i.default)
    required = [i.name for i in graph.inputs if i.default is inspect.Parameter.empty]
    inputs = {"type": "object", "properties": properties, "required": required}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {
        "type": "object", "required": ["inputs"] if required else [], "properties": {
            "inputs": inputs, "stream": {"type": "boolean", "default": False}}}}}}}


def _with_components(app: FastAPI, components: dict[str, Any]) -> None:
    """Add the graphs' named input types to the app's OpenAPI description."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
