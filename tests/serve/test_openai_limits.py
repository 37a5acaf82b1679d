"""A message's media is bounded before it is decoded, and decoded off the event loop: an
image's pixels are checked from its header (a small PNG may hold a huge image), every item's
bytes before anything else, only the usual image formats are opened."""

from __future__ import annotations

import base64
import io
import threading

import numpy as np
import pytest
from PIL import Image

from omni.serve import ApiError
from omni.serve.openai import MediaPolicy, _media
from omni.serve.openai._media import decode_image

WHERE = "messages.0.content.0.image_url.url"


def data_url(picture: Image.Image, fmt: str = "PNG") -> str:
    out = io.BytesIO()
    picture.save(out, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def huge_png() -> str:
    """12,000 x 12,000 pixels (432 MB as RGB) in a PNG of a few hundred KB."""
    return data_url(Image.new("1", (12_000, 12_000)))


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
async def test_an_image_over_the_pixel_cap_is_refused_from_its_header(huge_png: str,
                                                                      monkeypatch) -> None:
    assert len(huge_png) < 1 << 20
    converted = []
    monkeypatch.setattr(Image.Image, "convert", lambda self, *a: converted.append(a))
    with pytest.raises(ApiError, match=r"12000 x 12000 = 144,000,000 pixels, more than the "
                                       r"16,777,216 this server takes") as caught:
        await decode_image(huge_png, WHERE, MediaPolicy())
    assert caught.value.status == 400 and caught.value.param == WHERE
    assert converted == []  # nothing was decoded


async def test_the_caps_are_the_operators(huge_png: str) -> None:
    small = data_url(Image.new("RGB", (64, 32), (10, 20, 30)))
    with pytest.raises(ApiError, match="2,048 pixels, more than the 2,047"):
        await decode_image(small, WHERE, MediaPolicy(max_image_pixels=2047))
    with pytest.raises(ApiError, match="this server takes per item"):
        await decode_image(small, WHERE, MediaPolicy(max_item_bytes=16))
    part = await decode_image(small, WHERE, MediaPolicy(max_image_pixels=2048))
    assert part.pixels.shape == (32, 64, 3) and (part.pixels[0, 0] == [10, 20, 30]).all()


async def test_images_are_decoded_in_a_worker_thread(monkeypatch) -> None:
    threads = []
    pixels = _media._pixels

    def noting(*args):
        threads.append(threading.current_thread())
        return pixels(*args)

    monkeypatch.setattr(_media, "_pixels", noting)
    await decode_image(data_url(Image.new("RGB", (8, 8))), WHERE, MediaPolicy())
    assert threads and threads[0] is not threading.main_thread()


async def test_only_the_usual_image_formats_are_opened() -> None:
    tiff = data_url(Image.new("RGB", (8, 8)), "TIFF")
    with pytest.raises(ApiError, match="not an image this server reads"):
        await decode_image(tiff, WHERE, MediaPolicy())
    for fmt in ("PNG", "JPEG", "WEBP", "GIF", "BMP"):
        part = await decode_image(data_url(Image.new("RGB", (8, 8)), fmt), WHERE,
                                  MediaPolicy())
        assert part.pixels.shape == (8, 8, 3) and part.pixels.dtype == np.uint8


def test_a_policy_refuses_limits_that_are_not_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        MediaPolicy(max_image_pixels=0)
