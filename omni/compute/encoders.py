"""Media encoders: images and audio to embeddings at a prompt's placeholder positions.

`MediaEncoders` is what the engine asks of a model's media side: how many positions a segment
takes, which token id stands at them, its embeddings (and, for Qwen3-Omni, its deepstack
features and multimodal rotary positions). `BuiltinEncoders` are the small built-in ones.

Why built in: the demos and tests must run without downloads. Each encoder is one linear
projection of patches (images) or frames (audio), its weights drawn from a seed, so the same
seed gives the same embeddings in every process. A checkpoint's own encoders (Qwen3-Omni's
vision tower and audio encoder, `omni.compute.models.qwen3_omni`) take their place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from omni.compute.prompt import AUDIO_FRAME, IMAGE_PATCH, IMAGE_SIZE, Audio, Image, PromptTokens

__all__ = ["AudioEncoder", "BuiltinEncoders", "Encoded", "ImageEncoder", "MediaEncoders"]


@dataclass(frozen=True)
class Encoded:
    """A segment's embeddings ``[n, hidden]`` for its n positions, and the features a
    deepstack model adds after its first k layers (``[k, n, hidden]``; None: none)."""

    embeds: torch.Tensor
    deepstack: torch.Tensor | None = None


class MediaEncoders(Protocol):
    """A model's media side (see the module docstring). One may also name a `tap_layer`
    (an int attribute): the runner then keeps the hidden states after that layer at each
    media item's positions from the prefills (`ModelRunner.media_hidden`)."""

    def num_positions(self, segment: Image | Audio) -> int: ...

    def placeholder(self, segment: Image | Audio) -> int: ...

    def encode(self, segment: Image | Audio) -> Encoded: ...

    def positions(self, tokens: PromptTokens) -> torch.Tensor | None:
        """Multimodal rotary positions ``[3, T]`` of a prompt (None: 0..T-1)."""
        ...


def _seeded_linear(in_features: int, out_features: int, seed: int) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) * 0.02)
    return layer


class ImageEncoder(nn.Module):
    """An image -> ``[16, hidden]``: resize to 32x32, 8x8 patches, one linear projection."""

    def __init__(self, hidden_size: int, seed: int = 0):
        super().__init__()
        self.proj = _seeded_linear(3 * IMAGE_PATCH * IMAGE_PATCH, hidden_size, seed)

    @torch.no_grad()
    def encode(self, image: Image) -> torch.Tensor:
        x = torch.from_numpy(np.array(image.pixels)).permute(2, 0, 1)[None].float() / 255
        x = F.interpolate(x, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear",
                          align_corners=False)  # [1, 3, 32, 32]
        patches = F.unfold(x, IMAGE_PATCH, stride=IMAGE_PATCH)[0].T  # [16, 3 * 8 * 8]
        return self.proj(patches - 0.5)


class AudioEncoder(nn.Module):
    """Audio -> ``[ceil(n / 320), hidden]``: 320-sample frames, one linear projection."""

    def __init__(self, hidden_size: int, seed: int = 1):
        super().__init__()
        self.proj = _seeded_linear(AUDIO_FRAME, hidden_size, seed)

    @torch.no_grad()
    def encode(self, audio: Audio) -> torch.Tensor:
        n = audio.num_positions
        samples = torch.from_numpy(np.array(audio.samples[: n * AUDIO_FRAME]))
        frames = F.pad(samples, (0, n * AUDIO_FRAME - samples.numel())).view(n, AUDIO_FRAME)
        return self.proj(frames)


class BuiltinEncoders:
    """The built-in encoders of a model of `hidden_size`: a fixed number of positions per
    image (16) and per 20 ms of audio, placeholder id 0, one-dimensional positions."""

    def __init__(self, hidden_size: int, seed: int = 0):
        self.image = ImageEncoder(hidden_size, seed=seed + 1)
        self.audio = AudioEncoder(hidden_size, seed=seed + 2)

    def num_positions(self, segment: Image | Audio) -> int:
        return segment.num_positions

    def placeholder(self, segment: Image | Audio) -> int:
        return 0

    def encode(self, segment: Image | Audio) -> Encoded:
        if isinstance(segment, Image):
            return Encoded(self.image.encode(segment))
        return Encoded(self.audio.encode(segment))

    def positions(self, tokens: PromptTokens) -> torch.Tensor | None:
        return None
