"""``POST /v1/images/generations`` on ``omni serve examples/image_generation.py``, driven by
the official ``openai`` client: the PNG is the one ``omni run`` writes for the same prompt,
size and seed."""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from PIL import Image

from tests.serve._server import ROOT

IMAGES = ROOT / "examples" / "image_generation.py"
PROMPT = "a red fox in snow"


@pytest.fixture(scope="module")
def client(serve) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve(IMAGES) + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def omni_run_png(tmp_path: Path, **inputs: object) -> bytes:
    out = tmp_path / "run.png"
    args = [f"--input={k}={v}" for k, v in {**inputs, "out": out}.items()]
    done = subprocess.run([sys.executable, "-m", "cli", "run", str(IMAGES), *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    return out.read_bytes()


def test_the_png_is_what_omni_run_writes(client: openai.OpenAI, tmp_path: Path) -> None:
    reply = client.images.generate(prompt=PROMPT, size="64x48", response_format="b64_json",
                                   extra_body={"seed": 5})
    (image,) = reply.data
    png = base64.b64decode(image.b64_json)
    with Image.open(io.BytesIO(png)) as picture:
        assert picture.format == "PNG" and picture.size == (64, 48)
    assert png == omni_run_png(tmp_path, prompt=PROMPT, width=64, height=48, seed=5)


def test_n_images_take_the_seeds_in_turn(client: openai.OpenAI) -> None:
    two = client.images.generate(prompt=PROMPT, size="32x32", n=2, extra_body={"seed": 3})
    one = client.images.generate(prompt=PROMPT, size="32x32", extra_body={"seed": 4})
    assert len(two.data) == 2 and two.data[1].b64_json == one.data[0].b64_json
    assert two.data[0].b64_json != two.data[1].b64_json


@pytest.mark.parametrize(("fields", "named", "says"), [
    ({"response_format": "url"}, "response_format", "b64_json"),
    ({"size": "100x100"}, "size", "multiple of 16"),
    ({"quality": "hd"}, "quality", "not supported"),
    ({"n": 0}, "n", "greater than or equal to 1"),
])
def test_refusals_name_the_field(client: openai.OpenAI, fields: dict, named: str,
                                 says: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.images.generate(prompt=PROMPT, **fields)
    assert caught.value.body["param"] == named and says in caught.value.message


def test_an_unknown_model_is_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.images.generate(prompt=PROMPT, model="dall-e-3", size="32x32")
    assert "image_generation" in caught.value.message
