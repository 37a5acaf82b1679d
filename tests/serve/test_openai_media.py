"""``omni serve --allow-remote-media`` (`MediaPolicy(allow_remote=True)`, the app served in
process over httpx's ASGI transport): a message's http(s) image URL is fetched (here from
httpx's mock transport, its host resolved by a stand-in resolver to a public address) and
reads as the same image sent as a data URL; a failure says only that the URL cannot be
fetched."""

from __future__ import annotations

import base64
import functools
import io
from collections.abc import AsyncIterator

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from omni.serve import MediaPolicy
from omni.serve.openai import _media
from omni.serve.openai._fetch import fetch_public
from tests.serve._inproc import served
from tests.serve._server import ROOT

DIALOGUE = ROOT / "examples" / "omni_dialogue.py"
IMAGES_URL = "https://images.example"
PUBLIC = "93.184.216.34"


def png_bytes() -> bytes:
    pixels = np.random.default_rng(1).integers(0, 255, (40, 24, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


PNG = png_bytes()


def images(request: httpx.Request) -> httpx.Response:
    """The image host: /cat.png, asked of its public address under its own name."""
    assert request.url.host == PUBLIC and request.headers["host"] == "images.example"
    if request.url.path == "/cat.png":
        return httpx.Response(200, content=PNG, headers={"Content-Type": "image/png"})
    return httpx.Response(404)


async def resolve(host: str, port: int) -> list[str]:
    return [PUBLIC]


@pytest.fixture
async def client(monkeypatch) -> AsyncIterator[openai.AsyncOpenAI]:
    monkeypatch.setattr(_media, "fetch_public", functools.partial(
        fetch_public, resolve=resolve, transport=httpx.MockTransport(images)))
    async with served(DIALOGUE, media=MediaPolicy(allow_remote=True)) as app, \
            app.openai() as client:
        yield client
async def ask(client: openai.AsyncOpenAI, image_url: str) -> openai.types.chat.ChatCompletion:
    content = [{"type": "image_url", "image_url": {"url": image_url}},
               {"type": "text", "text": "What is it?"}]
    return await client.chat.completions.create(model="chat", temperature=0, max_tokens=8,
                                          messages=[{"role": "user", "content": content}])


async def test_a_fetched_image_reads_as_the_same_image_sent_inline(
        client: openai.AsyncOpenAI) -> None:
    inline = await ask(client, "data:image/png;base64," + base64.b64encode(PNG).decode())
    fetched = await ask(client, IMAGES_URL + "/cat.png")
    assert fetched.choices[0].message.content == inline.choices[0].message.content
    assert fetched.usage.prompt_tokens == inline.usage.prompt_tokens
    # The same image digest: its pages are in the store now.
    assert fetched.usage.prompt_tokens_details.cached_tokens >= (
        inline.usage.prompt_tokens // 16 * 16)


async def test_a_url_that_answers_an_error_is_a_400_saying_only_it_cannot_be_fetched(
        client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await ask(client, IMAGES_URL + "/missing.png")
    assert caught.value.body["message"] == (f"messages.0.content.0.image_url.url: cannot fetch "
                                    f"{IMAGES_URL}/missing.png")  # no status, no address
    assert caught.value.body["param"] == "messages.0.content.0.image_url.url"
