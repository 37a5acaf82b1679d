"""Diffusion on the LLM: cached prompt KV equals recomputation step by step, one copy of the
prompt KV shared with the LLM role (both ways), CFG, the Euler sampler, images, bad input."""

import io
import math

import numpy as np
import pytest
import torch
import trio
from PIL import Image as PILImage

from omni.compute.diffusion import (
    DiffusionHead,
    FlowMatchEulerSampler,
    ImageGenerator,
    LatentDecoder,
    _denoise_cached,
    _denoise_recompute,
    _should_batch,
    classifier_free_guidance,
)
from omni.compute.engine import TorchEngine
from omni.compute.models import DecoderLM
from omni.compute.prompt import Image, Prompt, Text
from omni.compute.sampling import Sampler, SamplingParams
from omni.kv import KVStore, TierConfig

PROMPT = "A red fox asleep in fresh snow, watercolour, soft morning light. "  # 65 tokens
NEGATIVE = "blurry, low quality, watermark, text, extra limbs"  # 49 tokens
CACHE_ONLY = SamplingParams(max_new_tokens=0)
GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
SIZE = dict(height=8, width=8)  # 16 image tokens (patch 2)
NUM_IMAGE = 16
ATOL = 1e-5


@pytest.fixture
def engine():
    layout = TorchEngine.tiny(seed=0).kv_layout
    store = KVStore(layout, [TierConfig("device", 64 * layout.page_bytes),
                             TierConfig("host", 256 * layout.page_bytes)])
    yield TorchEngine.tiny(seed=0, store=store)
    store.close()


def num_pages(store: KVStore) -> int:
    return sum(tier["pages"] for name, tier in store.stats().items() if name != "leases")


def full_pages(engine: TorchEngine, prompt) -> int:
    """Prompt tokens in full pages: what the store keeps of a prompt."""
    return len(engine.prepare(prompt)) // engine.page_size * engine.page_size


def pixels(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (24, 24, 3), dtype=np.uint8)


def oracle(gen: ImageGenerator, prompt, negative, steps: int, guidance: float, seed: int = 0):
    """The latents after each step when every step recomputes prompt + image tokens."""
    engine = gen.engine
    embeds = [engine.runner.embed_prompt(engine.prepare(prompt), 0)]
    if guidance != 1.0:
        embeds.append(engine.runner.embed_prompt(engine.prepare(negative), 0) if negative else None)
    state = gen.sampler.start((4, SIZE["height"], SIZE["width"]), steps, seed=seed)
    return _denoise_recompute(gen.model, gen.head, gen.sampler, state, embeds, guidance)


def cached(gen: ImageGenerator, prompt, negative, steps: int, guidance: float, seed: int = 0):
    """The latents after each step of the cached path (prompt KV through the store), and the
    prompt KVs it held."""
    prepared = [gen._prepare(prompt, "prompt", NUM_IMAGE)]
    if guidance != 1.0:
        prepared.append(gen._prepare(negative, "negative_prompt", NUM_IMAGE))
    prompt_kvs, passes = gen._prompt_passes(prepared, gen.engine.store, NUM_IMAGE)
    state = gen.sampler.start((4, SIZE["height"], SIZE["width"]), steps, seed=seed)
    trajectory = _denoise_cached(gen.model, gen.head, gen.sampler, state, passes, guidance)
    return trajectory, prompt_kvs


# --------------------------------------------------------------- cached equals recomputed

@pytest.mark.parametrize("batch_cfg", [True, False], ids=["batched", "separate"])
@pytest.mark.parametrize("negative", [NEGATIVE, ""], ids=["negative", "no-text"])
async def test_cached_prompt_kv_gives_the_recomputed_latents_at_every_step(engine, batch_cfg,
                                                                            negative):
    await engine.generate(PROMPT, CACHE_ONLY)  # the LLM role computes and caches the prompt
    gen = ImageGenerator(engine, batch_cfg=batch_cfg)
    steps, guidance = 6, 3.0
    trajectory, prompt_kvs = cached(gen, PROMPT, negative, steps, guidance)
    assert prompt_kvs[0].num_reused == full_pages(engine, PROMPT) > 0
    expected = oracle(gen, PROMPT, negative, steps, guidance)
    assert len(trajectory) == len(expected) == steps
    for step, (got, want) in enumerate(zip(trajectory, expected, strict=True)):
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL, msg=f"step {step}")
    result = await gen.generate(PROMPT, **SIZE, steps=steps, guidance=guidance,
                                negative_prompt=negative)
    torch.testing.assert_close(result.latents, expected[-1], rtol=0, atol=ATOL)


