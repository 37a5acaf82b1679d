"""Image generation that reuses the LLM itself and the prompt KV it already cached.

The HunyuanImage-3 pattern: one decoder serves both roles. For text it is the LLM; for images
the same weights denoise image tokens (a `DiffusionHead` turns latents into tokens and the
final hidden states into a velocity). The prompt is causal text, so its KV is exactly what the
LLM role computes and caches: `ImageGenerator` looks it up in the engine's `KVStore` under the
same page keys, computes only what is missing, and puts new full pages back, so the text KV
lives once in the store for both roles. Each denoising step then runs only the N image tokens,
attending to the held prompt KV and to each other (bidirectionally), instead of running the
whole prompt + image sequence again.

Shapes: C latent channels, H x W latent size, N image tokens, T prompt tokens, L layers,
Hkv KV heads, D head dim.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import Tensor

from omni._openmp import run_in_worker
from omni.compute._diffusion_modules import (
    DiffusionHead,
    FlowMatchEulerSampler,
    FlowMatchState,
    LatentDecoder,
    classifier_free_guidance,
    to_png,
)
from omni.compute.models import DecoderLM, KVList
from omni.compute.prompt import PromptTokens
from omni.kv import KVCapacityError, KVStore

if TYPE_CHECKING:
    from omni.compute.engine import TorchEngine

__all__ = ["DiffusionHead", "DiffusionResult", "FlowMatchEulerSampler", "FlowMatchState",
           "ImageGenerator", "LatentDecoder", "check_image_settings", "classifier_free_guidance",
           "to_png"]

log = logging.getLogger("omni.compute")


@dataclass(frozen=True, eq=False)
class DiffusionResult:
    """One generated image.

    `prompt_tokens` counts the tokens of every prompt the run attended to (the prompt, and the
    negative prompt when guidance is not 1); `prompt_tokens_reused` those whose KV came from
    the store. `kv_bytes_resident` is the size of one copy of those prompts' KV: the copy the
    store keeps for the LLM role and this one alike. `kv_bytes_separate` is what two separate
    deployments would keep (the LLM's cache and the diffusion model's own): twice as much.
    Both describe the prompts, whatever `reuse` was; while the steps run, each design also
    holds a transient working copy ([1, Hkv, T, D] per layer), as a decode batch does.
    """

    image: np.ndarray  # [8H, 8W, 3] uint8
    latents: Tensor  # [C, H, W], the denoised latents
    steps: int
    prompt_tokens: int
    prompt_tokens_reused: int
    time_per_step: float  # seconds, mean over the steps (forward passes, guidance, Euler)
    kv_bytes_resident: int
    kv_bytes_separate: int

    @property
    def png(self) -> bytes:
        """The image as PNG bytes."""
        return to_png(self.image)


@dataclass(frozen=True)
class _Prepared:
    """A prompt flattened and keyed on the event loop, before any thread work. Why: bad input
    fails before anything runs. `tokens` is None for an empty negative prompt (no text)."""

    tokens: PromptTokens | None
    keys: list[bytes]  # one per full page, the LLM role's keys


@dataclass(frozen=True)
class _PromptKV:
    """One prompt's KV, held for the whole run: per layer (k, v) [1, Hkv, T, D] (None: no
    text). Why: the steps attend to it without ever recomputing it."""

    kv: KVList | None
    num_tokens: int
    num_reused: int


@dataclass(frozen=True)
class _Pass:
    """The fixed inputs of one forward pass over the image tokens: a row per prompt. Why: built
    once per run, so a step only embeds the latents. Rows with a shorter prompt have zero KV
    after it, which their mask hides."""

    past: KVList | None  # per layer [B, Hkv, T_max, D]
    positions: Tensor  # [B, N]: the image tokens follow each row's own prompt
    mask: Tensor  # [B, 1, N, T_max + N]: True over the row's prompt and all image tokens


class ImageGenerator:
    """Text-to-image on a `TorchEngine`'s model and KV store.

    Args:
        engine: the LLM role. Its model is the transformer (shared weights, one copy); its
            store and page keys are where prompt KV is found and kept.
        latent_channels: C of the latents.
        patch: the side of a patch of latents that becomes one image token.
        seed: draws the weights of the `DiffusionHead` (seed) and `LatentDecoder` (seed + 1).
        shift: the sampler's SD3 time shift (1 = none).
        batch_cfg: run the conditional and unconditional passes of a step as one batch of two
            (the shorter prompt's KV padded and masked out) or one after the other. "auto"
            batches when padding adds at most 1/8 to the keys the two passes attend to:
            measured on CPU (perf/diffusion_reuse.py), a batch of two is ~8% faster with prompts
            of equal length, and slower once padding wastes more attention than batching saves.
    """

    def __init__(self, engine: TorchEngine, *, latent_channels: int = 4, patch: int = 2,
                 seed: int = 0, shift: float = 1.0,
                 batch_cfg: bool | Literal["auto"] = "auto") -> None:
        if batch_cfg not in (True, False, "auto"):
            raise ValueError(f"batch_cfg must be True, False or 'auto', got {batch_cfg!r}")
        self.engine = engine
        self.model: DecoderLM = engine.model
        self.device = next(engine.model.parameters()).device
        self.head = DiffusionHead(engine.config.hidden_size, latent_channels=latent_channels,
                                  patch=patch, seed=seed).to(self.device, engine.dtype).eval()
        self.decoder = LatentDecoder(latent_channels, seed=seed + 1).to(self.device).eval()
        self.sampler = FlowMatchEulerSampler(shift=shift)
        self.batch_cfg = batch_cfg
        self.num_generations = 0
        self.num_tokens_reused = 0

    def __repr__(self) -> str:
        return (f"<ImageGenerator {self.engine.model_id} latents={self.head.latent_channels}ch "
                f"patch={self.head.patch} generations={self.num_generations} "
                f"reused_tokens={self.num_tokens_reused}>")

    async def generate(self, prompt: Any, *, height: int = 16, width: int = 16, steps: int = 20,
                       guidance: float = 3.0, negative_prompt: Any = "", seed: int = 0,
                       reuse: bool = True, cache_salt: str = "") -> DiffusionResult:
        """Generate an image of latents [C, height, width] (pixels [8 height, 8 width, 3]).

        Args:
            prompt: text, token ids or a `Prompt` (as `TorchEngine.generate` takes).
            height, width: the latent size, multiples of the patch.
            steps: Euler steps from noise to image.
            guidance: classifier-free guidance scale; at exactly 1 the unconditional pass (and
                the negative prompt) is skipped.
            negative_prompt: the unconditional prompt; "" (or None) means no text at all.
            seed: draws the initial noise.
            reuse: look the prompts' KV up in the engine's store and put new full pages back;
                False computes it from scratch without touching the store (the baseline).
            cache_salt: mixed into the prompts' page keys (as `TorchEngine.generate`'s): only
                requests of the same salt share prompt KV.

        Raises:
            ValueError: steps < 1, guidance < 0 or not finite, a size that is not a positive
                multiple of the patch, a prompt that does not fit the context with the image
                tokens (each message names the parameter).
        """
        num_image = self._check(height, width, steps, guidance, seed)
        prepared = [self._prepare(prompt, "prompt", num_image, cache_salt)]
        if guidance != 1.0:
            prepared.append(self._prepare(negative_prompt, "negative_prompt", num_image,
                                          cache_salt))
        store = self.engine.store if reuse else None
        if store is not None:  # disk reads, and pages other workers hold, come in here
            for p in prepared:
                await store.prefetch(p.keys, recompute_page_s=self.engine.runner.prefill_page_s)
        prompt_kvs, passes = await run_in_worker(self._prompt_passes, prepared, store,
                                                 num_image)
        state = self.sampler.start((self.head.latent_channels, height, width), steps, seed=seed,
                                   dtype=self.engine.dtype, device=self.device)
        elapsed = 0.0
        for _ in range(steps):  # one thread call per step: cancellation waits one step at most
            elapsed += await run_in_worker(self._timed_step, state, passes, guidance)
        image = await run_in_worker(self.decoder.decode, state.latents)
        return self._result(image, state, prompt_kvs, elapsed)

    # -- on the event loop -------------------------------------------------------------------

    def _check(self, height: Any, width: Any, steps: Any, guidance: Any, seed: Any) -> int:
        """The number of image tokens; ValueError naming the first bad parameter."""
        patch = self.head.patch
        check_image_settings((("height", height), ("width", width)), patch,
                             f"the patch ({patch}) and >= it", steps=steps, guidance=guidance,
                             seed=seed)
        return (height // patch) * (width // patch)

    def _prepare(self, prompt: Any, name: str, num_image: int,
                 cache_salt: str = "") -> _Prepared:
        no_text = prompt is None or (isinstance(prompt, str) and not prompt)
        if name == "negative_prompt" and no_text:
            return _Prepared(None, [])
        try:
            tokens = self.engine.prepare(prompt)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        context = self.engine.config.max_position_embeddings
        if len(tokens) + num_image > context:
            raise ValueError(f"{name} has {len(tokens)} tokens; with {num_image} image tokens "
                             f"the context of {context} positions leaves {context - num_image}")
        return _Prepared(tokens, self.engine.runner.page_keys(tokens.token_ids, tokens.spans(),
                                                              cache_salt))

    def _result(self, image: np.ndarray, state: FlowMatchState, prompt_kvs: list[_PromptKV],
                elapsed: float) -> DiffusionResult:
        layout = self.engine.kv_layout
        per_token = layout.page_bytes // layout.page_size
        num_tokens = sum(p.num_tokens for p in prompt_kvs)
        reused = sum(p.num_reused for p in prompt_kvs)
        self.num_generations += 1
        self.num_tokens_reused += reused
        return DiffusionResult(
            image=image, latents=state.latents, steps=state.num_steps, prompt_tokens=num_tokens,
            prompt_tokens_reused=reused, time_per_step=elapsed / state.num_steps,
            kv_bytes_resident=num_tokens * per_token, kv_bytes_separate=2 * num_tokens * per_token)

    # -- in worker threads -------------------------------------------------------------------

    @torch.inference_mode()
    def _prompt_passes(self, prepared: list[_Prepared], store: KVStore | None,
                       num_image: int) -> tuple[list[_PromptKV], list[_Pass]]:
        prompt_kvs = [self._prompt_kv(p, store) for p in prepared]
        return prompt_kvs, _build_passes(prompt_kvs, num_image, batch=self.batch_cfg,
                                        device=self.device)

    def _prompt_kv(self, prepared: _Prepared, store: KVStore | None) -> _PromptKV:
        """The prompt's KV: the cached full pages (under a lease, released once read), then
        the rest computed causally after them; new full pages go back to the store."""
        tokens = prepared.tokens
        if tokens is None:
            return _PromptKV(None, 0, 0)
        page_size, past, reused = self.engine.page_size, None, 0
        if store is not None:
            past, reused = self._cached_pages(store, prepared.keys)
        kv = past
        if reused < len(tokens):
            positions = torch.arange(reused, len(tokens), device=self.device)[None]
            hidden = self.engine.runner.embed_prompt(tokens, reused).to(self.device)
            _, new = self.model(hidden, positions, past)
            kv = new if past is None else [(torch.cat((pk, nk), dim=2), torch.cat((pv, nv), dim=2))
                                           for (pk, pv), (nk, nv) in zip(past, new, strict=True)]
        assert kv is not None  # a prepared prompt has >= 1 token
        if store is not None and len(prepared.keys) > reused // page_size:
            pages = self.model.kv_to_pages(kv, reused, page_size).contiguous()
            try:
                store.put(prepared.keys[reused // page_size:], pages)
            except KVCapacityError as exc:
                log.warning("prompt KV pages not cached: %s", exc)
        return _PromptKV(kv, len(tokens), reused)

    def _cached_pages(self, store: KVStore, keys: list[bytes]) -> tuple[KVList | None, int]:
        """The KV of the longest cached run of full pages, and its token count. A top tier too
        full of pinned pages to lend them is a miss (recompute), never an error."""
        try:
            lease = store.acquire(keys[: store.match(keys)])
        except KVCapacityError as exc:
            log.warning("prompt KV pages not leased, recomputing: %s", exc)
            return None, 0
        with lease:
            if not len(lease):
                return None, 0
            return self.model.kv_from_pages(lease.pages()), len(lease) * self.engine.page_size

    @torch.inference_mode()
    def _timed_step(self, state: FlowMatchState, passes: list[_Pass], guidance: float) -> float:
        start = time.perf_counter()
        _cached_step(self.model, self.head, self.sampler, state, passes, guidance)
        return time.perf_counter() - start


# -- the two ways to compute a step (module functions, so tests and perf/ call them) ----------


PADDING_TOLERANCE = 1.125  # "auto" batches while padded keys <= this x the keys without padding


def _build_passes(prompt_kvs: list[_PromptKV], num_image: int, *,
                  batch: bool | Literal["auto"], device: torch.device) -> list[_Pass]:
    """One pass per prompt, or (batch) a single pass with a row per prompt."""
    lengths = [p.num_tokens for p in prompt_kvs]
    if not _should_batch(lengths, num_image, batch):
        return [_batched_pass([p], num_image, device) for p in prompt_kvs]
    return [_batched_pass(prompt_kvs, num_image, device)]


def _should_batch(prompt_lengths: list[int], num_image: int,
                  batch: bool | Literal["auto"]) -> bool:
    """Whether to run the prompts' passes as one batch ("auto": while padding adds at most
    `PADDING_TOLERANCE` x the keys the passes would attend to unpadded)."""
    if len(prompt_lengths) < 2:
        return False
    if batch != "auto":
        return bool(batch)
    keys = [n + num_image for n in prompt_lengths]
    return len(keys) * max(keys) <= PADDING_TOLERANCE * sum(keys)


def _batched_pass(prompt_kvs: list[_PromptKV], num_image: int, device: torch.device) -> _Pass:
    longest = max(p.num_tokens for p in prompt_kvs)
    rows = len(prompt_kvs)
    positions = torch.stack([torch.arange(p.num_tokens, p.num_tokens + num_image, device=device)
                             for p in prompt_kvs])  # [B, N]
    mask = torch.zeros(rows, 1, num_image, longest + num_image, dtype=torch.bool, device=device)
    mask[..., longest:] = True  # every image token sees every image token
    for row, p in enumerate(prompt_kvs):
        mask[row, ..., : p.num_tokens] = True  # and all of its own prompt
    if longest == 0:
        return _Pass(None, positions, mask)
    if rows == 1:
        return _Pass(prompt_kvs[0].kv, positions, mask)
    return _Pass(_padded_kv(prompt_kvs, longest), positions, mask)


def _padded_kv(prompt_kvs: list[_PromptKV], longest: int) -> KVList:
    """Each prompt's KV in its own row, zero after its end: per layer [B, Hkv, T_max, D]."""
    template = next(p.kv for p in prompt_kvs if p.kv is not None)[0][0]
    shape = (len(prompt_kvs), template.shape[1], longest, template.shape[3])
    padded: KVList = []
    for layer in range(len(next(p.kv for p in prompt_kvs if p.kv is not None))):
        k, v = template.new_zeros(shape), template.new_zeros(shape)
        for row, p in enumerate(prompt_kvs):
            if p.kv is not None:
                k[row, :, : p.num_tokens] = p.kv[layer][0][0]
                v[row, :, : p.num_tokens] = p.kv[layer][1][0]
        padded.append((k, v))
    return padded


