"""``POST /v1/images/generations`` on ``examples/image_generation.py`` served in process (the
app ``omni serve`` builds, over httpx's ASGI transport), driven by the official ``openai``
client: the PNG is the one ``omni run`` writes for the same prompt, size and seed."""

from __future__ import annotations

import base64
import io
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
import trio
from PIL import Image

from tests._cli import run_omni
from tests.serve._inproc import served
from tests.serve._server import ROOT

IMAGES = ROOT / "examples" / "image_generation.py"
PROMPT = "a red fox in snow"


@pytest.fixture
async def client() -> AsyncIterator[openai.AsyncOpenAI]:
    async with served(IMAGES) as app, app.openai() as client:
        yield client


def omni_run_png(tmp_path: Path, **inputs: object) -> bytes:
    """The PNG ``omni run`` writes (the command run in this process)."""
    out = tmp_path / "run.png"
    args = [f"--input={k}={v}" for k, v in {**inputs, "out": out}.items()]
    done = run_omni("run", str(IMAGES), *args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return out.read_bytes()


def test_the_png_is_what_omni_run_writes(tmp_path: Path) -> None:
    ran = omni_run_png(tmp_path, prompt=PROMPT, width=64, height=48, seed=5)

    async def generate() -> bytes:
        async with served(IMAGES) as app, app.openai() as client:
            reply = await client.images.generate(prompt=PROMPT, size="64x48",
                                                 response_format="b64_json",
                                                 extra_body={"seed": 5})
        (image,) = reply.data
        return base64.b64decode(image.b64_json)

    png = trio.run(generate)  # after `omni run`, which runs trio itself
    with Image.open(io.BytesIO(png)) as picture:
        assert picture.format == "PNG" and picture.size == (64, 48)
    assert png == ran


async def test_n_images_take_the_seeds_in_turn(client: openai.AsyncOpenAI) -> None:
    two = await client.images.generate(prompt=PROMPT, size="32x32", n=2,
                                       extra_body={"seed": 3})
    one = await client.images.generate(prompt=PROMPT, size="32x32", extra_body={"seed": 4})
    assert len(two.data) == 2 and two.data[1].b64_json == one.data[0].b64_json
    assert two.data[0].b64_json != two.data[1].b64_json


@pytest.mark.parametrize(("fields", "named", "says"), [
    ({"response_format": "url"}, "response_format", "b64_json"),
    ({"size": "100x100"}, "size", "multiple of 16"),
    ({"quality": "hd"}, "quality", "not supported"),
    ({"n": 0}, "n", "greater than or equal to 1"),
])
async def test_refusals_name_the_field(client: openai.AsyncOpenAI, fields: dict, named: str,
                                       says: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.images.generate(prompt=PROMPT, **fields)
    assert caught.value.body["param"] == named and says in caught.value.message


async def test_an_unknown_model_is_a_404(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await client.images.generate(prompt=PROMPT, model="dall-e-3", size="32x32")
    assert "image_generation" in caught.value.message


async def test_the_extension_fields_set_the_graphs_inputs_and_usage_counts_the_cache(
        client: openai.AsyncOpenAI) -> None:
    """num_inference_steps and guidance_scale reach the graph's steps and guidance (another
    image than the defaults'); a repeated prompt finds its KV cached (usage)."""
    first = await client.images.generate(prompt=PROMPT, size="32x32", extra_body={"seed": 1})
    fewer = await client.images.generate(prompt=PROMPT, size="32x32", extra_body={
        "seed": 1, "num_inference_steps": 2, "guidance_scale": 1.0})
    again = await client.images.generate(prompt=PROMPT, size="32x32", extra_body={"seed": 1})
    assert fewer.data[0].b64_json != first.data[0].b64_json
    assert again.data[0].b64_json == first.data[0].b64_json
    assert first.usage.input_tokens == again.usage.input_tokens > 0
    assert again.usage.input_tokens_details.cached_tokens > 0


@pytest.mark.parametrize(("fields", "named", "says"), [
    ({"size": "8192x16"}, "size", "at most 4096"),
    ({"num_inference_steps": 100_000}, "num_inference_steps", "less than or equal to 1000"),
    ({"guidance_scale": -1}, "guidance_scale", "greater than or equal to 0"),
    ({"negative_prompt": "blurry"}, "negative_prompt", "takes no such setting"),
    ({"output_format": "jpeg"}, "output_format", "'png'"),
    ({"prompt": "x" * 32_001}, "prompt", "at most 32000 characters"),
])
async def test_settings_out_of_range_are_refused_by_name_before_any_work(
        client: openai.AsyncOpenAI, fields: dict, named: str, says: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.images.generate(prompt=PROMPT, extra_body=fields)
    assert caught.value.body["param"] == named and says in caught.value.message, \
        caught.value.message


async def test_a_graph_that_takes_no_image_answers_edits_with_a_400_naming_the_model(
        client: openai.AsyncOpenAI) -> None:
    """The built-in model's graph reads its ``image`` input as a path only: it edits no
    upload, and says so before any work."""
    with pytest.raises(openai.BadRequestError) as caught:
        await client.images.edit(image=("fox.png", b"\x89PNG", "image/png"), prompt=PROMPT)
    assert caught.value.body["param"] == "model"
    assert "'image_generation' edits no uploaded image" in caught.value.message
