"""`Cosmos3` paints the images diffusers' `Cosmos3OmniPipeline` paints (the oracle) on tiny
random folders in the hub layout, while it runs the understanding expert once per prompt of
a request, on Omni's engine, rather than at every denoising step; the engine's keys and
values equal those diffusers' understanding layers compute (`understand` here: the oracle,
on a pipeline loaded apart), a prompt's prefix cached under the request's salt is read from
the engine's store, and what the steps read is what the store's pages hold."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omni.compute.cosmos3 import (
    Cosmos3,
    LayerKV,
    Rope,
    _attend,
    _heads,
    _rotate,
    generation_kv,
    generation_layer,
    rotary,
    velocity,
)
from omni.compute.models import DecoderConfig, DecoderLM
from omni.compute.models.cosmos3_weights import understanding_config
from tests.compute.cosmos3_builders import save_cosmos3
from tests.compute.image_builders import save_z_image

PROMPT = "A red fox asleep in fresh snow, watercolour."
SECOND = "A lighthouse at dusk, oil on canvas."
NEGATIVE = "blurry, dark"
SIZE = {"width": 32, "height": 24}  # 8 x 6 latents: patches of 2 x 2 over a non-square grid
STEPS = 3
# the Nemotron variant: squared-ReLU MLPs, Nemotron norms, no text q/k norm but a key norm
# for the generation expert; and the pipeline's native flow schedule
VARIANTS = {"qwen3": {}, "nemotron": {"hidden_act": "relu2", "qk_norm_for_text": False,
                                      "use_und_k_norm_for_gen": True,
                                      "native_flow_schedule": True}}


@pytest.fixture(scope="module", params=list(VARIANTS))
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_cosmos3(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])


@pytest.fixture(scope="module")
def pipeline(folder: Path) -> Any:
    from diffusers import Cosmos3OmniPipeline

    pipe = Cosmos3OmniPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def model(folder: Path) -> Cosmos3:
    return Cosmos3.from_pretrained(folder)


def paint(pipeline: Any, prompt: str, *, negative_prompt: str = NEGATIVE,
          guidance: float = 4.0, seed: int = 0, n: int = 1, width: int = SIZE["width"],
          height: int = SIZE["height"]) -> np.ndarray:
    """The oracle: `n` calls of diffusers' pipeline (one image each) sharing one generator."""
    generator = torch.Generator().manual_seed(seed)
    return np.concatenate([pipeline(
        prompt, negative_prompt=negative_prompt, num_frames=1, height=height, width=width,
        num_inference_steps=STEPS, guidance_scale=guidance, generator=generator,
        output_type="np").video for _ in range(n)])


def understanding_layer(layer: Any, hidden: torch.Tensor, rope: Rope, *,
                        last: bool = False) -> tuple[LayerKV, torch.Tensor | None]:
    """The oracle of one understanding layer, on diffusers' modules, over the prompt's
    `hidden` ``[T, hidden]``: the keys (rotated) and values the generation expert reads, and
    the next layer's input (None when `last`)."""
    attn = layer.self_attn
    normed = layer.input_layernorm(hidden)
    keys = attn.norm_k(_heads(attn.to_k(normed), attn.num_key_value_heads, attn.head_dim))
    values = _heads(attn.to_v(normed), attn.num_key_value_heads, attn.head_dim)
    keys_for_gen = keys if attn.k_norm_und_for_gen is None else attn.k_norm_und_for_gen(keys)
    kv = (_rotate(keys_for_gen, rope), values)
    if last:
        return kv, None
    query = attn.norm_q(_heads(attn.to_q(normed), attn.num_attention_heads, attn.head_dim))
    out = _attend(attn, _rotate(query, rope)[None], _rotate(keys, rope)[None], values[None],
                  causal=True)
    residual = hidden + attn.to_out(out[0])
    return kv, residual + layer.mlp(layer.post_attention_layernorm(residual))


