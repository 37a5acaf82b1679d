"""Cosmos3 text-to-image on Omni: the understanding pathway on Omni's engine, once per prompt.

A Cosmos3 folder (diffusers' layout: ``model_index.json`` naming ``Cosmos3OmniPipeline``) keeps
one transformer, a mixture of two experts over one joint sequence. The understanding expert
reads the prompt's tokens (system prompt, prompt and resolution sentence in the tokenizer's
chat template) with causal attention; the generation expert reads the image's latent patches,
and each of its layers attends to the understanding expert's keys and values of that layer
as well as to its own. No understanding token attends to an image token, so those keys and
values are the same at every denoising step; diffusers' pipeline still runs both experts at
every step (twice with guidance).

Here the understanding expert is a decoder on Omni's `TorchEngine`
(`omni.compute.models.cosmos3_weights`: the transformer's own weights, one copy) whose
KV is each layer's understanding keys and values: it runs once per prompt
(`ModelRunner.prompt_kv`), and a prompt that starts as an earlier one of the same cache salt
did (the system prompt every request shares, a repeated prompt) reads that prefix's KV from
the engine's store: only the rest is computed. Each denoising step runs only the generation
expert (`velocity`) against that KV.

Everything else is the folder's own diffusers objects, called rather than rewritten: the
pipeline's prompt rendering and sequence layout (mRoPE positions), the generation expert's
modules and weights (projections, norms, MLPs, rotary, patchify, timestep embedding), the
scheduler, the VAE and the video processor. Several of these are private diffusers helpers
(``_prepare_text_segment``, ``_patchify_and_pack_latents``, ...): they are the one home of
that layout, and calling them keeps Omni's sequence equal to the pipeline's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni._openmp import run_in_worker
from omni.compute.diffusion import check_image_settings
from omni.compute.engine import TorchEngine
from omni.compute.image_families import check_family
from omni.compute.models.cosmos3_weights import understanding_decoder
from omni.compute.prompt import Text
from omni.compute.z_image import OnStep, Painted

__all__ = ["Cosmos3", "PromptKV", "Understood", "generation_kv", "generation_layer", "rotary",
           "velocity"]


LayerKV = tuple[torch.Tensor, torch.Tensor]  # keys, values [T, kv_heads, head_dim]
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [N, 1, head_dim]


@dataclass(frozen=True)
class Understood:
    """A prompt as the understanding expert read it: its token ids, every layer's keys
    (rotated, as its attention reads them) and values ``[1, kv_heads, T, head_dim]``, and how
    many of its tokens came from cache. What travels from the understanding side to the
    generation side when they run on different workers."""

    input_ids: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    cached_tokens: int


@dataclass(frozen=True)
class PromptKV:
    """What a denoising step reads of one prompt, computed once per request.

    Why: the generation expert's input depends on the prompt only through the understanding
    keys and values of each layer and through its own token positions, which start after the
    prompt's; both are fixed for the whole request.

    Attributes:
        kv: each layer's understanding keys (normed, rotated) and values, as the generation
            expert reads them (`generation_kv`).
        rope: the image tokens' rotary cos and sin.
        token_shapes: the patch grid (frames, rows, columns) of one image.
        noisy_frames: the frames being denoised (every frame, for text-to-image).
        tokens: the prompt's tokens; `cached_tokens` of them were read from the store.
    """

    kv: list[LayerKV]
    rope: Rope
    token_shapes: list[tuple[int, int, int]]
    noisy_frames: list[torch.Tensor]
    tokens: int
    cached_tokens: int


def rotary(transformer: Any, position_ids: torch.Tensor, dtype: torch.dtype) -> Rope:
    """The transformer's mRoPE cos and sin ``[N, 1, head_dim]`` at `position_ids` ``[3, N]``."""
    cos, sin = transformer.rotary_emb(position_ids=position_ids.unsqueeze(1),
                                      device=position_ids.device, dtype=dtype)
    return cos.squeeze(0).unsqueeze(1), sin.squeeze(0).unsqueeze(1)


def _rotate(x: torch.Tensor, rope: Rope, *, inverse: bool = False) -> torch.Tensor:
    """`x` ``[..., heads, head_dim]`` turned by the angles of `rope` (back by them when
    `inverse`)."""
    from diffusers.models.transformers.transformer_cosmos3 import _rotate_half

    cos, sin = rope
    return x * cos + _rotate_half(x) * (-sin if inverse else sin)


