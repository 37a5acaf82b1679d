"""Z-Image's text condition on Omni's engine equals diffusers' (`ZImagePipeline.encode_prompt`)
on a tiny random folder in the hub layout; diffusers' own pipeline fed Omni's condition paints
the image it paints from the prompt, and `ZImage` (the folder's pipeline without its text
encoder, fed by Omni's) gives the library pipeline's images."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omni.compute.image_families import image_family
from omni.compute.z_image import MAX_SEQUENCE_LENGTH, ZImage, ZImageText
from tests.compute.image_builders import save_z_image

PROMPT = "A red fox asleep in fresh snow, watercolour."
PROMPTS = [PROMPT, "", "Hello world, " * 300]  # the last: longer than the kept tokens


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_z_image(tmp_path_factory.mktemp("z_image"))


@pytest.fixture(scope="module")
def pipeline(folder: Path) -> Any:
    from diffusers import ZImagePipeline

    return ZImagePipeline.from_pretrained(folder)


@pytest.fixture(scope="module")
def text(folder: Path) -> ZImageText:
    return ZImageText.from_pretrained(folder)


@pytest.mark.parametrize("prompt", PROMPTS, ids=["prompt", "empty", "long"])
def test_the_condition_equals_diffusers_encode_prompt(pipeline: Any, text: ZImageText,
                                                      prompt: str) -> None:
    (theirs,), _ = pipeline.encode_prompt(prompt, do_classifier_free_guidance=False)
    ours = text.encode(prompt).embeds
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs.detach(), rtol=0, atol=1e-4)


def test_a_long_prompt_keeps_the_tokens_diffusers_keeps(text: ZImageText) -> None:
    assert len(text.prompt_ids(PROMPTS[-1])) == MAX_SEQUENCE_LENGTH
    assert len(text.prompt_ids(PROMPT)) < MAX_SEQUENCE_LENGTH


def test_only_the_layers_before_the_one_read_are_loaded(folder: Path, text: ZImageText
                                                         ) -> None:
    """The condition is the second-to-last layer's output: the last layer is neither read
    from the checkpoint nor run."""
    config = json.loads((folder / "text_encoder" / "config.json").read_text())
    assert len(text.engine.model.layers) == config["num_hidden_layers"] - 1
    calls: list[int] = []
    hooks = [layer.register_forward_hook(lambda *_, i=i: calls.append(i))
             for i, layer in enumerate(text.engine.model.layers)]
    try:
        text.encode(PROMPT + " Unseen.")
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == list(range(config["num_hidden_layers"] - 1))


STYLE = ("In the style of a nineteenth-century botanical plate: fine ink lines, soft "
         "watercolour washes, a cream paper ground, labelled in copperplate. ")


def test_a_prompt_sharing_a_preamble_reads_it_cached_and_equals_diffusers(
        pipeline: Any, folder: Path) -> None:
    """The second prompt's preamble pages come from the store (KV) and from beside it (the
    rows read): only its own tokens run, and its condition is diffusers' all the same. The
    same prompt again reads every full page but the last token's; another salt reads none."""
    text = ZImageText.from_pretrained(folder)  # a store of its own: nothing cached yet
    size = text.engine.runner.page_size
    first = text.encode(STYLE + "A fern.")
    assert first.cached_tokens == 0
    second = text.encode(STYLE + "A thistle.")
    fern, thistle = text.prompt_ids(STYLE + "A fern."), text.prompt_ids(STYLE + "A thistle.")
    shared = next(i for i, (a, b) in enumerate(zip(fern, thistle, strict=False)) if a != b)
    assert second.cached_tokens == shared // size * size > 0
    (theirs,), _ = pipeline.encode_prompt(STYLE + "A thistle.", do_classifier_free_guidance=False)
    torch.testing.assert_close(second.embeds, theirs.detach(), rtol=0, atol=1e-4)
    computed = text.engine.stats().num_prefill_tokens
    again = text.encode(STYLE + "A thistle.")
    assert again.cached_tokens == (again.tokens - 1) // size * size
    assert text.engine.stats().num_prefill_tokens - computed == again.tokens - again.cached_tokens
    torch.testing.assert_close(again.embeds, theirs.detach(), rtol=0, atol=1e-4)
    other = text.encode(STYLE + "A thistle.", cache_salt="tenant-b")
    assert other.cached_tokens == 0
    torch.testing.assert_close(other.embeds, theirs.detach(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("guidance", [0.0, 4.0])
def test_diffusers_fed_omnis_condition_paints_the_prompts_image(
        pipeline: Any, text: ZImageText, guidance: float) -> None:
    negative = "blurry, dark"

    def paint(**inputs: Any) -> np.ndarray:
        return pipeline(**inputs, height=32, width=32, num_inference_steps=3,
                        guidance_scale=guidance, output_type="np",
                        generator=torch.Generator().manual_seed(7)).images[0]

    theirs = paint(prompt=PROMPT, negative_prompt=negative)
    ours = paint(prompt_embeds=[text.encode(PROMPT).embeds],
                 negative_prompt_embeds=[text.encode(negative).embeds])
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-3)
    other = paint(prompt="A blue whale at night.", negative_prompt=negative)
    assert np.abs(other - theirs).max() > 0.05  # the prompt matters to this random DiT


@pytest.fixture(scope="module")
def z_image(folder: Path) -> ZImage:
    return ZImage.from_pretrained(folder)


@pytest.mark.parametrize("guidance", [0.0, 4.0])
async def test_omnis_images_are_the_pipelines_own(pipeline: Any, z_image: ZImage,
                                                  guidance: float) -> None:
    """Two images of one request (one noise draw from the seed, as diffusers draws it):
    what the library's pipeline paints from the prompt itself."""
    theirs = pipeline(PROMPT, negative_prompt="blurry", height=32, width=48,
                      num_inference_steps=3, guidance_scale=guidance,
                      num_images_per_prompt=2, output_type="np",
                      generator=torch.Generator().manual_seed(11)).images
    painted = await z_image.agenerate(PROMPT, negative_prompt="blurry", width=48, height=32,
                                      steps=3, guidance=guidance, seed=11, n=2)
    ours = painted.images
    assert ours.shape == (2, 32, 48, 3)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-3)
    assert np.abs(ours[0] - ours[1]).max() > 0.05  # two draws, not one image twice