def understand(transformer: Any, input_ids: torch.Tensor,
               position_ids: torch.Tensor) -> list[LayerKV]:
    """The oracle of the understanding expert over token ids ``[T]`` at mRoPE positions
    ``[3, T]``, on diffusers' modules: each layer's (keys, values) as the generation expert
    reads them."""
    hidden = transformer.embed_tokens(input_ids)  # [T, hidden]
    rope = rotary(transformer, position_ids, hidden.dtype)
    layers = transformer.layers
    kv = []
    for index, layer in enumerate(layers):
        layer_kv, hidden = understanding_layer(layer, hidden, rope,
                                               last=index == len(layers) - 1)
        kv.append(layer_kv)
    return kv


@pytest.mark.parametrize(("prompt", "guidance", "n"), [
    (PROMPT, 4.0, 1), (PROMPT, 1.0, 1), (PROMPT, 0.0, 1), (PROMPT, 4.0, 2), (SECOND, 4.0, 1),
    (SECOND, 1.0, 2)])
def test_the_images_equal_the_pipelines(pipeline: Any, model: Cosmos3, prompt: str,
                                        guidance: float, n: int) -> None:
    theirs = paint(pipeline, prompt, guidance=guidance, n=n, seed=5)
    ours = model.generate(prompt, negative_prompt=NEGATIVE, steps=STEPS, guidance=guidance,
                          seed=5, n=n, **SIZE).images
    assert ours.shape == (n, SIZE["height"], SIZE["width"], 3) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-3)


def test_the_smallest_square_image_equals_the_pipelines(pipeline: Any, model: Cosmos3) -> None:
    """One latent pixel each way: a patch grid padded from 1 x 1 to 2 x 2."""
    step = model.pixel_step
    theirs = paint(pipeline, PROMPT, width=step, height=step)
    ours = model.generate(PROMPT, negative_prompt=NEGATIVE, steps=STEPS, guidance=4.0,
                          width=step, height=step).images
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-3)


def test_the_image_depends_on_the_prompt_and_the_negative_prompt(pipeline: Any) -> None:
    """The folder is a fair test: a change of either prompt moves the pixels by far more
    than the tolerance the images are compared with."""
    image = paint(pipeline, PROMPT)
    assert np.abs(image - paint(pipeline, SECOND)).mean() > 0.02
    assert np.abs(image - paint(pipeline, PROMPT, negative_prompt=SECOND)).mean() > 0.02
    assert np.abs(image - paint(pipeline, PROMPT, guidance=1.0)).mean() > 0.02


@pytest.mark.parametrize(("guidance", "num_prompts"), [(4.0, 2), (0.0, 2), (1.0, 1)])
def test_the_understanding_expert_runs_once_per_prompt(
        model: Cosmos3, guidance: float, num_prompts: int) -> None:
    """The engine runs one prefill for the prompt (and one for the negative prompt when
    guided), not one per step; diffusers' understanding modules never run, the generation
    expert's once per step and prompt, for all n images at once."""
    calls: Counter[str] = Counter()
    hooks = [module.register_forward_hook(lambda *_, key=key: calls.update([key]))
             for layer in model.transformer.layers
             for key, module in (("understanding", layer.mlp),
                                 ("generation", layer.mlp_moe_gen))]
    before = model.engine.stats()
    try:
        model.generate(PROMPT, negative_prompt=NEGATIVE, steps=STEPS, guidance=guidance, n=2,
                       cache_salt=f"once-{guidance}", **SIZE)
    finally:
        for hook in hooks:
            hook.remove()
    assert model.engine.stats().num_prefills - before.num_prefills == num_prompts
    assert calls["understanding"] == 0
    assert calls["generation"] == STEPS * num_prompts * len(model.transformer.layers)


