"""The image pipeline of a Z-Image folder (diffusers' layout): a prompt in, a PNG out.

    check_out ───────────────────────────► save_png ─► the result
    ZImagePaint (Omni's engine: the text condition; diffusers: DiT, VAE, scheduler) ─┘

`ZImagePaint` holds the folder's `omni.compute.ZImage`: Omni's engine computes the prompt's
and the negative prompt's conditions, the folder's own diffusers pipeline (loaded without its
text encoder) paints from them, with diffusers' defaults and generator semantics, so the PNG
is the one diffusers' ``ZImagePipeline`` saves for the same request. One call at a time per
replica: a diffusers pipeline keeps its scheduler's state while it runs. The graph answers
``POST /v1/images/generations`` under ``omni serve``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import numpy as np

from omni.compute import ZImage
from omni.compute.diffusion import to_png
from omni.compute.z_image import image_family
from omni.graph import Graph, OutputFile, graph, node
from omni.pipelines._files import check_out, write_file
from omni.serve.openai import image_generations

__all__ = ["ZImagePaint", "save_png", "z_image_graph"]


@node
class ZImagePaint:
    """The folder's model, built once per replica; a call paints one image."""

    def __init__(self, folder: str = "") -> None:
        self.model = ZImage.from_pretrained(folder)

    async def __call__(self, prompt: str, negative_prompt: str, width: int, height: int,
                       steps: int, guidance: float, seed: int) -> np.ndarray:
        """The image ``[height, width, 3]`` uint8, as diffusers' PIL output rounds it."""
        images = await self.model.agenerate(prompt, negative_prompt=negative_prompt,
                                            width=width, height=height, steps=steps,
                                            guidance=guidance, seed=seed)
        return (images[0] * 255).round().astype(np.uint8)


@node(thread=True)
def save_png(image: np.ndarray, path: str, png: bool) -> dict[str, Any]:
    """Encode `image` as PNG, write it to `path` (nothing for ""), report it (with the PNG's
    bytes under "png" when `png`)."""
    data = to_png(image)
    if path:
        write_file(path, data)
    height, width, _ = image.shape
    report: dict[str, Any] = {"out": path or None, "width": width, "height": height,
                              "png_bytes": len(data)}
    return {**report, "png": data} if png else report


def z_image_graph(folder: str | Path, name: str = "z_image") -> Graph:
    """The graph `name` painting with the Z-Image folder `folder`, marked for
    ``/v1/images/generations``. Inputs: `prompt`, `out` (the PNG to write), and optionally
    `width` and `height` (pixels; 1024), `steps` (50), `guidance` (5.0; 0 skips the negative
    prompt), `negative_prompt` (""), `seed` (0) and `png` (false; true with ``out=""``: the
    result carries the PNG's bytes).

    Raises:
        ValueError: `folder` is not a folder of a family Omni serves (`image_family`).
    """
    root = str(Path(folder).expanduser().resolve())
    image_family(root)

    def z_image(prompt: str, out: Annotated[str, OutputFile(".png")], width: int = 1024,
                height: int = 1024, steps: int = 50, guidance: float = 5.0,
                negative_prompt: str = "", seed: int = 0, png: bool = False):
        path = check_out(out, png)
        image = ZImagePaint(folder=root)(prompt, negative_prompt, width, height, steps,
                                         guidance, seed)
        return save_png(image, path, png)

    return image_generations(graph(z_image, name=name))