def _guided(velocities: Tensor, guidance: float) -> Tensor:
    """Rows [cond] or [cond, uncond] of [R, C, H, W] -> the velocity [C, H, W] to step with."""
    if velocities.shape[0] == 1:
        return velocities[0]
    return classifier_free_guidance(velocities[0], velocities[1], guidance)


def _cached_step(model: DecoderLM, head: DiffusionHead, sampler: FlowMatchEulerSampler,
                state: FlowMatchState, passes: list[_Pass], guidance: float) -> Tensor:
    """One step computing only the image tokens, against the held prompt KV; returns the new
    latents (and advances `state`)."""
    latents = state.latents  # [C, H, W]
    outputs = []
    for p in passes:
        rows = p.positions.shape[0]
        tokens = head.embed(latents[None].expand(rows, -1, -1, -1), state.t)  # [B, N, E]
        hidden, _ = model(tokens, p.positions, p.past, p.mask)
        outputs.append(head.velocity(hidden, *latents.shape[1:]))
    return sampler.step(_guided(torch.cat(outputs), guidance), state)


def _denoise_cached(model: DecoderLM, head: DiffusionHead, sampler: FlowMatchEulerSampler,
                    state: FlowMatchState, passes: list[_Pass], guidance: float) -> list[Tensor]:
    """All remaining steps of `_cached_step`; the latents after each step."""
    with torch.inference_mode():
        return [_cached_step(model, head, sampler, state, passes, guidance)
                for _ in range(state.index, state.num_steps)]


