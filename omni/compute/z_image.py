"""Z-Image's text condition computed by Omni's engine, as diffusers' `ZImagePipeline` computes it.

A Z-Image folder (diffusers' layout: ``model_index.json`` naming ``ZImagePipeline``) keeps its
text encoder, a Qwen3 language model, in ``text_encoder/`` and its tokenizer in
``tokenizer/``. diffusers renders a prompt as a one-message conversation with the tokenizer's
own chat template (``enable_thinking=True``, the generation prompt added), keeps its first
`MAX_SEQUENCE_LENGTH` tokens (the template's counted), and conditions the DiT on every token's
hidden state after the encoder's second-to-last layer (transformers' ``hidden_states[-2]``,
before any norm); padding is masked out. The negative prompt (``""`` when absent) is encoded
the same way. Here the encoder is Omni's `TorchEngine`, loaded with only the layers that state
needs, and the prompt is never padded. A prompt that starts as an earlier one did (a shared
style preamble, the constant negative prompt) reads that prefix's KV from the engine's store
and its hidden states from beside it (`ModelRunner.last_hidden`): only the rest is computed.
diffusers' own modules (the DiT, the VAE, the scheduler) take the result as ``prompt_embeds``
/ ``negative_prompt_embeds``: `ZImage` is the folder's pipeline loaded without its text
encoder, fed `ZImageText`'s conditions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni._openmp import run_in_worker
from omni.compute.diffusion import check_image_settings
from omni.compute.engine import TorchEngine
from omni.compute.image_families import check_family
from omni.compute.prompt import Text

__all__ = ["MAX_SEQUENCE_LENGTH", "Condition", "Conditions", "OnStep", "PaintRequest",
           "Painted", "ZImage", "ZImagePainter", "ZImageText"]

MAX_SEQUENCE_LENGTH = 512  # tokens of a rendered prompt diffusers keeps
OnStep = Callable[[int, int], None]  # (steps done, steps in all), after each step


@dataclass(frozen=True)
class Condition:
    """A prompt's condition and what it cost: `embeds` ``[T, hidden]``, its `tokens`, and how
    many of them came from cache (`cached_tokens`)."""

    embeds: torch.Tensor
    tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Conditions:
    """A request's conditions: its prompt's, and its negative prompt's when guidance reads
    it (None otherwise). What travels from the text side to the diffusion side."""

    prompt: Condition
    negative: Condition | None

    def painted(self, images: np.ndarray) -> Painted:
        """`images` with the tokens these conditions cost."""
        used = [c for c in (self.prompt, self.negative) if c is not None]
        return Painted(images, sum(c.tokens for c in used), sum(c.cached_tokens for c in used))


@dataclass(frozen=True)
class Painted:
    """A request's images, float pixels ``[n, H, W, 3]`` in [0, 1], and its prompts' cost:
    `input_tokens` of the prompt and the negative prompt (when encoded), `cached_tokens` of
    them read from cache."""

    images: np.ndarray
    input_tokens: int
    cached_tokens: int

    def usage(self) -> dict[str, int]:
        """``{"input_tokens", "cached_tokens"}``: what ``omni serve`` reports as ``usage``."""
        return {"input_tokens": self.input_tokens, "cached_tokens": self.cached_tokens}


@dataclass(frozen=True)
class PaintRequest:
    """One request of a batch (`ZImage.generate_batch`): what may differ between requests
    denoised together."""

    prompt: str
    negative_prompt: str = ""
    seed: int = 0
    cache_salt: str = ""


class ZImageText:
    """The text side of a Z-Image folder: its tokenizer's rendering and its text encoder's
    condition.

    Args:
        engine: the text encoder without its last decoder layer, whose output is the condition,
            with the folder's tokenizer and a KV store for prefixes (`from_pretrained` loads
            it so).
        max_sequence_length: how many tokens of a rendered prompt are kept.
    """

    def __init__(self, engine: TorchEngine, max_sequence_length: int = MAX_SEQUENCE_LENGTH):
        if engine.tokenizer is None or engine.tokenizer.chat_template is None:
            raise ValueError(f"{engine.model_id}: Z-Image's text encoder needs a tokenizer "
                             "with a chat template (tokenizer/ of the folder)")
        self.engine = engine
        self.max_sequence_length = max_sequence_length

    @classmethod
    def from_pretrained(cls, folder: str | Path, *, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> ZImageText:
        """The text encoder of the Z-Image folder `folder` (``text_encoder/`` with
        ``tokenizer/``) on `device` in `dtype`.

        Raises:
            ValueError: as `TorchEngine.from_pretrained`, or no tokenizer with a template.
        """
        root = Path(folder)
        engine = TorchEngine.from_pretrained(
            root / "text_encoder", tokenizer=root / "tokenizer", layers=-1, dtype=dtype,
            device=device, model_id=f"{root.resolve().name}/text_encoder")
        return cls(engine)

    def prompt_ids(self, prompt: str) -> list[int]:
        """The token ids the encoder reads for `prompt` (rendered, cut to the kept length)."""
        if not isinstance(prompt, str):
            raise ValueError(f"a Z-Image prompt is text, got {type(prompt).__name__}")
        ids = self.engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True,
            enable_thinking=True)
        return list(ids)[: self.max_sequence_length]

    def encode(self, prompt: str, cache_salt: str = "") -> Condition:
        """`prompt`'s condition: every token's hidden state after the text encoder's
        second-to-last layer, a prefix cached under the same `cache_salt` read from the store.
        Runs the encoder in the calling thread."""
        tokens = self.engine.prepare(Text(self.prompt_ids(prompt)))
        embeds, cached = self.engine.runner.last_hidden(tokens, cache_salt)
        return Condition(embeds, len(tokens), cached)

    def conditions(self, prompt: str, negative_prompt: str, guidance: float,
                   cache_salt: str = "") -> Conditions:
        """A request's conditions: the prompt's, and the negative prompt's when `guidance`
        (diffusers' ``guidance_scale``) is above 0. Runs in the calling thread."""
        condition = self.encode(prompt, cache_salt)
        negative = self.encode(negative_prompt, cache_salt) if guidance > 0 else None
        return Conditions(condition, negative)

    def __repr__(self) -> str:
        return (f"<ZImageText {self.engine.model_id} layers={self.engine.config.num_layers} "
                f"max_tokens={self.max_sequence_length}>")


class ZImagePainter:
    """The diffusion side of a Z-Image folder: its own diffusers pipeline loaded without its
    text encoder (the DiT, the VAE, the scheduler) paints from conditions `ZImageText` made,
    with diffusers' generator semantics, and edits an image with them (diffusers'
    ``ZImageImg2ImgPipeline`` on the same modules). Why apart from the text side: the two are
    separate models, and a graph may run them on different workers (the conditions travel).

    One call at a time: a diffusers pipeline keeps its scheduler's state while it runs.

    Args:
        pipeline: the folder's ``ZImagePipeline`` without ``text_encoder`` and ``tokenizer``.
    """

    def __init__(self, pipeline: Any):
        from diffusers import ZImageImg2ImgPipeline

        self.pipeline = pipeline
        self.pixel_step = 2 * int(pipeline.vae_scale_factor)  # latents are patched 2 x 2
        # the pipeline's modules, scheduler included (each call sets the scheduler's
        # timesteps anew), not a second copy of the weights. from_pipe casts the modules it
        # shares, in place, to its `dtype` (float32 unless given): the pipeline's. It warns
        # of that cast whatever the modules: its warning is not the user's concern.
        cast_log = logging.getLogger("diffusers.models.modeling_utils")
        level = cast_log.level
        cast_log.setLevel(logging.ERROR)
        try:
            self.editor = ZImageImg2ImgPipeline.from_pipe(pipeline, dtype=pipeline.dtype)
        finally:
            cast_log.setLevel(level)
        self.editor.set_progress_bar_config(disable=True)

    @classmethod
    def from_pretrained(cls, folder: str | Path, *, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> ZImagePainter:
        """The diffusion side of the Z-Image folder `folder` on `device` in `dtype`.

        Raises:
            ValueError: a folder of another family (`image_family`).
        """
        from diffusers import ZImagePipeline

        check_family(folder, "z_image")
        pipeline = ZImagePipeline.from_pretrained(folder, text_encoder=None, tokenizer=None,
                                                  dtype=dtype).to(device)
        pipeline.set_progress_bar_config(disable=True)
        return cls(pipeline)

    def check(self, *, width: Any, height: Any, steps: Any, guidance: Any, seed: Any,
              n: Any) -> None:
        """ValueError naming the first setting out of range (`check_image_settings`), or a
        side larger than the DiT places patches along (its rotary tables' length)."""
        step = self.pixel_step
        check_image_settings((("width", width), ("height", height)), step, f"{step} pixels",
                             steps=steps, guidance=guidance, seed=seed, n=n)
        _, rows, columns = self.pipeline.transformer.config.axes_lens
        for name, value, most in (("width", width, columns * step),
                                  ("height", height, rows * step)):
            if value > most:
                raise ValueError(f"{name} must be at most {most} pixels for this model (its "
                                 f"DiT places at most {most // step} patches a side), got "
                                 f"{value}")

    def paint(self, conditions: list[Conditions], seeds: list[int], *, width: int = 1024,
              height: int = 1024, steps: int = 50, guidance: float = 5.0, n: int = 1,
              on_step: OnStep | None = None) -> np.ndarray:
        """Images for requests' `conditions` as float pixels ``[len * n, height, width, 3]``
        in [0, 1]: one request's `n` images from one CPU generator seeded with its seed (one
        noise draw, as diffusers draws them), or several requests' images denoised together
        (one DiT pass per step; `n` 1), each with its own generator. `guidance` is diffusers'
        ``guidance_scale`` (above 0, every request's negative condition is read);
        `on_step(done, total)` after each step. Runs in the calling thread.

        Raises:
            ValueError: a setting out of range (`check`), `n` above 1 for several requests,
                a request without its negative condition when guidance reads it.
        """
        for seed in seeds:
            self.check(width=width, height=height, steps=steps, guidance=guidance, seed=seed,
                       n=n)
        if len(conditions) != len(seeds) or (n != 1 and len(conditions) != 1):
            raise ValueError("give a seed per request, and n = 1 for several requests")
        generator = ([torch.Generator().manual_seed(seed) for seed in seeds]
                     if len(seeds) > 1 else torch.Generator().manual_seed(seeds[0]))
        return self.pipeline(
            **_embeds(conditions, guidance), guidance_scale=guidance, num_images_per_prompt=n,
            height=height, width=width, num_inference_steps=steps, output_type="np",
            generator=generator, **_stepping(on_step)).images

    def edit(self, conditions: Conditions, image: np.ndarray, *, strength: float = 0.6,
             width: int | None = None, height: int | None = None, steps: int = 50,
             guidance: float = 5.0, seed: int = 0, n: int = 1,
             on_step: OnStep | None = None) -> np.ndarray:
        """`n` edits of `image` (RGB pixels, uint8 ``[H, W, 3]``) under `conditions`, as float
        pixels ``[n, height, width, 3]`` in [0, 1]: what diffusers' ``ZImageImg2ImgPipeline``
        gives for the same arguments with the image as a PIL image. `strength` (diffusers'
        default; 0 < strength <= 1) is how far the image is noised: the last
        ``steps * strength`` of the `steps` run (`on_step`'s total). Without `width` and
        `height` the edit has the image's size rounded down to a multiple of `pixel_step`
        (diffusers' own default); with them, the image is resized to them first, as diffusers'
        image processor resizes (Lanczos). Runs in the calling thread.

        Raises:
            ValueError: a setting out of range (`check`), a strength outside (0, 1], an image
                that is not uint8 RGB pixels or is smaller than `pixel_step` without a size,
                one of `width` and `height` without the other.
        """
        width, height = self._edit_size(image, width, height)
        self.check(width=width, height=height, steps=steps, guidance=guidance, seed=seed, n=n)
        if isinstance(strength, bool) or not isinstance(strength, int | float) or not (
                0 < strength <= 1):
            raise ValueError(f"strength must be a number in (0, 1], got {strength!r}")
        from PIL import Image

        picture = self.editor.image_processor.resize(Image.fromarray(image), height, width)
        return self.editor(
            **_embeds([conditions], guidance), image=picture, strength=strength,
            guidance_scale=guidance, num_images_per_prompt=n, num_inference_steps=steps,
            output_type="np", generator=torch.Generator().manual_seed(seed),
            **_stepping(on_step)).images

    def _edit_size(self, image: Any, width: Any, height: Any) -> tuple[Any, Any]:
        """The edit's size: `width` x `height`, or the image's rounded down to `pixel_step`."""
        if not (isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim == 3
                and image.shape[2] == 3):
            shape = getattr(image, "shape", None)
            raise ValueError(f"image must be RGB pixels, uint8 [H, W, 3], got "
                             f"{type(image).__name__} {shape or ''}".rstrip())
        if (width is None) != (height is None):
            raise ValueError("give an edit both width and height, or neither (the image's size)")
        if width is not None:
            return width, height
        rows, columns, _ = image.shape
        step = self.pixel_step
        if min(rows, columns) < step:
            raise ValueError(f"the image is {columns} x {rows} pixels: an edit without a width "
                             f"and height keeps its size rounded down to a multiple of {step} "
                             "pixels, which leaves nothing; give a width and height")
        return columns - columns % step, rows - rows % step

    def __repr__(self) -> str:
        return f"<ZImagePainter pixel_step={self.pixel_step}>"


class ZImage:
    """A Z-Image folder on Omni, both sides in one process: `ZImageText` computes a request's
    conditions, `ZImagePainter` paints (or edits) from them, and the images are what diffusers'
    own pipeline gives for the same request.

    Args:
        text: the text side (`ZImageText`).
        painter: the diffusion side (`ZImagePainter`).
    """

    def __init__(self, text: ZImageText, painter: ZImagePainter):
        self.text, self.painter = text, painter
        self.pixel_step = painter.pixel_step

    @classmethod
    def from_pretrained(cls, folder: str | Path, *, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> ZImage:
        """The Z-Image folder `folder` (diffusers' layout) on `device` in `dtype`.

        Raises:
            ValueError: a folder of another family (`image_family`), or as
                `ZImageText.from_pretrained`.
        """
        painter = ZImagePainter.from_pretrained(folder, dtype=dtype, device=device)
        return cls(ZImageText.from_pretrained(folder, dtype=dtype, device=device), painter)

    def check(self, **settings: Any) -> None:
        """ValueError naming the first setting out of range (`ZImagePainter.check`)."""
        self.painter.check(**settings)

    def generate(self, prompt: str, *, negative_prompt: str = "", width: int = 1024,
                 height: int = 1024, steps: int = 50, guidance: float = 5.0, seed: int = 0,
                 n: int = 1, cache_salt: str = "", on_step: OnStep | None = None) -> Painted:
        """`n` images of `prompt` as float pixels ``[n, height, width, 3]`` in [0, 1], what
        diffusers' pipeline gives for the same arguments (`guidance` is its
        ``guidance_scale``; the negative prompt is encoded only when it is above 0). The
        prompts' cached prefixes are read only from requests of the same `cache_salt`;
        `on_step(done, total)` is called after each denoising step. Runs in the calling
        thread (see `agenerate`).

        Raises:
            ValueError: a setting out of range (`check`), a prompt that is not text.
        """
        self.check(width=width, height=height, steps=steps, guidance=guidance, seed=seed, n=n)
        conditions = self.text.conditions(prompt, negative_prompt, guidance, cache_salt)
        images = self.painter.paint([conditions], [seed], width=width, height=height,
                                    steps=steps, guidance=guidance, n=n, on_step=on_step)
        return conditions.painted(images)

    async def agenerate(self, prompt: str, **settings: Any) -> Painted:
        """`generate` in a worker thread."""
        return await run_in_worker(lambda: self.generate(prompt, **settings))

    def generate_batch(self, requests: list[PaintRequest], *, width: int = 1024,
                       height: int = 1024, steps: int = 50, guidance: float = 5.0,
                       on_step: OnStep | None = None) -> list[Painted]:
        """One image for each of `requests`, denoised together (one DiT pass per step for
        all of them): each what `generate` gives for that request alone, within the float
        error of batched arithmetic (its own generator from its `seed`, its own prompts and
        cache salt). `on_step` as `generate`'s. Runs in the calling thread.

        Raises:
            ValueError: a setting out of range (`check`), a prompt that is not text; none of
                the requests is painted then.
        """
        for r in requests:
            self.check(width=width, height=height, steps=steps, guidance=guidance,
                       seed=r.seed, n=1)
        conditions = [self.text.conditions(r.prompt, r.negative_prompt, guidance, r.cache_salt)
                      for r in requests]
        images = self.painter.paint(conditions, [r.seed for r in requests], width=width,
                                    height=height, steps=steps, guidance=guidance,
                                    on_step=on_step)
        return [c.painted(images[i:i + 1]) for i, c in enumerate(conditions)]

    def edit(self, prompt: str, image: np.ndarray, *, negative_prompt: str = "",
             guidance: float = 5.0, cache_salt: str = "", **settings: Any) -> Painted:
        """`n` edits of `image` following `prompt` (`ZImagePainter.edit`'s settings, and
        `cache_salt` and `negative_prompt` as `generate`'s). Runs in the calling thread (see
        `aedit`).

        Raises:
            ValueError: as `ZImagePainter.edit`, a prompt that is not text.
        """
        self.painter._edit_size(image, settings.get("width"), settings.get("height"))
        conditions = self.text.conditions(prompt, negative_prompt, guidance, cache_salt)
        return conditions.painted(self.painter.edit(conditions, image, guidance=guidance,
                                                    **settings))

    async def aedit(self, prompt: str, image: np.ndarray, **settings: Any) -> Painted:
        """`edit` in a worker thread."""
        return await run_in_worker(lambda: self.edit(prompt, image, **settings))

    def __repr__(self) -> str:
        return f"<ZImage {self.text.engine.model_id} pixel_step={self.pixel_step}>"


def _embeds(conditions: list[Conditions], guidance: float) -> dict[str, Any]:
    """The pipeline's ``prompt_embeds`` and ``negative_prompt_embeds`` of requests'
    conditions (the negative ones read only when `guidance` is above 0)."""
    negatives = [c.negative for c in conditions]
    if guidance > 0 and any(n is None for n in negatives):
        raise ValueError("guidance above 0 reads each request's negative condition: encode "
                         "it (ZImageText.conditions with that guidance)")
    return {"prompt_embeds": [c.prompt.embeds for c in conditions],
            "negative_prompt_embeds": [n.embeds for n in negatives if n is not None]
            if guidance > 0 else None}


def _stepping(on_step: OnStep | None) -> dict[str, Any]:
    """The pipeline's arguments that call `on_step(done, total)` after each step (its
    step-end callback, which reads no tensor and changes none)."""
    if on_step is None:
        return {}

    def step_ended(pipeline: Any, i: int, t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        on_step(i + 1, pipeline.num_timesteps)
        return {}

    return {"callback_on_step_end": step_ended, "callback_on_step_end_tensor_inputs": []}