@pytest.mark.parametrize(("setting", "value", "says"), [
    ("width", 30, "width must be a multiple of 4 pixels"),
    ("height", 0, "height must be a multiple of 4 pixels"),
    ("steps", 0, "steps must be an int >= 1"), ("n", 1.5, "n must be an int >= 1"),
    ("guidance", float("nan"), "guidance must be a finite number >= 0"),
    ("seed", "7", "seed must be an int"),
    ("width", 132, "width must be at most 128 pixels for this model (its DiT places at most "
                   "32 patches a side), got 132")])
def test_a_setting_out_of_range_is_refused_by_name_before_any_work(
        z_image: ZImage, setting: str, value: Any, says: str) -> None:
    settings = {"width": 32, "height": 32, "steps": 1, "guidance": 0.0, "seed": 0, "n": 1,
                setting: value}
    with pytest.raises(ValueError, match=re.escape(says)):
        z_image.generate(PROMPT, **settings)


def test_a_folder_of_another_family_is_refused_naming_it_and_the_served_ones(
        tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(ValueError, match=r"a FluxPipeline .* it serves ZImagePipeline"):
        ZImage.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"cannot read model_index\.json"):
        image_family(tmp_path / "nowhere")


def test_a_folder_missing_a_component_is_refused_naming_it(folder: Path, tmp_path: Path) -> None:
    import shutil

    broken = shutil.copytree(folder, tmp_path / "broken")
    shutil.rmtree(broken / "vae")
    with pytest.raises(ValueError, match=r"names the component\(s\) vae, whose folder"):
        ZImage.from_pretrained(broken)


# -- image to image: diffusers' ZImageImg2ImgPipeline is the oracle ---------------------------


