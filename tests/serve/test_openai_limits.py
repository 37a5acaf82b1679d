"""A message's media is bounded before it is decoded, and decoded off the event loop: an
image's pixels are checked from its header (a small PNG may hold a huge image), every item's
bytes before anything else, a request's sums against its budget and the budget of the
requests in flight, only the usual image formats are opened; the parts' prompt segments and
their digests are made in the decode threads."""

from __future__ import annotations

import base64
import io
import threading
import wave
from pathlib import Path

import numpy as np
import pytest
import trio
from PIL import Image
from trio.testing import wait_all_tasks_blocked

from omni.serve import ApiError
from omni.serve.openai import MediaPolicy, _media
from omni.serve.openai._budget import BudgetStats, DecodeNeed
from omni.serve.openai._media import MediaSource, decode_image, decode_media
from tests._wait import wait_until
from tests.serve._inproc import served
from tests.serve._server import ROOT

DIALOGUE = ROOT / "examples" / "omni_dialogue.py"

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


def png_url(size: tuple[int, int]) -> str:
    return data_url(Image.new("RGB", size, (1, 2, 3)))


async def test_a_request_over_its_budget_is_refused_from_headers_before_any_decode(
        monkeypatch) -> None:
    converted = []
    monkeypatch.setattr(Image.Image, "convert", lambda self, *a: converted.append(a))
    policy = MediaPolicy(max_image_pixels=64, max_request_pixels=100)
    images = [MediaSource(f"messages.0.content.{i}.image_url.url", "image", png_url((8, 8)))
              for i in range(2)]
    with pytest.raises(ApiError) as caught:
        await decode_media(images, policy)
    assert (caught.value.status, caught.value.param) == (400, "messages")
    assert caught.value.message == (
        "messages: the request's images hold 128 pixels in all, more than the 100 this "
        "server decodes per request (set by --max-request-pixels)")
    clips = [MediaSource(f"messages.0.content.{i}.input_audio", "audio", wav(300), "wav")
             for i in range(2)]
    with pytest.raises(ApiError, match=r"audio holds 600 samples in all, more than the 500 "
                                       r".*--max-request-samples\)"):
        await decode_media(clips, MediaPolicy(max_request_samples=500))
    assert converted == [] and policy.budget.stats().pixels == 0


def wav(num_samples: int) -> str:
    out = io.BytesIO()
    with wave.open(out, "wb") as clip:
        clip.setnchannels(1)
        clip.setsampwidth(2)
        clip.setframerate(16_000)
        clip.writeframes(np.zeros(num_samples, "<i2").tobytes())
    return base64.b64encode(out.getvalue()).decode()


async def test_requests_in_flight_share_the_budget_wait_for_room_then_get_429(
        autojump_clock) -> None:
    policy = MediaPolicy(max_request_pixels=64, max_inflight_pixels=100)
    other = DecodeNeed(pixels=64)  # another request decoding
    assert policy.budget.try_reserve(other)
    decoded = []

    async def decode() -> None:
        decoded.append(await decode_image(png_url((8, 8)), WHERE, policy))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(decode)
        while policy.budget.stats().num_waiting != 1:  # its headers are read in a thread
            await wait_all_tasks_blocked()
        assert decoded == []
        policy.budget.release(other)
    assert decoded[0].pixels.shape == (8, 8, 3)
    assert policy.budget.stats() == BudgetStats(0, 0, 100, policy.max_inflight_samples, 0, 0)

    assert policy.budget.try_reserve(other)
    start = trio.current_time()
    with pytest.raises(ApiError) as caught:
        await decode_image(png_url((8, 8)), WHERE, policy)
    assert caught.value.status == 429 and caught.value.headers == {"Retry-After": "1"}
    assert trio.current_time() - start == pytest.approx(_media.DECODE_WAIT_S)
    policy.budget.release(other)
    assert policy.budget.stats().num_refused == 1


async def test_the_budget_is_released_when_a_decode_fails() -> None:
    out = io.BytesIO()
    Image.new("RGB", (64, 64)).save(out, "PNG")
    broken = "data:image/png;base64," + base64.b64encode(out.getvalue()[:60]).decode()
    policy = MediaPolicy()
    with pytest.raises(ApiError, match="cannot be decoded"):
        await decode_image(broken, WHERE, policy)  # its header is whole, its pixels not
    assert policy.budget.stats().pixels == 0


async def test_a_parts_prompt_segment_and_its_digest_are_made_off_the_event_loop(
        monkeypatch) -> None:
    from omni.compute import prompt
    from omni.kv.keys import media_digest

    threads = []

    def noting(data):
        threads.append(threading.current_thread())
        return media_digest(data)

    monkeypatch.setattr(prompt, "media_digest", noting)
    async with served(DIALOGUE) as app, app.http() as http:
        answer = await http.post("/v1/chat/completions", json={
            "model": "chat", "max_tokens": 1, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": png_url((64, 48))}},
                {"type": "input_audio", "input_audio": {"data": wav(400), "format": "wav"}},
                {"type": "text", "text": "What is it?"}]}]})
    assert answer.status_code == 200, answer.text
    assert len(threads) == 2  # one digest per item, each made once
    assert threading.main_thread() not in threads


@pytest.mark.parametrize("stream", [False, True])
async def test_a_requests_media_stays_in_the_budget_until_it_is_answered(
        tmp_path, monkeypatch, stream: bool) -> None:
    """The decoded arrays live as long as the request: its share of the budget in flight is
    given back once its answer (a stream's last event included) has gone, not before."""
    gate = tmp_path / "open"
    monkeypatch.setenv("OMNI_TEST_GATE", str(gate))
    policy = MediaPolicy()
    image = {"type": "image_url", "image_url": {"url": png_url((64, 32))}}
    body = {"model": "held", "stream": stream, "messages": [
        {"role": "user", "content": [image, {"type": "text", "text": "hi"}]}]}
    answers = []
    async with served(Path(__file__).with_name("held_chat.py"), media=policy) as app, \
            app.http() as http, trio.open_nursery() as nursery:

        async def ask() -> None:
            answers.append(await http.post("/v1/chat/completions", json=body))

        nursery.start_soon(ask)
        await wait_until((tmp_path / "waiting").exists, "the reply under way")
        assert policy.budget.stats().pixels == 64 * 32  # decoded, still being answered
        gate.touch()
    (answer,) = answers
    assert answer.status_code == 200 and "done" in answer.text
    assert policy.budget.stats().pixels == 0
