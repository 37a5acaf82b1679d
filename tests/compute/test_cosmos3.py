"""`Cosmos3` paints the images diffusers' `Cosmos3OmniPipeline` paints (the oracle) on tiny
random folders in the hub layout, while it runs the understanding expert once per prompt of
a request rather than at every denoising step; its layers equal the diffusers layer whose
modules they call."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import omni.compute.cosmos3 as cosmos3
from omni.compute.cosmos3 import (
    Cosmos3,
    generation_layer,
    rotary,
    understand,
    understanding_layer,
    velocity,
)
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


@pytest.mark.parametrize(("prompt", "guidance", "n"), [
    (PROMPT, 4.0, 1), (PROMPT, 1.0, 1), (PROMPT, 0.0, 1), (PROMPT, 4.0, 2), (SECOND, 4.0, 1),
    (SECOND, 1.0, 2)])
def test_the_images_equal_the_pipelines(pipeline: Any, model: Cosmos3, prompt: str,
                                        guidance: float, n: int) -> None:
    theirs = paint(pipeline, prompt, guidance=guidance, n=n, seed=5)
    ours = model.generate(prompt, negative_prompt=NEGATIVE, steps=STEPS, guidance=guidance,
                          seed=5, n=n, **SIZE)
    assert ours.shape == (n, SIZE["height"], SIZE["width"], 3) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-3)


def test_the_smallest_square_image_equals_the_pipelines(pipeline: Any, model: Cosmos3) -> None:
    """One latent pixel each way: a patch grid padded from 1 x 1 to 2 x 2."""
    step = model.pixel_step
    theirs = paint(pipeline, PROMPT, width=step, height=step)
    ours = model.generate(PROMPT, negative_prompt=NEGATIVE, steps=STEPS, guidance=4.0,
                          width=step, height=step)
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
        model: Cosmos3, monkeypatch: pytest.MonkeyPatch, guidance: float,
        num_prompts: int) -> None:
    """`understand` runs once for the prompt (and once for the negative one when guided),
    not per step; the understanding expert's modules run only inside it, and the generation
    expert's once per step and prompt, for all n images at once."""
    understood: list[list[int]] = []

    def counted(transformer: Any, input_ids: torch.Tensor, position_ids: torch.Tensor) -> Any:
        understood.append(input_ids.tolist())
        return understand(transformer, input_ids, position_ids)

    monkeypatch.setattr(cosmos3, "understand", counted)
    calls: Counter[str] = Counter()
    hooks = [module.register_forward_hook(lambda *_, key=key: calls.update([key]))
             for layer in model.transformer.layers
             for key, module in (("understanding", layer.mlp),
                                 ("generation", layer.mlp_moe_gen))]
    try:
        model.generate(PROMPT, negative_prompt=NEGATIVE, steps=STEPS, guidance=guidance, n=2,
                       **SIZE)
    finally:
        for hook in hooks:
            hook.remove()
    ids, negative_ids = model.prompt_ids(PROMPT, NEGATIVE, **SIZE)
    assert understood == [ids, negative_ids][:num_prompts]
    num_layers = len(model.transformer.layers)
    # the last layer's keys and values are all that is read of it: its MLP never runs
    assert calls["understanding"] == num_prompts * (num_layers - 1)
    assert calls["generation"] == STEPS * num_prompts * num_layers


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
def test_the_velocity_equals_the_transformers(model: Cosmos3) -> None:
    """`velocity` on `understand`'s keys and values equals diffusers' whole transformer
    forward on the joint sequence, for each of two images."""
    ids, _ = model.prompt_ids(PROMPT, NEGATIVE, **SIZE)
    latents = model.noise(seed=2, n=2, **SIZE)
    prompt = model.prepare(ids, latents)
    ours = velocity(model.transformer, latents, 500, prompt)
    text = model.painter._prepare_text_segment(ids, device="cpu")
    image = model.painter._prepare_vision_segment(
        input_vision_tokens=latents[:1], has_image_condition=False,
        mrope_offset=text["vision_start_temporal_offset"], vision_fps=None,
        curr=text["und_len"], device="cpu")
    for index, latent in enumerate(latents):
        (theirs,) = model.transformer(
            input_ids=text["input_ids"], text_indexes=text["text_indexes"],
            position_ids=torch.cat([text["text_mrope_ids"], image["vision_mrope_ids"]], dim=1),
            und_len=text["und_len"], sequence_length=text["und_len"] + image["num_vision_tokens"],
            vision_tokens=[latent[None]], vision_token_shapes=image["vision_token_shapes"],
            vision_sequence_indexes=image["vision_sequence_indexes"],
            vision_mse_loss_indexes=image["vision_mse_loss_indexes"],
            vision_timesteps=torch.full((image["num_noisy_vision_tokens"],), 500),
            vision_noisy_frame_indexes=image["vision_noisy_frame_indexes"]).sample
        torch.testing.assert_close(ours[index], theirs[0], rtol=0, atol=1e-6)


async def test_agenerate_equals_generate(model: Cosmos3) -> None:
    settings = {"negative_prompt": NEGATIVE, "steps": 2, "guidance": 3.0, "seed": 9, **SIZE}
    np.testing.assert_array_equal(await model.agenerate(PROMPT, **settings),
                                  model.generate(PROMPT, **settings))


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