@pytest.fixture(scope="module")
def img2img(folder: Path) -> Any:
    from diffusers import ZImageImg2ImgPipeline

    pipeline = ZImageImg2ImgPipeline.from_pretrained(folder)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def photo(width: int, height: int, seed: int = 0) -> Any:
    """A PIL image: smooth colour ramps with noise on them."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 1, width)[None, :, None] * np.linspace(1, 0, height)[:, None, None]
    pixels = 255 * (0.7 * ramp * rng.random(3) + 0.3 * rng.random((height, width, 3)))
    return Image.fromarray(pixels.astype(np.uint8))


@pytest.mark.parametrize(("guidance", "strength"), [(0.0, None), (4.0, 0.4)])
def test_omnis_edits_are_diffusers_img2img_own(img2img: Any, z_image: ZImage, guidance: float,
                                               strength: float | None) -> None:
    """Two edits of one request of a 50 x 37 image (its size rounded down to the pixel step,
    as diffusers rounds it; strength diffusers' default, then another): the library's
    img2img pipeline's own, prompt read by diffusers itself."""
    picture = photo(50, 37)
    chosen = {} if strength is None else {"strength": strength}
    theirs = img2img(PROMPT, image=picture, negative_prompt="blurry", num_inference_steps=5,
                     guidance_scale=guidance, num_images_per_prompt=2, output_type="np",
                     generator=torch.Generator().manual_seed(5), **chosen).images
    ours = z_image.edit(PROMPT, np.asarray(picture), negative_prompt="blurry", steps=5,
                        guidance=guidance, seed=5, n=2, **chosen).images
    assert ours.shape == (2, 36, 48, 3)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-3)
    assert np.abs(ours[0] - ours[1]).max() > 0.05  # two draws, not one edit twice
    other = z_image.edit(PROMPT, np.asarray(photo(50, 37, seed=1)), negative_prompt="blurry",
                         steps=5, guidance=guidance, seed=5, n=2, **chosen).images
    assert np.abs(other - ours).max() > 0.05  # the image matters


def test_an_edit_of_another_size_is_diffusers_on_the_image_resized(img2img: Any,
                                                                   z_image: ZImage) -> None:
    from PIL import Image

    picture = photo(50, 37)
    resized = picture.resize((24, 32), Image.Resampling.LANCZOS)
    theirs = img2img(PROMPT, image=resized, num_inference_steps=3, guidance_scale=0.0,
                     output_type="np", generator=torch.Generator().manual_seed(2)).images
    ours = z_image.edit(PROMPT, np.asarray(picture), width=24, height=32, steps=3,
                        guidance=0.0, seed=2).images
    assert ours.shape == (1, 32, 24, 3)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-3)


def test_the_editor_paints_with_the_painters_modules_and_leaves_it_as_it_was(
        pipeline: Any, z_image: ZImage) -> None:
    """No second copy of the weights; a text-to-image call after an edit (the scheduler
    shared) is still the library pipeline's own."""
    for part in ("transformer", "vae", "scheduler"):
        assert getattr(z_image.painter.editor, part) is getattr(z_image.painter.pipeline, part)
    z_image.edit(PROMPT, np.asarray(photo(32, 32)), steps=5, strength=0.5, guidance=0.0)
    theirs = pipeline(PROMPT, height=32, width=32, num_inference_steps=3, guidance_scale=0.0,
                      output_type="np", generator=torch.Generator().manual_seed(4)).images
    ours = z_image.generate(PROMPT, width=32, height=32, steps=3, guidance=0.0, seed=4)
    np.testing.assert_allclose(ours.images, theirs, rtol=0, atol=1e-3)


@pytest.mark.parametrize(("image", "settings", "says"), [
    (np.zeros((32, 32, 3), np.uint8), {"strength": 0}, "strength must be a number in (0, 1]"),
    (np.zeros((32, 32, 3), np.uint8), {"strength": float("nan")}, "strength must be"),
    (np.zeros((32, 32, 3), np.uint8), {"strength": 1.5}, "strength must be"),
    (np.zeros((32, 32, 3), np.uint8), {"width": 32}, "both width and height, or neither"),
    (np.zeros((32, 32, 3), np.uint8), {"width": 30, "height": 32}, "width must be a multiple"),
    (np.zeros((3, 40, 3), np.uint8), {}, "the image is 40 x 3 pixels"),
    (np.zeros((32, 32, 3), np.float32), {}, "image must be RGB pixels, uint8 [H, W, 3]"),
    (np.zeros((32, 32), np.uint8), {}, "image must be RGB pixels, uint8 [H, W, 3]")])
