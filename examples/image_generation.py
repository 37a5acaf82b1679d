r"""Text (and an optional reference image) to a PNG: an LLM role and a diffusion role on ONE model
and ONE copy of the prompt's KV cache.

    omni run examples/image_generation.py --input prompt="a red fox in snow" --input out=fox.png
    omni run examples/image_generation.py --input prompt="the same fox, at dusk" \
        --input image=fox.png --input out=dusk.png --input steps=20 --json
    OMNI_MODEL=/path/to/hf-model omni run examples/image_generation.py --input prompt=... ...
    omni graph show examples/image_generation.py --format mermaid

Inputs: `prompt`, `out` (the PNG to write), and optionally `image` (a PNG or JPEG reference
image), `width` and `height` (pixels, multiples of 16; 128), `steps` (8), `guidance` (3.0),
`seed` (0), `expand` (tokens the LLM role writes; 8), `reuse` (true) and `png` (false; true
with ``out=""``: the result carries the PNG's bytes under "png" and no file is written, which
is how ``omni serve`` answers ``POST /v1/images/generations`` with this graph). `out` and
`image` are marked as files: on ``POST /v1/graphs/image_generation`` the server picks `out`
and sends the PNG back in the answer's ``"files"``, and `image` must lie under a folder its
operator allows (``--allow-path``).

The graph (`check_settings` feeds both roles):

    read_reference ─┬─► Understand ─► Paint ─────────► write_png ─► the result
    check_settings ─┘   (LLM role)    (diffusion role)  ▲
    check_out ──────────────────────────────────────────┘

- `Understand`, the LLM role, reads the prompt (the reference image's embeddings at their
  placeholder positions) with `TorchEngine.generate` and writes `expand` more tokens (greedy):
  a prompt expansion, as a model that "thinks" before it draws does. Prefill and decode put
  every full page of prompt + expansion into the runtime's KV store (`omni.context().kv`).
- `Paint`, the diffusion role, runs `ImageGenerator` on the SAME engine (one copy of the
  weights): it conditions on prompt + expansion, looks that up in the same store under the
  same page keys and leases the LLM role's pages (`prompt_tokens_reused`); only the tokens
  after the last full page are computed again. Each denoising step then runs the image tokens
  only, against that KV. Its last stage is the latent decoder (latents -> pixels).
- `write_png` encodes the pixels and writes them to `out` (whole or not at all).

Both roles are class nodes built once when the runtime starts; `_shared_engine` hands them the
one engine of this process for the runtime's store, so "one copy" holds for the weights and
for the KV alike (in one process: with `--cluster` each worker would build its own engine).
`kv_bytes_resident` is that one copy of the prompt's KV; `kv_bytes_separate` is what an LLM
service plus a separate diffusion service would each keep (twice as much). `reuse=false` makes
the diffusion role recompute the prompt's KV instead: the same image with
`prompt_tokens_reused` 0 (the baseline). It is the same PNG bit for bit for the built-in model's
prompts; on long prompts the recomputed KV is summed in another order, and a pixel may then
differ by one level (`perf/footprint.py` measured 1 of 49,152 for a 1,999-token prompt).

Models. Without `OMNI_MODEL` it runs the built-in tiny random Llama (no download; a few
seconds on a laptop CPU, most of it importing torch): the images are seeded noise that the
prompt changes only a little (a few levels per pixel), not pictures of foxes, and the
expansion is random bytes. With `OMNI_MODEL=/path` (a Hugging Face Llama or Qwen2 folder:
config.json, safetensors and, for text prompts, tokenizer.json) the LLM role is that model,
loaded with `TorchEngine.from_pretrained`, in float32 on the CPU. The diffusion side stays
the built-in one even then: the `DiffusionHead` (latents <-> the model's hidden size), the
latent decoder and the encoder of the reference image are small seeded random modules, not
trained weights, so a real LLM gives real expansions and real KV reuse but not a real
picture. The model is chosen per process (an environment variable), not per request (an
input), because `omni run` builds the KV store from `KV_LAYOUT`, the model's page layout,
before any request runs.

With `OMNI_MODEL` a diffusers pipeline folder (``model_index.json``), the graph is the
library's pipeline for that family instead (`omni.pipelines.image_graph`), and the PNG is the
one diffusers' own pipeline saves for the same request. Z-Image (`z_image_graph`): Omni's
engine computes the text condition (a prompt's cached prefix read from the store), the
folder's diffusers modules paint; inputs `prompt`, `out`, `image` (a file to edit, as
diffusers' image-to-image pipeline does) with `strength` (0.6), `width`, `height` (1024, or
the image's), `steps` (50), `guidance` (5.0), `negative_prompt`, `seed`, `png`. Cosmos3
(`cosmos3_graph`): the understanding pathway once per request, each step the generation
expert alone; the same inputs but `image` and `strength`, 1280 x 720, 35 steps, guidance
6.0. A folder of another family is refused, naming it and the families served.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch

import omni
from omni.compute import (
    DiffusionResult,
    Image,
    ImageGenerator,
    Prompt,
    SamplingParams,
    Text,
    TorchEngine,
)
from omni.compute.diffusion import to_png
from omni.compute.models import DecoderConfig, tiny_config
from omni.pipelines import check_out, image_graph, read_pixels, write_file
from omni.serve.openai import image_generations

MODEL = os.environ.get("OMNI_MODEL", "")  # a Hugging Face folder; "" = the built-in tiny model
PAGE_SIZE = 16
PIXEL_STEP = 16  # an image side is a multiple of this: 8 pixels per latent, 2x2 latents a token
MAX_SIDE = 1024
MAX_STEPS = 1000
MAX_EXPAND = 256


def _kv_layout(model: str) -> Any:
    """The page layout of `model`'s KV cache, read from its config.json (no weights loaded)."""
    if not model:
        return tiny_config().kv_layout(PAGE_SIZE, torch.float32)
    config = Path(model) / "config.json"
    try:
        hf = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"OMNI_MODEL={model!r}: cannot read {config} ({exc}); give a Hugging "
                         "Face model folder, or unset OMNI_MODEL for the built-in tiny model"
                         ) from None
    return DecoderConfig.from_hf(hf).kv_layout(PAGE_SIZE, torch.float32)