async def test_a_partly_cached_prompt_computes_the_rest_after_the_cached_pages(engine):
    await engine.generate(PROMPT + "Hello!", CACHE_ONLY)  # shares PROMPT's pages only
    gen = ImageGenerator(engine)
    other = PROMPT + "Now paint it at dusk, in oils, with a lantern."
    trajectory, prompt_kvs = cached(gen, other, "", 5, 1.0)
    assert prompt_kvs[0].num_reused == full_pages(engine, PROMPT)
    assert prompt_kvs[0].num_tokens == len(other)
    for got, want in zip(trajectory, oracle(gen, other, "", 5, 1.0), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


async def test_without_reuse_the_store_is_untouched_and_the_image_is_the_same(engine):
    await engine.generate(PROMPT, CACHE_ONLY)
    gen = ImageGenerator(engine)
    before = engine.store.stats()
    baseline = await gen.generate(PROMPT, **SIZE, steps=4, negative_prompt=NEGATIVE, reuse=False)
    assert engine.store.stats() == before
    assert baseline.prompt_tokens_reused == 0
    reused = await gen.generate(PROMPT, **SIZE, steps=4, negative_prompt=NEGATIVE)
    assert reused.prompt_tokens_reused > 0
    torch.testing.assert_close(reused.latents, baseline.latents, rtol=0, atol=ATOL)


async def test_pages_the_store_cannot_lend_are_recomputed_not_an_error():
    layout = TorchEngine.tiny(seed=0).kv_layout
    store = KVStore(layout, [TierConfig("device", 4 * layout.page_bytes),
                             TierConfig("host", 64 * layout.page_bytes)])
    engine = TorchEngine.tiny(seed=0, store=store)
    await engine.generate(PROMPT, CACHE_ONLY)
    other = list(range(10, 74))  # 4 pages: PROMPT's move down to the host tier
    await engine.generate(other, CACHE_ONLY)
    with store.acquire(engine.runner.page_keys(other, [])) as pinned:  # the device tier, all pinned
        assert len(pinned) == 4
        gen = ImageGenerator(engine)
        result = await gen.generate(PROMPT, **SIZE, steps=3, guidance=1.0)
    assert result.prompt_tokens_reused == 0
    torch.testing.assert_close(result.latents, oracle(gen, PROMPT, "", 3, 1.0)[-1], rtol=0,
                               atol=ATOL)
    store.close()


# ------------------------------------------------------------------ one copy, both roles

@pytest.mark.parametrize("prompt", [PROMPT, Prompt([Text(PROMPT), Image(pixels()),
                                                    Text("In this style.")])],
                         ids=["text", "image"])
async def test_a_generation_reuses_the_llm_roles_pages_without_a_second_copy(engine, prompt):
    await engine.generate(prompt, CACHE_ONLY)
    pages = num_pages(engine.store)
    result = await ImageGenerator(engine).generate(prompt, **SIZE, steps=2, guidance=1.0)
    assert result.prompt_tokens_reused == full_pages(engine, prompt) > 0
    assert num_pages(engine.store) == pages
    assert result.kv_bytes_separate == 2 * result.kv_bytes_resident
    layout = engine.kv_layout
    assert result.kv_bytes_resident == len(engine.prepare(prompt)) * (
        layout.page_bytes // layout.page_size)


async def test_the_llm_role_reuses_a_generations_pages_and_gives_the_recomputed_tokens(engine):
    await ImageGenerator(engine).generate(PROMPT, **SIZE, steps=2, guidance=1.0)
    pages = num_pages(engine.store)
    assert pages == full_pages(engine, PROMPT) // engine.page_size
    turn = await engine.generate(PROMPT + "Describe it.", GREEDY)
    assert turn.cached_tokens == full_pages(engine, PROMPT)
    reference = await TorchEngine.tiny(seed=0).generate(PROMPT + "Describe it.", GREEDY)
    assert turn.token_ids == reference.token_ids


async def test_cfg_keeps_both_prompts_cached_and_a_second_generation_reuses_both(engine):
    gen = ImageGenerator(engine)
    first = await gen.generate(PROMPT, **SIZE, steps=2, negative_prompt=NEGATIVE)
    both = full_pages(engine, PROMPT) + full_pages(engine, NEGATIVE)
    assert first.prompt_tokens_reused == 0
    assert first.prompt_tokens == len(PROMPT) + len(NEGATIVE)
    assert num_pages(engine.store) == both // engine.page_size
    second = await gen.generate(PROMPT, **SIZE, steps=2, negative_prompt=NEGATIVE)
    assert second.prompt_tokens_reused == both
    assert num_pages(engine.store) == both // engine.page_size
    assert repr(gen).endswith(f"generations=2 reused_tokens={both}>")


async def test_guidance_one_skips_the_negative_prompt(engine):
    result = await ImageGenerator(engine).generate(PROMPT, **SIZE, steps=2, guidance=1.0,
                                                   negative_prompt=NEGATIVE)
    assert result.prompt_tokens == len(PROMPT)


async def test_leases_are_released_after_generations_and_a_cancelled_one(engine):
    gen = ImageGenerator(engine)
    await engine.generate(PROMPT, CACHE_ONLY)
    for _ in range(3):
        await gen.generate(PROMPT, **SIZE, steps=2, negative_prompt=NEGATIVE)
    with trio.move_on_after(0.001):
        await gen.generate(PROMPT, **SIZE, steps=200, negative_prompt=NEGATIVE)
    leases = engine.store.stats()["leases"]
    assert leases["open"] == 0 and leases["pinned_pages"] == 0


def test_the_generator_shares_the_llms_weights():
    engine = TorchEngine.tiny(seed=0)
    gen = ImageGenerator(engine)
    assert gen.model is engine.model
    others = [v for k, v in vars(gen).items() if k not in ("model", "engine")]
    assert not any(isinstance(v, DecoderLM) for v in others)
    own = {n for m in (gen.head, gen.decoder) for n, _ in m.named_parameters()}
    assert own == {"latent_in.weight", "latent_in.bias", "time_mlp.0.weight", "time_mlp.0.bias",
                   "time_mlp.2.weight", "time_mlp.2.bias", "velocity_out.weight",
                   "velocity_out.bias", "proj.weight", "proj.bias"}


@pytest.mark.parametrize(("batch_cfg", "lengths", "batched"), [
    ("auto", [64, 64], True), ("auto", [64, 60], True), ("auto", [64, 0], False),
    ("auto", [64], False), (True, [64, 0], True), (False, [64, 64], False)])
def test_auto_batches_cfg_passes_only_when_padding_wastes_little(batch_cfg, lengths, batched):
    assert _should_batch(lengths, 16, batch_cfg) is batched


# ------------------------------------------------------------------ images and seeds

async def test_a_seed_reproduces_the_image_and_another_seed_or_prompt_changes_it(engine):
    gen = ImageGenerator(engine)
    a = await gen.generate(PROMPT, **SIZE, steps=3, seed=7)
    again = await ImageGenerator(TorchEngine.tiny(seed=0)).generate(PROMPT, **SIZE, steps=3,
                                                                   seed=7)
    assert np.array_equal(a.image, again.image) and torch.equal(a.latents, again.latents)
    other_seed = await gen.generate(PROMPT, **SIZE, steps=3, seed=8)
    other_prompt = await gen.generate("A blue whale in deep water.", **SIZE, steps=3, seed=7)
    for other in (other_seed, other_prompt):
        assert not np.array_equal(a.image, other.image)
        assert not torch.allclose(a.latents, other.latents, atol=1e-3)


async def test_the_image_has_eight_pixels_per_latent_and_a_valid_png(engine):
    result = await ImageGenerator(engine).generate(PROMPT, height=8, width=12, steps=2)
    assert result.image.shape == (64, 96, 3) and result.image.dtype == np.uint8
    assert result.latents.shape == (4, 8, 12) and result.steps == 2
    assert result.time_per_step > 0
    with PILImage.open(io.BytesIO(result.png)) as png:
        assert png.format == "PNG" and png.size == (96, 64) and png.mode == "RGB"
        assert np.array_equal(np.asarray(png), result.image)


def test_patchify_and_unpatchify_are_inverse_and_the_decoder_is_seeded():
    head = DiffusionHead(64, latent_channels=4, patch=2, seed=0)
    latents = torch.randn(2, 4, 6, 10)
    tokens = head.patchify(latents)
    assert tokens.shape == (2, 15, 16)
    assert torch.equal(tokens[0, 1], latents[0, :, 0:2, 2:4].reshape(-1))  # row-major patches
    assert torch.equal(head.unpatchify(tokens, 6, 10), latents)
    image = LatentDecoder(4, seed=3).decode(latents[0])
    assert image.shape == (48, 80, 3)
    assert np.array_equal(image, LatentDecoder(4, seed=3).decode(latents[0]))
    assert not np.array_equal(image, LatentDecoder(4, seed=4).decode(latents[0]))


# ------------------------------------------------------------------ the Euler sampler

@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_euler_on_the_straight_path_velocity_lands_exactly_on_the_data(shift):
    sampler = FlowMatchEulerSampler(shift=shift)
    assert isinstance(sampler, Sampler)
    state = sampler.start((3, 4), 7, seed=0, dtype=torch.float64)
    data = torch.linspace(-2, 2, 12, dtype=torch.float64).view(3, 4)
    velocity = state.latents - data  # x_t = (1 - t) data + t noise: dx/dt = noise - data
    for _ in range(7):
        sampler.step(velocity, state)
    assert state.done and state.t == 0.0
    torch.testing.assert_close(state.latents, data, rtol=0, atol=1e-12)


def test_euler_on_a_linear_field_gives_the_analytic_product():
    sampler, a = FlowMatchEulerSampler(), 0.5
    state = sampler.start((5,), 4, seed=1, dtype=torch.float64)
    x0 = state.latents.clone()
    for _ in range(4):
        sampler.step(a * state.latents, state)  # v = a x
    expected = x0 * math.prod(1 - a * 0.25 for _ in range(4))  # dt = 1/4 each
    torch.testing.assert_close(state.latents, expected, rtol=0, atol=1e-12)


def test_the_schedule_runs_from_one_to_zero_shifted_like_sd3():
    plain = FlowMatchEulerSampler().schedule(4)
    assert plain.tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]
    shifted = FlowMatchEulerSampler(shift=3.0).schedule(4)
    assert shifted[0] == 1.0 and shifted[-1] == 0.0
    assert shifted[2].item() == pytest.approx(3 * 0.5 / (1 + 2 * 0.5))  # 0.75
    assert bool((shifted[1:] < shifted[:-1]).all())


def test_the_sampler_refuses_a_wrong_shape_a_finished_run_and_a_bad_shift():
    sampler = FlowMatchEulerSampler()
    state = sampler.start((2, 2), 1, seed=0)
    with pytest.raises(ValueError, match="shape"):
        sampler.step(torch.zeros(3), state)
    sampler.step(torch.zeros(2, 2), state)
    with pytest.raises(ValueError, match="finished"):
        sampler.step(torch.zeros(2, 2), state)
    with pytest.raises(ValueError, match="shift"):
        FlowMatchEulerSampler(shift=0.0)


def test_classifier_free_guidance_interpolates_and_extrapolates():
    cond, uncond = torch.tensor([2.0]), torch.tensor([1.0])
    assert classifier_free_guidance(cond, uncond, 1.0).item() == 2.0
    assert classifier_free_guidance(cond, uncond, 0.0).item() == 1.0
    assert classifier_free_guidance(cond, uncond, 3.0).item() == 4.0


# ------------------------------------------------------------------ bad input

@pytest.mark.parametrize(("kwargs", "name"), [
    (dict(steps=0), "steps"), (dict(steps=2.5), "steps"), (dict(guidance=-0.5), "guidance"),
    (dict(guidance=float("nan")), "guidance"), (dict(guidance=float("inf")), "guidance"),
    (dict(height=7), "height"), (dict(width=0), "width"), (dict(height=1), "height"),
    (dict(seed=1.5), "seed"), (dict(prompt=""), "prompt"),
    (dict(prompt=[5] * (4096 - NUM_IMAGE + 1)), "prompt"),
    (dict(negative_prompt=[5] * (4096 - NUM_IMAGE + 1)), "negative_prompt"),
])
async def test_bad_input_raises_a_value_error_naming_the_parameter(engine, kwargs, name):
    args = {"prompt": PROMPT, **SIZE, **kwargs}
    before = engine.store.stats()
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        await ImageGenerator(engine).generate(args.pop("prompt"), **args)
    assert engine.store.stats() == before


async def test_a_prompt_that_fits_the_context_with_the_image_tokens_is_accepted(engine):
    result = await ImageGenerator(engine).generate([5] * (4096 - NUM_IMAGE), **SIZE, steps=1,
                                                   guidance=1.0)
    assert result.prompt_tokens == 4096 - NUM_IMAGE


async def test_a_prompts_kv_is_reused_under_its_own_cache_salt_only(engine):
    """Pages a request of one salt cached are not another salt's: a tenant's image prompt
    tells no other tenant it was seen."""
    await engine.generate(PROMPT, CACHE_ONLY, cache_salt="alice")
    gen = ImageGenerator(engine)
    other = await gen.generate(PROMPT, **SIZE, steps=2, guidance=1.0, cache_salt="bob")
    assert other.prompt_tokens_reused == 0
    own = await gen.generate(PROMPT, **SIZE, steps=2, guidance=1.0, cache_salt="alice")
    assert own.prompt_tokens_reused == full_pages(engine, PROMPT)
    torch.testing.assert_close(own.latents, other.latents, rtol=0, atol=ATOL)
