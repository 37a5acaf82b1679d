"""The image pipeline of a Z-Image folder (diffusers' layout): a prompt, and optionally an image
to edit, in; a PNG out.

    check_out ─────────────────────────────────────────────────────► save_png ─► the result
    read_image ──────────────────────────────► ZImagePaint (diffusers: ─┘
    ZImageCondition (Omni's engine: the text ─┘  DiT, VAE, scheduler)
                     conditions, prefixes cached)

`ZImageCondition` holds the folder's text side (`omni.compute.ZImageText`): Omni's engine
computes the prompt's and the negative prompt's conditions, a cached prefix read from its
store. `ZImagePaint` holds the diffusion side (`omni.compute.ZImagePainter`): the folder's own
diffusers pipeline, loaded without its text encoder, paints from them with diffusers' defaults
and generator semantics, so the PNG is the one diffusers' ``ZImagePipeline`` saves for the
same request; given an image, the one diffusers' ``ZImageImg2ImgPipeline`` saves (the same
modules, `strength` its). Two nodes, so that the two models may run on different workers:
the conditions travel. One pipeline call at a time per replica (a diffusers pipeline keeps its
scheduler's state while it runs): requests that arrive meanwhile and paint at one size, step
count and guidance are then denoised together, each its own image. The graph answers
``POST /v1/images/generations`` under ``omni serve``, and ``POST /v1/images/edits`` (its
`image` input takes the uploaded image, decoded: an `ImagePart`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import numpy as np

from omni._openmp import run_in_worker
from omni.compute.image_families import image_family
from omni.compute.z_image import Conditions, Painted, ZImagePainter, ZImageText
from omni.graph import CacheSalt, Context, Graph, InputFile, OutputFile, context, graph, node
from omni.pipelines._batch import Batcher
from omni.pipelines._files import check_out, read_pixels, save_png
from omni.serve.openai import ImagePart, image_generations

__all__ = ["MAX_BATCH", "ZImageCondition", "ZImagePaint", "read_image", "z_image_graph"]


@node(thread=True)
def read_image(image: str | ImagePart) -> np.ndarray | None:
    """The pixels to edit, uint8 RGB ``[H, W, 3]``: an `ImagePart`'s (the edits route decoded
    the upload), the image file's at the path `image` (PNG, JPEG or another Pillow reads), or
    None for "" (paint from the prompt alone)."""
    if isinstance(image, ImagePart):
        return image.pixels
    if not isinstance(image, str):
        raise ValueError(f"image must be the path of an image file, got {type(image).__name__}")
    return None if image == "" else read_pixels(image)


MAX_BATCH = 8  # requests of one size and step count a replica denoises together


@node
class ZImageCondition:
    """The folder's text side (`ZImageText`: Omni's engine, a KV store of its own for cached
    prefixes), built once per replica; a call gives a request's conditions."""

    def __init__(self, folder: str = "") -> None:
        self.text = ZImageText.from_pretrained(folder)

    async def __call__(self, prompt: str, negative_prompt: str, guidance: float,
                       cache_salt: str) -> Conditions:
        """The prompt's condition, and the negative prompt's when `guidance` reads it,
        prefixes read only from requests of the same `cache_salt` (`ZImageText.conditions`)."""
        return await run_in_worker(self.text.conditions, prompt, negative_prompt, guidance,
                                   cache_salt)