def _heads(projected: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    return projected.unflatten(-1, (num_heads, head_dim))  # [..., S, heads, head_dim]


def _attend(attn: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
            causal: bool) -> torch.Tensor:
    """Attention ``[B, S, heads * head_dim]`` through diffusers' dispatcher, with the
    backend the layer's processor is set to."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    out = dispatch_attention_fn(query, key, value, is_causal=causal, enable_gqa=True,
                                backend=attn.processor._attention_backend,
                                parallel_config=attn.processor._parallel_config)
    return out.flatten(-2, -1)


def generation_kv(layer: Any, kv: tuple[torch.Tensor, torch.Tensor], rope: Rope) -> LayerKV:
    """The keys and values ``[T, kv_heads, head_dim]`` the generation expert's `layer` reads
    of the understanding KV `kv` (the engine's, ``[1, kv_heads, T, head_dim]``, keys rotated
    by the prompt's `rope` as the understanding attention reads them): the same tensors,
    but with ``use_und_k_norm_for_gen`` (``k_norm_und_for_gen``), which the understanding
    attention does not apply, the keys turned back, normed and turned again."""
    keys, values = (x[0].transpose(0, 1) for x in kv)
    norm = layer.self_attn.k_norm_und_for_gen
    if norm is not None:
        keys = _rotate(norm(_rotate(keys, rope, inverse=True)), rope)
    return keys, values


def generation_layer(layer: Any, hidden: torch.Tensor, kv: LayerKV, rope: Rope) -> torch.Tensor:
    """One layer of the generation expert over `hidden` ``[n, S, hidden]`` (n images of S
    tokens each), attending to the prompt's keys and values `kv` of this layer and to its
    own; the n images share `kv`."""
    attn = layer.self_attn
    normed = layer.input_layernorm_moe_gen(hidden)
    query = attn.norm_added_q(_heads(attn.add_q_proj(normed), attn.num_attention_heads,
                                     attn.head_dim))
    keys = attn.norm_added_k(_heads(attn.add_k_proj(normed), attn.num_key_value_heads,
                                    attn.head_dim))
    values = _heads(attn.add_v_proj(normed), attn.num_key_value_heads, attn.head_dim)
    prompt_keys, prompt_values = (x.expand(len(hidden), -1, -1, -1) for x in kv)
    out = _attend(attn, _rotate(query, rope),
                  torch.cat([prompt_keys, _rotate(keys, rope)], dim=1),
                  torch.cat([prompt_values, values], dim=1), causal=False)
    residual = hidden + attn.to_add_out(out)
    return residual + layer.mlp_moe_gen(layer.post_attention_layernorm_moe_gen(residual))


def _image_tokens(transformer: Any, latents: torch.Tensor, timestep: float,
                  prompt: PromptKV) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """The generation expert's input ``[n * S, hidden]`` for `latents` ``[n, C, T, H, W]``:
    patches projected, the timestep's embedding added to the noisy ones; and the latent
    shapes the patchify saw."""
    n = len(latents)
    packed, latent_shapes = transformer._patchify_and_pack_latents(list(latents.unsqueeze(1)))
    tokens = transformer.proj_in(packed)
    timesteps = torch.full((len(tokens),), timestep, device=tokens.device)
    embedder_dtype = next(transformer.time_embedder.parameters()).dtype
    embeds = transformer.time_embedder(transformer.time_proj(
        timesteps * transformer.config.timestep_scale).to(embedder_dtype)).to(tokens.dtype)
    tokens = transformer._apply_timestep_embeds_to_noisy_tokens(
        packed_tokens=tokens, packed_timestep_embeds=embeds,
        noisy_frame_indexes=prompt.noisy_frames * n, token_shapes=prompt.token_shapes * n)
    return tokens, latent_shapes


def velocity(transformer: Any, latents: torch.Tensor, timestep: float,
             prompt: PromptKV) -> torch.Tensor:
    """The transformer's velocity ``[n, C, T, H, W]`` (float32) for `latents` at `timestep`,
    conditioned on `prompt`: only the generation expert runs."""
    n = len(latents)
    tokens, latent_shapes = _image_tokens(transformer, latents.to(transformer.dtype), timestep,
                                          prompt)
    hidden = tokens.unflatten(0, (n, -1))  # [n, S, hidden]
    for layer, kv in zip(transformer.layers, prompt.kv, strict=True):
        hidden = generation_layer(layer, hidden, kv, prompt.rope)
    patches = transformer.proj_out(transformer.norm_moe_gen(hidden)).flatten(0, 1)
    predicted = transformer._unpatchify_and_unpack_latents(
        patches, token_shapes_vision=prompt.token_shapes * n,
        noisy_frame_indexes_vision=prompt.noisy_frames * n,
        original_latent_shapes=latent_shapes)
    return torch.cat(predicted).float()


class Cosmos3:
    """A Cosmos3 folder on Omni, text to image: each prompt's understanding keys and values
    computed once on Omni's engine (`prepare`; a cached prefix read from its store), then
    every denoising step runs only the generation expert against them (`velocity`), the n
    images of a request in one batch. The folder's own pipeline supplies the rest, with its
    semantics: one CPU generator drawn from `seed` whose successive draws are the n images'
    noise (as n pipeline calls sharing that generator), a fresh copy of its scheduler per
    request. No guardrail runs: the images are the pipeline's with
    ``enable_safety_checker=False``.

    Args:
        painter: the folder's ``Cosmos3OmniPipeline``.
        engine: the understanding expert of its transformer, without a tokenizer, with a KV
            store for prefixes (`from_pretrained` builds it so, `understanding_decoder`).
        model_id: the name `repr` shows.
    """

    def __init__(self, painter: Any, engine: TorchEngine, model_id: str = "cosmos3"):
        self.painter, self.engine, self.model_id = painter, engine, model_id
        self.transformer = painter.transformer
        self.pixel_step = int(painter.vae_scale_factor_spatial)

    @classmethod
    def from_pretrained(cls, folder: str | Path, *, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> Cosmos3:
        """The Cosmos3 folder `folder` (diffusers' layout) on `device` in `dtype`.

        Raises:
            ValueError: not a Cosmos3 folder (`image_family`).
        """
        from diffusers import Cosmos3OmniPipeline

        check_family(folder, "cosmos3")
        painter = Cosmos3OmniPipeline.from_pretrained(
            folder, dtype=dtype, safety_checker=None, enable_safety_checker=False).to(device)
        painter.set_progress_bar_config(disable=True)
        name = Path(folder).resolve().name
        model, config = understanding_decoder(painter.transformer)
        engine = TorchEngine(model, config, model_id=f"{name}/understanding")
        return cls(painter, engine, model_id=name)

    @property
    def device(self) -> torch.device:
        """Where the transformer's weights are."""
        return self.transformer.device

    def check(self, *, width: Any, height: Any, steps: Any, guidance: Any, seed: Any,
              n: Any) -> None:
        """ValueError naming the first setting out of range (`check_image_settings`)."""
        step = self.pixel_step
        check_image_settings((("width", width), ("height", height)), step, f"{step} pixels",
                             steps=steps, guidance=guidance, seed=seed, n=n)

    def prompt_ids(self, prompt: str, negative_prompt: str, *, width: int,
                   height: int) -> tuple[list[int], list[int]]:
        """The token ids the understanding expert reads for `prompt` and `negative_prompt`:
        the pipeline's rendering of a one-frame request of that size."""
        for name, text in (("prompt", prompt), ("negative prompt", negative_prompt)):
            if not isinstance(text, str):
                raise ValueError(f"a Cosmos3 {name} is text, got {type(text).__name__}")
        return self.painter.tokenize_prompt(prompt, negative_prompt, num_frames=1,
                                            height=height, width=width)

    def prepare(self, input_ids: list[int], latents: torch.Tensor,
                cache_salt: str = "") -> PromptKV:
        """Everything the denoising steps read of the prompt `input_ids` for images of the
        shape of `latents` ``[n, C, 1, H, W]``: `understand`, then `prompt_kv`."""
        return self.prompt_kv(self.understand(input_ids, cache_salt), latents)

    def understand(self, input_ids: list[int], cache_salt: str = "") -> Understood:
        """The understanding expert's keys and values of the prompt `input_ids`, computed on
        the engine after the prompt's longest prefix cached under `cache_salt`."""
        # the engine's positions are 0 .. T - 1 on all three axes, as the pipeline's
        tokens = self.engine.prepare(Text(input_ids))
        kv, cached = self.engine.runner.prompt_kv(tokens, cache_salt)
        return Understood(list(input_ids), kv, cached)

    def understand_request(self, prompt: str, negative_prompt: str, *, width: int,
                           height: int, guidance: float, cache_salt: str = ""
                           ) -> list[Understood]:
        """A request's prompts as the understanding expert read them: the prompt, and the
        negative prompt when `guidance` is not 1 (`understand`). Runs in the calling thread.

        Raises:
            ValueError: a prompt that is not text.
        """
        ids, negative_ids = self.prompt_ids(prompt, negative_prompt, width=width,
                                            height=height)
        understood = [self.understand(ids, cache_salt)]
        if guidance != 1.0:
            understood.append(self.understand(negative_ids, cache_salt))
        return understood

    def prompt_kv(self, understood: Understood, latents: torch.Tensor) -> PromptKV:
        """What the denoising steps read of an understood prompt for images of the shape of
        `latents` ``[n, C, 1, H, W]``: its keys and values as the generation expert reads
        them, and the image tokens' rotary angles."""
        text = self.painter._prepare_text_segment(understood.input_ids, device=self.device)
        image = self.painter._prepare_vision_segment(
            input_vision_tokens=latents[:1], has_image_condition=False,
            mrope_offset=text["vision_start_temporal_offset"], vision_fps=None,
            curr=text["und_len"], device=self.device)
        text_rope = rotary(self.transformer, text["text_mrope_ids"], self.transformer.dtype)
        kv = [(k.to(self.device), v.to(self.device)) for k, v in understood.kv]
        return PromptKV(
            kv=[generation_kv(layer, layer_kv, text_rope)
                for layer, layer_kv in zip(self.transformer.layers, kv, strict=True)],
            rope=rotary(self.transformer, image["vision_mrope_ids"], self.transformer.dtype),
            token_shapes=image["vision_token_shapes"],
            noisy_frames=image["vision_noisy_frame_indexes"],
            tokens=len(understood.input_ids), cached_tokens=understood.cached_tokens)

    def noise(self, *, width: int, height: int, seed: int, n: int) -> torch.Tensor:
        """The initial latents ``[n, C, 1, H / pixel_step, W / pixel_step]``: the pipeline's
        draw, n times from one CPU generator seeded with `seed`."""
        from diffusers.utils.torch_utils import randn_tensor

        generator = torch.Generator().manual_seed(seed)
        shape = (1, self.painter.vae.config.z_dim, 1, height // self.pixel_step,
                 width // self.pixel_step)
        return torch.cat([randn_tensor(shape, generator=generator, device=self.device,
                                       dtype=torch.float32) for _ in range(n)])

    def scheduler(self, steps: int) -> Any:
        """A fresh copy of the folder's scheduler (it keeps a request's state) set to the
        pipeline's `steps` timesteps: its own, or with ``use_native_flow_schedule`` sigmas
        evenly spaced from 1 - 1 / num_train_timesteps down to 0 (0 left out)."""
        scheduler = type(self.painter.scheduler).from_config(self.painter.scheduler.config)
        if not self.painter.config.use_native_flow_schedule:
            scheduler.set_timesteps(steps, device=self.device)
            return scheduler
        top = 1.0 - 1.0 / scheduler.config.num_train_timesteps
        sigmas = np.linspace(top, 0.0, steps + 1)[:-1]
        scheduler.set_timesteps(steps, device=self.device, sigmas=sigmas)
        return scheduler

    def denoise(self, latents: torch.Tensor, prompts: list[PromptKV], *, steps: int,
                guidance: float, on_step: OnStep | None = None) -> torch.Tensor:
        """`latents` after `steps` steps: the velocity for `prompts` (the prompt, then the
        negative prompt when guided), combined as ``negative + guidance * (prompt -
        negative)``; `on_step(done, total)` after each step."""
        scheduler = self.scheduler(steps)
        total = len(scheduler.timesteps)
        for done, t in enumerate(scheduler.timesteps, 1):
            predicted = [velocity(self.transformer, latents, t.item(), p) for p in prompts]
            guided = predicted[0] if len(predicted) == 1 else (
                predicted[1] + guidance * (predicted[0] - predicted[1]))
            latents = scheduler.step(guided, t, latents, return_dict=False)[0]
            if on_step is not None:
                on_step(done, total)
        return latents

    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """The VAE's pixels ``[n, H, W, 3]`` in [0, 1] for normalised `latents`, one image at
        a time as the pipeline decodes (the VAE's batched convolutions round differently)."""
        return np.concatenate([self._decode_one(one) for one in latents.split(1)])

    def _decode_one(self, latents: torch.Tensor) -> np.ndarray:
        painter, vae = self.painter, self.painter.vae
        mean = painter._vae_latents_mean.to(device=latents.device, dtype=vae.dtype)
        inv_std = painter._vae_latents_inv_std.to(device=latents.device, dtype=vae.dtype)
        raw = latents.to(vae.dtype) / inv_std.view(1, -1, 1, 1, 1) + mean.view(1, -1, 1, 1, 1)
        frames = vae.decode(raw).sample.to(latents.dtype)  # [1, 3, 1, H, W]
        return painter.video_processor.postprocess_video(frames, output_type="np")[0]

    @torch.no_grad()
    def generate(self, prompt: str, *, negative_prompt: str = "", width: int = 1280,
                 height: int = 720, steps: int = 35, guidance: float = 6.0, seed: int = 0,
                 n: int = 1, cache_salt: str = "", on_step: OnStep | None = None) -> Painted:
        """`n` images of `prompt` as float pixels ``[n, height, width, 3]`` in [0, 1], what
        diffusers' pipeline gives for the same arguments with ``num_frames=1`` (`guidance` is
        its ``guidance_scale``: at 1 the negative prompt is not read, and any other value,
        0 included, mixes both predictions), and the prompts' tokens. The prompts' cached
        prefixes are read only from requests of the same `cache_salt`; `on_step(done,
        total)` is called after each denoising step. Runs in the calling thread (see
        `agenerate`).

        Raises:
            ValueError: a setting out of range (`check`), a prompt that is not text.
        """
        self.check(width=width, height=height, steps=steps, guidance=guidance, seed=seed, n=n)
        understood = self.understand_request(prompt, negative_prompt, width=width,
                                             height=height, guidance=guidance,
                                             cache_salt=cache_salt)
        return self.paint(understood, width=width, height=height, steps=steps,
                          guidance=guidance, seed=seed, n=n, on_step=on_step)

    @torch.no_grad()
    def paint(self, understood: list[Understood], *, width: int = 1280, height: int = 720,
              steps: int = 35, guidance: float = 6.0, seed: int = 0, n: int = 1,
              on_step: OnStep | None = None) -> Painted:
        """`generate`'s images from a request's understood prompts (`understand_request`,
        perhaps on another worker: only the keys and values travel). Runs in the calling
        thread.

        Raises:
            ValueError: a setting out of range (`check`), or not the prompts `guidance` reads
                (the negative one with guidance other than 1).
        """
        self.check(width=width, height=height, steps=steps, guidance=guidance, seed=seed, n=n)
        if len(understood) != (1 if guidance == 1.0 else 2):
            raise ValueError("guidance other than 1 reads the prompt and the negative prompt, "
                             "1 the prompt alone: understand them with that guidance")
        latents = self.noise(width=width, height=height, seed=seed, n=n)
        prompts = [self.prompt_kv(u, latents) for u in understood]
        images = self.decode(self.denoise(latents, prompts, steps=steps, guidance=guidance,
                                          on_step=on_step))
        return Painted(images, sum(p.tokens for p in prompts),
                       sum(p.cached_tokens for p in prompts))

    async def agenerate(self, prompt: str, **settings: Any) -> Painted:
        """`generate` in a worker thread."""
        return await run_in_worker(lambda: self.generate(prompt, **settings))

    def __repr__(self) -> str:
        return (f"<Cosmos3 {self.model_id} layers={len(self.transformer.layers)} "
                f"pixel_step={self.pixel_step}>")
