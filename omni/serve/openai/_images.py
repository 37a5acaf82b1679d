"""``POST /v1/images/generations``: a prompt in, the declared image graph's PNGs out (base64).

`size` is ``"WxH"`` (each a multiple of 16, at most `MAX_SIDE`; the graph's default without
it), `n` images are made with the seeds ``seed``, ``seed + 1``... (`seed`, an Omni extension as
in vLLM-Omni, defaults to the graph's), `response_format` is ``b64_json`` (no URLs: nothing is
stored) and `output_format` ``png``. vLLM-Omni's extension fields reach the graph's inputs of
the same meaning where it has them (`negative_prompt`, `num_inference_steps` as ``steps``,
`guidance_scale` as ``guidance``); one the graph does not take is refused by name. Every
setting is checked before any work. The answer's ``usage`` (``input_tokens``,
``input_tokens_details.cached_tokens``, summed over the `n` runs) comes from the graph's
results when they carry one (`image_generations`).
A graph input marked `omni.CacheSalt` gets the request's salt (its tenant's, and its own
``cache_salt`` as on chat completions): tenants share no prompt KV. ``POST /v1/images/edits``
(`omni.serve.openai._edits`) checks its fields and answers with the same functions
(`checked_inputs`, `answer_images`).
"""

from __future__ import annotations

import base64
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import anyio
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omni.serve._errors import ApiError
from omni.serve._requests import json_body, until_disconnected
from omni.serve._tenants import MAX_CACHE_SALT_CHARS, tenant_of, with_cache_salts
from omni.serve.openai._body import validated

__all__ = ["MAX_IMAGES", "MAX_PROMPT_CHARS", "MAX_SIDE", "MAX_STEPS", "ImageRequest",
           "answer_images", "checked_inputs", "images_route"]

MAX_IMAGES = 10
MAX_SIDE = 4096  # pixels of an image side the route takes (a graph may take fewer)
MAX_STEPS = 1000  # denoising steps the route takes
# characters of a prompt (OpenAI's own cap for image prompts): a model reads a few hundred
# tokens of it, and tokenizing more is work for nothing
MAX_PROMPT_CHARS = 32_000
PIXEL_STEP = 16
# the extension fields and the graph inputs they set (`strength`: an edit's alone)
_SETTINGS = {"negative_prompt": "negative_prompt", "num_inference_steps": "steps",
             "guidance_scale": "guidance", "strength": "strength"}
_SIZE = re.compile(r"(\d+)x(\d+)")


class ImageRequest(BaseModel):
    """The fields Omni serves (OpenAI's, and `seed`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_IMAGES)
    size: str | None = None
    seed: int | None = None
    response_format: Literal["b64_json", "url"] | None = None
    user: str | None = None
    cache_salt: str | None = Field(default=None, max_length=MAX_CACHE_SALT_CHARS)
    output_format: Literal["png"] | None = None
    negative_prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    num_inference_steps: int | None = Field(default=None, ge=1, le=MAX_STEPS)
    guidance_scale: float | None = Field(default=None, ge=0, allow_inf_nan=False)


def images_route(runtime: Any, find: Callable[[str | None], Any]
                 ) -> Callable[[Request], Awaitable[Response]]:
    """The route's handler; `find(model)` is the image graph serving `model` (None: the
    only one), or `ApiError` 404."""

    async def image_generations(request: Request) -> Response:
        body = validated(ImageRequest, await json_body(request), "image generations")
        graph = find(body.model)
        inputs = checked_inputs(request, graph, body)
        return await answer_images(request, runtime, graph, inputs, body.n)

    return image_generations


def checked_inputs(request: Request, graph: Any, body: ImageRequest) -> dict[str, Any]:
    """The graph's inputs for `body` (its cache salts included), every setting checked;
    `ApiError` 400 naming the first field the route or `graph` does not take."""
    if body.response_format == "url":
        raise ApiError(400, "response_format: 'url' is not served (this server keeps no "
                            "images); use 'b64_json'", param="response_format")
    return with_cache_salts(graph, _inputs(graph, body), tenant_of(request),
                            body.cache_salt or "")


async def answer_images(request: Request, runtime: Any, graph: Any, inputs: dict[str, Any],
                        n: int) -> Response:
    """`graph` run `n` times on `inputs` (seeds ``seed``, ``seed + 1``...), their PNGs as
    OpenAI's images answer; 499 once the client is gone (the runs cancelled)."""
    images = await until_disconnected(request, lambda: _generate(runtime, graph, inputs, n))
    if images is None:
        return Response(status_code=499)  # nobody is there to read it
    answer: dict[str, Any] = {"created": int(time.time()), "data": [
        {"b64_json": base64.b64encode(png).decode("ascii"), "revised_prompt": None}
        for png, _ in images]}
    usage = _usage([used for _, used in images])
    if usage is not None:
        answer["usage"] = usage
    return JSONResponse(answer)


