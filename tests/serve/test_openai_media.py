"""``omni serve --allow-remote-media`` (`MediaPolicy(allow_remote=True)`, the app served in
process over httpx's ASGI transport): a message's http(s) image URL is fetched (here from a
loopback server this test runs in a thread) and reads as the same image sent as a data
URL."""

from __future__ import annotations

import base64
import http.server
import io
import threading
from collections.abc import AsyncIterator, Iterator

import numpy as np
import openai
import pytest
from PIL import Image

from omni.serve import MediaPolicy
from tests.serve._inproc import served
from tests.serve._server import ROOT

DIALOGUE = ROOT / "examples" / "omni_dialogue.py"


def png_bytes() -> bytes:
    pixels = np.random.default_rng(1).integers(0, 255, (40, 24, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


PNG = png_bytes()


class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        found = self.path == "/cat.png"
        self.send_response(200 if found else 404)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(PNG) if found else 0))
        self.end_headers()
        if found:
            self.wfile.write(PNG)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def images_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)  # how soon it sees the shutdown
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
async def client() -> AsyncIterator[openai.AsyncOpenAI]:
    async with served(DIALOGUE, media=MediaPolicy(allow_remote=True)) as app, \
            app.openai() as client:
        yield client


async def ask(client: openai.AsyncOpenAI, image_url: str) -> openai.types.chat.ChatCompletion:
    content = [{"type": "image_url", "image_url": {"url": image_url}},
               {"type": "text", "text": "What is it?"}]
    return await client.chat.completions.create(model="chat", temperature=0, max_tokens=8,
                                          messages=[{"role": "user", "content": content}])


async def test_a_fetched_image_reads_as_the_same_image_sent_inline(
        client: openai.AsyncOpenAI, images_url: str) -> None:
    inline = await ask(client, "data:image/png;base64," + base64.b64encode(PNG).decode())
    fetched = await ask(client, images_url + "/cat.png")
    assert fetched.choices[0].message.content == inline.choices[0].message.content
    assert fetched.usage.prompt_tokens == inline.usage.prompt_tokens
    # The same image digest: its pages are in the store now.
    assert fetched.usage.prompt_tokens_details.cached_tokens >= (
        inline.usage.prompt_tokens // 16 * 16)


async def test_a_url_that_answers_an_error_is_a_400_naming_it(client: openai.AsyncOpenAI,
                                                              images_url: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await ask(client, images_url + "/missing.png")
    assert "answered 404" in caught.value.message
    assert caught.value.body["param"] == "messages.0.content.0.image_url.url"
