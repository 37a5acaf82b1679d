"""Prompts made of text, images and audio, and how they become token ids and media spans.

A `Prompt` is a sequence of segments. Text becomes token ids (given, or from the engine's
tokenizer); an image or an audio clip becomes a run of placeholder positions whose embeddings
its encoder provides, and whose content digest (canonical bytes, shape and dtype) enters the
KV page keys of every page it overlaps: two prompts that differ in one pixel never share a
page from that image on.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from omni.kv.keys import MediaSpan, media_digest

__all__ = ["Audio", "Image", "MediaItem", "Prompt", "PromptTokens", "Text", "as_prompt",
           "check_length", "tokenize", "tokenize_for_model"]

IMAGE_SIZE = 32  # images are resized to IMAGE_SIZE x IMAGE_SIZE before patching
IMAGE_PATCH = 8  # -> (32 / 8)^2 = 16 positions per image
AUDIO_FRAME = 320  # samples per audio position (20 ms at 16 kHz)
MAX_AUDIO_FRAMES = 256


@dataclass(frozen=True)
class Text:
    """Text: a string (tokenized by the engine's tokenizer) or token ids."""

    content: str | tuple[int, ...]

    def __init__(self, content: str | Iterable[int]):
        if not isinstance(content, str):
            content = tuple(int(t) for t in content)
        object.__setattr__(self, "content", content)


@dataclass(frozen=True, eq=False)
class Image:
    """An RGB image: an ``[H, W, 3]`` uint8 array (or float in [0, 1]), encoded bytes, or a
    path to a PNG/JPEG file. `pixels` is the canonical ``[H, W, 3]`` uint8 array."""

    pixels: np.ndarray = field(repr=False)
    digest: bytes = field(repr=False)

    def __init__(self, data: Any):
        pixels = _to_pixels(data)
        pixels.setflags(write=False)
        object.__setattr__(self, "pixels", pixels)
        object.__setattr__(self, "digest", media_digest(pixels))

    @property
    def num_positions(self) -> int:
        return (IMAGE_SIZE // IMAGE_PATCH) ** 2

    def __repr__(self) -> str:
        h, w, _ = self.pixels.shape
        return f"Image({h}x{w}, {self.digest.hex()[:8]})"


@dataclass(frozen=True, eq=False)
class Audio:
    """Mono audio: a 1-D float array of samples in [-1, 1] (16 kHz by default)."""

    samples: np.ndarray = field(repr=False)
    sample_rate: int
    digest: bytes = field(repr=False)

    def __init__(self, samples: Any, sample_rate: int = 16_000):
        array = np.asarray(samples)
        if array.ndim != 1 or array.size == 0:
            raise ValueError(f"Audio must be a non-empty 1-D array of samples, got shape "
                             f"{array.shape}")
        if not np.issubdtype(array.dtype, np.floating):
            raise ValueError(f"Audio samples must be floats in [-1, 1], got dtype {array.dtype}")
        if not isinstance(sample_rate, int) or sample_rate <= 0:
            raise ValueError(f"Audio sample_rate must be a positive int, got {sample_rate!r}")
        array = np.ascontiguousarray(array, dtype=np.float32)
        array.setflags(write=False)
        object.__setattr__(self, "samples", array)
        object.__setattr__(self, "sample_rate", sample_rate)
        object.__setattr__(self, "digest", media_digest(array))

    @property
    def num_positions(self) -> int:
        return min(MAX_AUDIO_FRAMES, math.ceil(self.samples.size / AUDIO_FRAME))

    def __repr__(self) -> str:
        return f"Audio({self.samples.size} samples, {self.digest.hex()[:8]})"


Segment = Text | Image | Audio


@dataclass(frozen=True)
class Prompt:
    """A multimodal prompt: text, images and audio in order. ``prompt + segment`` extends it
    (the next turn of a conversation)."""

    segments: tuple[Segment, ...]

    def __init__(self, segments: Segment | str | Iterable[Segment | str] = ()):
        if isinstance(segments, (str, Text, Image, Audio)):
            segments = (segments,)
        items = tuple(Text(s) if isinstance(s, str) else s for s in segments)
        for s in items:
            if not isinstance(s, (Text, Image, Audio)):
                raise TypeError(f"a prompt segment is Text, Image, Audio or str, got {s!r}")
        object.__setattr__(self, "segments", items)

    def __add__(self, other: Prompt | Segment | str) -> Prompt:
        more = other.segments if isinstance(other, Prompt) else (other,)
        return Prompt(self.segments + tuple(more))


def as_prompt(value: Prompt | Segment | str | Sequence[int]) -> Prompt:
    """A `Prompt` from a prompt, a segment, a string, or token ids."""
    if isinstance(value, Prompt):
        return value
    if isinstance(value, (str, Text, Image, Audio)):
        return Prompt(value)
    if isinstance(value, Sequence) and all(isinstance(t, int) for t in value):
        return Prompt(Text(value))
    raise TypeError(f"expected a Prompt, a segment, a string or token ids, got {value!r:.60}")


@dataclass(frozen=True)
class MediaItem:
    """A media segment placed at positions ``[start, start + length)`` of the token ids."""

    kind: Literal["image", "audio"]
    start: int
    length: int
    segment: Image | Audio


@dataclass(frozen=True)
class PromptTokens:
    """A prompt flattened: token ids (placeholders at media positions) and the media items."""

    token_ids: tuple[int, ...]
    media: tuple[MediaItem, ...]

    def __len__(self) -> int:
        return len(self.token_ids)

    def spans(self) -> list[MediaSpan]:
        """Where each media item sits, with its digest: what a page key holds of it."""
        return [MediaSpan(m.start, m.length, m.segment.digest) for m in self.media]


def _to_pixels(data: Any) -> np.ndarray:
    if isinstance(data, (str, os.PathLike)):
        data = _decode_file(os.fspath(data))
    elif isinstance(data, (bytes, bytearray, memoryview)):
        data = _decode_bytes(bytes(data))
    array = np.asarray(data)
    if array.ndim != 3 or array.shape[2] != 3 or array.shape[0] < 1 or array.shape[1] < 1:
        raise ValueError(f"Image must be an [H, W, 3] RGB array, got shape {array.shape}")
    if array.dtype == np.uint8:
        return np.ascontiguousarray(array)
    if np.issubdtype(array.dtype, np.floating):
        if not np.isfinite(array).all() or array.min() < 0 or array.max() > 1:
            raise ValueError("a float Image must hold values in [0, 1]")
        return np.ascontiguousarray(np.round(array * 255).astype(np.uint8))
    raise ValueError(f"Image must be uint8 (or float in [0, 1]), got dtype {array.dtype}")


def _decode_bytes(data: bytes) -> np.ndarray:
    import io

    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    try:
        with PILImage.open(io.BytesIO(data)) as img:
            return np.asarray(img.convert("RGB"))
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"Image bytes are not a PNG/JPEG image: {exc}") from None


def _decode_file(path: str) -> np.ndarray:
    if not os.path.isfile(path):
        raise ValueError(f"Image file not found: {path}")
    with open(path, "rb") as f:
        return _decode_bytes(f.read())


def tokenize(prompt: Prompt, encode: Any | None, media: Any) -> PromptTokens:
    """Flatten a prompt: text through `encode` (str -> ids), media as placeholder runs, as
    many positions and of the id the model's `media` encoders say (a `MediaEncoders`).

    Raises:
        ValueError: a text segment is a string but there is no tokenizer.
    """
    ids: list[int] = []
    items: list[MediaItem] = []
    for segment in prompt.segments:
        if isinstance(segment, Text):
            if isinstance(segment.content, str):
                if encode is None:
                    raise ValueError("this engine has no tokenizer: give text as token ids "
                                     "(Text([...]))")
                ids.extend(encode(segment.content))
            else:
                ids.extend(segment.content)
            continue
        kind = "image" if isinstance(segment, Image) else "audio"
        n = media.num_positions(segment)
        items.append(MediaItem(kind, len(ids), n, segment))
        ids.extend([media.placeholder(segment)] * n)
    return PromptTokens(tuple(ids), tuple(items))


def tokenize_for_model(prompt: Prompt, encode: Any | None, context: int,
                       vocab_size: int, media: Any) -> PromptTokens:
    """`tokenize`, refusing (ValueError) an empty prompt, one as long as the model's
    `context` or longer, and token ids outside its vocabulary."""
    tokens = tokenize(prompt, encode, media)
    if not tokens.token_ids:
        raise ValueError("the prompt is empty")
    if len(tokens) >= context:
        raise ValueError(f"the prompt has {len(tokens)} tokens; this model's context is "
                         f"{context} tokens")
    bad = [t for t in tokens.token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    return tokens


def check_length(prompt: Prompt, context: int, max_token_chars: int | None,
                 media: Any) -> int:
    """The prompt's characters of text; ValueError when they alone prove it as long as the
    model's `context` or longer (no tokenizer runs: a hostile 30 MB prompt costs a sum of
    lengths). `max_token_chars`: the most characters one token covers (None: unknown);
    `media`: the model's `MediaEncoders`, which count the positions of its images and audio."""
    chars = fewest = 0  # characters of text; tokens at least (ids and media: exactly)
    for segment in prompt.segments:
        if not isinstance(segment, Text):
            fewest += media.num_positions(segment)
        elif isinstance(segment.content, str):
            chars += len(segment.content)
        else:
            fewest += len(segment.content)
    if max_token_chars:
        fewest += -(-chars // max_token_chars)
    if fewest >= context:
        raise ValueError(f"the prompt has at least {fewest} tokens ({chars} characters "
                         f"of text); this model's context is {context} tokens")
    return chars