def _inputs(graph: Any, body: ImageRequest) -> dict[str, Any]:
    inputs: dict[str, Any] = {"prompt": body.prompt, "out": "", "png": True}
    if body.size is not None:
        inputs["width"], inputs["height"] = _size(body.size)
    takes = {i.name for i in graph.inputs}
    for field, name in _SETTINGS.items():
        value = getattr(body, field, None)
        if value is None:
            continue
        if name not in takes:
            raise ApiError(400, f"{field}: the model {graph.name!r} takes no such setting",
                           param=field)
        inputs[name] = value
    if body.seed is not None:
        inputs["seed"] = body.seed
    else:
        inputs["seed"] = next(i.default for i in graph.inputs if i.name == "seed")
    return inputs


def _size(size: str) -> tuple[int, int]:
    match = _SIZE.fullmatch(size)
    if match is None or any(int(v) < PIXEL_STEP or int(v) % PIXEL_STEP or int(v) > MAX_SIDE
                            for v in match.groups()):
        raise ApiError(400, f"size must be 'WIDTHxHEIGHT' in pixels, each a multiple of "
                            f"{PIXEL_STEP} and at most {MAX_SIDE} (e.g. '256x256'), got "
                            f"{size[:40]!r}", param="size")
    return int(match[1]), int(match[2])


async def _generate(runtime: Any, graph: Any, inputs: dict[str, Any], n: int
                    ) -> list[tuple[bytes, Any]]:
    """Each run's PNG and its ``usage`` (None where the graph reports none). The `n` runs go
    at once (a graph that batches denoises them together); the first to fail cancels the
    others and its error is the request's."""
    results: list[Any] = [None] * n
    failures: list[Exception] = []

    async def run(i: int) -> None:
        try:
            results[i] = await runtime.run(graph, **{**inputs, "seed": inputs["seed"] + i})
        except Exception as exc:  # raised below as itself, not in the group's wrapping
            failures.append(exc)
            group.cancel_scope.cancel()

    async with anyio.create_task_group() as group:
        for i in range(n):
            group.start_soon(run, i)
    if failures:
        raise failures[0]
    images = []
    for result in results:
        png = result.get("png") if isinstance(result, dict) else None
        if not isinstance(png, bytes):
            raise ApiError(500, f"graph '{graph.name}' returned no PNG bytes under 'png'")
        images.append((png, result.get("usage")))
    return images


def _usage(reported: list[Any]) -> dict[str, Any] | None:
    """OpenAI's ``usage`` of the runs' reports (``{"input_tokens", "cached_tokens"}`` each),
    summed; None unless every run reported one."""
    if not reported or not all(isinstance(u, dict) for u in reported):
        return None
    inputs = sum(int(u.get("input_tokens", 0)) for u in reported)
    cached = sum(int(u.get("cached_tokens", 0)) for u in reported)
    return {"input_tokens": inputs, "output_tokens": 0, "total_tokens": inputs,
            "input_tokens_details": {"cached_tokens": cached}}
