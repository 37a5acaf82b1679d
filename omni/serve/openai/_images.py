"""``POST /v1/images/generations``: a prompt in, the declared image graph's PNGs out (base64).

`size` is ``"WxH"`` (each a multiple of 16; the graph's default without it), `n` images are
made with the seeds ``seed``, ``seed + 1``... (`seed`, an Omni extension as in vLLM-Omni,
defaults to the graph's), and `response_format` is ``b64_json`` (no URLs: nothing is stored).
A graph input marked `omni.CacheSalt` gets the request's salt (its tenant's, and its own
``cache_salt`` as on chat completions): tenants share no prompt KV.
"""

from __future__ import annotations

import base64
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omni.serve._errors import ApiError
from omni.serve._requests import json_body, until_disconnected
from omni.serve._tenants import MAX_CACHE_SALT_CHARS, tenant_of, with_cache_salts
from omni.serve.openai._body import validated

__all__ = ["MAX_IMAGES", "ImageRequest", "images_route"]

MAX_IMAGES = 10
PIXEL_STEP = 16
_SIZE = re.compile(r"(\d+)x(\d+)")


class ImageRequest(BaseModel):
    """The fields Omni serves (OpenAI's, and `seed`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(min_length=1)
    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_IMAGES)
    size: str | None = None
    seed: int | None = None
    response_format: Literal["b64_json", "url"] | None = None
    user: str | None = None
    cache_salt: str | None = Field(default=None, max_length=MAX_CACHE_SALT_CHARS)


def images_route(runtime: Any, find: Callable[[str | None], Any]
                 ) -> Callable[[Request], Awaitable[Response]]:
    """The route's handler; `find(model)` is the image graph serving `model` (None: the
    only one), or `ApiError` 404."""

    async def image_generations(request: Request) -> Response:
        body = validated(ImageRequest, await json_body(request), "image generations")
        if body.response_format == "url":
            raise ApiError(400, "response_format: 'url' is not served (this server keeps no "
                                "images); use 'b64_json'", param="response_format")
        graph = find(body.model)
        inputs = with_cache_salts(graph, _inputs(graph, body), tenant_of(request),
                                  body.cache_salt or "")
        images = await until_disconnected(request, lambda: _generate(runtime, graph, inputs,
                                                                     body.n))
        if images is None:
            return Response(status_code=499)  # nobody is there to read it
        return JSONResponse({"created": int(time.time()), "data": [
            {"b64_json": base64.b64encode(png).decode("ascii"), "revised_prompt": None}
            for png in images]})

    return image_generations


def _inputs(graph: Any, body: ImageRequest) -> dict[str, Any]:
    inputs: dict[str, Any] = {"prompt": body.prompt, "out": "", "png": True}
    if body.size is not None:
        inputs["width"], inputs["height"] = _size(body.size)
    if body.seed is not None:
        inputs["seed"] = body.seed
    else:
        inputs["seed"] = next(i.default for i in graph.inputs if i.name == "seed")
    return inputs


def _size(size: str) -> tuple[int, int]:
    match = _SIZE.fullmatch(size)
    if match is None or any(int(v) < PIXEL_STEP or int(v) % PIXEL_STEP for v in
                            match.groups()):
        raise ApiError(400, f"size must be 'WIDTHxHEIGHT' in pixels, each a multiple of "
                            f"{PIXEL_STEP} (e.g. '256x256'), got {size!r}", param="size")
    return int(match[1]), int(match[2])


async def _generate(runtime: Any, graph: Any, inputs: dict[str, Any], n: int) -> list[bytes]:
    images = []
    for i in range(n):
        result = await runtime.run(graph, **{**inputs, "seed": inputs["seed"] + i})
        png = result.get("png") if isinstance(result, dict) else None
        if not isinstance(png, bytes):
            raise ApiError(500, f"graph '{graph.name}' returned no PNG bytes under 'png'")
        images.append(png)
    return images
