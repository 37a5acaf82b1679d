"""A message's images and audio as the engine takes them: data URLs and base64 WAV decoded,
remote URLs fetched only where the server allows it."""

from __future__ import annotations

import base64
import binascii
import io
import re
import wave

import numpy as np

from omni.serve._errors import ApiError
from omni.serve.openai._declare import AudioPart, ImagePart

__all__ = ["MAX_FETCH_BYTES", "decode_audio", "decode_image"]

MAX_FETCH_BYTES = 32 * 1024 * 1024
FETCH_TIMEOUT_S = 20.0
_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*?);base64,",
                       re.IGNORECASE)


async def decode_image(url: str, where: str, *, allow_remote: bool) -> ImagePart:
    """The image a message's ``image_url.url`` names: a ``data:image/...;base64,`` URL, or an
    http(s) URL when `allow_remote`. `ApiError` 400 naming `where` otherwise."""
    if url.startswith(("http://", "https://")):
        if not allow_remote:
            raise ApiError(400, f"{where}: this server does not fetch remote URLs (start it "
                                "with --allow-remote-media); send the image as a data URL: "
                                "data:image/png;base64,...", param=where)
        data = await _fetch(url, where)
    else:
        data = _data_url(url, where)
    return ImagePart(_pixels(data, where))


def decode_audio(data: str, fmt: str, where: str) -> AudioPart:
    """A message's ``input_audio``: base64 WAV (PCM 8/16/32-bit, any rate, channels
    averaged). `ApiError` 400 naming `where` for anything else."""
    if fmt != "wav":
        raise ApiError(400, f"{where}.format: only 'wav' audio is accepted, got {fmt!r}",
                       param=f"{where}.format")
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


def _pixels(data: bytes, where: str) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as picture:
            return np.asarray(picture.convert("RGB"))
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ApiError(400, f"{where}: not an image Pillow reads (PNG, JPEG, WebP...): {exc}",
                       param=where) from None


async def _fetch(url: str, where: str) -> bytes:
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
                    if len(body) > MAX_FETCH_BYTES:
                        raise ApiError(400, f"{where}: {url} is larger than "
                                            f"{MAX_FETCH_BYTES >> 20} MiB", param=where)
                return bytes(body)
    except httpx.HTTPError as exc:
        raise ApiError(400, f"{where}: cannot fetch {url}: {exc}", param=where) from None