def layer_inputs(model: Cosmos3, prompt: str) -> dict[str, Any]:
    """A joint sequence as the pipeline lays it out: the prompt's tokens, then an image's
    latent patches with random hidden states, and their rotary embeddings."""
    ids, _ = model.prompt_ids(prompt, "", **SIZE)
    latents = model.noise(seed=3, n=1, **SIZE)
    text = model.painter._prepare_text_segment(ids, device="cpu")
    image = model.painter._prepare_vision_segment(
        input_vision_tokens=latents, has_image_condition=False,
        mrope_offset=text["vision_start_temporal_offset"], vision_fps=None,
        curr=text["und_len"], device="cpu")
    transformer = model.transformer
    hidden = transformer.config.hidden_size
    generator = torch.Generator().manual_seed(1)
    return {"und": torch.randn(len(ids), hidden, generator=generator),
            "gen": torch.randn(2, image["num_vision_tokens"], hidden, generator=generator),
            "und_rope": rotary(transformer, text["text_mrope_ids"], torch.float32),
            "gen_rope": rotary(transformer, image["vision_mrope_ids"], torch.float32)}


@torch.no_grad()
@pytest.mark.parametrize("prompt", [PROMPT, SECOND])
def test_each_layer_equals_the_diffusers_layer(model: Cosmos3, prompt: str) -> None:
    """`understanding_layer`'s output and `generation_layer`'s, fed its keys and values,
    equal diffusers' layer over the joint sequence; two images batched equal each alone."""
    inputs = layer_inputs(model, prompt)
    und_rope = tuple(x.squeeze(1) for x in inputs["und_rope"])
    gen_rope = tuple(x.squeeze(1) for x in inputs["gen_rope"])
    for layer in model.transformer.layers:
        kv, und_out = understanding_layer(layer, inputs["und"], inputs["und_rope"])
        ours = generation_layer(layer, inputs["gen"], kv, inputs["gen_rope"])
        for image, gen in enumerate(inputs["gen"]):
            theirs_und, theirs_gen = layer(inputs["und"], gen, (*und_rope, *gen_rope))
            torch.testing.assert_close(und_out, theirs_und, rtol=0, atol=1e-6)
            torch.testing.assert_close(ours[image], theirs_gen, rtol=0, atol=1e-6)


@torch.no_grad()
def test_the_velocity_equals_the_transformers(model: Cosmos3, pipeline: Any) -> None:
    """`velocity` on the engine's keys and values (`prepare`) equals diffusers' whole
    transformer forward on the joint sequence (the pipeline's, loaded apart), for each of
    two images, to the engine's rounding (its fused projections and attention)."""
    ids, _ = model.prompt_ids(PROMPT, NEGATIVE, **SIZE)
    latents = model.noise(seed=2, n=2, **SIZE)
    prompt = model.prepare(ids, latents, cache_salt="velocity")
    ours = velocity(model.transformer, latents, 500, prompt)
    text = model.painter._prepare_text_segment(ids, device="cpu")
    image = model.painter._prepare_vision_segment(
        input_vision_tokens=latents[:1], has_image_condition=False,
        mrope_offset=text["vision_start_temporal_offset"], vision_fps=None,
        curr=text["und_len"], device="cpu")
    for index, latent in enumerate(latents):
        (theirs,) = pipeline.transformer(
            input_ids=text["input_ids"], text_indexes=text["text_indexes"],
            position_ids=torch.cat([text["text_mrope_ids"], image["vision_mrope_ids"]], dim=1),
            und_len=text["und_len"], sequence_length=text["und_len"] + image["num_vision_tokens"],
            vision_tokens=[latent[None]], vision_token_shapes=image["vision_token_shapes"],
            vision_sequence_indexes=image["vision_sequence_indexes"],
            vision_mse_loss_indexes=image["vision_mse_loss_indexes"],
            vision_timesteps=torch.full((image["num_noisy_vision_tokens"],), 500),
            vision_noisy_frame_indexes=image["vision_noisy_frame_indexes"]).sample
        torch.testing.assert_close(ours[index], theirs[0], rtol=0, atol=1e-5)


async def test_agenerate_equals_generate(model: Cosmos3) -> None:
    """The same request in a worker thread: the same images and usage (each under a salt
    of its own, so that both compute their prompts whole)."""
    settings = {"negative_prompt": NEGATIVE, "steps": 2, "guidance": 3.0, "seed": 9, **SIZE}
    theirs = await model.agenerate(PROMPT, cache_salt="agenerate", **settings)
    ours = model.generate(PROMPT, cache_salt="generate", **settings)
    np.testing.assert_array_equal(theirs.images, ours.images)
    assert theirs.usage() == ours.usage()


