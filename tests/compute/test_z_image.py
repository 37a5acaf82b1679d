"""Z-Image's text condition on Omni's engine equals diffusers' (`ZImagePipeline.encode_prompt`)
on a tiny random folder in the hub layout, and diffusers' own pipeline fed Omni's condition
paints the image it paints from the prompt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omni.compute.z_image import MAX_SEQUENCE_LENGTH, ZImageText
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
    ours = text.condition(prompt)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs.detach(), rtol=0, atol=1e-4)


def test_a_long_prompt_keeps_the_tokens_diffusers_keeps(text: ZImageText) -> None:
    assert len(text.prompt_ids(PROMPTS[-1])) == MAX_SEQUENCE_LENGTH
    assert len(text.prompt_ids(PROMPT)) < MAX_SEQUENCE_LENGTH


def test_only_the_layers_before_the_one_read_run(text: ZImageText) -> None:
    """The condition is the second-to-last layer's output: the last layer never runs."""
    calls: list[int] = []
    hooks = [layer.register_forward_hook(lambda *_, i=i: calls.append(i))
             for i, layer in enumerate(text.engine.model.layers)]
    try:
        text.condition(PROMPT)
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == list(range(text.engine.config.num_layers - 1))


@pytest.mark.parametrize("guidance", [0.0, 4.0])
async def test_diffusers_fed_omnis_condition_paints_the_prompts_image(
        pipeline: Any, text: ZImageText, guidance: float) -> None:
    negative = "blurry, dark"

    def paint(**inputs: Any) -> np.ndarray:
        return pipeline(**inputs, height=32, width=32, num_inference_steps=3,
                        guidance_scale=guidance, output_type="np",
                        generator=torch.Generator().manual_seed(7)).images[0]

    theirs = paint(prompt=PROMPT, negative_prompt=negative)
    ours = paint(prompt_embeds=[await text.encode(PROMPT)],
                 negative_prompt_embeds=[await text.encode(negative)])
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-3)
    other = paint(prompt="A blue whale at night.", negative_prompt=negative)
    assert np.abs(other - theirs).max() > 0.05  # the prompt matters to this random DiT