# a diffusers pipeline folder (model_index.json): its family's pipeline from the library
DIFFUSERS_FOLDER = bool(MODEL) and (Path(MODEL) / "model_index.json").is_file()
# `omni run` builds the runtime's KV store with this layout (none for a diffusers folder: its
# text encoder keeps no KV in the runtime's store yet)
KV_LAYOUT = None if DIFFUSERS_FOLDER else _kv_layout(MODEL)

# One engine per (store, model) in this process, alive while a node holds it.
_ENGINES: weakref.WeakValueDictionary[tuple[int, str], TorchEngine] = (
    weakref.WeakValueDictionary())


def _shared_engine(model: str) -> TorchEngine:
    """The engine of `model` on the runtime's KV store, built by the first role that asks.

    Why: both roles run on one copy of the weights, and both read and write the same store
    under the same page keys (the engine's model id and page size), so the prompt's KV is kept
    once. The engine holds the store, so the store's id is not reused while the entry lives.
    """
    store = omni.context().kv
    if store is None:
        raise RuntimeError("this graph needs the runtime's KV store: run it with `omni run`, "
                           "which builds one from KV_LAYOUT, or omni.Runtime(kv=KV_LAYOUT)")
    key = (id(store), model)
    engine = _ENGINES.get(key)
    if engine is None:
        if model:
            engine = TorchEngine.from_pretrained(model, store=store, page_size=PAGE_SIZE)
        else:
            engine = TorchEngine.tiny(seed=0, store=store, page_size=PAGE_SIZE)
        _ENGINES[key] = engine
    return engine


# -- values that travel between the nodes -----------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """A request's checked settings; `width` and `height` in pixels."""

    width: int
    height: int
    steps: int
    guidance: float
    seed: int
    expand: int


@dataclass(frozen=True, eq=False)
class Understood:
    """What the LLM role read and wrote: the prompt the diffusion role conditions on."""

    prompt: Prompt  # the request's prompt + the expansion's token ids
    expansion: str
    expansion_tokens: int
    llm_prompt_tokens: int
    llm_cached_tokens: int  # of them, found in the store (an earlier request's pages)
    seconds: float


@dataclass(frozen=True, eq=False)
class Painted:
    """The diffusion role's image and figures (`result`: the `DiffusionResult`)."""

    understood: Understood
    result: DiffusionResult
    model: str
    reuse: bool
    seconds: float


# -- nodes ------------------------------------------------------------------------------------


@omni.node
async def check_settings(width: int, height: int, steps: int, guidance: float, seed: int,
                         expand: int) -> Settings:
    """Check every number before any model runs; ValueError naming the input."""
    for name, value in (("width", width), ("height", height)):
        if (not _is_int(value) or value < PIXEL_STEP or value > MAX_SIDE
                or value % PIXEL_STEP):
            raise ValueError(f"{name} must be a multiple of {PIXEL_STEP} pixels from "
                             f"{PIXEL_STEP} to {MAX_SIDE}, got {value!r}")
    if not _is_int(steps) or not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"steps must be an integer from 1 to {MAX_STEPS}, got {steps!r}")
    if (isinstance(guidance, bool) or not isinstance(guidance, numbers.Real)
            or not math.isfinite(guidance) or guidance < 0):
        raise ValueError(f"guidance must be a number >= 0, got {guidance!r}")
    if not _is_int(seed):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if not _is_int(expand) or not 0 <= expand <= MAX_EXPAND:
        raise ValueError(f"expand must be an integer from 0 to {MAX_EXPAND} (tokens the LLM "
                         f"role writes), got {expand!r}")
    return Settings(width, height, steps, float(guidance), seed, expand)


