"""The OpenAI endpoints `build_app` adds for the graphs marked with them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omni.serve._errors import ApiError
from omni.serve.openai._chat import chat_route, unknown_model
from omni.serve.openai._chat_models import ChatCompletionRequest
from omni.serve.openai._chat_request import ChatPolicy
from omni.serve.openai._declare import CHAT_COMPLETIONS, IMAGE_GENERATIONS, endpoint_of
from omni.serve.openai._images import ImageRequest, images_route
from omni.serve.openai._media import MediaPolicy

__all__ = ["add_openai_routes"]


def add_openai_routes(app: Any, runtime: Any, graphs: Mapping[str, Any], *,
                      media: MediaPolicy | None = None,
                      chat: ChatPolicy | None = None) -> None:
    """Add ``POST /v1/chat/completions`` when a graph of `graphs` is marked
    `chat_completions`, ``POST /v1/images/generations`` when one is marked
    `image_generations`; the `model` of a request is the graph's name in `graphs`.

    Args:
        media: what a message's images and audio may be (`MediaPolicy`: remote URLs,
            pixels, bytes); default: data URLs only, the default limits.
        chat: the operator's system prompt and JSON whitespace (`ChatPolicy`); default:
            no system prompt, any whitespace.
    """
    chats = _marked(graphs, CHAT_COMPLETIONS)
    if chats:
        def find_chat(model: str) -> Any:
            if model not in chats:
                raise unknown_model(model, list(chats), "/v1/chat/completions")
            return chats[model]

        app.add_api_route("/v1/chat/completions", chat_route(
            runtime, chats, find_chat, media or MediaPolicy(), chat or ChatPolicy()),
            methods=["POST"],
            summary="OpenAI chat completions (JSON, or SSE with stream: true)",
            response_model=None, openapi_extra=_body_schema(ChatCompletionRequest))
    images = _marked(graphs, IMAGE_GENERATIONS)
    if images:
        def find_images(model: str | None) -> Any:
            if model is None and len(images) == 1:
                return next(iter(images.values()))
            if model is None:
                raise ApiError(400, f"model: required, this server has several image models: "
                                    f"{', '.join(images)}", param="model")
            if model not in images:
                raise unknown_model(model, list(images), "/v1/images/generations")
            return images[model]

        app.add_api_route("/v1/images/generations", images_route(runtime, find_images),
                          methods=["POST"], summary="OpenAI image generations (b64_json)",
                          response_model=None, openapi_extra=_body_schema(ImageRequest))


def _marked(graphs: Mapping[str, Any], endpoint: str) -> dict[str, Any]:
    return {name: g for name, g in graphs.items() if endpoint_of(g) == endpoint}


def _body_schema(model: Any) -> dict[str, Any]:
    """The route's request body for the API's description: `model`'s JSON schema with its
    definitions written in place (a route's schema cannot refer to its own ``$defs``)."""
    schema = model.model_json_schema(by_alias=True)
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        return [inline(v) for v in node] if isinstance(node, list) else node

    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": inline(schema)}}}}
