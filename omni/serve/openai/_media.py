"""A message's images and audio as the engine takes them: data URLs and base64 WAV decoded,
remote URLs fetched only where the server allows it.

Remote input is hostile: an image's size is checked against `MediaPolicy.max_image_pixels`
from its header before it is decoded (a 560 KB PNG can hold 12,000 x 12,000 pixels: 432 MB
decoded), every item's bytes against `max_item_bytes` before anything else, and the base64
and the decoding run in a worker thread, never on the event loop."""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
import wave
from dataclasses import dataclass

import anyio
import numpy as np

from omni.serve._errors import ApiError
from omni.serve.openai._declare import AudioPart, ImagePart

__all__ = ["IMAGE_FORMATS", "MAX_IMAGE_PIXELS", "MAX_ITEM_BYTES", "MediaPolicy",
           "decode_audio", "decode_image"]

MAX_IMAGE_PIXELS = 16 << 20  # 16,777,216: a 4,096 x 4,096 image, 48 MiB as RGB
# The cap above is checked from the header, below Pillow's own threshold: Pillow's warning
# about a large image a client sent would only repeat the 400 on the server's stderr.
warnings.filterwarnings("ignore", message="Image size .* could be decompression bomb",
                        module="PIL.Image")
MAX_ITEM_BYTES = 16 << 20  # an image's or a clip's bytes, before decoding
FETCH_TIMEOUT_S = 20.0
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # what Pillow may open: no others'
# decoders run on a client's bytes


@dataclass(frozen=True)
class MediaPolicy:
    """What the server takes of a message's media: remote URLs (`allow_remote`), images of
    at most `max_image_pixels`, items of at most `max_item_bytes` (encoded)."""

    allow_remote: bool = False
    max_image_pixels: int = MAX_IMAGE_PIXELS
    max_item_bytes: int = MAX_ITEM_BYTES

    def __post_init__(self) -> None:
        if self.max_image_pixels < 1 or self.max_item_bytes < 1:
            raise ValueError(f"media limits must be positive, got {self.max_image_pixels} "
                             f"pixels and {self.max_item_bytes} bytes")
_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*?);base64,",
                       re.IGNORECASE)


async def decode_image(url: str, where: str, policy: MediaPolicy) -> ImagePart:
    """The image a message's ``image_url.url`` names: a ``data:image/...;base64,`` URL, or an
    http(s) URL when the policy allows remote media. `ApiError` 400 naming `where` otherwise,
    and for an image over the policy's bytes or pixels."""
    if url.startswith(("http://", "https://")):
        if not policy.allow_remote:
            raise ApiError(400, f"{where}: this server does not fetch remote URLs (start it "
                                "with --allow-remote-media); send the image as a data URL: "
                                "data:image/png;base64,...", param=where)
        data = await _fetch(url, where, policy.max_item_bytes)
        return ImagePart(await anyio.to_thread.run_sync(_pixels, data, where, policy))
    _check_encoded_size(url, where, policy)
    return ImagePart(await anyio.to_thread.run_sync(_image_from_data_url, url, where, policy))


async def decode_audio(data: str, fmt: str, where: str, policy: MediaPolicy) -> AudioPart:
    """A message's ``input_audio``: base64 WAV (PCM 8/16/32-bit, any rate, channels
    averaged), decoded in a worker thread. `ApiError` 400 naming `where` for anything else,
    and for a clip over the policy's bytes."""
    if fmt != "wav":
        raise ApiError(400, f"{where}.format: only 'wav' audio is accepted, got {fmt!r}",
                       param=f"{where}.format")
    _check_encoded_size(data, f"{where}.data", policy)
    return await anyio.to_thread.run_sync(_wav, data, where)


def _check_encoded_size(text: str, where: str, policy: MediaPolicy) -> None:
    """Refuse base64 (a data URL's or plain) whose bytes would exceed the policy's (3 bytes
    per 4 characters), before decoding any of it."""
    payload = len(text) - (text.find(",") + 1 if text.startswith("data:") else 0)
    if payload * 3 // 4 > policy.max_item_bytes:
        raise ApiError(400, f"{where}: {payload * 3 // 4:,} bytes, more than the "
                            f"{policy.max_item_bytes:,} this server takes per item",
                       param=where)


def _image_from_data_url(url: str, where: str, policy: MediaPolicy) -> np.ndarray:
    return _pixels(_data_url(url, where), where, policy)


def _wav(data: str, where: str) -> AudioPart:
    raw = _b64(data, f"{where}.data")
    try:
        with wave.open(io.BytesIO(raw)) as wav:
            width, channels = wav.getsampwidth(), wav.getnchannels()
            rate, frames = wav.getframerate(), wav.readframes(wav.getnframes())
    except (wave.Error, EOFError) as exc:
        raise ApiError(400, f"{where}.data is not a PCM WAV file: {exc}",
                       param=f"{where}.data") from None
    kinds = {1: (np.uint8, 128.0, 128.0), 2: (np.int16, 0.0, 32768.0),
             4: (np.int32, 0.0, 2.0**31)}
    if width not in kinds or not frames:
        raise ApiError(400, f"{where}.data: expected 8, 16 or 32-bit PCM samples, got "
                            f"{width * 8}-bit" if frames else f"{where}.data: no samples",
                       param=f"{where}.data")
    dtype, zero, scale = kinds[width]
    samples = (np.frombuffer(frames, dtype=dtype).astype(np.float32) - zero) / scale
    samples = samples.reshape(-1, channels).mean(axis=1, dtype=np.float32)
    return AudioPart(samples, rate)


def _data_url(url: str, where: str) -> bytes:
    match = _DATA_URL.match(url)
    if match is None:
        raise ApiError(400, f"{where}: expected a data URL (data:image/png;base64,...) or an "
                            f"http(s) URL, got {url[:40]!r}", param=where)
    return _b64(url[match.end():], where)


def _b64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{where} is not valid base64", param=where) from None


def _pixels(data: bytes, where: str, policy: MediaPolicy) -> np.ndarray:
    """RGB pixels of an image, its size checked from its header before it is decoded."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as picture:
            width, height = picture.size
            if width * height > policy.max_image_pixels:
                raise ApiError(400, f"{where}: the image is {width} x {height} = "
                                    f"{width * height:,} pixels, more than the "
                                    f"{policy.max_image_pixels:,} this server takes "
                                    "(--max-image-pixels)", param=where)
            return np.asarray(picture.convert("RGB"))
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ApiError(400, f"{where}: not an image this server reads "
                            f"({', '.join(IMAGE_FORMATS)}): {exc}", param=where) from None


async def _fetch(url: str, where: str, limit: int) -> bytes:
    import httpx

    try:
        async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_S, follow_redirects=True) as client:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise ApiError(400, f"{where}: fetching {url} answered "
                                        f"{response.status_code}", param=where)
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > limit:
                        raise ApiError(400, f"{where}: {url} is larger than the "
                                            f"{limit:,} bytes this server takes per item",
                                       param=where)
                return bytes(body)
    except httpx.HTTPError as exc:
        raise ApiError(400, f"{where}: cannot fetch {url}: {exc}", param=where) from None