def test_an_edit_out_of_range_is_refused_by_name_before_any_work(
        z_image: ZImage, image: np.ndarray, settings: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        z_image.edit(PROMPT, image, steps=1, guidance=0.0, **settings)


def test_a_requests_usage_counts_its_prompts_and_what_of_them_was_cached(
        folder: Path) -> None:
    """Both prompts are counted when guidance encodes the negative one; a repeated request
    reads all but each prompt's last page's worth from cache, under its own salt only."""
    model = ZImage.from_pretrained(folder)  # a store of its own
    settings = {"width": 32, "height": 32, "steps": 1, "guidance": 4.0, "seed": 0}
    ids = [model.text.prompt_ids(STYLE + "A fern."), model.text.prompt_ids("")]
    first = model.generate(STYLE + "A fern.", **settings)
    assert (first.input_tokens, first.cached_tokens) == (sum(map(len, ids)), 0)
    again = model.generate(STYLE + "A fern.", **settings)
    size = model.text.engine.runner.page_size
    assert again.cached_tokens == sum((len(i) - 1) // size * size for i in ids) > 0
    np.testing.assert_allclose(again.images, first.images, rtol=0, atol=1e-5)
    elsewhere = model.generate(STYLE + "A fern.", **settings, cache_salt="tenant-b")
    assert elsewhere.cached_tokens == 0
    unguided = model.generate(STYLE + "A fern.", **{**settings, "guidance": 0.0})
    assert unguided.input_tokens == len(ids[0])


@pytest.mark.parametrize("guidance", [0.0, 4.0])
def test_requests_denoised_together_are_each_the_pipelines_own_image(
        pipeline: Any, z_image: ZImage, guidance: float) -> None:
    """Three requests of one size and step count in one batch (one DiT pass per step): each
    image is what diffusers paints for that request alone (its prompt, negative prompt and
    seed), and each request's usage is its own."""
    from omni.compute.z_image import PaintRequest

    requests = [PaintRequest(PROMPT, "blurry", seed=1),
                PaintRequest("A blue whale at night.", "", seed=2, cache_salt="b"),
                PaintRequest(STYLE + "A fern.", "dark", seed=3)]
    painted = z_image.generate_batch(requests, width=32, height=32, steps=3,
                                     guidance=guidance)
    for request, ours in zip(requests, painted, strict=True):
        theirs = pipeline(request.prompt, negative_prompt=request.negative_prompt, height=32,
                          width=32, num_inference_steps=3, guidance_scale=guidance,
                          output_type="np",
                          generator=torch.Generator().manual_seed(request.seed)).images
        np.testing.assert_allclose(ours.images, theirs, rtol=0, atol=1e-3)
        alone = z_image.generate(request.prompt, negative_prompt=request.negative_prompt,
                                 width=32, height=32, steps=3, guidance=guidance,
                                 seed=request.seed, cache_salt=request.cache_salt)
        assert alone.input_tokens == ours.input_tokens
    assert np.abs(painted[0].images - painted[1].images).max() > 0.05


def test_a_batch_with_a_bad_request_paints_none(z_image: ZImage) -> None:
    from omni.compute.z_image import PaintRequest

    with pytest.raises(ValueError, match="seed must be an int"):
        z_image.generate_batch([PaintRequest(PROMPT), PaintRequest(PROMPT, seed="7")],
                               width=32, height=32, steps=1, guidance=0.0)


def test_a_bfloat16_folder_stays_bfloat16_with_its_editor(folder: Path) -> None:
    """The editor shares the painter's modules: building it leaves them in the dtype asked
    for (diffusers' from_pipe casts what it shares, to float32 unless told)."""
    model = ZImage.from_pretrained(folder, dtype=torch.bfloat16)
    for part in ("transformer", "vae"):
        assert getattr(model.painter.pipeline, part).dtype == torch.bfloat16
        assert getattr(model.painter.editor, part) is getattr(model.painter.pipeline, part)


def test_each_denoising_step_is_reported(z_image: ZImage) -> None:
    """`on_step(done, total)` after each step: of a generation, a batch, and an edit (whose
    steps are the last `steps * strength` of them)."""
    from omni.compute.z_image import PaintRequest

    seen: list[tuple[int, int]] = []
    settings = {"width": 32, "height": 32, "steps": 3, "guidance": 0.0}
    z_image.generate(PROMPT, **settings, on_step=lambda *step: seen.append(step))
    assert seen == [(1, 3), (2, 3), (3, 3)]
    seen.clear()
    z_image.generate_batch([PaintRequest(PROMPT), PaintRequest("A blue whale at night.")],
                           **settings, on_step=lambda *step: seen.append(step))
    assert seen == [(1, 3), (2, 3), (3, 3)]
    seen.clear()
    z_image.edit(PROMPT, np.asarray(photo(32, 32)), steps=4, strength=0.5, guidance=0.0,
                 on_step=lambda *step: seen.append(step))
    assert seen == [(1, 2), (2, 2)]
