"""``POST /v1/images/edits`` on a real ``omni serve`` of ``examples/image_generation.py`` with
``OMNI_MODEL`` a tiny Z-Image folder, driven by the official ``openai`` client: the edits are
the ones diffusers' own ``ZImageImg2ImgPipeline`` paints for the same request; hostile uploads
(cut short, not an image, too many pixels, too many bytes, a body over the server's limit, a
mask) are refused with a 400 (413 for the body) naming the field, and the server answers on."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from tests.compute.image_builders import save_z_image
from tests.serve._server import ROOT, running

pytestmark = pytest.mark.proc

EXAMPLE = ROOT / "examples" / "image_generation.py"
PROMPT = "The same fox, at dusk."
MAX_PIXELS = 1_000_000  # the server's --max-image-pixels
# the server's --max-media-mib and --max-body-mib
MAX_ITEM_BYTES, MAX_BODY_BYTES = 1 << 20, 2 << 20


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_z_image(tmp_path_factory.mktemp("z_image"))


@pytest.fixture(scope="module")
def url(folder: Path) -> Iterator[str]:
    with running(EXAMPLE, f"--max-image-pixels={MAX_PIXELS}", "--max-media-mib=1",
                 "--max-body-mib=2", env={"OMNI_MODEL": str(folder)}) as server:
        yield server.url


@pytest.fixture
def client(url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                       timeout=120) as client:
        yield client


def photo(width: int, height: int) -> Image.Image:
    """Colour ramps with noise on them."""
    rng = np.random.default_rng(width * height)
    ramp = np.linspace(0, 1, width)[None, :, None] * np.linspace(1, 0, height)[:, None, None]
    pixels = 255 * (0.7 * ramp * rng.random(3) + 0.3 * rng.random((height, width, 3)))
    return Image.fromarray(pixels.astype(np.uint8))


def png(picture: Image.Image) -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


def pixels(image: Any) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(image.b64_json))))


def diffusers_edit(folder: Path, picture: Image.Image, seed: int, **request: Any) -> np.ndarray:
    """What diffusers' own img2img pipeline paints (its PIL image, as it would save it)."""
    from diffusers import ZImageImg2ImgPipeline

    pipeline = ZImageImg2ImgPipeline.from_pretrained(folder)
    image = pipeline(PROMPT, image=picture, **request,
                     generator=torch.Generator().manual_seed(seed)).images[0]
    return np.asarray(image)


def test_the_official_client_gets_the_edits_diffusers_paints(
        client: openai.OpenAI, folder: Path) -> None:
    """`n` edits take the seeds in turn; without `size`, an edit has the image's size rounded
    down to the model's pixel step (4 here: 50 x 37 -> 48 x 36), as diffusers rounds it."""
    picture = photo(50, 37)
    reply = client.images.edit(
        image=("fox.png", png(picture), "image/png"), prompt=PROMPT, n=2,
        response_format="b64_json", extra_body={
            "seed": 3, "num_inference_steps": 4, "guidance_scale": 0.0, "strength": 0.7})
    assert len(reply.data) == 2
    for image, seed in zip(reply.data, (3, 4), strict=True):
        ours = pixels(image)
        theirs = diffusers_edit(folder, picture, seed, num_inference_steps=4,
                                guidance_scale=0.0, strength=0.7)
        assert ours.shape == (36, 48, 3)
        assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 1


def test_an_image_sent_as_a_list_is_edited_at_the_size_asked(client: openai.OpenAI) -> None:
    reply = client.images.edit(image=[("fox.png", png(photo(50, 37)), "image/png")],
                               prompt=PROMPT, size="32x16", response_format="b64_json",
                               extra_body={"num_inference_steps": 2})
    assert pixels(reply.data[0]).shape == (16, 32, 3)


def cut_short() -> bytes:
    data = png(photo(64, 64))
    return data[: len(data) // 2]


def too_many_pixels() -> bytes:
    """A 2,000 x 2,000 PNG of a few KB: over the server's pixel cap, told by its header."""
    return png(Image.new("L", (2000, 2000)))


@pytest.mark.parametrize(("upload", "fields", "named", "says"), [
    (cut_short, {}, "image", "cannot be decoded"),
    (lambda: b"Dear server, this is not an image.\n", {}, "image", "not an image"),
    (too_many_pixels, {}, "image", f"more than the {MAX_PIXELS:,} this server takes"),
    (lambda: bytes(MAX_ITEM_BYTES + 1), {}, "image",
     f"more than the {MAX_ITEM_BYTES:,} this server takes per item"),
    (lambda: png(photo(3, 40)), {}, None, "the image is 3 x 40 pixels"),
    (lambda: png(photo(32, 32)), {"strength": 1.5}, "strength", "less than or equal to 1"),
    (lambda: png(photo(32, 32)), {"num_inference_steps": "many"}, "num_inference_steps",
     "valid integer"),
    (lambda: png(photo(32, 32)), {"size": "30x30"}, "size", "multiple of 16"),
    (lambda: png(photo(32, 32)), {"quality": "hd"}, "quality", "not supported"),
])
def test_a_hostile_or_wrong_edit_is_refused_by_name_and_the_server_answers_on(
        client: openai.OpenAI, url: str, upload: Any, fields: dict[str, Any],
        named: str | None, says: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.images.edit(image=("upload.png", upload(), "image/png"), prompt=PROMPT,
                           response_format="b64_json", extra_body=fields)
    assert caught.value.body["param"] == named and says in caught.value.message
    assert "Traceback" not in caught.value.message
    assert httpx.get(url + "/health").status_code == 200


def test_a_mask_is_refused_by_name(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.images.edit(image=("fox.png", png(photo(32, 32)), "image/png"),
                           mask=("mask.png", png(photo(32, 32)), "image/png"), prompt=PROMPT)
    assert caught.value.body["param"] == "mask" and "not served" in caught.value.message


@pytest.mark.parametrize(("files", "says"), [
    ([], "got 0"),
    ([("image[]", ("a.png", b"a")), ("image[]", ("b.png", b"b"))], "got 2"),
])
def test_one_image_is_edited_per_request(url: str, files: list[Any], says: str) -> None:
    answer = httpx.post(url + "/v1/images/edits", data={"prompt": PROMPT}, files=files or None)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "image" and says in error["message"]


def test_a_body_over_the_servers_limit_is_refused_before_it_is_read(
        client: openai.OpenAI, url: str) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        client.images.edit(image=("big.png", bytes(MAX_BODY_BYTES + 1), "image/png"),
                           prompt=PROMPT)
    assert caught.value.status_code == 413
    assert httpx.get(url + "/health").json()["status"] == "ok"
