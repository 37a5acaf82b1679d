"""The OpenAI endpoints `build_app` adds for the graphs marked with them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from omni.serve._errors import ApiError
from omni.serve.openai._chat import chat_route, unknown_model
from omni.serve.openai._chat_models import ChatCompletionRequest
from omni.serve.openai._chat_request import ChatPolicy
from omni.serve.openai._declare import (
    CHAT_COMPLETIONS,
    EDIT_INPUT,
    IMAGE_GENERATIONS,
    edits_images,
    endpoint_of,
)
from omni.serve.openai._edits import EditRequest, edits_route
from omni.serve.openai._images import ImageRequest, images_route
from omni.serve.openai._media import MediaPolicy

__all__ = ["add_openai_routes"]


def add_openai_routes(app: Any, runtime: Any, graphs: Mapping[str, Any], *,
                      media: MediaPolicy | None = None,
                      chat: ChatPolicy | None = None) -> None:
    """Add ``POST /v1/chat/completions`` when a graph of `graphs` is marked
    `chat_completions`, ``POST /v1/images/generations`` and ``POST /v1/images/edits`` when
    one is marked `image_generations` (edits answered by the graphs that take an image,
    `edits_images`); the `model` of a request is the graph's name in `graphs`.

    Args:
        media: what a message's images and audio, and an edit's image, may be
            (`MediaPolicy`: remote URLs, pixels, bytes; its budget in flight shared by
            both routes); default: data URLs only, the default limits.
        chat: the operator's system prompt and JSON whitespace (`ChatPolicy`); default:
            no system prompt, any whitespace.
    """
    media = media or MediaPolicy()
    chats = _marked(graphs, CHAT_COMPLETIONS)
    if chats:
        def find_chat(model: str) -> Any:
            if model not in chats:
                raise unknown_model(model, list(chats), "/v1/chat/completions")
            return chats[model]

        app.add_api_route("/v1/chat/completions", chat_route(
            runtime, chats, find_chat, media, chat or ChatPolicy()),
            methods=["POST"],
            summary="OpenAI chat completions (JSON, or SSE with stream: true)",
            response_model=None, openapi_extra=_body_schema(ChatCompletionRequest))
    images = _marked(graphs, IMAGE_GENERATIONS)
    if images:
        app.add_api_route("/v1/images/generations",
                          images_route(runtime, _image_finder(images, "/v1/images/generations")),
                          methods=["POST"], summary="OpenAI image generations (b64_json)",
                          response_model=None, openapi_extra=_body_schema(ImageRequest))
        app.add_api_route("/v1/images/edits",
                          edits_route(runtime, _editor_finder(images), media),
                          methods=["POST"],
                          summary="OpenAI image edits (multipart/form-data, b64_json)",
                          response_model=None,
                          openapi_extra=_body_schema(EditRequest, files=(EDIT_INPUT,)))


def _marked(graphs: Mapping[str, Any], endpoint: str) -> dict[str, Any]:
    return {name: g for name, g in graphs.items() if endpoint_of(g) == endpoint}


def _image_finder(images: Mapping[str, Any], path: str) -> Callable[[str | None], Any]:
    """The image graph a request's `model` names at `path` (None: the only one)."""

    def find(model: str | None) -> Any:
        if model is None and len(images) == 1:
            return next(iter(images.values()))
        if model is None:
            raise ApiError(400, f"model: required, this server has several image models: "
                                f"{', '.join(images)}", param="model")
        if model not in images:
            raise unknown_model(model, list(images), path)
        return images[model]

    return find


def _editor_finder(images: Mapping[str, Any]) -> Callable[[str | None], Any]:
    """`_image_finder` for ``/v1/images/edits``: 400 for a graph that takes no image."""
    find = _image_finder(images, "/v1/images/edits")

    def find_editor(model: str | None) -> Any:
        graph = find(model)
        if not edits_images(graph):
            raise ApiError(400, f"model: {graph.name!r} edits no uploaded image (its graph's "
                                f"'{EDIT_INPUT}' input takes no ImagePart); "
                                "/v1/images/generations serves it", param="model")
        return graph

    return find_editor


def _body_schema(model: Any, *, files: tuple[str, ...] = ()) -> dict[str, Any]:
    """The route's request body for the API's description: `model`'s JSON schema with its
    definitions written in place (a route's schema cannot refer to its own ``$defs``); with
    `files`, a multipart/form-data form of those fields and files (each required)."""
    schema = model.model_json_schema(by_alias=True)
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        return [inline(v) for v in node] if isinstance(node, list) else node

    body = inline(schema)
    if files:
        body["properties"].update({f: {"type": "string", "format": "binary"} for f in files})
        body["required"] = [*files, *body.get("required", [])]
    kind = "multipart/form-data" if files else "application/json"
    return {"requestBody": {"required": True, "content": {kind: {"schema": body}}}}
