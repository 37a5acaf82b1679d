"""The image pipeline of a Cosmos3 folder (diffusers' layout): a prompt in, a PNG out.

    check_out ───────────────────────────────────────────────────────────► save_png ─►
    Cosmos3Understand (the understanding expert on Omni's engine, ─► Cosmos3Paint ─┘
                       prefixes cached)             (each step the generation expert;
                                                     diffusers: VAE, scheduler)

`Cosmos3Understand` reads a request's prompts once: the understanding expert's keys and
values, on Omni's engine, the shared system prompt read from its store. `Cosmos3Paint` runs
every denoising step with the generation expert alone, against them, and the folder's own
diffusers modules do the rest, so the PNG is the one diffusers' ``Cosmos3OmniPipeline`` saves
for the same request (with its safety checker off). Two nodes, so that the two experts may
run on different workers (the keys and values travel); in one process they share one loaded
model. One call at a time per replica. The graph answers ``POST /v1/images/generations``
under ``omni serve``.
"""

from __future__ import annotations

import threading
import weakref
from pathlib import Path
from typing import Annotated, Any

import numpy as np

from omni._openmp import run_in_worker
from omni.compute import Cosmos3
from omni.compute.cosmos3 import Understood
from omni.compute.image_families import check_family
from omni.graph import CacheSalt, Graph, OutputFile, context, graph, node
from omni.pipelines._files import check_out, save_png
from omni.serve.openai import image_generations

__all__ = ["Cosmos3Paint", "Cosmos3Understand", "cosmos3_graph"]


_MODELS: weakref.WeakValueDictionary[str, Cosmos3] = weakref.WeakValueDictionary()
_MODELS_LOCK = threading.Lock()


def _model(folder: str) -> Cosmos3:
    """The folder's `Cosmos3`, loaded once per process while a node holds it: the two nodes
    of a graph share it when they run in one process, and each worker that runs one of them
    loads its own."""
    with _MODELS_LOCK:
        model = _MODELS.get(folder)
        if model is None:
            model = _MODELS[folder] = Cosmos3.from_pretrained(folder)
        return model


@node
class Cosmos3Understand:
    """The understanding side, built once per replica; a call reads a request's prompts
    (the understanding expert on Omni's engine, a cached prefix from its store)."""

    def __init__(self, folder: str = "") -> None:
        self.model = _model(folder)

    async def __call__(self, prompt: str, negative_prompt: str, width: int, height: int,
                       guidance: float, cache_salt: str) -> list[Understood]:
        """`Cosmos3.understand_request`: the keys and values the generation side reads."""
        return await run_in_worker(lambda: self.model.understand_request(
            prompt, negative_prompt, width=width, height=height, guidance=guidance,
            cache_salt=cache_salt))


@node
class Cosmos3Paint:
    """The generation side, built once per replica; a call paints one image."""

    def __init__(self, folder: str = "") -> None:
        self.model = _model(folder)

    async def __call__(self, understood: list[Understood], width: int, height: int,
                       steps: int, guidance: float, seed: int) -> dict[str, Any]:
        """``{"image", "usage"}``: the image ``[height, width, 3]`` uint8, as diffusers' PIL
        output rounds it, and its prompts' tokens (`Painted.usage`)."""
        progress = context().progress  # each step reaches /metrics
        painted = await run_in_worker(lambda: self.model.paint(
            understood, width=width, height=height, steps=steps, guidance=guidance, seed=seed,
            on_step=progress))
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
        understood = Cosmos3Understand(folder=root)(prompt, negative_prompt, width, height,
                                                    guidance, cache_salt)
        painted = Cosmos3Paint(folder=root)(understood, width, height, steps, guidance, seed)
        return save_png(painted, path, png)

    return image_generations(graph(cosmos3, name=name))