def _prefix_mask(num_prompt: int, num_image: int, device: torch.device) -> Tensor:
    """[1, 1, S, S] for S = T + N: prompt rows causal, image rows see everything."""
    size = num_prompt + num_image
    mask = torch.ones(size, size, dtype=torch.bool, device=device).tril()
    mask[num_prompt:] = True
    return mask[None, None]


def _denoise_recompute(model: DecoderLM, head: DiffusionHead, sampler: FlowMatchEulerSampler,
                       state: FlowMatchState, prompt_embeds: list[Tensor | None],
                       guidance: float) -> list[Tensor]:
    """The oracle (and the no-sharing baseline): every step runs the whole sequence, prompt +
    image tokens, through the model with `_prefix_mask`, one pass per prompt (embeddings
    [1, T, E], or None for no text). Returns the latents after each step."""
    _, height, width = state.latents.shape
    device, trajectory = state.latents.device, []
    with torch.inference_mode():
        while not state.done:
            outputs = []
            for embeds in prompt_embeds:
                image = head.embed(state.latents[None], state.t)  # [1, N, E]
                num_prompt = 0 if embeds is None else embeds.shape[1]
                hidden = image if embeds is None else torch.cat((embeds, image), dim=1)
                positions = torch.arange(hidden.shape[1], device=device)[None]
                mask = _prefix_mask(num_prompt, image.shape[1], device)
                out, _ = model(hidden, positions, None, mask)
                outputs.append(head.velocity(out[:, num_prompt:], height, width))
            trajectory.append(sampler.step(_guided(torch.cat(outputs), guidance), state))
    return trajectory


def check_image_settings(sizes: Sequence[tuple[str, Any]], step: int, multiple: str, *,
                         steps: Any, guidance: Any, seed: Any, n: Any = 1) -> None:
    """What an image generator checks before any work; ValueError naming the first setting
    out of range: each of `sizes` (name, value) a positive multiple of `step` (`multiple`
    says of what, in the message), `steps` and `n` ints >= 1, `guidance` a finite number
    >= 0, `seed` an int."""
    for name, value in sizes:
        if not _is_int(value) or value < step or value % step:
            raise ValueError(f"{name} must be a multiple of {multiple}, got {value!r}")
    for name, value in (("steps", steps), ("n", n)):
        if not _is_int(value) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if (isinstance(guidance, bool) or not isinstance(guidance, numbers.Real)
            or not math.isfinite(guidance) or guidance < 0):
        raise ValueError(f"guidance must be a finite number >= 0, got {guidance!r}")
    if not _is_int(seed):
        raise ValueError(f"seed must be an int, got {seed!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
