"""A request's images and audio as the engine takes them: data URLs and base64 WAV decoded,
remote URLs fetched only where the server allows it (`omni.serve.openai._fetch`).

Remote input is hostile, and an image decoder is a compression amplifier (a 560 KB PNG can
hold 12,000 x 12,000 pixels: 432 MB decoded). So, for every item of a request before any is
decoded: its bytes are checked against `MediaPolicy.max_item_bytes`, its header is read (an
image's size, a WAV's sample count) and checked against the per-item caps, and the sums over
the request against its budget (`max_request_pixels`, `max_request_samples`); then the request
reserves its sums in the budget of the requests in flight (`DecodeBudget`) until its answer
has ended, and decodes. Every
pass over the bytes (base64, headers, decoding, the prompt segments' content digests) runs in
a worker thread, never on the event loop.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import struct
import warnings
import wave
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import anyio
import numpy as np

from omni.serve._errors import ApiError
from omni.serve.openai._budget import DecodeBudget, DecodeNeed
from omni.serve.openai._declare import AudioPart, ImagePart
from omni.serve.openai._fetch import CannotFetch, TooLarge, fetch_public

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage

__all__ = ["IMAGE_FORMATS", "MAX_IMAGE_PIXELS", "MAX_ITEM_BYTES", "MAX_REQUEST_PIXELS",
           "MAX_REQUEST_SAMPLES", "MIN_AUDIO_SAMPLES", "MediaPolicy", "MediaSource",
           "decode_audio", "decode_image", "decode_media"]

MAX_IMAGE_PIXELS = 16 << 20  # 16,777,216: a 4,096 x 4,096 image, 48 MiB as RGB
MAX_REQUEST_PIXELS = 64 << 20  # four such images: 192 MiB as RGB
MAX_REQUEST_SAMPLES = 16 << 20  # 17 minutes at 16 kHz: 64 MiB as float32
# The requests in flight together: twice one request's budget (a request decodes its images
# one by one, so the transient peak is one image's; the budget bounds the arrays the requests
# in flight keep until they are answered).
MAX_INFLIGHT_PIXELS = 2 * MAX_REQUEST_PIXELS
MAX_INFLIGHT_SAMPLES = 2 * MAX_REQUEST_SAMPLES
# The fewest samples of a clip: Qwen3-Omni's feature extractor (Whisper's, n_fft 400) pads a
# clip by 200 samples on each side by reflection, which needs more than 200 of them.
MIN_AUDIO_SAMPLES = 201
# The cap above is checked from the header, below Pillow's own threshold: Pillow's warning
# about a large image a client sent would only repeat the 400 on the server's stderr.
warnings.filterwarnings("ignore", message="Image size .* could be decompression bomb",
                        module="PIL.Image")
MAX_ITEM_BYTES = 16 << 20  # an image's or a clip's bytes, before decoding
FETCH_TIMEOUT_S = 20.0  # for all of a request's remote images together
DECODE_WAIT_S = 10.0  # how long a request waits for room in the budget in flight, then 429
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # what Pillow may open: no others'
# decoders run on a client's bytes
_PCM = {1: (np.uint8, 128.0, 128.0), 2: (np.int16, 0.0, 32768.0), 4: (np.int32, 0.0, 2.0**31)}
_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*?);base64,",
                       re.IGNORECASE)


@dataclass(frozen=True)
class MediaPolicy:
    """What the server takes of a request's media: remote URLs (`allow_remote`), images of
    at most `max_image_pixels`, items of at most `max_item_bytes` (encoded), at most
    `max_request_pixels` and `max_request_samples` (audio, every channel's) in one request,
    and at most `max_inflight_pixels` and `max_inflight_samples` being decoded by all the
    requests in flight (`budget` counts them: one policy is shared by a server's requests).

    Raises:
        ValueError: a limit that is not positive, or a budget in flight below a request's.
    """

    allow_remote: bool = False
    max_image_pixels: int = MAX_IMAGE_PIXELS
    max_item_bytes: int = MAX_ITEM_BYTES
    max_request_pixels: int = MAX_REQUEST_PIXELS
    max_request_samples: int = MAX_REQUEST_SAMPLES
    max_inflight_pixels: int = MAX_INFLIGHT_PIXELS
    max_inflight_samples: int = MAX_INFLIGHT_SAMPLES
    budget: DecodeBudget = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        limits = (self.max_image_pixels, self.max_item_bytes, self.max_request_pixels,
                  self.max_request_samples, self.max_inflight_pixels,
                  self.max_inflight_samples)
        if min(limits) < 1:
            raise ValueError(f"media limits must be positive, got {limits}")
        if (self.max_inflight_pixels < self.max_request_pixels
                or self.max_inflight_samples < self.max_request_samples):
            raise ValueError("the media budget in flight must hold one request's at least")
        object.__setattr__(self, "budget", DecodeBudget(self.max_inflight_pixels,
                                                        self.max_inflight_samples))


@dataclass(frozen=True)
class MediaSource:
    """One image or clip as the request holds it. Why: a request's items are gathered
    before any is decoded, so that their headers are all checked against its budget first.

    `where` is the field's path as the request spells it (an image's
    ``messages.0.content.1.image_url.url``, a clip's ``messages.0.content.2.input_audio``);
    `data` an image's URL, or its bytes as they were uploaded (a multipart file), or a clip's
    base64; `format` a clip's."""

    where: str
    kind: Literal["image", "audio"]
    data: str | bytes
    format: str = ""


@dataclass(frozen=True)
class _Opened:
    """An item's bytes and what its header says. Why: nothing is decoded until every
    item's header was read and the sums checked."""

    source: MediaSource
    raw: bytes
    pixels: int = 0
    samples: int = 0  # every channel's


async def decode_media(sources: Sequence[MediaSource], policy: MediaPolicy,
                       hold: AsyncExitStack | None = None) -> list[ImagePart | AudioPart]:
    """The request's items decoded, in order, each part carrying its prompt segment. Their
    pixels and samples are reserved in the budget in flight until `hold` closes (the
    request's `omni.serve._guard.until_answered`: the decoded arrays live as long as the
    request), or, without one, while they are decoded.

    Raises:
        ApiError: 400 naming the field (or the budget and its option) for an item the policy
            refuses, 429 with ``Retry-After`` when the budget in flight had no room for
            `DECODE_WAIT_S` seconds.
    """
    for source in sources:
        _check_source(source, policy)
    opened = await _open_all(sources, policy)
    need = _check_request_budget(opened, policy)
    async with AsyncExitStack() as scoped:
        try:
            await (hold or scoped).enter_async_context(
                policy.budget.reserved(need, DECODE_WAIT_S))
        except TimeoutError:
            raise ApiError(429, "The server holds as many decoded images and audio samples "
                                "as it takes at once; retry shortly.",
                           headers={"Retry-After": "1"}, code="media_budget_busy") from None
        return [await anyio.to_thread.run_sync(_decode, item, policy) for item in opened]


async def decode_image(url: str, where: str, policy: MediaPolicy) -> ImagePart:
    """One image (`decode_media` of it alone): a ``data:image/...;base64,`` URL, or an
    http(s) URL when the policy allows remote media."""
    return (await decode_media([MediaSource(where, "image", url)], policy))[0]


async def decode_audio(data: str, fmt: str, where: str, policy: MediaPolicy) -> AudioPart:
    """One clip (`decode_media` of it alone): base64 WAV (PCM 8/16/32-bit, any rate,
    channels averaged); `where` is its ``input_audio`` field."""
    return (await decode_media([MediaSource(where, "audio", data, fmt)], policy))[0]


def _check_source(source: MediaSource, policy: MediaPolicy) -> None:
    """The checks that need no pass over the bytes: the audio format, remote URLs allowed,
    the encoded size."""
    where = source.where
    if isinstance(source.data, bytes):
        _check_size(len(source.data), where, policy)
    elif source.kind == "audio":
        if source.format != "wav":
            raise ApiError(400, f"{where}.format: only 'wav' audio is accepted, got "
                                f"{source.format!r}", param=f"{where}.format")
        _check_encoded_size(source.data, f"{where}.data", policy)
    elif _is_remote(source.data):
        if not policy.allow_remote:
            raise ApiError(400, f"{where}: this server does not fetch remote URLs (start it "
                                "with --allow-remote-media); send the image as a data URL: "
                                "data:image/png;base64,...", param=where)
    else:
        _check_encoded_size(source.data, where, policy)


def _is_remote(data: str | bytes) -> bool:
    return isinstance(data, str) and data.startswith(("http://", "https://"))


def _check_encoded_size(text: str, where: str, policy: MediaPolicy) -> None:
    """Refuse base64 (a data URL's or plain) whose bytes would exceed the policy's (3 bytes
    per 4 characters), before decoding any of it."""
    payload = len(text) - (text.find(",") + 1 if text.startswith("data:") else 0)
    _check_size(payload * 3 // 4, where, policy)


def _check_size(nbytes: int, where: str, policy: MediaPolicy) -> None:
    if nbytes > policy.max_item_bytes:
        raise ApiError(400, f"{where}: {nbytes:,} bytes, more than the "
                            f"{policy.max_item_bytes:,} this server takes per item (set by "
                            "--max-media-mib)", param=where)


async def _open_all(sources: Sequence[MediaSource], policy: MediaPolicy) -> list[_Opened]:
    """Every item's bytes (fetched, all of them by one deadline, or base64-decoded) and
    header, read in worker threads."""
    deadline = anyio.current_time() + FETCH_TIMEOUT_S
    opened = []
    for source in sources:
        if source.kind == "image" and _is_remote(source.data):
            raw = await _fetch(source, policy, deadline)
            opened.append(await anyio.to_thread.run_sync(_open_image, source, raw, policy))
        else:
            opened.append(await anyio.to_thread.run_sync(_open, source, policy))
    return opened


async def _fetch(source: MediaSource, policy: MediaPolicy, deadline: float) -> bytes:
    try:
        return await fetch_public(source.data, policy.max_item_bytes, deadline)
    except CannotFetch:
        raise ApiError(400, f"{source.where}: cannot fetch {source.data}",
                       param=source.where) from None
    except TooLarge:
        raise ApiError(400, f"{source.where}: {source.data} is larger than the "
                            f"{policy.max_item_bytes:,} bytes this server takes per item "
                            "(set by --max-media-mib)", param=source.where) from None


def _open(source: MediaSource, policy: MediaPolicy) -> _Opened:
    if isinstance(source.data, bytes):  # as uploaded
        raw = source.data
    elif source.kind == "audio":
        return _open_wav(source, _b64(source.data, f"{source.where}.data"))
    else:
        raw = _data_url(source.data, source.where)
    return _open_image(source, raw, policy)


def _check_request_budget(opened: list[_Opened], policy: MediaPolicy) -> DecodeNeed:
    need = DecodeNeed(sum(o.pixels for o in opened), sum(o.samples for o in opened))
    if need.pixels > policy.max_request_pixels:
        raise ApiError(400, f"messages: the request's images hold {need.pixels:,} pixels in "
                            f"all, more than the {policy.max_request_pixels:,} this server "
                            "decodes per request (set by --max-request-pixels)",
                       param="messages", code="media_budget_exceeded")
    if need.samples > policy.max_request_samples:
        raise ApiError(400, f"messages: the request's audio holds {need.samples:,} samples "
                            f"in all, more than the {policy.max_request_samples:,} this "
                            "server decodes per request (set by --max-request-samples)",
                       param="messages", code="media_budget_exceeded")
    return need


def _decode(item: _Opened, policy: MediaPolicy) -> ImagePart | AudioPart:
    """An item's part with its prompt segment (content digest included), in a worker
    thread."""
    from omni.compute.prompt import Audio, Image  # the engine's: not for a light import

    if item.source.kind == "image":
        pixels = _pixels(item.raw, item.source.where, policy)
        return ImagePart(pixels, Image(pixels))
    samples, rate = _wav_samples(item.raw, item.source.where)
    return AudioPart(samples, rate, Audio(samples, rate))


def _open_image(source: MediaSource, raw: bytes, policy: MediaPolicy) -> _Opened:
    """The image's size from its header (nothing decoded), checked against the cap."""
    with _opened_image(raw, source.where, policy) as picture:
        width, height = picture.size
    _check_image_size(width, height, source.where, policy)
    return _Opened(source, raw, pixels=width * height)


def _opened_image(raw: bytes, where: str, policy: MediaPolicy) -> PILImage:
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(io.BytesIO(raw), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError:
        raise ApiError(400, f"{where}: the image has more than {2 * Image.MAX_IMAGE_PIXELS:,} "
                            f"pixels, more than the {policy.max_image_pixels:,} this server "
                            "takes per image (set by --max-image-pixels)", param=where) from None
    except (UnidentifiedImageError, OSError) as exc:
        # PIL's "cannot identify image file" names the buffer object (its address): not said
        detail = "" if isinstance(exc, UnidentifiedImageError) else f": {exc}"
        raise ApiError(400, f"{where}: not an image this server reads "
                            f"({', '.join(IMAGE_FORMATS)}){detail}", param=where) from None


def _check_image_size(width: int, height: int, where: str, policy: MediaPolicy) -> None:
    if width * height > policy.max_image_pixels:
        raise ApiError(400, f"{where}: the image is {width} x {height} = {width * height:,} "
                            f"pixels, more than the {policy.max_image_pixels:,} this server "
                            "takes per image (set by --max-image-pixels)", param=where)


def _pixels(raw: bytes, where: str, policy: MediaPolicy) -> np.ndarray:
    """RGB pixels of an image, its size checked from its header again before decoding."""
    from PIL import Image

    with _opened_image(raw, where, policy) as picture:
        _check_image_size(*picture.size, where, policy)
        try:
            return np.asarray(picture.convert("RGB"))
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
            raise ApiError(400, f"{where}: the image cannot be decoded: {exc}",
                           param=where) from None


def _open_wav(source: MediaSource, raw: bytes) -> _Opened:
    """A clip's sample count from its header (at most what its bytes hold), checked."""
    where = f"{source.where}.data"
    with _wav(raw, where) as clip:
        width, channels, frames = clip.getsampwidth(), clip.getnchannels(), clip.getnframes()
    _check_sample_width(width, where)
    _check_clip_length(frames, where)
    return _Opened(source, raw, samples=min(frames * channels, len(raw) // width))


def _wav_samples(raw: bytes, where: str) -> tuple[np.ndarray, int]:
    """Mono float32 samples in [-1, 1] and their rate (channels averaged)."""
    where = f"{where}.data"
    with _wav(raw, where) as clip:
        width, channels, rate = clip.getsampwidth(), clip.getnchannels(), clip.getframerate()
        data = clip.readframes(clip.getnframes())
    _check_sample_width(width, where)
    if len(data) % (width * channels):
        raise ApiError(400, f"{where}: the clip is cut short: {len(data):,} bytes of samples "
                            f"is not a whole number of {width * channels}-byte frames",
                       param=where)
    _check_clip_length(len(data) // (width * channels), where)
    dtype, zero, scale = _PCM[width]
    samples = (np.frombuffer(data, dtype=dtype).astype(np.float32) - zero) / scale
    return samples.reshape(-1, channels).mean(axis=1, dtype=np.float32), rate


def _wav(raw: bytes, where: str) -> wave.Wave_read:
    try:
        return wave.open(io.BytesIO(raw))
    except (wave.Error, EOFError, ValueError, OverflowError, struct.error) as exc:
        why = str(exc) or "it ends before its header does"
        raise ApiError(400, f"{where} is not a PCM WAV file: {why}", param=where) from None


def _check_sample_width(width: int, where: str) -> None:
    if width not in _PCM:
        raise ApiError(400, f"{where}: expected 8, 16 or 32-bit PCM samples, got "
                            f"{width * 8}-bit", param=where)


def _check_clip_length(frames: int, where: str) -> None:
    if frames < MIN_AUDIO_SAMPLES:
        raise ApiError(400, f"{where}: the clip has {frames} samples; at least "
                            f"{MIN_AUDIO_SAMPLES} are needed", param=where)


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