@pytest.mark.parametrize(("settings", "named"), [
    ({"width": 30}, "width"), ({"height": 0}, "height"), ({"steps": 0}, "steps"),
    ({"n": 0}, "n"), ({"guidance": -1.0}, "guidance"), ({"seed": 1.5}, "seed"),
    ({"negative_prompt": None}, "negative prompt")])
def test_a_setting_out_of_range_is_refused_by_name(model: Cosmos3, settings: dict[str, Any],
                                                   named: str) -> None:
    with pytest.raises(ValueError, match=named):
        model.generate(PROMPT, **{"steps": 1, **SIZE, **settings})


def test_a_prompt_that_is_not_text_is_refused(model: Cosmos3) -> None:
    with pytest.raises(ValueError, match="prompt is text"):
        model.generate(["a", "b"], steps=1, **SIZE)  # type: ignore[arg-type]


def test_a_folder_of_another_family_is_refused(tmp_path: Path, folder: Path) -> None:
    from omni.compute import ZImage

    z_image = save_z_image(tmp_path / "z_image")
    with pytest.raises(ValueError, match=r"a z_image folder, not cosmos3 \(load it as z_image"):
        Cosmos3.from_pretrained(z_image)
    with pytest.raises(ValueError, match=r"a cosmos3 folder, not z_image \(load it as cosmos3"):
        ZImage.from_pretrained(folder)


def test_repr_names_the_folder_and_its_sizes(model: Cosmos3, folder: Path) -> None:
    assert repr(model) == f"<Cosmos3 {folder.name} layers=2 pixel_step=4>"


def cached_prefix(ids: list[int], earlier: list[int], page_size: int) -> int:
    """Tokens of `ids` a prefill reads cached once `earlier` was computed: the full pages
    both start with, at least one token of `ids` left to compute."""
    shared = next((i for i, (a, b) in enumerate(zip(ids, earlier, strict=False)) if a != b),
                  min(len(ids), len(earlier)))
    return min(shared, len(ids) - 1) // page_size * page_size


def prefilled(model: Cosmos3) -> int:
    """The prompt tokens the engine computed so far."""
    return model.engine.stats().num_prefill_tokens


@torch.no_grad()
@pytest.mark.parametrize("prompt", [PROMPT, SECOND])
def test_the_engines_kv_equals_diffusers_understanding(model: Cosmos3, pipeline: Any,
                                                       prompt: str) -> None:
    """The keys and values `prepare` gives the generation expert, computed whole and then
    read from the store, equal `understand` on the pipeline's own transformer (loaded
    apart), for the prompt and the negative prompt."""
    latents = model.noise(seed=0, n=1, **SIZE)
    for which, ids in enumerate(model.prompt_ids(prompt, NEGATIVE, **SIZE)):
        text = pipeline._prepare_text_segment(ids, device="cpu")
        theirs = understand(pipeline.transformer, text["input_ids"], text["text_mrope_ids"])
        for attempt in range(2):
            ours = model.prepare(ids, latents, cache_salt=f"kv-{prompt}-{which}")
            assert (ours.cached_tokens > 0) == (attempt == 1)
            for (keys, values), (their_keys, their_values) in zip(ours.kv, theirs,
                                                                  strict=True):
                torch.testing.assert_close(keys, their_keys, rtol=0, atol=1e-5)
                torch.testing.assert_close(values, their_values, rtol=0, atol=1e-5)


