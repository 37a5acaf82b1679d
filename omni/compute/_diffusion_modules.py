"""The small modules that turn a decoder LM into a latent diffusion model, and the Euler sampler.

`DiffusionHead` maps latents to image tokens the LLM's `DecoderLM` reads (and its output back
to a velocity); `LatentDecoder` maps latents to RGB pixels; `FlowMatchEulerSampler` integrates
the velocity field from noise (t = 1) to an image (t = 0). Weights are drawn from a seed, so a
seed gives the same image in every process, as the built-in encoders do.

Shapes: B batch, C latent channels, H x W latent size, p patch, N = (H / p) * (W / p) image
tokens, E the LLM's hidden size.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

__all__ = ["DiffusionHead", "FlowMatchEulerSampler", "FlowMatchState", "LatentDecoder",
           "classifier_free_guidance", "to_png"]

PIXELS_PER_LATENT = 8  # the decoder's upscale: a latent [C, H, W] -> an image [8H, 8W, 3]


def _seed_parameters(module: nn.Module, seed: int) -> None:
    """Weights ~ N(0, 1 / fan_in) and zero biases, drawn in parameter-name order from `seed`.

    Why: unit-scale activations whatever the sizes, and the same weights in every process (no
    dependence on the global RNG or on how many modules were built before).
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            if name.endswith("bias"):
                param.zero_()
            else:
                fan_in = math.prod(param.shape[1:])
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(fan_in))


def timestep_embedding(t: Tensor, dim: int, max_period: float = 10_000.0) -> Tensor:
    """Sinusoidal features [B, dim] of timesteps t [B] in [0, 1] (scaled by 1000, as SD3)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device) / half)
    angles = 1000.0 * t.float()[:, None] * freqs[None]  # [B, dim / 2]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


class DiffusionHead(nn.Module):
    """Latents <-> the LLM's hidden space: the only diffusion-specific weights.

    `embed`: patchify latents [B, C, H, W] into N tokens of C*p*p values, project each to E
    (`latent_in`) and add the timestep's embedding (sinusoid -> Linear -> SiLU -> Linear) to
    every token. `velocity`: project the LLM's final hidden states back (`velocity_out`) and
    unpatchify. The transformer in between is the LLM itself (shared weights).

    Args:
        hidden_size: the LLM's E.
        latent_channels: C.
        patch: p, the side of a square patch of latents that becomes one image token.
        seed: draws the weights.
        time_dim: width of the sinusoidal timestep features.
    """

    def __init__(self, hidden_size: int, *, latent_channels: int = 4, patch: int = 2,
                 seed: int = 0, time_dim: int = 256) -> None:
        super().__init__()
        if latent_channels < 1 or patch < 1 or time_dim < 2 or time_dim % 2:
            raise ValueError(f"need latent_channels >= 1, patch >= 1 and an even time_dim >= 2, "
                             f"got {latent_channels}, {patch}, {time_dim}")
        self.latent_channels, self.patch, self.time_dim = latent_channels, patch, time_dim
        patch_values = latent_channels * patch * patch
        self.latent_in = nn.Linear(patch_values, hidden_size)
        self.time_mlp = nn.Sequential(nn.Linear(time_dim, hidden_size), nn.SiLU(),
                                      nn.Linear(hidden_size, hidden_size))
        self.velocity_out = nn.Linear(hidden_size, patch_values)
        _seed_parameters(self, seed)

    def patchify(self, latents: Tensor) -> Tensor:
        """[B, C, H, W] -> [B, N, C*p*p], tokens in row-major patch order."""
        batch, channels, height, width = latents.shape
        p = self.patch
        x = latents.reshape(batch, channels, height // p, p, width // p, p)
        return x.permute(0, 2, 4, 1, 3, 5).reshape(batch, (height // p) * (width // p), -1)

    def unpatchify(self, tokens: Tensor, height: int, width: int) -> Tensor:
        """[B, N, C*p*p] -> [B, C, H, W] (the inverse of `patchify`)."""
        batch, p, c = tokens.shape[0], self.patch, self.latent_channels
        x = tokens.reshape(batch, height // p, width // p, c, p, p)
        return x.permute(0, 3, 1, 4, 2, 5).reshape(batch, c, height, width)

    def embed(self, latents: Tensor, t: float) -> Tensor:
        """Latents [B, C, H, W] at time t -> image tokens [B, N, E] in the latents' dtype."""
        times = torch.full((latents.shape[0],), t, device=latents.device)
        features = timestep_embedding(times, self.time_dim).to(latents.dtype)
        return self.latent_in(self.patchify(latents)) + self.time_mlp(features)[:, None]

    def velocity(self, hidden: Tensor, height: int, width: int) -> Tensor:
        """The LLM's final hidden states of the image tokens [B, N, E] -> velocity [B, C, H, W]."""
        return self.unpatchify(self.velocity_out(hidden), height, width)


