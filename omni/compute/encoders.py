"""Small built-in media encoders: images and audio to embeddings at placeholder positions.

Why built in: the demos and tests must run without downloads. Each encoder is one linear
projection of patches (images) or frames (audio), its weights drawn from a seed, so the same
seed gives the same embeddings in every process; a real model's encoder takes its place by
implementing the same `encode` method.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from omni.compute.prompt import AUDIO_FRAME, IMAGE_PATCH, IMAGE_SIZE, Audio, Image

__all__ = ["AudioEncoder", "ImageEncoder"]


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
