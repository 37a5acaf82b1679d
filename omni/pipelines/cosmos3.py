"""The image pipeline of a Cosmos3 folder (diffusers' layout): a prompt in, a PNG out.

    check_out ──────────────────────────────────────────────────────► save_png ─► the result
    Cosmos3Paint (the understanding pathway once per request; each  ─┘
                  step the generation expert only; diffusers: VAE, scheduler)

`Cosmos3Paint` holds the folder's `omni.compute.Cosmos3`: each prompt's understanding keys and
values are computed once, every denoising step runs only the generation expert against them,
and the folder's own diffusers modules do the rest, so the PNG is the one diffusers'
``Cosmos3OmniPipeline`` saves for the same request (with its safety checker off). One call at
a time per replica. The graph answers ``POST /v1/images/generations`` under ``omni serve``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import numpy as np

from omni.compute import Cosmos3
from omni.compute.image_families import check_family
from omni.graph import CacheSalt, Graph, OutputFile, context, graph, node
from omni.pipelines._files import check_out, save_png
from omni.serve.openai import image_generations

__all__ = ["Cosmos3Paint", "cosmos3_graph"]


@node
class Cosmos3Paint:
    """The folder's model, built once per replica; a call paints one image."""

    def __init__(self, folder: str = "") -> None:
        self.model = Cosmos3.from_pretrained(folder)

    async def __call__(self, prompt: str, negative_prompt: str, width: int, height: int,
                       steps: int, guidance: float, seed: int, cache_salt: str
                       ) -> dict[str, Any]:
        """``{"image", "usage"}``: the image ``[height, width, 3]`` uint8, as diffusers' PIL
        output rounds it, and its prompts' tokens (`Painted.usage`)."""
        painted = await self.model.agenerate(
            prompt, negative_prompt=negative_prompt, width=width, height=height, steps=steps,
            guidance=guidance, seed=seed, cache_salt=cache_salt,
            on_step=context().progress)  # each step reaches /metrics
        return {"image": (painted.images[0] * 255).round().astype(np.uint8),
                "usage": painted.usage()}


def cosmos3_graph(folder: str | Path, name: str = "cosmos3") -> Graph:
    """The graph `name` painting with the Cosmos3 folder `folder`, marked for
    ``/v1/images/generations``. Inputs: `prompt`, `out` (the PNG to write), and optionally
    `width` and `height` (pixels; 1280 x 720), `steps` (35), `guidance` (6.0: the pipeline's
    ``guidance_scale``, 1 reads no negative prompt), `negative_prompt` (""), `seed` (0),
    `png` (false; true with ``out=""``: the result carries the PNG's bytes) and `cache_salt`
    (the request's: ``omni serve`` sets it). The result reports the prompts' `usage`.

    Raises:
        ValueError: `folder` is not a Cosmos3 folder (`image_family`).
    """
    root = str(Path(folder).expanduser().resolve())
    check_family(root, "cosmos3")

    def cosmos3(prompt: str, out: Annotated[str, OutputFile(".png")], width: int = 1280,
                height: int = 720, steps: int = 35, guidance: float = 6.0,
                negative_prompt: str = "", seed: int = 0, png: bool = False,
                cache_salt: Annotated[str, CacheSalt()] = ""):
        path = check_out(out, png)
        painted = Cosmos3Paint(folder=root)(prompt, negative_prompt, width, height, steps,
                                            guidance, seed, cache_salt)
        return save_png(painted, path, png)

    return image_generations(graph(cosmos3, name=name))