class LatentDecoder(nn.Module):
    """Latents [C, H, W] -> an RGB image [8H, 8W, 3] uint8: a 1x1 convolution to 3*8*8
    channels, pixel shuffle, sigmoid. Weights drawn from `seed`."""

    def __init__(self, latent_channels: int = 4, *, seed: int = 0) -> None:
        super().__init__()
        scale = PIXELS_PER_LATENT
        self.proj = nn.Conv2d(latent_channels, 3 * scale * scale, kernel_size=1)
        self.shuffle = nn.PixelShuffle(scale)
        _seed_parameters(self, seed)

    @torch.inference_mode()
    def decode(self, latents: Tensor) -> np.ndarray:
        """Latents [C, H, W] -> [8H, 8W, 3] uint8 (on the CPU, as numpy)."""
        x = latents[None].to(self.proj.weight.dtype)
        rgb = torch.sigmoid(self.shuffle(self.proj(x)))[0]  # [3, 8H, 8W] in (0, 1)
        return (rgb.permute(1, 2, 0) * 255).round().to(torch.uint8).cpu().numpy()


def to_png(image: np.ndarray) -> bytes:
    """An [H, W, 3] uint8 image as PNG bytes (Pillow)."""
    from PIL import Image as PILImage

    array = np.asarray(image)
    if array.ndim != 3 or array.shape[2] != 3 or array.dtype != np.uint8:
        raise ValueError(f"to_png takes an [H, W, 3] uint8 image, got {array.dtype} "
                         f"{list(array.shape)}")
    out = io.BytesIO()
    PILImage.fromarray(np.ascontiguousarray(array), mode="RGB").save(out, format="PNG")
    return out.getvalue()


def classifier_free_guidance(v_cond: Tensor, v_uncond: Tensor, guidance: float) -> Tensor:
    """v_uncond + guidance * (v_cond - v_uncond): 1 is the conditional velocity, 0 the
    unconditional one, > 1 pushes away from the negative prompt."""
    return v_uncond + guidance * (v_cond - v_uncond)


class FlowMatchState:
    """Where one denoising run is: the latents x_t and the index of t in the schedule.

    Why a separate object: the sampler is stateless (one for every request), as `TokenSampler`
    is; a request's progress lives here and `FlowMatchEulerSampler.step` advances it.
    """

    def __init__(self, latents: Tensor, sigmas: Tensor) -> None:
        self.latents = latents
        self.sigmas = sigmas  # [steps + 1] float64, from 1 down to exactly 0
        self.index = 0

    @property
    def num_steps(self) -> int:
        return len(self.sigmas) - 1

    @property
    def t(self) -> float:
        """The current time (1 = noise, 0 = data)."""
        return float(self.sigmas[self.index])

    @property
    def done(self) -> bool:
        return self.index >= self.num_steps

    def __repr__(self) -> str:
        return f"<FlowMatchState step={self.index}/{self.num_steps} t={self.t:.4f}>"


@dataclass(frozen=True)
class FlowMatchEulerSampler:
    """Rectified flow / flow matching integrated with Euler steps; implements
    `Sampler[FlowMatchState]`.

    The model predicts the velocity v = dx/dt of x_t = (1 - t) x_0 + t noise; sampling goes
    from t = 1 (Gaussian noise) to t = 0 over `steps` Euler steps x <- x - (t_i - t_{i+1}) v.
    The times are linspace(1, 0, steps + 1), shifted as SD3 does: t' = s t / (1 + (s - 1) t)
    (s = `shift`; s > 1 spends more steps at high noise). Guidance is not done here: the
    pipeline combines conditional and unconditional velocities (`classifier_free_guidance`)
    and steps with the result.
    """

    shift: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.shift) and self.shift > 0):
            raise ValueError(f"shift must be a finite number > 0, got {self.shift!r}")

    def schedule(self, steps: int) -> Tensor:
        """The times t_0 = 1 > t_1 > ... > t_steps = 0, float64 [steps + 1]."""
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps!r}")
        t = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
        return self.shift * t / (1 + (self.shift - 1) * t)

    def start(self, shape: tuple[int, ...], steps: int, *, seed: int,
              dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> FlowMatchState:
        """A state at t = 1: latents of `shape` drawn from N(0, 1) with `seed` (on the CPU, so
        a seed gives the same noise on every device)."""
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        return FlowMatchState(noise.to(device=device, dtype=dtype), self.schedule(steps))

    def step(self, output: Tensor, state: FlowMatchState) -> Tensor:
        """One Euler step with velocity `output` (the latents' shape); returns the new
        latents and advances `state`.

        Raises:
            ValueError: the run is finished, or `output` does not have the latents' shape.
        """
        if state.done:
            raise ValueError(f"the denoising run is finished ({state.num_steps} steps)")
        if output.shape != state.latents.shape:
            raise ValueError(f"velocity must have the latents' shape "
                             f"{list(state.latents.shape)}, got {list(output.shape)}")
        dt = float(state.sigmas[state.index] - state.sigmas[state.index + 1])
        state.latents = state.latents - dt * output.to(state.latents.dtype)
        state.index += 1
        return state.latents