@node(concurrency=MAX_BATCH)
class ZImagePaint:
    """The folder's diffusion side (`ZImagePainter`), built once per replica; a call paints
    one image from a request's conditions, or edits one. Calls that arrive while the replica
    paints wait, then those painting from text at one size, step count and guidance are
    denoised together (`Batcher`, up to `MAX_BATCH`); edits run one at a time."""

    def __init__(self, folder: str = "") -> None:
        self.painter = ZImagePainter.from_pretrained(folder)
        self.batcher: Batcher[tuple[Any, Any, Context], Painted] = Batcher(self._paint, MAX_BATCH)

    async def __call__(self, conditions: Conditions, image: np.ndarray | None, strength: float,
                       width: int | None, height: int | None, steps: int, guidance: float,
                       seed: int) -> dict[str, Any]:
        """``{"image", "usage"}``: the image ``[height, width, 3]`` uint8, as diffusers' PIL
        output rounds it, `image` edited (`ZImagePainter.edit`), or, without one, painted
        (`ZImagePainter.paint`; 1024 pixels a side unless given); and the tokens its
        conditions cost (`Painted.usage`)."""
        key: Any
        if image is not None:
            key = ("edit", object())  # a batch of its own
            item: Any = (conditions, image, {
                "strength": strength, "width": width, "height": height, "steps": steps,
                "guidance": guidance, "seed": seed})
        else:
            key = ("paint", 1024 if width is None else width,
                   1024 if height is None else height, steps, guidance)
            item = (conditions, seed)
        # each call's steps reach /metrics (`omni.Context.progress`), whichever call's task
        # runs the batch
        painted = await self.batcher(key, (key, item, context()))
        return {"image": (painted.images[0] * 255).round().astype(np.uint8),
                "usage": painted.usage()}

    async def _paint(self, calls: list[tuple[Any, Any, Context]]) -> list[Painted]:
        """One batch's images, in a worker thread (the calls share their key)."""
        return await run_in_worker(self._paint_now, calls)

    def _paint_now(self, calls: list[tuple[Any, Any, Context]]) -> list[Painted]:
        (kind, *shared), _, _ = calls[0]

        def on_step(done: int, total: int) -> None:
            for _, _, call in calls:
                call.progress(done, total)

        if kind == "edit":
            ((_, (conditions, image, settings), _),) = calls
            return [conditions.painted(self.painter.edit(conditions, image, on_step=on_step,
                                                         **settings))]
        width, height, steps, guidance = shared
        requests = [conditions for _, (conditions, _), _ in calls]
        images = self.painter.paint(requests, [seed for _, (_, seed), _ in calls], width=width,
                                    height=height, steps=steps, guidance=guidance,
                                    on_step=on_step)
        return [c.painted(images[i:i + 1]) for i, c in enumerate(requests)]


def z_image_graph(folder: str | Path, name: str = "z_image") -> Graph:
    """The graph `name` painting with the Z-Image folder `folder`, marked for
    ``/v1/images/generations`` (and so ``/v1/images/edits``). Inputs: `prompt`, `out` (the PNG
    to write), and optionally `image` (an image to edit: a file's path, or an `ImagePart`;
    "": paint from the prompt), `strength` (0.6: how far an edited image is noised),
    `width` and `height` (pixels; 1024, or for an edit the image's size rounded down to the
    model's pixel step), `steps` (50), `guidance` (5.0; 0 skips the negative prompt),
    `negative_prompt` (""), `seed` (0), `png` (false; true with ``out=""``: the result
    carries the PNG's bytes) and `cache_salt` (the request's: ``omni serve`` sets it, so
    tenants share no cached prompt). The result reports the prompts' `usage`
    (``input_tokens``, ``cached_tokens``).

    Raises:
        ValueError: `folder` is not a folder of a family Omni serves (`image_family`).
    """
    root = str(Path(folder).expanduser().resolve())
    image_family(root)

    def z_image(prompt: str, out: Annotated[str, OutputFile(".png")],
                image: Annotated[str | ImagePart, InputFile()] = "", strength: float = 0.6,
                width: int | None = None, height: int | None = None, steps: int = 50,
                guidance: float = 5.0, negative_prompt: str = "", seed: int = 0,
                png: bool = False, cache_salt: Annotated[str, CacheSalt()] = ""):
        path = check_out(out, png)
        pixels = read_image(image)
        conditions = ZImageCondition(folder=root)(prompt, negative_prompt, guidance,
                                                  cache_salt)
        painted = ZImagePaint(folder=root)(conditions, pixels, strength, width, height, steps,
                                           guidance, seed)
        return save_png(painted, path, png)

    return image_generations(graph(z_image, name=name))
