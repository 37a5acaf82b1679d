"""``POST /v1/images/edits``: an image and a prompt in, as OpenAI's multipart/form-data form, the
declared image graph's edits of it out (base64 PNGs).

The form holds one file, `image` (the official client names it ``image``, or ``image[]`` for a
list), and the text fields of ``/v1/images/generations``, checked as that route checks them
(`checked_inputs`: `n`, `size`, `seed`, `negative_prompt`, `num_inference_steps`,
`guidance_scale`...) before any work, plus `strength` (as in diffusers: how far the image is
noised; the graph's default). A `mask` is refused by name: the whole image is edited. Without
`size` the edit has the image's size, rounded down to the model's pixel step by the graph.

The upload is hostile input. Its bytes are bounded before they are read: the whole body by the
server's body limit (`omni.serve._guard` refuses a larger one with 413 before any route reads
it), the file by `MediaPolicy.max_item_bytes`; then it is decoded as a chat message's image is
(`decode_media`: its header read first, the pixel caps, a decompression bomb refused, the
budget of pixels in flight reserved until the answer has gone), every pass in a worker thread.
The form itself is parsed by Starlette's parser (python-multipart) on the event loop, as a JSON
body is: ~30 ms at a 30 MiB body, the file spooled to disk in a worker thread past 1 MiB.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import ConfigDict, Field
from starlette.datastructures import FormData, UploadFile
from starlette.requests import Request
from starlette.responses import Response

from omni.serve._errors import ApiError
from omni.serve._guard import until_answered
from omni.serve.openai._body import validated
from omni.serve.openai._declare import EDIT_INPUT, ImagePart
from omni.serve.openai._images import ImageRequest, answer_images, checked_inputs
from omni.serve.openai._media import MediaPolicy, MediaSource, decode_media

__all__ = ["EditRequest", "edits_route"]

MAX_FORM_FILES = 2  # the image, and a mask: refused by name rather than by count
MAX_FORM_FIELDS = 32  # text fields: more than the form has names for
MAX_FIELD_BYTES = 1 << 20  # a text field's bytes (the prompt's among them)
IMAGE_FIELDS = ("image", "image[]")  # how OpenAI's client names the image: one file, a list


class EditRequest(ImageRequest):
    """The form's text fields: the generations route's, read from text (a form holds no
    numbers), and `strength`."""

    model_config = ConfigDict(extra="forbid", strict=False)

    strength: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)


def edits_route(runtime: Any, find: Callable[[str | None], Any], media: MediaPolicy
                ) -> Callable[[Request], Awaitable[Response]]:
    """The route's handler; `find(model)` is the image graph editing for `model` (or
    `ApiError`: 404 for no such model, 400 for one that takes no image); the upload is
    decoded under `media`."""

    async def image_edits(request: Request) -> Response:
        async with request.form(max_files=MAX_FORM_FILES, max_fields=MAX_FORM_FIELDS,
                                max_part_size=MAX_FIELD_BYTES) as form:
            fields, upload = _fields(form)
            body = validated(EditRequest, fields, "image edits")
            graph = find(body.model)
            inputs = checked_inputs(request, graph, body)
            raw = await _read(upload, media)
        image = await _decode(raw, media, request)
        return await answer_images(request, runtime, graph, {**inputs, EDIT_INPUT: image},
                                   body.n)

    return image_edits


def _fields(form: FormData) -> tuple[dict[str, str], UploadFile]:
    """The form's text fields by name and its image file; `ApiError` 400 naming the field for
    a mask, a file where text belongs (or text where the image does), a field sent twice,
    and no image or more than one."""
    fields: dict[str, str] = {}
    images = []
    for name, value in form.multi_items():
        if name == "mask":
            raise ApiError(400, "mask: not served: Omni edits the whole image (no inpainting "
                                "mask); leave mask out", param="mask")
        if name in IMAGE_FIELDS:
            if not isinstance(value, UploadFile):
                raise ApiError(400, f"{name}: the image must be a file part, got text",
                               param="image")
            images.append(value)
        elif not isinstance(value, str):
            raise ApiError(400, f"{name}: a file where a text field belongs (only the image "
                                "is a file)", param=name)
        elif name in fields:
            raise ApiError(400, f"{name}: sent twice", param=name)
        else:
            fields[name] = value
    if len(images) != 1:
        raise ApiError(400, f"image: one image file is edited per request, sent as a part of "
                            f"a multipart/form-data body; got {len(images)}", param="image")
    return fields, images[0]


async def _read(upload: UploadFile, media: MediaPolicy) -> bytes:
    """The upload's bytes, once its size (counted as the form was parsed) is within the
    policy's per item: a larger one is not read into memory at all."""
    size = upload.size or 0
    if size > media.max_item_bytes:
        raise ApiError(400, f"image: {size:,} bytes, more than the {media.max_item_bytes:,} this "
                            "server takes per item (set by --max-media-mib)", param="image")
    return await upload.read()


async def _decode(raw: bytes, media: MediaPolicy, request: Request) -> ImagePart:
    """The image decoded by `decode_media` (the one home of the server's checks on client
    media), its pixels held in the budget in flight until the answer has gone."""
    (image,) = await decode_media([MediaSource("image", "image", raw)], media,
                                  until_answered(request))
    return image