@torch.no_grad()
def test_the_steps_read_what_the_store_holds(model: Cosmos3) -> None:
    """The keys and values the steps read of a prompt's full pages, computed or read from
    cache, are exactly the store's pages for those positions (as `generation_kv` reads
    them: the pages as they are, or with the generation expert's key norm)."""
    ids, _ = model.prompt_ids(PROMPT, NEGATIVE, **SIZE)
    latents = model.noise(seed=0, n=1, **SIZE)
    computed = model.prepare(ids, latents, cache_salt="pages")
    read = model.prepare(ids, latents, cache_salt="pages")
    size = model.engine.page_size
    keys = model.engine.runner.page_keys(ids, [], "pages")
    assert computed.cached_tokens == 0 and read.cached_tokens == len(keys) * size
    with model.engine.store.acquire(keys) as lease:
        pages = DecoderLM.kv_from_pages(lease.pages())
    text = model.painter._prepare_text_segment(ids, device="cpu")
    rope = rotary(model.transformer, text["text_mrope_ids"][:, :len(keys) * size],
                  torch.float32)
    held = [generation_kv(layer, kv, rope)
            for layer, kv in zip(model.transformer.layers, pages, strict=True)]
    for prompt in (computed, read):
        for (keys_read, values_read), (keys_held, values_held) in zip(prompt.kv, held,
                                                                      strict=True):
            assert torch.equal(keys_read[:len(keys) * size], keys_held)
            assert torch.equal(values_read[:len(keys) * size], values_held)


def test_a_second_request_reads_the_shared_system_prompt(model: Cosmos3) -> None:
    """Another prompt after a first, under the same salt, reads the full pages both start
    with (the system prompt's) and computes only the rest."""
    size = model.engine.page_size
    first_ids, _ = model.prompt_ids(PROMPT, "", **SIZE)
    second_ids, _ = model.prompt_ids(SECOND, "", **SIZE)
    settings = {"guidance": 1.0, "steps": 1, "cache_salt": "system", **SIZE}
    before = prefilled(model)
    first = model.generate(PROMPT, **settings)
    between = prefilled(model)
    second = model.generate(SECOND, **settings)
    expected = cached_prefix(second_ids, first_ids, size)
    assert expected >= size
    assert first.usage() == {"input_tokens": len(first_ids), "cached_tokens": 0}
    assert second.usage() == {"input_tokens": len(second_ids), "cached_tokens": expected}
    assert between - before == len(first_ids)
    assert prefilled(model) - between == len(second_ids) - expected