@omni.node(thread=True)
def read_reference(image: str) -> list[Image]:
    """The reference image at path `image` (PNG, JPEG or whatever else Pillow reads; any
    size: the encoder resizes it), or none for ""."""
    if image == "":
        return []
    if not isinstance(image, str):
        raise ValueError(f"image must be the path of a PNG or JPEG file, got {image!r}")
    return [Image(read_pixels(image))]


@omni.node(concurrency=8)  # concurrent requests share the engine's decode steps
class Understand:
    """The LLM role: prefill the prompt (its pages go to the store) and expand it greedily."""

    def __init__(self, model: str = MODEL) -> None:
        self.engine = _shared_engine(model)

    async def __call__(self, prompt: str, references: list[Image], settings: Settings,
                       cache_salt: str = "") -> Understood:
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"prompt must be non-empty text, got {prompt!r}")
        if self.engine.tokenizer is None:
            raise ValueError(f"the model {self.engine.model_id} has no tokenizer.json, so it "
                             "cannot read a text prompt")
        request = Prompt([*references, Text(prompt)])
        started = time.perf_counter()
        params = SamplingParams(max_new_tokens=settings.expand, temperature=0)
        result = await self.engine.generate(request, params, cache_salt=cache_salt)
        # The expansion goes on as token ids, exactly the ones whose KV the engine cached.
        conditioned = request + Text(result.token_ids) if result.token_ids else request
        return Understood(conditioned, result.text or "", len(result.token_ids),
                          result.prompt_tokens, result.cached_tokens,
                          time.perf_counter() - started)


@omni.node
class Paint:
    """The diffusion role: the same engine's transformer denoises image tokens against the
    prompt KV the LLM role cached; the latent decoder turns the latents into pixels."""

    def __init__(self, model: str = MODEL) -> None:
        self.engine = _shared_engine(model)
        self.generator = ImageGenerator(self.engine, seed=0)

    async def __call__(self, understood: Understood, settings: Settings, reuse: bool,
                       cache_salt: str = "") -> Painted:
        if not isinstance(reuse, bool):
            raise ValueError(f"reuse must be true or false, got {reuse!r}")
        started = time.perf_counter()
        result = await self.generator.generate(
            understood.prompt, height=settings.height // 8, width=settings.width // 8,
            steps=settings.steps, guidance=settings.guidance, seed=settings.seed, reuse=reuse,
            cache_salt=cache_salt)
        return Painted(understood, result, self.engine.model_id, reuse,
                       time.perf_counter() - started)


@omni.node(thread=True)
def write_png(painted: Painted, path: str, png: bool) -> dict:
    """Encode the image as PNG, write it to `path` (whole or not at all; nothing for ""),
    report the run (with the PNG's bytes under "png" when `png`)."""
    started = time.perf_counter()
    data = to_png(painted.result.image)
    if path:
        write_file(path, data)
    result, understood = painted.result, painted.understood
    height, width, _ = result.image.shape
    report = {
        "out": path or None, "width": width, "height": height, "png_bytes": len(data),
        "model": painted.model, "steps": result.steps,
        "prompt_tokens": result.prompt_tokens,
        "prompt_tokens_reused": result.prompt_tokens_reused,
        "seconds_per_step": round(result.time_per_step, 6),
        "kv_bytes_resident": result.kv_bytes_resident,
        "kv_bytes_separate": result.kv_bytes_separate,
        "reuse": painted.reuse,
        "expansion": understood.expansion,
        "expansion_tokens": understood.expansion_tokens,
        "llm": {"prompt_tokens": understood.llm_prompt_tokens,
                "cached_tokens": understood.llm_cached_tokens},
        # what /v1/images/generations reports: the prompt as the LLM role read it
        "usage": {"input_tokens": understood.llm_prompt_tokens,
                  "cached_tokens": understood.llm_cached_tokens},
        "timing": {"understand_s": round(understood.seconds, 4),
                   "diffusion_s": round(painted.seconds, 4),
                   "write_s": round(time.perf_counter() - started, 4)},
    }
    return {**report, "png": data} if png else report


@image_generations  # POST /v1/images/generations with `omni serve` (out="", png=true)
@omni.graph
def image_generation(prompt: str, out: Annotated[str, omni.OutputFile(".png")],
                     image: Annotated[str, omni.InputFile()] = "", width: int = 128,
                     height: int = 128, steps: int = 8, guidance: float = 3.0, seed: int = 0,
                     expand: int = 8, reuse: bool = True, png: bool = False,
                     cache_salt: Annotated[str, omni.CacheSalt()] = ""):
    settings = check_settings(width, height, steps, guidance, seed, expand)
    references = read_reference(image)
    path = check_out(out, png)
    understood = Understand()(prompt, references, settings, cache_salt)
    painted = Paint()(understood, settings, reuse, cache_salt)
    return write_png(painted, path, png)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


if DIFFUSERS_FOLDER:  # OMNI_MODEL is a diffusers folder: its family's pipeline paints instead
    image_generation = image_graph(MODEL, name="image_generation")