def test_a_repeated_request_reads_all_its_full_pages_but_the_last_tokens(
        model: Cosmos3) -> None:
    """A request sent again reads every full page of its prompt and negative prompt but a
    page that ends on the last token (which is computed)."""
    size = model.engine.page_size
    ids = model.prompt_ids(PROMPT, NEGATIVE, **SIZE)
    settings = {"negative_prompt": NEGATIVE, "guidance": 4.0, "steps": 1,
                "cache_salt": "repeat", **SIZE}
    model.generate(PROMPT, **settings)
    before = prefilled(model)
    again = model.generate(PROMPT, **settings)
    tokens = sum(len(x) for x in ids)
    full = sum((len(x) - 1) // size * size for x in ids)
    assert again.usage() == {"input_tokens": tokens, "cached_tokens": full}
    assert prefilled(model) - before == tokens - full
    # a prompt of whole pages: its last page ends on the last token, which is computed
    whole = ids[0][:2 * size]
    latents = model.noise(seed=0, n=1, **SIZE)
    assert model.prepare(whole, latents, cache_salt="whole pages").cached_tokens == 0
    assert model.prepare(whole, latents, cache_salt="whole pages").cached_tokens == size


def test_another_cache_salt_reads_none(model: Cosmos3) -> None:
    """The same request under another salt reads nothing and computes its prompt whole."""
    ids, _ = model.prompt_ids(PROMPT, "", **SIZE)
    settings = {"guidance": 1.0, "steps": 1, **SIZE}
    model.generate(PROMPT, cache_salt="tenant a", **settings)
    before = prefilled(model)
    other = model.generate(PROMPT, cache_salt="tenant b", **settings)
    assert other.usage() == {"input_tokens": len(ids), "cached_tokens": 0}
    assert prefilled(model) - before == len(ids)


def test_the_images_are_unchanged_by_caching(model: Cosmos3) -> None:
    """A request whose prompts are read from the store paints what one on an engine
    without a store (every prompt computed whole) paints."""
    from omni.compute.engine import TorchEngine

    engine = model.engine
    uncached = Cosmos3(model.painter, TorchEngine(engine.model, engine.config, store=None))
    settings = {"negative_prompt": NEGATIVE, "guidance": 4.0, "steps": STEPS, "seed": 5,
                "cache_salt": "images", **SIZE}
    model.generate(PROMPT, **settings)
    cached = model.generate(PROMPT, **settings)
    whole = uncached.generate(PROMPT, **settings)
    assert whole.cached_tokens == 0 and cached.cached_tokens > 0
    np.testing.assert_allclose(cached.images, whole.images, rtol=0, atol=1e-5)


def test_the_transformer_and_the_engine_hold_one_copy_of_the_weights(
        model: Cosmos3, pipeline: Any) -> None:
    """The transformer's understanding projections are views of the engine's fused ones,
    and every tensor of the transformer is still the checkpoint's (the pipeline's)."""
    def storage(tensor: torch.Tensor) -> int:
        return tensor.untyped_storage().data_ptr()

    for theirs, ours in zip(model.transformer.layers, model.engine.model.layers, strict=True):
        attn = theirs.self_attn
        for part in (attn.to_q, attn.to_k, attn.to_v):
            assert storage(part.weight) == storage(ours.attn.qkv_proj.weight)
        if hasattr(ours.mlp, "gate_up_proj"):
            for part in (theirs.mlp.gate_proj, theirs.mlp.up_proj):
                assert storage(part.weight) == storage(ours.mlp.gate_up_proj.weight)
        assert storage(attn.to_out.weight) == storage(ours.attn.o_proj.weight)
    checkpoint = pipeline.transformer.state_dict()
    for name, tensor in model.transformer.state_dict().items():
        assert torch.equal(tensor, checkpoint[name]), name


@torch.no_grad()
def test_the_engines_layers_have_the_understanding_experts_mlp_and_norms(
        model: Cosmos3, pipeline: Any) -> None:
    """The engine's MLP (SwiGLU, or Nemotron's ungated squared ReLU) and norms equal the
    understanding expert's modules (the pipeline's) on random input."""
    hidden = torch.randn(1, 5, model.transformer.config.hidden_size,
                         generator=torch.Generator().manual_seed(0))
    for theirs, ours in zip(pipeline.transformer.layers, model.engine.model.layers,
                            strict=True):
        for mine, reference in ((ours.mlp, theirs.mlp), (ours.attn_norm, theirs.input_layernorm),
                                (ours.mlp_norm, theirs.post_attention_layernorm)):
            torch.testing.assert_close(mine(hidden), reference(hidden), rtol=0, atol=1e-6)


def test_the_understanding_config_names_the_variant(model: Cosmos3) -> None:
    """qwen3 layers (q/k norms, SwiGLU) or, for the Nemotron variant, llama layers (no q/k
    norm) with a squared-ReLU MLP; interleaved M-RoPE by the transformer's axes."""
    transformer = model.transformer.config
    config = understanding_config(transformer)
    assert config.hidden_act == transformer.hidden_act
    assert config.qk_norm == transformer.qk_norm_for_text
    assert config.mrope_section == tuple(transformer.rope_axes_dim)
    assert config == model.engine.config


def test_a_relu2_decoder_config_is_checked() -> None:
    """relu2 is for dense layers and has no config.json; other activations are refused."""
    sizes = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_layers": 1,
             "num_heads": 2, "num_kv_heads": 1}
    with pytest.raises(ValueError, match="unsupported hidden_act 'gelu'"):
        DecoderConfig("llama", **sizes, hidden_act="gelu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="qwen3_moe's experts are SwiGLU"):
        DecoderConfig("qwen3_moe", **sizes, num_experts=2, num_experts_per_tok=1,
                      moe_intermediate_size=4, hidden_act="relu2")
    with pytest.raises(ValueError, match=r"no config\.json"):
        DecoderConfig("llama", **sizes, hidden_act="relu2").to_hf()


def test_each_denoising_step_is_reported(model: Cosmos3) -> None:
    seen: list[tuple[int, int]] = []
    model.generate(PROMPT, steps=STEPS, guidance=4.0, **SIZE,
                   on_step=lambda *step: seen.append(step))
    assert seen == [(i, STEPS) for i in range(1, STEPS + 1)]
